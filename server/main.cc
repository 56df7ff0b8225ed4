// gradwatchd: the training-monitor daemon. Parses configuration, wires the daemon, and waits for
// SIGTERM/SIGINT to stop it cleanly.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <malloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "server/core/version.h"
#include "server/daemon/config.h"
#include "server/daemon/daemon.h"
#include "server/daemon/logging.h"
#include "server/daemon/repair.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitConfig = 2;
constexpr int kExitStart = 1;

bool WriteReadyFile(const std::string& path, int grpc_port, int metrics_port) {
  const nlohmann::json ready = {{"grpc_port", grpc_port}, {"metrics_port", metrics_port}, {"pid", getpid()}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) return false;
    out << ready.dump() << "\n";
    if (!out) return false;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

// SQLite maps the journal's -shm file; if that file stops being writable or backed (made
// immutable, its disk full or gone) a write to the mapping raises SIGBUS. Say so on stderr (only
// async-signal-safe calls here), then die of the signal as before: the state on disk is the
// journal's last commit, and nothing after it was acked.
void OnSigbus(int sig) {
  constexpr char kMessage[] =
      "gradwatchd: fatal: SIGBUS writing a memory-mapped journal file (journal.db-shm): the data directory's "
      "files became unwritable or its disk is full; nothing uncommitted was acknowledged. Fix the data "
      "directory and restart.\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void InstallSigbusHandler() {
  struct sigaction action {};
  action.sa_handler = OnSigbus;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;
  sigaction(SIGBUS, &action, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  // glibc gives every thread that allocates an arena of its own, up to 8 per core; the gRPC
  // threads' transient step buffers then keep pages resident in each. Two arenas unless
  // MALLOC_ARENA_MAX says otherwise: the bench's 20,001-series run added 17.9–19.9 KB of RSS per
  // series with them against 19.5–20.2 KB without, at the same CPU per sample.
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, 2);
  CLI::App app{
      "gradwatchd — live training-monitor daemon: trainers stream per-step gradient and "
      "parameter norms over gRPC; it keeps them durably and exports Prometheus metrics."};
  app.footer(
      "Flags override the config file. Exit codes: 0 clean stop or valid config, 1 failed to start, "
      "2 bad configuration or usage (--repair: 0 sound, 3 damage found, 1 failed).\nSignals: SIGTERM/SIGINT stop "
      "accepting, commit the journal, exit 0; SIGHUP "
      "reloads "
      "the rule files and the tokens file, and checks the TLS files (which new connections get within a second of "
      "being "
      "rewritten).");
  std::string config_path, listen, metrics_listen, data_dir, log_format, log_level, ready_file;
  std::string tls_cert, tls_key, tls_client_ca;
  bool check_config = false;
  app.add_option("-c,--config", config_path, "YAML config file")->check(CLI::ExistingFile);
  app.add_option("--listen", listen, "gRPC address HOST:PORT (port 0: any free port)");
  app.add_option("--metrics-listen", metrics_listen, "/metrics address HOST:PORT (port 0: any free port)");
  app.add_option("--data-dir", data_dir, "directory for the journal");
  app.add_option("--log-format", log_format, "text or json")->check(CLI::IsMember({"text", "json"}));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error");
  app.add_option("--ready-file", ready_file,
                 "once serving, write {\"grpc_port\",\"metrics_port\",\"pid\"} as JSON to this file");
  app.add_option("--tls-cert", tls_cert, "TLS certificate chain (PEM) of the gRPC listener (security.tls_cert_file)");
  app.add_option("--tls-key", tls_key, "its private key (PEM) (security.tls_key_file)");
  app.add_option("--tls-client-ca", tls_client_ca,
                 "CA (PEM) of the clients' certificates: clients must present one it signed "
                 "(mutual TLS; security.tls_client_ca_file)");
  bool insecure = false;
  app.add_flag("--insecure", insecure,
               "allow a gRPC listener beyond loopback without mutual TLS: any host that reaches it may write runs, "
               "silence alerts and reload rules (security.allow_insecure)");
  app.add_flag("--check-config", check_config, "validate the configuration, print it as JSON, and exit");
  bool repair = false, dry_run = false, json = false;
  app.add_flag("--repair", repair,
               "check the journal in the data directory (the daemon stopped): SQLite's quick_check and every step "
               "checksum; when damaged, copy every run that can be read into a fresh journal, leaving out the "
               "damaged steps, and keep the old files beside it. Exit 0 sound (unchanged), 3 damage found (and "
               "repaired unless --dry-run), 1 failed");
  app.add_flag("--dry-run", dry_run, "with --repair: report only, change nothing");
  app.add_flag("--json", json, "with --repair: print the report as JSON");
  app.set_version_flag("--version", std::string("gradwatchd ") + gradwatch::kVersion);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error (an unknown flag, a bad value, a config file
    // that does not exist) exits 2, as the footer says.
    return app.exit(e) == 0 ? kExitOk : kExitConfig;
  }

  gradwatch::daemon::Config config;
  if (!config_path.empty()) {
    auto loaded = gradwatch::daemon::LoadConfigFile(config_path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "gradwatchd: %s\n", loaded.status().message().c_str());
      return kExitConfig;
    }
    config = std::move(loaded).value();
  }
  if (!listen.empty()) config.listen = listen;
  if (!metrics_listen.empty()) config.metrics_listen = metrics_listen;
  if (!data_dir.empty()) config.data_dir = data_dir;
  if (!log_format.empty()) config.log_format = log_format;
  if (!log_level.empty()) config.log_level = log_level;
  if (!tls_cert.empty()) config.tls_cert_file = tls_cert;
  if (!tls_key.empty()) config.tls_key_file = tls_key;
  if (!tls_client_ca.empty()) config.tls_client_ca_file = tls_client_ca;
  if (insecure) config.allow_insecure = true;
  if (auto s = gradwatch::daemon::ValidateConfig(config); !s.ok()) {
    std::fprintf(stderr, "gradwatchd: invalid configuration: %s\n", s.message().c_str());
    return kExitConfig;
  }
  if (auto s = gradwatch::daemon::CheckConfigFiles(config); !s.ok()) {
    std::fprintf(stderr, "gradwatchd: invalid configuration: %s\n", s.message().c_str());
    return kExitConfig;
  }
  if (!repair && (dry_run || json)) {
    std::fprintf(stderr, "gradwatchd: --dry-run and --json go with --repair\n");
    return kExitConfig;
  }
  if (check_config) {
    std::cout << gradwatch::daemon::ConfigJson(config) << "\nconfiguration OK\n";
    return kExitOk;
  }
  if (auto s = gradwatch::daemon::SetUpLogging(config.log_format, config.log_level); !s.ok()) {
    std::fprintf(stderr, "gradwatchd: %s\n", s.message().c_str());
    return kExitConfig;
  }
  if (repair) return gradwatch::daemon::RunRepair(config.data_dir, dry_run, json);

  // Block the stop signals in every thread; the main thread waits for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  InstallSigbusHandler();

  gradwatch::daemon::Daemon daemon(config);
  if (auto s = daemon.Start(); !s.ok()) {
    spdlog::critical("cannot start: {}", s.ToString());
    daemon.Stop();
    return kExitStart;
  }
  if (!ready_file.empty() && !WriteReadyFile(ready_file, daemon.grpc_port(), daemon.metrics_port())) {
    spdlog::critical("cannot write ready file {}", ready_file);
    daemon.Stop();
    return kExitStart;
  }
  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    if (config_path.empty()) {
      spdlog::info("received SIGHUP: reloading the rule files");
      daemon.ReloadRules();  // logs the outcome; invalid files leave the rules unchanged
    } else {
      spdlog::info("received SIGHUP: reading the alerts section of {} and the rule files again", config_path);
      auto fresh = gradwatch::daemon::LoadConfigFile(config_path);
      if (!fresh.ok()) {
        spdlog::error("configuration not read again, the rules in force are unchanged: {}", fresh.status().message());
      } else {
        daemon.ReloadAlertsConfig(*fresh);  // logs the outcome; an invalid alerts section changes nothing
      }
    }
    daemon.CheckTls();      // logs the certificate new connections get, or what is wrong with the files
    daemon.ReloadTokens();  // an invalid file leaves the tokens in force
  }
  spdlog::info("received {}: stopping", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  daemon.Stop();
  return kExitOk;
}
