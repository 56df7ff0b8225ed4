// gradwatchd's security: TLS on the gRPC listener, with certificates this test makes (tests/support/
// make_test_certs.sh, openssl): plain and mutual TLS, every wrong client refused with a message
// that says why, a renewed certificate served without a restart while a stream stays open, and
// configurations that cannot work refused before the daemon starts; listeners beyond loopback;
// silences' limits; bearer tokens and certificate identities with scopes.
#include <catch2/catch.hpp>

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradwatch/monitor.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/support/test_certs.h"

using namespace gradwatch::testing;
using nlohmann::json;

namespace {

std::string TlsConfig(const std::string& cert, const std::string& key, const std::string& client_ca) {
  std::string yaml =
      "log: {format: text, level: debug}\nsecurity:\n  tls_cert_file: " + cert + "\n  tls_key_file: " + key + "\n";
  if (!client_ca.empty()) yaml += "  tls_client_ca_file: " + client_ca + "\n";
  return yaml;
}

// `gradwatch --addr <daemon> [tls...] runs --json`.
CommandResult Runs(const DaemonProcess& daemon, std::vector<std::string> tls) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target(), "--timeout", "5"};
  argv.insert(argv.end(), tls.begin(), tls.end());
  argv.insert(argv.end(), {"--json", "runs"});
  return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
}

}  // namespace

TEST_CASE("mutual TLS: only a client with a certificate of the daemon's client CA gets through", "[integration][tls]") {
  Certs c;
  DaemonOptions options;
  options.config_yaml = TlsConfig(c("server.pem"), c("server.key"), c("ca.pem"));
  DaemonProcess daemon(options);
  CHECK_THAT(daemon.LogText(), Catch::Contains("TLS with /CN=gradwatchd") &&
                                   Catch::Contains("client certificates required (CA /CN=gradwatch test CA)"));
  const std::vector<std::string> good = {"--tls-ca",      c("ca.pem"), "--tls-cert",
                                         c("client.pem"), "--tls-key", c("client.key")};

  CommandResult r = Runs(daemon, good);
  INFO(r.err);
  CHECK(r.exit_code == 0);

  SECTION("plain text is refused, and told to use TLS") {
    r = Runs(daemon, {});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("closes plain-text connections") && Catch::Contains("--tls-ca"));
  }
  SECTION("TLS without a client certificate is refused") {
    r = Runs(daemon, {"--tls-ca", c("ca.pem")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon"));
  }
  SECTION("an expired client certificate is refused") {
    r = Runs(daemon,
             {"--tls-ca", c("ca.pem"), "--tls-cert", c("expired-client.pem"), "--tls-key", c("expired-client.key")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon"));
  }
  SECTION("a client certificate of another CA is refused") {
    r = Runs(daemon,
             {"--tls-ca", c("ca.pem"), "--tls-cert", c("other-client.pem"), "--tls-key", c("other-client.key")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon"));
  }
  SECTION("a daemon whose certificate the client's CA did not sign is not trusted") {
    r = Runs(daemon, {"--tls-ca", c("other-ca.pem"), "--tls-cert", c("client.pem"), "--tls-key", c("client.key")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("TLS handshake failed") && Catch::Contains("not signed by --tls-ca"));
  }
  SECTION("files the client cannot read are named") {
    r = Runs(daemon, {"--tls-ca", c("missing.pem")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("cannot read the TLS CA file " + c("missing.pem")));
    r = Runs(daemon, {"--tls-ca", c("ca.pem"), "--tls-cert", c("client.pem")});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Catch::Contains("a TLS certificate needs its key"));
  }
  SECTION("replay streams over mutual TLS, and the environment gives the files") {
    TempDir dir("gradwatch-tls-replay");
    const auto file = dir.path() / "secure.jsonl";
    std::ofstream(file) << R"({"_step": 1, "grad/norm/total": 0.5})"
                           "\n"
                           R"({"_step": 2, "grad/norm/total": 0.6})"
                           "\n";
    std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target(), "--json"};
    argv.insert(argv.end(), good.begin(), good.end());
    argv.insert(argv.end(), {"replay", file.string()});
    r = RunCommand(argv, std::nullopt, std::chrono::seconds(60));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(json::parse(r.out)["last_acked_step"] == 2);
    r = RunCommand(
        {"env", "GRADWATCH_TLS_CA=" + c("ca.pem"), "GRADWATCH_TLS_CERT=" + c("client.pem"),
         "GRADWATCH_TLS_KEY=" + c("client.key"), CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "runs"},
        std::nullopt, std::chrono::seconds(60));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("secure") != std::string::npos);
  }
}

TEST_CASE("a renewed certificate is served to new connections without a restart, and an open stream goes on",
          "[integration][tls]") {
  Certs c;
  TempDir live("gradwatch-live-certs");
  const auto cert = live.path() / "server.pem";
  const auto key = live.path() / "server.key";
  std::filesystem::copy_file(c("server.pem"), cert);
  std::filesystem::copy_file(c("server.key"), key);
  DaemonOptions options;
  options.config_yaml = TlsConfig(cert.string(), key.string(), "");
  DaemonProcess daemon(options);
  CHECK_THAT(daemon.LogText(), Catch::Contains("no client certificates asked"));
  REQUIRE(Runs(daemon, {"--tls-ca", c("ca.pem")}).exit_code == 0);

  // A tail of a log file holds one stream open across the renewal.
  TempDir dir("gradwatch-tls-tail");
  const auto log = dir.path() / "job.log";
  const auto append = [&](int from, int to) {
    std::ofstream out(log, std::ios::app);
    for (int step = from; step <= to; ++step)
      out << R"({"_step": )" << step << R"(, "train/loss": 2.0})"
          << "\n";
  };
  append(1, 5);
  BackgroundCommand tail({CliBinaryPath(), "--addr", daemon.grpc_target(), "--tls-ca", c("ca.pem"), "--json", "tail",
                          log.string(), "--run", "renewed"});
  const auto steps = [&](const std::vector<std::string>& tls) {
    std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target(), "--timeout", "5"};
    argv.insert(argv.end(), tls.begin(), tls.end());
    argv.insert(argv.end(), {"series", "renewed", "train/loss", "--json"});
    const CommandResult r = RunCommand(argv, std::nullopt, std::chrono::seconds(60));
    return r.exit_code == 0 ? json::parse(r.out).size() : size_t{0};
  };
  REQUIRE(WaitUntil([&] { return steps({"--tls-ca", c("ca.pem")}) == 5; }, std::chrono::seconds(60)));

  // The renewal: another CA's certificate written over the files, then SIGHUP.
  std::filesystem::copy_file(c("other-server.key"), key, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(c("other-server.pem"), cert, std::filesystem::copy_options::overwrite_existing);
  daemon.Signal(SIGHUP);
  REQUIRE(WaitUntil(
      [&] {
        return Runs(daemon, {"--tls-ca", c("other-ca.pem")}).exit_code == 0;
      },
      std::chrono::seconds(60)));
  CHECK(WaitUntil(
      [&] {
        const std::string log = daemon.LogText();
        return log.find("gRPC: TLS files reloaded: new connections get /CN=") != std::string::npos;
      },
      std::chrono::seconds(30)));
  CHECK(Runs(daemon, {"--tls-ca", c("ca.pem")}).exit_code == 1);  // the old certificate is gone

  // The stream opened before the renewal is still there and still delivers.
  append(6, 9);
  CHECK(WaitUntil([&] { return steps({"--tls-ca", c("other-ca.pem")}) == 9; }, std::chrono::seconds(60)));
  CHECK(tail.running());
  tail.Signal(SIGTERM);
  const CommandResult r = tail.Wait(std::chrono::seconds(60));
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(json::parse(r.out)["steps_sent"] == 9);
}

TEST_CASE("a renewal written in place in every broken way keeps the last good pair on both listeners",
          "[integration][tls]") {
  // Found by a hostile pass: an empty certificate or key file aborted the daemon (gRPC's assertion)
  // within a second; a broken PEM, or a certificate written before its key, made every new gRPC
  // connection fail until the files were fixed.
  Certs c;
  TempDir live("gradwatch-broken-renewal");
  const auto cert = live.path() / "server.pem";
  const auto key = live.path() / "server.key";
  std::filesystem::copy_file(c("server.pem"), cert);
  std::filesystem::copy_file(c("server.key"), key);
  DaemonOptions options;
  options.config_yaml = TlsConfig(cert.string(), key.string(), "");
  DaemonProcess daemon(options);
  const auto grpc_ok = [&](const std::string& ca) { return Runs(daemon, {"--tls-ca", ca}).exit_code == 0; };
  const auto https_ok = [&](const std::string& ca) {
    try {
      return HttpsRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics", {ca, "", "", ""}).status == 200;
    } catch (const std::exception&) {
      return false;
    }
  };
  REQUIRE(grpc_ok(c("ca.pem")));
  REQUIRE(https_ok(c("ca.pem")));
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const auto write = [](const std::filesystem::path& path, const std::string& text) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  };
  const std::string good_cert = read(c("server.pem")), good_key = read(c("server.key"));
  const std::string new_cert = read(c("other-server.pem")), new_key = read(c("other-server.key"));
  size_t refusals = 0;
  const auto count_refusals = [&] {
    const std::string log = daemon.LogText();
    size_t n = 0;
    for (size_t at = log.find("gRPC: TLS files not loaded ("); at != std::string::npos;
         at = log.find("gRPC: TLS files not loaded (", at + 1)) {
      ++n;
    }
    return n;
  };
  for (const auto& [what, cert_text, key_text, reason] :
       std::vector<std::tuple<std::string, std::string, std::string, std::string>>{
           {"an empty certificate (a shell's > before the write)", "", good_key, "is empty"},
           {"an empty key", good_cert, "", "is empty"},
           {"a truncated certificate", good_cert.substr(0, good_cert.size() / 2), good_key, "no PEM certificate"},
           {"the new certificate written before its key", new_cert, good_key, "is not the key of"},
           {"the new key written before its certificate", good_cert, new_key, "is not the key of"},
       }) {
    INFO(what);
    write(cert, cert_text);
    write(key, key_text);
    // The daemon rereads the files every second and reports each broken pair once.
    REQUIRE(WaitUntil([&] { return count_refusals() > refusals; }, std::chrono::seconds(30)));
    refusals = count_refusals();
    CHECK_THAT(daemon.LogText(), Catch::Contains(reason) && Catch::Contains("new connections keep /CN=gradwatchd"));
    REQUIRE(daemon.running());
    CHECK(grpc_ok(c("ca.pem")));  // the last good pair, still served
    CHECK(https_ok(c("ca.pem")));
  }
  // Written whole at last: both listeners serve it, without a restart.
  write(cert, new_cert);
  write(key, new_key);
  CHECK(WaitUntil([&] { return grpc_ok(c("other-ca.pem")); }, std::chrono::seconds(60)));
  CHECK(WaitUntil([&] { return https_ok(c("other-ca.pem")); }, std::chrono::seconds(60)));
  CHECK_THAT(daemon.LogText(), Catch::Contains("gRPC: TLS files reloaded: new connections get /CN=gradwatchd"));
  CHECK_FALSE(grpc_ok(c("ca.pem")));
  REQUIRE(daemon.running());
}

TEST_CASE("a TLS configuration that cannot work is refused before the daemon starts", "[integration][tls]") {
  Certs c;
  const auto check = [](const std::string& yaml) {
    TempDir dir("gradwatch-tls-config");
    const auto file = dir.path() / "gradwatchd.yaml";
    std::ofstream(file) << yaml;
    return RunCommand({DaemonBinaryPath(), "--config", file.string(), "--check-config"}, std::nullopt,
                      std::chrono::seconds(60));
  };
  CommandResult r = check("security: {tls_cert_file: " + c("server.pem") + "}\n");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("security.tls_cert_file: needs security.tls_key_file"));
  r = check(TlsConfig(c("server.pem"), c("client.key"), ""));
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("is not the key of " + c("server.pem")));
  r = check(TlsConfig(c("expired-client.pem"), c("expired-client.key"), ""));
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("expired at 2020-01-02T00:00:00Z"));
  r = check(TlsConfig(c("server.pem"), c("server.key"), c("missing.pem")));
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("security.tls_client_ca_file " + c("missing.pem") + ": no such file"));
  r = check(TlsConfig(c("server.pem"), c("server.key"), c("ca.pem")));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("\"tls_client_ca_file\": \"" + c("ca.pem") + "\""));
}

TEST_CASE("a listener beyond loopback needs mutual TLS or --insecure", "[integration][security]") {
  Certs c;
  TempDir dir("gradwatch-insecure");
  const auto check = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {DaemonBinaryPath(), "--data-dir", (dir.path() / "data").string(),
                                     "--check-config"};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
  };
  // --check-config validates the addresses without binding them: nothing listens beyond loopback here.
  CommandResult r = check({"--listen", "0.0.0.0:7390"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("listen: 0.0.0.0:7390 is not loopback") && Catch::Contains("--insecure"));
  r = check({"--listen", "10.1.2.3:7390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key")});
  CHECK(r.exit_code == 2);  // TLS alone: anyone may still connect
  r = check({"--listen", "0.0.0.0:7390", "--insecure"});
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("\"allow_insecure\": true"));
  r = check({"--listen", "[::]:7390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key"), "--tls-client-ca",
             c("ca.pem")});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  for (const char* loopback : {"127.0.0.1:7390", "127.8.9.10:7390", "localhost:7390", "[::1]:7390"}) {
    CHECK(check({"--listen", loopback}).exit_code == 0);
  }
  // A daemon on loopback says its listener is not open to others.
  DaemonProcess daemon;
  CHECK_THAT(daemon.ScrapeMetrics(), Catch::Contains("gradwatch_insecure_listener 0"));
}

TEST_CASE("silences have a maximum duration and record who made them", "[integration][security]") {
  Certs c;
  DaemonOptions options;
  options.config_yaml = TlsConfig(c("server.pem"), c("server.key"), c("ca.pem")) + "  max_silence_seconds: 7200\n";
  DaemonProcess daemon(options);
  const auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {CliBinaryPath(), "--addr",    daemon.grpc_target(),
                                     "--tls-ca",      c("ca.pem"), "--tls-cert",
                                     c("client.pem"), "--tls-key", c("client.key")};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
  };
  CommandResult r = cli({"silence", "add", "run=moe", "--duration", "7201"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("a silence may last at most 2h (security.max_silence_seconds)") &&
                        Catch::Contains("this one would last 7201s"));
  r = cli({"silence", "add", "run=moe", "--duration", "3600", "--by", "alice", "--comment", "planned restart"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = cli({"--json", "silence", "list"});
  REQUIRE(r.exit_code == 0);
  const json silences = json::parse(r.out)["silences"];
  REQUIRE(silences.size() == 1);
  // The name given, and the client certificate's identity, which the client cannot choose.
  CHECK(silences[0]["created_by"] == "alice (certificate trainer)");
}

namespace {

// A token's SHA-256 in hex, as the tokens file holds it, computed as docs/security.md says to.
std::string Sha256Hex(const std::string& token) {
  const CommandResult r = RunCommand({"bash", "-c", "printf %s '" + token + "' | sha256sum | cut -d' ' -f1"},
                                     std::nullopt, std::chrono::seconds(30));
  return r.out.substr(0, 64);
}

// A tokens file granting `trainer` write and read on runs pre-*, `oncall` read, silence and ack,
// `admin` everything, and the client certificate "trainer" read only.
std::string TokensYaml(bool with_trainer = true) {
  const auto sha = Sha256Hex;
  std::string yaml = "tokens:\n";
  if (with_trainer) {
    yaml += "  - {name: trainer, sha256: " + sha("trainer-secret-1") + ", scopes: [write, read], runs: [\"pre-*\"]}\n";
  }
  yaml += "  - {name: oncall, sha256: " + sha("oncall-secret-2") + ", scopes: [read, silence, ack]}\n";
  yaml += "  - {name: admin, sha256: " + sha("admin-secret-3") + ", scopes: [read, write, silence, ack, admin]}\n";
  yaml += "identities:\n  - {identity: trainer, scopes: [read]}\n";
  return yaml;
}

}  // namespace

TEST_CASE("tokens: each caller may do what its scopes and run patterns allow, and nothing else",
          "[integration][security]") {
  TempDir dir("gradwatch-tokens");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << TokensYaml();
  DaemonOptions options;
  options.config_yaml = "log: {format: text, level: debug}\nsecurity: {tokens_file: " + tokens.string() + "}\n";
  DaemonProcess daemon(options);
  const auto file = dir.path() / "job.jsonl";
  std::ofstream(file) << R"({"_step": 1, "grad/norm/total": 0.5})"
                         "\n";
  const auto cli = [&](const std::string& token, std::vector<std::string> args) {
    std::vector<std::string> argv = {"env", "GRADWATCH_TOKEN=" + token, CliBinaryPath(), "--addr",
                                     daemon.grpc_target()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
  };

  CommandResult r = cli("", {"runs"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("refused by the daemon") && Catch::Contains("requires a bearer token"));
  r = cli("wrong", {"runs"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("not one this daemon knows"));

  r = cli("trainer-secret-1", {"replay", file.string(), "--run", "pre-1"});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  r = cli("trainer-secret-1", {"replay", file.string(), "--run", "prod-1"});
  CHECK(r.exit_code == 1);
  // The refusal arrives as the Hello's error and as the stream's status; either says why.
  CHECK_THAT(r.err, Catch::Contains("refused run prod-1") && Catch::Contains("may write only runs matching pre-*"));
  r = cli("trainer-secret-1", {"annotate", "pre-1", "1", "note"});
  CHECK(r.exit_code == 0);
  r = cli("trainer-secret-1", {"silence", "add", "run=pre-1", "--duration", "60"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("token trainer has no 'silence' scope"));

  r = cli("oncall-secret-2", {"silence", "add", "run=pre-1", "--duration", "60", "--by", "bob"});
  CHECK(r.exit_code == 0);
  r = cli("oncall-secret-2", {"--json", "silence", "list"});
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out)["silences"][0]["created_by"] == "bob (token oncall)");
  r = cli("oncall-secret-2", {"replay", file.string(), "--run", "pre-2"});
  CHECK(r.exit_code == 1);
  r = cli("oncall-secret-2", {"rules", "reload"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("token oncall has no 'admin' scope"));
  r = cli("admin-secret-3", {"rules", "reload"});
  CHECK(r.exit_code == 0);

  // Refusals are counted, and logged without the secret.
  const std::string metrics = daemon.ScrapeMetrics();
  CHECK_THAT(metrics, Catch::Contains("gradwatch_auth_refusals_total{reason=\"unauthenticated\"} 2") &&
                          Catch::Contains("gradwatch_auth_refusals_total{reason=\"permission_denied\"} 4"));
  CHECK_THAT(daemon.LogText(), Catch::Contains("refused reload rules") && Catch::Contains("no token"));
  for (const char* secret : {"trainer-secret-1", "oncall-secret-2", "admin-secret-3", "wrong"}) {
    CHECK(daemon.LogText().find(secret) == std::string::npos);
  }

  // SIGHUP reloads the file: the trainer's token is revoked; a broken file changes nothing.
  std::ofstream(tokens) << TokensYaml(/*with_trainer=*/false);
  daemon.Signal(SIGHUP);
  REQUIRE(WaitUntil([&] { return cli("trainer-secret-1", {"runs"}).exit_code == 1; }, std::chrono::seconds(30)));
  std::ofstream(tokens) << "tokens:\n  - {name: x, sha256: not-a-hash, scopes: [read]}\n";
  daemon.Signal(SIGHUP);
  REQUIRE(WaitUntil([&] { return daemon.LogText().find("tokens not reloaded") != std::string::npos; },
                    std::chrono::seconds(30)));
  CHECK(cli("oncall-secret-2", {"runs"}).exit_code == 0);
}

TEST_CASE("client certificates map to scopes like tokens, and tokens open a listener beyond loopback",
          "[integration][security]") {
  Certs c;
  TempDir dir("gradwatch-identities");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << TokensYaml();
  DaemonOptions options;
  options.config_yaml =
      TlsConfig(c("server.pem"), c("server.key"), c("ca.pem")) + "  tokens_file: " + tokens.string() + "\n";
  DaemonProcess daemon(options);
  const std::vector<std::string> cert = {CliBinaryPath(), "--addr",    daemon.grpc_target(),
                                         "--tls-ca",      c("ca.pem"), "--tls-cert",
                                         c("client.pem"), "--tls-key", c("client.key")};
  const auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = cert;
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
  };
  CommandResult r = cli({"runs"});
  INFO(r.err);
  CHECK(r.exit_code == 0);  // the certificate "trainer" may read
  r = cli({"silence", "add", "run=x", "--duration", "60"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("certificate trainer has no 'silence' scope"));
  // A token over the same connection wins over the certificate's grant.
  r = cli({"--token-file", (dir.path() / "oncall.token").string(), "runs"});
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("cannot read the token file"));
  std::ofstream(dir.path() / "oncall.token") << "oncall-secret-2\n";
  r = cli({"--token-file", (dir.path() / "oncall.token").string(), "silence", "add", "run=x", "--duration", "60"});
  CHECK(r.exit_code == 0);

  // TLS with tokens (without client certificates) may listen beyond loopback; --check-config binds nothing.
  r = RunCommand({DaemonBinaryPath(), "--data-dir", (dir.path() / "data").string(), "--check-config", "--listen",
                  "0.0.0.0:7390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key")},
                 std::nullopt, std::chrono::seconds(60));
  CHECK(r.exit_code == 2);
  std::ofstream(dir.path() / "c.yaml") << "security: {tokens_file: " + tokens.string() + "}\n";
  r = RunCommand(
      {DaemonBinaryPath(), "--config", (dir.path() / "c.yaml").string(), "--data-dir", (dir.path() / "data").string(),
       "--check-config", "--listen", "0.0.0.0:7390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key")},
      std::nullopt, std::chrono::seconds(60));
  CHECK(r.exit_code == 0);
  // A tokens file with a token in clear instead of its hash is refused before start.
  std::ofstream(tokens) << "tokens:\n  - {name: x, sha256: my-plain-token, scopes: [read]}\n";
  r = RunCommand({DaemonBinaryPath(), "--config", (dir.path() / "c.yaml").string(), "--data-dir",
                  (dir.path() / "data").string(), "--check-config"},
                 std::nullopt, std::chrono::seconds(60));
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("sha256 must be the token's SHA-256 in hex") && Catch::Contains("never the token"));
}

namespace {

// `scraper` may read, `writer` may only write; the client certificate "trainer" may read.
std::string HttpTokensYaml() {
  const auto sha = Sha256Hex;
  return "tokens:\n  - {name: scraper, sha256: " + sha("scrape-secret-4") + ", scopes: [read]}\n" +
         "  - {name: writer, sha256: " + sha("write-secret-5") + ", scopes: [write]}\n" +
         "identities:\n  - {identity: trainer, scopes: [read]}\n";
}

HttpResponse Scrape(const DaemonProcess& daemon, const TlsClient& tls, const std::string& token = "") {
  std::map<std::string, std::string> headers;
  if (!token.empty()) headers["Authorization"] = "Bearer " + token;
  return HttpsRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics", tls, "", headers);
}

}  // namespace

TEST_CASE("300 silent TCP connections cannot keep a scraper with a token from HTTPS /metrics",
          "[integration][security][tls]") {
  // Found by a hostile pass: with metrics_require_token, 256 TCP connections that sent nothing
  // failed 72 of 73 scrapes. The head deadline covers the TLS handshake.
  Certs c;
  TempDir dir("gradwatch-https-slow");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << HttpTokensYaml();
  DaemonOptions options;
  options.config_yaml = TlsConfig(c("server.pem"), c("server.key"), "") + "  tokens_file: " + tokens.string() +
                        "\n  metrics_require_token: true\nhttp: {header_timeout_seconds: 2}\n";
  DaemonProcess daemon(options);
  const TlsClient ca{c("ca.pem"), "", "", ""};
  SlowClients silent(daemon.metrics_port(), 300, /*silent=*/true);
  int failed = 0;
  std::string last_error;
  for (int scrape = 0; scrape < 40; ++scrape) {
    try {
      const HttpResponse r = Scrape(daemon, ca, "scrape-secret-4");
      if (r.status != 200 || r.body.find("gradwatch_open_streams") == std::string::npos) ++failed;
    } catch (const std::exception& e) {
      ++failed;
      last_error = e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  INFO(last_error);
  CHECK(failed == 0);
  CHECK(silent.reopened() > 0);  // closed by the deadline or to make room, and opened again
  CHECK(daemon.running());
}

TEST_CASE("HTTPS /metrics with tokens: each wrong client refused with a reason, a renewed certificate served",
          "[integration][security][tls]") {
  Certs c;
  TempDir dir("gradwatch-https");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << HttpTokensYaml();
  const auto cert = dir.path() / "server.pem";
  const auto key = dir.path() / "server.key";
  std::filesystem::copy_file(c("server.pem"), cert);
  std::filesystem::copy_file(c("server.key"), key);
  DaemonOptions options;
  options.config_yaml = TlsConfig(cert.string(), key.string(), "") + "  tokens_file: " + tokens.string() +
                        "\n  metrics_require_token: true\n";
  DaemonProcess daemon(options);
  CHECK_THAT(daemon.LogText(),
             Catch::Contains("/metrics on 127.0.0.1:0 (port " + std::to_string(daemon.metrics_port()) + ", HTTPS)"));
  const TlsClient ca{c("ca.pem"), "", "", ""};

  HttpResponse r = HttpRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics");
  CHECK(r.status == 400);
  CHECK_THAT(r.body, Catch::Contains("this listener serves HTTPS: use https://"));
  CHECK_THROWS_WITH(Scrape(daemon, {c("other-ca.pem"), "", "", ""}), Catch::Contains("certificate verify failed"));

  r = Scrape(daemon, ca);
  CHECK(r.status == 401);
  CHECK(r.headers["www-authenticate"] == "Bearer realm=\"gradwatch\"");
  CHECK_THAT(r.body, Catch::Contains("requires a bearer token") && Catch::Contains("credentials_file"));
  r = Scrape(daemon, ca, "wrong-secret");
  CHECK(r.status == 401);
  CHECK_THAT(r.body, Catch::Contains("not one this daemon knows"));
  r = Scrape(daemon, ca, "write-secret-5");
  CHECK(r.status == 403);
  CHECK(r.body == "GET /metrics: token writer has no 'read' scope\n");
  // The scheme is case-insensitive (RFC 9110), as Go's and Prometheus' servers read it.
  r = HttpsRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics", ca, "",
                   {{"Authorization", "bearer  scrape-secret-4"}});
  CHECK(r.status == 200);
  r = Scrape(daemon, ca, "scrape-secret-4");
  REQUIRE(r.status == 200);
  CHECK_THAT(r.body, Catch::Contains("gradwatch_auth_refusals_total{reason=\"unauthenticated\"} 2") &&
                         Catch::Contains("gradwatch_auth_refusals_total{reason=\"permission_denied\"} 1") &&
                         Catch::Contains("gradwatch_insecure_listener 0"));
  for (const char* secret : {"scrape-secret-4", "write-secret-5", "wrong-secret"}) {
    CHECK(daemon.LogText().find(secret) == std::string::npos);
  }
  CHECK_THAT(daemon.LogText(), Catch::Contains("refused GET /metrics from 127.0.0.1:"));

  // Renewed in place (another CA's certificate), then SIGHUP: new connections get it.
  std::filesystem::copy_file(c("other-server.key"), key, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(c("other-server.pem"), cert, std::filesystem::copy_options::overwrite_existing);
  daemon.Signal(SIGHUP);
  CHECK(WaitUntil([&] { return daemon.LogText().find("HTTP: TLS files reloaded") != std::string::npos; },
                  std::chrono::seconds(30)));
  r = Scrape(daemon, {c("other-ca.pem"), "", "", ""}, "scrape-secret-4");
  CHECK(r.status == 200);
  CHECK_THROWS_WITH(Scrape(daemon, ca, "scrape-secret-4"), Catch::Contains("certificate verify failed"));
}

TEST_CASE(
    "HTTPS /metrics with client certificates: the certificate's identity has scopes, other clients cannot connect",
    "[integration][security][tls]") {
  Certs c;
  TempDir dir("gradwatch-https-mtls");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << HttpTokensYaml();
  DaemonOptions options;
  options.config_yaml = TlsConfig(c("server.pem"), c("server.key"), "") + "  tokens_file: " + tokens.string() +
                        "\n  metrics_require_token: true\n  http_client_ca_file: " + c("ca.pem") + "\n";
  DaemonProcess daemon(options);

  // The certificate "trainer" may read: no token needed.
  HttpResponse r = Scrape(daemon, {c("ca.pem"), c("client.pem"), c("client.key"), ""});
  CHECK(r.status == 200);
  CHECK_THAT(r.body, Catch::Contains("gradwatch_auth_refusals_total{reason=\"unauthenticated\"} 0"));
  // Without a certificate, with an expired one, or with another CA's: no connection at all.
  CHECK_THROWS(Scrape(daemon, {c("ca.pem"), "", "", ""}, "scrape-secret-4"));
  CHECK_THROWS(Scrape(daemon, {c("ca.pem"), c("expired-client.pem"), c("expired-client.key"), ""}));
  CHECK_THROWS(Scrape(daemon, {c("ca.pem"), c("other-client.pem"), c("other-client.key"), ""}));
  CHECK_THAT(daemon.LogText(), Catch::Contains("HTTP: TLS handshake with 127.0.0.1:"));
  // A token still decides when it is sent: the writer's has no read scope.
  r = Scrape(daemon, {c("ca.pem"), c("client.pem"), c("client.key"), ""}, "write-secret-5");
  CHECK(r.status == 403);
}

TEST_CASE("the HTTP listener beyond loopback needs TLS or --insecure, and http_tls: false keeps it plain",
          "[integration][security][tls]") {
  Certs c;
  TempDir dir("gradwatch-http-insecure");
  const auto check = [&](std::vector<std::string> args, const std::string& yaml = "") {
    const auto file = dir.path() / "c.yaml";
    std::ofstream(file) << yaml;
    std::vector<std::string> argv = {
        DaemonBinaryPath(), "--config", file.string(), "--data-dir", (dir.path() / "data").string(), "--check-config"};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
  };
  CommandResult r = check({"--metrics-listen", "0.0.0.0:9390"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("metrics_listen: 0.0.0.0:9390 is not loopback") && Catch::Contains("--insecure"));
  r = check({"--metrics-listen", "0.0.0.0:9390", "--insecure"});
  CHECK(r.exit_code == 0);
  r = check({"--metrics-listen", "0.0.0.0:9390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key")});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  r = check({"--metrics-listen", "0.0.0.0:9390", "--tls-cert", c("server.pem"), "--tls-key", c("server.key")},
            "security: {http_tls: false}\n");
  CHECK(r.exit_code == 2);
  r = check({}, "security: {http_client_ca_file: " + c("ca.pem") + "}\n");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("security.http_client_ca_file: client certificates need TLS"));
  r = check({"--tls-cert", c("server.pem"), "--tls-key", c("server.key")},
            "security: {http_client_ca_file: " + c("missing.pem") + "}\n");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("security.http_client_ca_file " + c("missing.pem") + ": no such file"));

  // gRPC over TLS, /metrics plain on loopback.
  DaemonOptions options;
  options.config_yaml = TlsConfig(c("server.pem"), c("server.key"), "") + "  http_tls: false\n";
  DaemonProcess daemon(options);
  CHECK_THAT(daemon.ScrapeMetrics(), Catch::Contains("gradwatch_insecure_listener 0"));
  CHECK(Runs(daemon, {"--tls-ca", c("ca.pem")}).exit_code == 0);
}

TEST_CASE(
    "streams the policy refuses take no slot, a silent stream is closed at the Hello deadline, and one caller "
    "cannot take every slot",
    "[integration][security]") {
  // Found by a hostile pass: with tokens on and max_streams 4096, 4,200 Stream RPCs with no token
  // and no message held every slot; a trainer with a valid token got RESOURCE_EXHAUSTED.
  TempDir dir("gradwatch-stream-slots");
  const auto tokens = dir.path() / "tokens.yaml";
  std::ofstream(tokens) << TokensYaml();
  DaemonOptions options;
  options.config_yaml = "security: {tokens_file: " + tokens.string() +
                        "}\nlimits: {max_streams: 6, max_streams_per_identity: 4, hello_timeout_seconds: 2}\n";
  DaemonProcess daemon(options);

  std::vector<std::unique_ptr<StreamClient>> silent;
  for (int i = 0; i < 40; ++i) silent.push_back(std::make_unique<StreamClient>(daemon.grpc_target()));

  const auto monitor = [&](const std::string& token, const std::string& run, uint32_t rank) {
    gradwatch::client::MonitorOptions mo;
    mo.address = daemon.grpc_target();
    mo.tls.token = token;
    mo.hello.set_run_id(run);
    mo.hello.set_rank(rank);
    mo.hello.set_world_size(8);
    mo.initial_backoff = std::chrono::milliseconds(200);
    mo.max_backoff = std::chrono::seconds(1);
    auto m = std::make_unique<gradwatch::client::Monitor>(mo);
    m->Start();
    return m;
  };
  std::vector<std::unique_ptr<gradwatch::client::Monitor>> trainer;
  for (uint32_t rank = 0; rank < 4; ++rank) {
    trainer.push_back(monitor("trainer-secret-1", "pre-slots", rank));
    REQUIRE(trainer.back()->WaitAccepted(std::chrono::seconds(30)));  // the 40 silent streams hold no slot
  }
  // A fifth stream of the same caller is refused, naming the limit; another caller still gets one.
  auto fifth = monitor("trainer-secret-1", "pre-slots", 4);
  CHECK(WaitUntil([&] { return fifth->Stats().last_error.find("max_streams_per_identity") != std::string::npos; },
                  std::chrono::seconds(30)));
  CHECK_FALSE(fifth->Stats().connected);
  fifth->Stop();
  auto admin = monitor("admin-secret-3", "adm-slots", 0);
  CHECK(admin->WaitAccepted(std::chrono::seconds(30)));

  // The silent streams are closed at the Hello deadline.
  const auto closed = [&] {
    const std::string log = daemon.LogText();
    const std::regex line("closed ([0-9]+) stream\\(s\\) that sent no Hello within 2 s of opening");
    int total = 0;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
      total += std::stoi((*it)[1]);
    }
    return total;
  };
  CHECK(WaitUntil([&] { return closed() >= 40; }, std::chrono::seconds(60)));
  CHECK(closed() == 40);  // the streams that sent their Hello were not
  for (const auto& m : trainer) CHECK(m->Stats().connected);
  CHECK_THAT(daemon.LogText(), Catch::Contains("refused opening a stream from") && Catch::Contains("no token"));
}
