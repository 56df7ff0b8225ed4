#include "tests/integration/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/time.h>
#include <nlohmann/json.hpp>

#ifndef GRADWATCHD_PATH
#define GRADWATCHD_PATH ""
#endif
#ifndef GRADWATCH_CLI_PATH
#define GRADWATCH_CLI_PATH ""
#endif
#ifndef GRADWATCH_SOURCE_DIR
#define GRADWATCH_SOURCE_DIR ""
#endif
#ifndef GRADWATCH_PROMTOOL_PATH
#define GRADWATCH_PROMTOOL_PATH ""
#endif

namespace gradwatch::testing {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::string EnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

[[noreturn]] void ThrowErrno(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void MakePipe(Fd& read_end, Fd& write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) ThrowErrno("pipe2");
  read_end = Fd(fds[0]);
  write_end = Fd(fds[1]);
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Waits for child `pid` to end (block) or polls it; its exit code (DecodeWaitStatus) once ended.
std::optional<int> WaitChild(pid_t pid, bool block) {
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(pid, &status, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return std::nullopt;
  if (r < 0) ThrowErrno("waitpid " + std::to_string(pid));
  return DecodeWaitStatus(status);
}

int RemainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, std::numeric_limits<int>::max()));
}

// Looks `program` up in PATH when it has no '/'; empty when not found.
std::string ResolveProgram(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  std::stringstream path(EnvOr("PATH", "/usr/local/bin:/usr/bin:/bin"));
  std::string dir;
  while (std::getline(path, dir, ':')) {
    fs::path candidate = fs::path(dir.empty() ? "." : dir) / program;
    if (::access(candidate.c_str(), X_OK) == 0 && !fs::is_directory(candidate)) return candidate;
  }
  return {};
}

// Everything the child needs, prepared before fork: after fork only async-signal-safe calls.
struct ChildSpec {
  std::string program;  // resolved path
  std::vector<std::string> argv;
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

// Starts the child; returns its pid. Throws if fork fails or the program cannot be executed.
pid_t Spawn(const ChildSpec& spec) {
  std::vector<char*> argv;
  argv.reserve(spec.argv.size() + 1);
  for (const auto& arg : spec.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);

  Fd exec_error_read, exec_error_write;
  MakePipe(exec_error_read, exec_error_write);
  const pid_t parent = ::getpid();
  const int error_fd = exec_error_write.get();

  const pid_t pid = ::fork();
  if (pid < 0) ThrowErrno("fork");
  if (pid == 0) {
    // Child. A signal ignored or blocked by the test process would otherwise stay so across exec.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &default_action, nullptr);
    }
    // Its own process group (so a timeout can kill what it started), and gone if the test dies.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    if (::dup2(spec.stdin_fd, 0) < 0 || ::dup2(spec.stdout_fd, 1) < 0 || ::dup2(spec.stderr_fd, 2) < 0) {
      int err = errno;
      [[maybe_unused]] auto ignored = ::write(error_fd, &err, sizeof err);
      ::_exit(127);
    }
    // Descriptors the test process holds (sockets, files) must not leak into the child; the
    // exec-error pipe closes itself at exec (O_CLOEXEC).
    if (error_fd > 3) ::close_range(3, error_fd - 1, 0);
    ::close_range(error_fd + 1, ~0U, 0);
    ::execv(spec.program.c_str(), argv.data());
    int err = errno;
    [[maybe_unused]] auto ignored = ::write(error_fd, &err, sizeof err);
    ::_exit(127);
  }

  exec_error_write.Reset();
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_error_read.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  if (n > 0) {
    int status;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    throw std::runtime_error("cannot execute " + spec.program + ": " + std::strerror(child_errno));
  }
  return pid;
}

std::string ReadFileFrom(const fs::path& path, std::uintmax_t offset) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  in.seekg(static_cast<std::streamoff>(offset));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::uintmax_t FileSize(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::uintmax_t>(st.st_size) : 0;
}

Fd OpenLog(const fs::path& path) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!fd.valid()) ThrowErrno("open " + path.string());
  return fd;
}

std::string Lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Writes to a pipe without letting a closed reader raise SIGPIPE in the test process.
ssize_t WriteNoSigpipe(int fd, const char* data, size_t size) {
  sigset_t pipe_set, old_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  ssize_t n = ::write(fd, data, size);
  int saved = errno;
  if (n < 0 && errno == EPIPE) {
    timespec zero{};
    ::sigtimedwait(&pipe_set, nullptr, &zero);
  }
  ::pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  errno = saved;
  return n;
}

std::string Dechunk(const std::string& body) {
  std::string out;
  size_t pos = 0;
  while (true) {
    size_t line_end = body.find("\r\n", pos);
    if (line_end == std::string::npos) throw std::runtime_error("HTTP: truncated chunked body");
    size_t size = std::stoul(body.substr(pos, line_end - pos), nullptr, 16);
    pos = line_end + 2;
    if (size == 0) return out;
    if (pos + size > body.size()) throw std::runtime_error("HTTP: truncated chunk");
    out.append(body, pos, size);
    pos += size + 2;
  }
}

double ParseSampleValue(const std::string& token) {
  if (token == "NaN") return std::numeric_limits<double>::quiet_NaN();
  if (token == "+Inf" || token == "Inf") return std::numeric_limits<double>::infinity();
  if (token == "-Inf") return -std::numeric_limits<double>::infinity();
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(token.c_str(), &end);
  if (token.empty() || end != token.c_str() + token.size()) {
    throw std::runtime_error("bad sample value '" + token + "'");
  }
  return value;
}

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IsNameChar(char c) { return IsNameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

MetricSample ParseSampleLine(const std::string& line) {
  MetricSample sample;
  size_t i = 0;
  auto skip_spaces = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  };
  auto fail = [&](const std::string& why) -> MetricSample {
    throw std::runtime_error("malformed sample (" + why + "): " + line);
  };
  skip_spaces();
  size_t start = i;
  if (i >= line.size() || !IsNameStart(line[i])) return fail("metric name");
  while (i < line.size() && IsNameChar(line[i])) ++i;
  sample.name = line.substr(start, i - start);
  const size_t after_name = i;
  skip_spaces();
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      skip_spaces();
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      start = i;
      if (i >= line.size() || IsNameStart(line[i]) == false || line[i] == ':') return fail("label name");
      while (i < line.size() && IsNameChar(line[i]) && line[i] != ':') ++i;
      std::string label = line.substr(start, i - start);
      skip_spaces();
      if (i >= line.size() || line[i] != '=') return fail("'=' after label " + label);
      ++i;
      skip_spaces();
      if (i >= line.size() || line[i] != '"') return fail("opening quote of label " + label);
      ++i;
      std::string value;
      while (true) {
        if (i >= line.size()) return fail("closing quote of label " + label);
        char c = line[i++];
        if (c == '"') break;
        if (c == '\\') {
          if (i >= line.size()) return fail("escape in label " + label);
          char e = line[i++];
          value.push_back(e == 'n' ? '\n' : e);
        } else {
          value.push_back(c);
        }
      }
      if (!sample.labels.emplace(label, value).second) return fail("duplicate label " + label);
      skip_spaces();
      if (i < line.size() && line[i] == ',') {
        ++i;
      } else if (i >= line.size() || line[i] != '}') {
        return fail("',' or '}' after label " + label);
      }
    }
  } else {
    i = after_name;
  }
  if (i >= line.size() || (line[i] != ' ' && line[i] != '\t')) return fail("space before value");
  skip_spaces();
  start = i;
  while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
  try {
    sample.value = ParseSampleValue(line.substr(start, i - start));
  } catch (const std::runtime_error& e) {
    return fail(e.what());
  }
  return sample;
}

}  // namespace

std::string DaemonBinaryPath() { return EnvOr("GRADWATCHD_PATH", GRADWATCHD_PATH); }
std::string CliBinaryPath() { return EnvOr("GRADWATCH_CLI_PATH", GRADWATCH_CLI_PATH); }
std::string SourceDir() { return EnvOr("GRADWATCH_SOURCE_DIR", GRADWATCH_SOURCE_DIR); }
std::string PromtoolPath() { return EnvOr("GRADWATCH_PROMTOOL_PATH", GRADWATCH_PROMTOOL_PATH); }

// ---------------------------------------------------------------------------------------------
// DaemonProcess

DaemonProcess::DaemonProcess(DaemonOptions options) : options_(std::move(options)) {
  if (options_.data_dir.empty()) {
    owned_dir_.emplace("gradwatchd-it");
    data_dir_ = owned_dir_->path();
  } else {
    data_dir_ = options_.data_dir;
    fs::create_directories(data_dir_);
  }
  if (options_.binary.empty()) options_.binary = DaemonBinaryPath();
  Start();
}

DaemonProcess::~DaemonProcess() {
  try {
    if (pid_ > 0 && !status_) Stop();
  } catch (...) {
    // A destructor must not throw; Stop() only throws on impossible waitpid failures.
  }
}

void DaemonProcess::Start() {
  if (options_.binary.empty() || ::access(options_.binary.c_str(), X_OK) != 0) {
    throw std::runtime_error("gradwatchd binary not executable: '" + options_.binary + "' (set GRADWATCHD_PATH)");
  }
  const fs::path config = data_dir_ / "gradwatchd.yaml";
  {
    std::ofstream out(config, std::ios::trunc);
    out << options_.config_yaml;
    if (!out) throw std::runtime_error("cannot write " + config.string());
  }
  const fs::path ready = data_dir_ / "ready.json";
  std::error_code ignored;
  fs::remove(ready, ignored);

  Fd out_log = OpenLog(data_dir_ / "gradwatchd.stdout.log");
  Fd err_log = OpenLog(data_dir_ / "gradwatchd.stderr.log");
  Fd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null.valid()) ThrowErrno("open /dev/null");
  stdout_offset_ = FileSize(out_log.get());
  stderr_offset_ = FileSize(err_log.get());

  ChildSpec spec;
  spec.program = options_.binary;
  spec.argv = {options_.binary, "--config",   config.string(),    "--listen",     options_.listen, "--metrics-listen",
               "127.0.0.1:0",   "--data-dir", data_dir_.string(), "--ready-file", ready.string()};
  spec.argv.insert(spec.argv.end(), options_.extra_args.begin(), options_.extra_args.end());
  spec.stdin_fd = dev_null.get();
  spec.stdout_fd = out_log.get();
  spec.stderr_fd = err_log.get();
  pid_ = Spawn(spec);
  status_.reset();
  grpc_port_ = 0;
  metrics_port_ = 0;

  const auto ready_timeout = Scaled(options_.ready_timeout);
  const auto deadline = Clock::now() + ready_timeout;
  while (true) {
    std::ifstream in(ready);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      auto json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
      if (!json.is_discarded() && json.is_object() && json.contains("grpc_port") && json.contains("metrics_port") &&
          json.contains("pid") && json["grpc_port"].is_number_integer() && json["metrics_port"].is_number_integer() &&
          json["pid"].is_number_integer()) {
        if (json["pid"].get<pid_t>() != pid_) {
          Stop(SIGKILL);
          throw std::runtime_error("ready file names pid " + json["pid"].dump() + ", expected " + std::to_string(pid_) +
                                   "\n" + LogText());
        }
        grpc_port_ = json["grpc_port"].get<int>();
        metrics_port_ = json["metrics_port"].get<int>();
        return;
      }
    }
    if (Reap(false)) {
      throw std::runtime_error("gradwatchd exited with status " + std::to_string(*status_) + " before it was ready\n" +
                               LogText());
    }
    if (Clock::now() >= deadline) {
      Stop(SIGKILL);
      throw std::runtime_error("gradwatchd was not ready within " + std::to_string(ready_timeout.count()) + " s\n" +
                               LogText());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

bool DaemonProcess::Reap(bool block) {
  if (status_) return true;
  if (pid_ <= 0) return false;
  status_ = WaitChild(pid_, block);
  return status_.has_value();
}

int DaemonProcess::Stop(int sig, std::chrono::seconds timeout) {
  if (status_) return *status_;
  if (pid_ <= 0) throw std::logic_error("DaemonProcess::Stop: never started");
  ::kill(pid_, sig);
  const auto deadline = Clock::now() + Scaled(timeout);
  while (!Reap(false)) {
    if (Clock::now() >= deadline) {
      ::kill(pid_, SIGKILL);
      Reap(true);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return *status_;
}

int DaemonProcess::Restart() {
  int status = Stop();
  Start();
  return status;
}

void DaemonProcess::Signal(int sig) {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

bool DaemonProcess::running() { return pid_ > 0 && !Reap(false); }

std::string DaemonProcess::grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port_); }

std::string DaemonProcess::Stdout() const { return ReadFileFrom(data_dir_ / "gradwatchd.stdout.log", stdout_offset_); }

std::string DaemonProcess::Stderr() const { return ReadFileFrom(data_dir_ / "gradwatchd.stderr.log", stderr_offset_); }

std::string DaemonProcess::LogText() const {
  return "--- gradwatchd stderr ---\n" + Stderr() + "--- gradwatchd stdout ---\n" + Stdout();
}

std::string DaemonProcess::ScrapeMetrics() const { return HttpGet("127.0.0.1", metrics_port_, "/metrics"); }

int FreeLoopbackPort() {
  Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) ThrowErrno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ThrowErrno("bind 127.0.0.1:0");
  socklen_t len = sizeof addr;
  if (::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) ThrowErrno("getsockname");
  return ntohs(addr.sin_port);
}

// ---------------------------------------------------------------------------------------------
// HTTP

namespace {

// A non-blocking TCP connection to host:port, made before `deadline`.
Fd ConnectTcp(const std::string& host, int port, Clock::time_point deadline) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses); rc != 0) {
    throw std::runtime_error("HTTP: cannot resolve " + host + ": " + ::gai_strerror(rc));
  }
  Fd sock;
  std::string connect_error = "no address";
  for (addrinfo* a = addresses; a != nullptr && !sock.valid(); a = a->ai_next) {
    Fd candidate(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (!candidate.valid()) continue;
    int rc = ::connect(candidate.get(), a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{candidate.get(), POLLOUT, 0};
      rc = ::poll(&p, 1, RemainingMs(deadline));
      if (rc == 1) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(candidate.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        errno = err;
        rc = err == 0 ? 0 : -1;
      } else {
        errno = rc == 0 ? ETIMEDOUT : errno;
        rc = -1;
      }
    }
    if (rc == 0) {
      sock = std::move(candidate);
    } else {
      connect_error = std::strerror(errno);
    }
  }
  ::freeaddrinfo(addresses);
  if (!sock.valid()) throw std::runtime_error("HTTP: cannot connect to " + where + ": " + connect_error);
  return sock;
}

std::string RequestText(const std::string& method, const std::string& where, const std::string& path,
                        const std::string& body, const std::map<std::string, std::string>& headers) {
  std::string request =
      method + " " + path + " HTTP/1.1\r\nHost: " + where + "\r\nConnection: close\r\nAccept: */*\r\n";
  for (const auto& [name, value] : headers) request += name + ": " + value + "\r\n";
  if (!body.empty() || method == "POST" || method == "PUT") {
    request += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  }
  request += "\r\n" + body;
  return request;
}

HttpResponse ParseResponse(std::string raw, const std::string& where, bool head_request) {
  const size_t head_end = raw.find("\r\n\r\n");
  if (head_end == std::string::npos) throw std::runtime_error("HTTP: no complete response head from " + where);
  HttpResponse response;
  std::istringstream head(raw.substr(0, head_end));
  std::string status_line;
  std::getline(head, status_line);
  if (status_line.rfind("HTTP/", 0) != 0 || status_line.size() < 12) {
    throw std::runtime_error("HTTP: bad status line from " + where + ": " + status_line);
  }
  response.status = std::atoi(status_line.c_str() + status_line.find(' ') + 1);
  std::string line;
  while (std::getline(head, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    size_t value_start = line.find_first_not_of(" \t", colon + 1);
    response.headers[Lower(line.substr(0, colon))] = value_start == std::string::npos ? "" : line.substr(value_start);
  }
  raw.erase(0, head_end + 4);
  response.body = std::move(raw);
  if (auto te = response.headers.find("transfer-encoding");
      te != response.headers.end() && Lower(te->second).find("chunked") != std::string::npos) {
    response.body = Dechunk(response.body);
  } else if (auto cl = response.headers.find("content-length"); cl != response.headers.end() && !head_request) {
    size_t length = std::stoul(cl->second);
    if (response.body.size() < length) throw std::runtime_error("HTTP: truncated body from " + where);
    response.body.resize(length);
  }
  return response;
}

std::string OpenSslErrors() {
  std::string text;
  while (const unsigned long code = ERR_get_error()) {
    char one[256];
    ERR_error_string_n(code, one, sizeof one);
    text += (text.empty() ? "" : "; ") + std::string(one);
  }
  return text.empty() ? "no OpenSSL error" : text;
}

}  // namespace

HttpResponse HttpsRequest(const std::string& method, const std::string& host, int port, const std::string& path,
                          const TlsClient& tls, const std::string& body,
                          const std::map<std::string, std::string>& headers, std::chrono::milliseconds timeout) {
  // OpenSSL writes with write(2): a connection the daemon closed must fail the request, not kill
  // the test with SIGPIPE.
  static const bool kIgnoreSigpipe = std::signal(SIGPIPE, SIG_IGN) != SIG_ERR;
  (void)kIgnoreSigpipe;
  const auto deadline = Clock::now() + Scaled(timeout);
  const std::string where = host + ":" + std::to_string(port);
  // The TLS context first, then the connection, whose hello follows at once: as a real client
  // (Prometheus) does. A context loaded after connecting leaves the daemon a connection that says
  // nothing for as long as loading the files takes on a busy machine, the first to be closed for
  // a new one when silent clients crowd the listener.
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  auto fail = [&](const std::string& what) -> std::runtime_error {
    return std::runtime_error("HTTPS " + where + ": " + what + ": " + OpenSslErrors());
  };
  if (!tls.ca_file.empty() && SSL_CTX_load_verify_locations(ctx.get(), tls.ca_file.c_str(), nullptr) != 1) {
    throw fail("CA " + tls.ca_file);
  }
  if (!tls.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1)
      throw fail("certificate " + tls.cert_file);
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
      throw fail("key " + tls.key_file);
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  const std::string name = tls.server_name.empty() ? host : tls.server_name;
  SSL_set1_host(ssl.get(), name.c_str());
  if (in_addr a{}; ::inet_pton(AF_INET, name.c_str(), &a) != 1) SSL_set_tlsext_host_name(ssl.get(), name.c_str());
  Fd sock = ConnectTcp(host, port, deadline);
  // Blocking from here, each call bounded by what is left of the deadline.
  ::fcntl(sock.get(), F_SETFL, ::fcntl(sock.get(), F_GETFL) & ~O_NONBLOCK);
  const int left_ms = std::max(1, RemainingMs(deadline));
  timeval tv{left_ms / 1000, (left_ms % 1000) * 1000};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  SSL_set_fd(ssl.get(), sock.get());
  if (SSL_connect(ssl.get()) != 1) {
    const long verify = SSL_get_verify_result(ssl.get());
    std::string why = "TLS handshake failed";
    if (verify != X509_V_OK) why += " (" + std::string(X509_verify_cert_error_string(verify)) + ")";
    throw fail(why);
  }
  const std::string request = RequestText(method, where, path, body, headers);
  if (SSL_write(ssl.get(), request.data(), static_cast<int>(request.size())) <= 0) throw fail("write");
  std::string raw;
  char chunk[1 << 16];
  while (true) {
    const int n = SSL_read(ssl.get(), chunk, sizeof chunk);
    if (n > 0) {
      raw.append(chunk, static_cast<size_t>(n));
      continue;
    }
    const int error = SSL_get_error(ssl.get(), n);
    if (error == SSL_ERROR_ZERO_RETURN || (error == SSL_ERROR_SYSCALL && ERR_peek_error() == 0 && !raw.empty())) break;
    throw fail(raw.empty() ? "read (the server closed the connection: a refused client certificate?)" : "read");
  }
  return ParseResponse(std::move(raw), where, method == "HEAD");
}

HttpResponse HttpRequest(const std::string& method, const std::string& host, int port, const std::string& path,
                         const std::string& body, const std::map<std::string, std::string>& headers,
                         std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + Scaled(timeout);
  const std::string where = host + ":" + std::to_string(port);
  Fd sock = ConnectTcp(host, port, deadline);
  const std::string request = RequestText(method, where, path, body, headers);

  size_t sent = 0;
  while (sent < request.size()) {
    pollfd p{sock.get(), POLLOUT, 0};
    if (::poll(&p, 1, RemainingMs(deadline)) != 1) throw std::runtime_error("HTTP: timeout sending to " + where);
    ssize_t n = ::send(sock.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      ThrowErrno("HTTP: send to " + where);
    }
    sent += static_cast<size_t>(n);
  }

  // Read straight into the response, in large pieces: the benchmark times 50 MB /metrics bodies.
  std::string raw;
  size_t received = 0;
  constexpr size_t kReadSize = 1 << 20;
  while (true) {
    pollfd p{sock.get(), POLLIN, 0};
    int rc = ::poll(&p, 1, RemainingMs(deadline));
    if (rc == 0) throw std::runtime_error("HTTP: timeout reading from " + where);
    if (rc < 0) {
      if (errno == EINTR) continue;
      ThrowErrno("HTTP: poll");
    }
    if (raw.size() < received + kReadSize) raw.resize(std::max(2 * raw.size(), received + kReadSize));
    ssize_t n = ::recv(sock.get(), raw.data() + received, raw.size() - received, 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      ThrowErrno("HTTP: recv from " + where);
    }
    received += static_cast<size_t>(n);
  }
  raw.resize(received);
  return ParseResponse(std::move(raw), where, method == "HEAD");
}

std::string HttpGet(const std::string& host, int port, const std::string& path, std::chrono::milliseconds timeout) {
  HttpResponse response = HttpRequest("GET", host, port, path, "", {}, timeout);
  if (response.status != 200) {
    throw std::runtime_error("HTTP GET " + host + ":" + std::to_string(port) + path + " returned " +
                             std::to_string(response.status) + ": " + response.body.substr(0, 500));
  }
  return std::move(response.body);
}

// ---------------------------------------------------------------------------------------------
// RunCommand

CommandResult RunCommand(const std::vector<std::string>& argv, const std::optional<std::string>& stdin_text,
                         std::chrono::milliseconds timeout) {
  if (argv.empty()) throw std::invalid_argument("RunCommand: empty argv");
  CommandResult result;
  ChildSpec spec;
  spec.program = ResolveProgram(argv[0]);
  if (spec.program.empty()) {
    result.exit_code = 127;
    result.err = argv[0] + ": command not found in PATH\n";
    return result;
  }
  spec.argv = argv;

  Fd in_read, in_write, out_read, out_write, err_read, err_write;
  if (stdin_text) {
    MakePipe(in_read, in_write);
  } else {
    in_read = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!in_read.valid()) ThrowErrno("open /dev/null");
  }
  MakePipe(out_read, out_write);
  MakePipe(err_read, err_write);
  spec.stdin_fd = in_read.get();
  spec.stdout_fd = out_write.get();
  spec.stderr_fd = err_write.get();

  pid_t pid;
  try {
    pid = Spawn(spec);
  } catch (const std::runtime_error& e) {
    result.exit_code = 127;
    result.err = std::string(e.what()) + "\n";
    return result;
  }
  in_read.Reset();
  out_write.Reset();
  err_write.Reset();
  for (const Fd* fd : {&in_write, &out_read, &err_read}) {
    if (fd->valid()) ::fcntl(fd->get(), F_SETFL, ::fcntl(fd->get(), F_GETFL) | O_NONBLOCK);
  }

  const auto deadline = Clock::now() + Scaled(timeout);
  size_t written = 0;
  if (stdin_text && stdin_text->empty()) in_write.Reset();
  char buffer[16384];
  while (out_read.valid() || err_read.valid()) {
    std::vector<pollfd> fds;
    if (in_write.valid()) fds.push_back({in_write.get(), POLLOUT, 0});
    if (out_read.valid()) fds.push_back({out_read.get(), POLLIN, 0});
    if (err_read.valid()) fds.push_back({err_read.get(), POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), RemainingMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) ThrowErrno("poll");
    if (rc == 0) {
      result.timed_out = true;
      break;
    }
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      if (in_write.valid() && p.fd == in_write.get()) {
        ssize_t n = WriteNoSigpipe(p.fd, stdin_text->data() + written, stdin_text->size() - written);
        if (n > 0) written += static_cast<size_t>(n);
        if ((n < 0 && errno != EAGAIN && errno != EINTR) || written == stdin_text->size()) in_write.Reset();
        continue;
      }
      Fd& source = p.fd == out_read.get() ? out_read : err_read;
      std::string& sink = p.fd == out_read.get() ? result.out : result.err;
      ssize_t n = ::read(p.fd, buffer, sizeof buffer);
      if (n > 0) {
        sink.append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        source.Reset();
      }
    }
  }
  if (result.timed_out) ::kill(-pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exit_code = DecodeWaitStatus(status);
  return result;
}

// ---------------------------------------------------------------------------------------------
// BackgroundCommand

BackgroundCommand::BackgroundCommand(const std::vector<std::string>& argv) : dir_("gradwatch-bg") {
  if (argv.empty()) throw std::invalid_argument("BackgroundCommand: empty argv");
  ChildSpec spec;
  spec.program = ResolveProgram(argv[0]);
  if (spec.program.empty()) throw std::runtime_error(argv[0] + ": command not found in PATH");
  spec.argv = argv;
  Fd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null.valid()) ThrowErrno("open /dev/null");
  Fd out = OpenLog(dir_.path() / "stdout");
  Fd err = OpenLog(dir_.path() / "stderr");
  spec.stdin_fd = dev_null.get();
  spec.stdout_fd = out.get();
  spec.stderr_fd = err.get();
  pid_ = Spawn(spec);
}

BackgroundCommand::~BackgroundCommand() {
  if (pid_ > 0 && !status_) {
    ::kill(-pid_, SIGKILL);
    Reap(true);
  }
}

void BackgroundCommand::Signal(int sig) {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

bool BackgroundCommand::Reap(bool block) {
  if (status_) return true;
  status_ = WaitChild(pid_, block);
  return status_.has_value();
}

bool BackgroundCommand::running() { return !Reap(false); }

CommandResult BackgroundCommand::Wait(std::chrono::milliseconds timeout) {
  CommandResult result;
  const auto deadline = Clock::now() + Scaled(timeout);
  while (!Reap(false)) {
    if (Clock::now() >= deadline) {
      ::kill(-pid_, SIGKILL);
      Reap(true);
      result.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  result.exit_code = *status_;
  result.out = ReadFileFrom(dir_.path() / "stdout", 0);
  result.err = ReadFileFrom(dir_.path() / "stderr", 0);
  return result;
}

std::string BackgroundCommand::Stderr() const { return ReadFileFrom(dir_.path() / "stderr", 0); }

// ---------------------------------------------------------------------------------------------
// Prometheus text exposition

std::vector<MetricSample> ParseExposition(const std::string& exposition) {
  std::vector<MetricSample> samples;
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    samples.push_back(ParseSampleLine(line));
  }
  return samples;
}

std::optional<double> ParseMetric(const std::string& exposition, const std::string& name,
                                  const std::map<std::string, std::string>& labels) {
  for (const MetricSample& sample : ParseExposition(exposition)) {
    if (sample.name == name && sample.labels == labels) return sample.value;
  }
  return std::nullopt;
}

SlowClients::SlowClients(int port, int count, bool silent) : port_(port), silent_(silent), fds_(count, -1) {
  for (int& fd : fds_) fd = Open();
  thread_ = std::thread([this] { Run(); });
}

SlowClients::~SlowClients() {
  stop_ = true;
  thread_.join();
  for (int fd : fds_) ::close(fd);
}

int SlowClients::Open() const {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void SlowClients::Run() {
  for (int tick = 0; !stop_; ++tick) {
    for (size_t i = 0; i < fds_.size() && !stop_; ++i) {
      if (fds_[i] >= 0) {
        bool alive = false;
        if (silent_ || i % 2 == 1) {
          // A silent one learns that the daemon closed it by reading the end of the stream.
          char byte = 0;
          const ssize_t n = ::recv(fds_[i], &byte, 1, MSG_DONTWAIT);
          alive = n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
        } else {
          const std::string line = tick == 0 ? "GET /metrics HTTP/1.1\r\n" : "X-Slow: " + std::to_string(tick) + "\r\n";
          alive = ::send(fds_[i], line.data(), line.size(), MSG_NOSIGNAL) >= 0;
        }
        if (alive) continue;
        ::close(fds_[i]);
      }
      fds_[i] = Open();
      reopened_.fetch_add(1);
    }
    for (int i = 0; i < 10 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + Scaled(limit);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

}  // namespace gradwatch::testing
