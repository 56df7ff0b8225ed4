// Integration-test support: runs the real gradwatchd as a child process on ephemeral loopback
// ports, plus small helpers to scrape HTTP, run commands and read Prometheus text exposition.
//
// For tests only: failures throw std::runtime_error (Catch2 reports them); nothing here is meant
// for the daemon itself. The paths of the binaries under test come from compile definitions set by
// tests/integration/CMakeLists.txt (GRADWATCHD_PATH, GRADWATCH_CLI_PATH, ...).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/temp_dir.h"
#include "tests/support/time_scale.h"

namespace gradwatch::testing {

// Paths fixed at build time. An environment variable of the same name overrides each (useful to
// run the tests against an installed binary).
std::string DaemonBinaryPath();  // GRADWATCHD_PATH: build/server/gradwatchd
std::string CliBinaryPath();     // GRADWATCH_CLI_PATH: build/client/gradwatch
std::string SourceDir();         // GRADWATCH_SOURCE_DIR: the repository root
std::string PromtoolPath();      // GRADWATCH_PROMTOOL_PATH: promtool, empty when not found

struct DaemonOptions {
  // Data directory to use. Empty: the daemon makes a fresh TempDir it owns (removed when the
  // DaemonProcess is destroyed). Set it to a directory the test owns to restart a daemon on the
  // same journal.
  std::filesystem::path data_dir;
  // Contents of the YAML config file written to <data_dir>/gradwatchd.yaml and passed with
  // --config. The command-line flags below win over it.
  std::string config_yaml = "log: {format: text, level: debug}\n";
  // gRPC address (--listen). A fixed port lets clients reconnect to a restarted daemon.
  std::string listen = "127.0.0.1:0";
  // Extra command-line arguments, appended after the standard ones.
  std::vector<std::string> extra_args;
  // How long to wait for the ready file (stretched by TimeScale(), as every wait below is).
  std::chrono::seconds ready_timeout{20};
  // Binary to run; empty means DaemonBinaryPath().
  std::string binary;
};

// A running gradwatchd, started by the constructor with
//   --config D/gradwatchd.yaml --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0
//   --data-dir D --ready-file D/ready.json [extra_args...]
// The constructor returns once D/ready.json holds {"grpc_port", "metrics_port", "pid"}, and throws
// (with the daemon's log in the message) if the daemon exits first or the ready timeout passes.
// stdout and stderr are appended to D/gradwatchd.stdout.log and D/gradwatchd.stderr.log.
// The destructor stops a daemon still running (SIGTERM, then SIGKILL after 10 s).
// Not thread-safe: use one instance from one thread.
class DaemonProcess {
 public:
  explicit DaemonProcess(DaemonOptions options = {});
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Sends `sig`, waits up to `timeout` for the process to exit, then sends SIGKILL and waits.
  // Returns the exit status: the exit code for a normal exit, 128 + signal number when a signal
  // ended it (shell convention). Calling it again returns the same status.
  int Stop(int sig = SIGTERM, std::chrono::seconds timeout = std::chrono::seconds(10));

  // Stops the daemon (SIGTERM) if it is running and starts a new one on the same data directory
  // and options. The ports change. Returns the stop status (or the earlier one).
  int Restart();

  // Sends a signal without waiting (e.g. SIGKILL to simulate a crash, then Stop() to reap it).
  void Signal(int sig);

  // Whether the process is still running (reaps it if it has exited).
  bool running();

  pid_t pid() const { return pid_; }
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  std::string grpc_target() const;  // "127.0.0.1:<grpc_port>"
  const std::filesystem::path& data_dir() const { return data_dir_; }

  // What this process (since its last start) wrote to stdout, to stderr, and both (stderr first).
  std::string Stdout() const;
  std::string Stderr() const;
  std::string LogText() const;

  // GET /metrics from this daemon (throws unless HTTP 200).
  std::string ScrapeMetrics() const;

 private:
  void Start();
  // Non-blocking reap; true if the process has exited (status_ then holds its status).
  bool Reap(bool block);

  DaemonOptions options_;
  std::optional<TempDir> owned_dir_;
  std::filesystem::path data_dir_;
  pid_t pid_ = -1;
  std::optional<int> status_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
  // Sizes of the log files when the current process started, so Stdout()/Stderr() return only its
  // own output after a restart.
  std::uintmax_t stdout_offset_ = 0;
  std::uintmax_t stderr_offset_ = 0;
};

struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // de-chunked
};

// One HTTP/1.1 request over a plain TCP connection (Connection: close), bounded by `timeout` as a
// whole. Throws std::runtime_error on connection or protocol failure (not on HTTP error statuses).
HttpResponse HttpRequest(const std::string& method, const std::string& host, int port, const std::string& path,
                         const std::string& body = "", const std::map<std::string, std::string>& headers = {},
                         std::chrono::milliseconds timeout = std::chrono::seconds(10));

// The client side of TLS: the CA to trust (required), a certificate and key to present (optional),
// and the name to check the server's certificate against (default: the host).
struct TlsClient {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string server_name;
};

// HttpRequest over TLS (OpenSSL). Throws std::runtime_error naming the step that failed and
// OpenSSL's reasons (an untrusted certificate, a refused client certificate, ...).
HttpResponse HttpsRequest(const std::string& method, const std::string& host, int port, const std::string& path,
                          const TlsClient& tls, const std::string& body = "",
                          const std::map<std::string, std::string>& headers = {},
                          std::chrono::milliseconds timeout = std::chrono::seconds(10));

// A loopback TCP port that is free now (bound to port 0, read back, closed), for a daemon that
// must come back on the same port after a restart.
int FreeLoopbackPort();

// GET and return the body; throws std::runtime_error on failure or a status other than 200.
std::string HttpGet(const std::string& host, int port, const std::string& path,
                    std::chrono::milliseconds timeout = std::chrono::seconds(10));

struct CommandResult {
  int exit_code = -1;  // exit code, or 128 + signal number; 127 when the program could not start
  std::string out;
  std::string err;
  bool timed_out = false;  // killed (SIGKILL) because it outlived the timeout
};

// Runs argv (argv[0] is looked up in PATH when it has no '/'), feeding `stdin_text` (stdin is
// /dev/null without it) and collecting stdout and stderr, killing it after `timeout`.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::optional<std::string>& stdin_text = std::nullopt,
                         std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A command running in the background, for tests that act while it runs (signal it, stop its
// peer). stdin is /dev/null; stdout and stderr go to files, readable at any time. It runs in its
// own process group. The destructor kills it (SIGKILL) if it is still running.
// Not thread-safe: use one instance from one thread.
class BackgroundCommand {
 public:
  // argv[0] is looked up in PATH when it has no '/'. Throws if it cannot be started.
  explicit BackgroundCommand(const std::vector<std::string>& argv);
  ~BackgroundCommand();
  BackgroundCommand(const BackgroundCommand&) = delete;
  BackgroundCommand& operator=(const BackgroundCommand&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Whether it is still running (reaps it if it has exited).
  bool running();
  // Waits up to `timeout` (stretched by TimeScale()) for it to exit, killing it (SIGKILL, then
  // timed_out) if it does not. Returns its exit code and all it wrote.
  CommandResult Wait(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // What it has written to stderr so far.
  std::string Stderr() const;

 private:
  bool Reap(bool block);

  TempDir dir_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

// One sample of Prometheus text exposition format 0.0.4.
struct MetricSample {
  std::string name;  // including any _bucket/_sum/_count/_total suffix
  std::map<std::string, std::string> labels;
  double value = 0;  // NaN, +Inf and -Inf as such
};

// Every sample line of `exposition` (comments and blank lines skipped). Throws std::runtime_error
// on a malformed sample line.
std::vector<MetricSample> ParseExposition(const std::string& exposition);

// The value of the sample named `name` whose label set equals `labels` exactly; nullopt when there
// is none.
std::optional<double> ParseMetric(const std::string& exposition, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

// `count` loopback connections to `port` that never finish a request, as a slow-client attack
// holds them: half send a request line and then a header line every second and half send nothing
// (all send nothing when `silent`). A closed one is opened again, as an attacker would. Stops when
// destroyed.
class SlowClients {
 public:
  SlowClients(int port, int count, bool silent = false);
  ~SlowClients();
  SlowClients(const SlowClients&) = delete;
  SlowClients& operator=(const SlowClients&) = delete;
  int reopened() const { return reopened_.load(); }

 private:
  int Open() const;
  void Run();

  const int port_;
  const bool silent_;
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::atomic<int> reopened_{0};
  std::thread thread_;
};

// Polls `pred` every 50 ms until it holds or `limit` (scaled by the sanitizers' time scale)
// passes; returns its last answer.
bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds limit = std::chrono::seconds(30));

}  // namespace gradwatch::testing
