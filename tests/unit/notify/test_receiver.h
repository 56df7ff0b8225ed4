// A scriptable HTTP(S) receiver on 127.0.0.1 for the notifier tests, and a self-signed
// certificate made with OpenSSL's C API. Header-only so that each test file can use it.
#pragma once

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/time_scale.h"

namespace gradwatch::notify::testing {

struct SelfSignedCert {
  std::string cert_pem;
  std::string key_pem;
};

// A P-256 certificate for the given subject alternative names (by default 127.0.0.1 and
// localhost), valid for a day, that is its own CA.
inline SelfSignedCert MakeSelfSignedCert(const std::string& alt_names = "IP:127.0.0.1,DNS:localhost") {
  auto fail = [](const char* what) { throw std::runtime_error(std::string("openssl: ") + what); };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  if (!key) fail("EVP_EC_gen");
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  if (!cert) fail("X509_new");
  X509_set_version(cert.get(), 2);
  unsigned char serial_bytes[8];
  RAND_bytes(serial_bytes, sizeof(serial_bytes));
  long serial = 1;
  for (unsigned char b : serial_bytes) serial = (serial << 8 | b) & 0x7fffffffffffL;
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), serial);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 86400);
  X509_set_pubkey(cert.get(), key.get());
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("gradwatch test"), -1, -1,
                             0);
  X509_set_issuer_name(cert.get(), name);
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, cert.get(), cert.get(), nullptr, nullptr, 0);
  const std::pair<int, const char*> extensions[] = {
      {NID_basic_constraints, "critical,CA:TRUE"}, {NID_key_usage, "critical,digitalSignature,keyCertSign"},
      {NID_ext_key_usage, "serverAuth"},           {NID_subject_key_identifier, "hash"},
      {NID_subject_alt_name, alt_names.c_str()},
  };
  for (const auto& [nid, value] : extensions) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    if (ext == nullptr) fail("X509V3_EXT_conf_nid");
    X509_add_ext(cert.get(), ext, -1);
    X509_EXTENSION_free(ext);
  }
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) == 0) fail("X509_sign");

  auto to_pem = [&](auto write) {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new(BIO_s_mem()), BIO_free);
    if (!write(bio.get())) fail("PEM_write");
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio.get(), &data);
    return std::string(data, static_cast<size_t>(size));
  };
  SelfSignedCert out;
  out.cert_pem = to_pem([&](BIO* bio) { return PEM_write_bio_X509(bio, cert.get()) == 1; });
  out.key_pem = to_pem(
      [&](BIO* bio) { return PEM_write_bio_PrivateKey(bio, key.get(), nullptr, nullptr, 0, nullptr, nullptr) == 1; });
  return out;
}

// A file removed when this goes out of scope.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    char path[] = "/tmp/gradwatch-notify-test-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) throw std::runtime_error("mkstemp failed");
    close(fd);
    path_ = path;
    std::ofstream(path_) << contents;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct RecordedRequest {
  std::string method;
  std::string target;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  int answered_status = 0;                            // what the receiver answered
  std::chrono::steady_clock::time_point received_at;  // when the whole request had been read
};

// Listens on 127.0.0.1 (port 0: the kernel picks one), one thread per connection, and answers
// each request with the next scripted status (then default_status), after an optional delay.
class TestReceiver {
 public:
  struct Options {
    std::optional<SelfSignedCert> tls;  // serve HTTPS with this certificate
    // Answer HTTP/1.1 keep-alive requests on the same connection (a Go server's default, e.g.
    // Alertmanager's); else every response closes its connection.
    bool keep_alive = false;
  };

  TestReceiver() : TestReceiver(Options{}) {}
  explicit TestReceiver(Options options) : keep_alive_(options.keep_alive) {
    namespace ssl = boost::asio::ssl;
    if (options.tls) {
      tls_.emplace(ssl::context::tls_server);
      tls_->use_certificate_chain(boost::asio::buffer(options.tls->cert_pem));
      tls_->use_private_key(boost::asio::buffer(options.tls->key_pem), ssl::context::pem);
    }
    Listen(0);
    io_thread_ = std::thread([this] { io_.run(); });
  }

  ~TestReceiver() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      for (int fd : open_sockets_) ::shutdown(fd, SHUT_RDWR);
    }
    cv_.notify_all();
    RunOnIo([this] { acceptor_.close(); });
    work_.reset();
    io_.stop();
    io_thread_.join();
    std::vector<std::thread> threads;
    {
      std::lock_guard lock(mu_);
      threads.swap(connections_);
    }
    for (auto& t : threads) t.join();
  }

  uint16_t port() const { return port_; }
  std::string url(const std::string& path = "/") const {
    return std::string(tls_ ? "https" : "http") + "://127.0.0.1:" + std::to_string(port_) + path;
  }

  // The statuses of the next responses, in order; afterwards default_status.
  void Script(std::vector<int> statuses) {
    std::lock_guard lock(mu_);
    script_.assign(statuses.begin(), statuses.end());
  }
  void SetDefaultStatus(int status) {
    std::lock_guard lock(mu_);
    default_status_ = status;
  }
  // Every answer waits this long first.
  void SetDelay(std::chrono::milliseconds delay) {
    std::lock_guard lock(mu_);
    delay_ = delay;
  }

  // Stops listening: connections to the port are refused until Up(). Connections kept open
  // (keep_alive) are closed too.
  void Down() {
    RunOnIo([this] { acceptor_.close(); });
    CloseConnections();
  }
  // Closes the connections kept open, as a server closes idle ones.
  void CloseConnections() {
    std::lock_guard lock(mu_);
    for (int fd : open_sockets_) ::shutdown(fd, SHUT_RDWR);
  }
  // Connections accepted so far.
  size_t Connections() const {
    std::lock_guard lock(mu_);
    return accepted_;
  }
  // Listens again on the same port.
  void Up() {
    RunOnIo([this] { Listen(port_); });
  }

  std::vector<RecordedRequest> Requests() const {
    std::lock_guard lock(mu_);
    return requests_;
  }
  std::vector<RecordedRequest> Delivered() const {
    std::lock_guard lock(mu_);
    std::vector<RecordedRequest> ok;
    for (const auto& r : requests_) {
      if (r.answered_status >= 200 && r.answered_status < 300) ok.push_back(r);
    }
    return ok;
  }

  // Waits until at least n requests were answered with 2xx; false on timeout.
  bool WaitForDelivered(size_t n, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, gradwatch::testing::Scaled(timeout), [&] { return delivered_ >= n; });
  }
  // Waits until at least n requests arrived, whatever the answer; false on timeout.
  bool WaitForRequests(size_t n, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, gradwatch::testing::Scaled(timeout), [&] { return requests_.size() >= n; });
  }

 private:
  using tcp = boost::asio::ip::tcp;

  template <typename F>
  void RunOnIo(F f) {
    if (!io_thread_.joinable() || io_.stopped()) {
      f();
      return;
    }
    std::promise<void> done;
    boost::asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait();
  }

  void Listen(uint16_t port) {
    const tcp::endpoint endpoint(boost::asio::ip::make_address("127.0.0.1"), port);
    acceptor_ = tcp::acceptor(io_);
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    Accept();
  }

  void Accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;  // closed by Down() or the destructor
      std::lock_guard lock(mu_);
      if (stopping_) return;
      open_sockets_.insert(socket.native_handle());
      ++accepted_;
      connections_.emplace_back([this, s = std::make_shared<tcp::socket>(std::move(socket))]() mutable { Serve(*s); });
      Accept();
    });
  }

  void Serve(tcp::socket& socket) {
    namespace beast = boost::beast;
    namespace http = beast::http;
    namespace ssl = boost::asio::ssl;
    const int fd = socket.native_handle();
    beast::error_code ec;
    if (tls_) {
      ssl::stream<tcp::socket&> stream(socket, *tls_);
      stream.handshake(ssl::stream_base::server, ec);
      if (!ec) Exchange(stream);
    } else {
      Exchange(socket);
    }
    {
      std::lock_guard lock(mu_);
      open_sockets_.erase(fd);
    }
    socket.shutdown(tcp::socket::shutdown_both, ec);
    socket.close(ec);
  }

  // Answers the requests on a connection: one, or while both sides keep it alive.
  template <typename Stream>
  void Exchange(Stream& stream) {
    boost::beast::flat_buffer buffer;
    while (Answer(stream, buffer)) {
    }
  }

  // Reads and answers one request; true when the connection stays open for another.
  template <typename Stream>
  bool Answer(Stream& stream, boost::beast::flat_buffer& buffer) {
    namespace beast = boost::beast;
    namespace http = beast::http;
    beast::error_code ec;
    http::request<http::string_body> request;
    http::read(stream, buffer, request, ec);
    if (ec) return false;
    RecordedRequest record;
    record.received_at = std::chrono::steady_clock::now();
    record.method = std::string(request.method_string());
    record.target = std::string(request.target());
    for (const auto& field : request) {
      std::string name(field.name_string());
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      record.headers[name] = std::string(field.value());
    }
    record.body = request.body();
    std::chrono::milliseconds delay;
    {
      std::unique_lock lock(mu_);
      record.answered_status = default_status_;
      if (!script_.empty()) {
        record.answered_status = script_.front();
        script_.pop_front();
      }
      delay = delay_;
      if (delay.count() > 0) {
        cv_.wait_for(lock, delay, [&] { return stopping_; });
        if (stopping_) return false;
      }
      requests_.push_back(record);
      if (record.answered_status >= 200 && record.answered_status < 300) ++delivered_;
    }
    cv_.notify_all();
    http::response<http::string_body> response{static_cast<http::status>(record.answered_status), request.version()};
    response.set(http::field::content_type, "application/json");
    const bool keep = keep_alive_ && request.keep_alive();
    response.keep_alive(keep);
    response.body() = "{}";
    response.prepare_payload();
    http::write(stream, response, ec);
    return keep && !ec;
  }

  boost::asio::io_context io_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_{
      boost::asio::make_work_guard(io_)};
  std::optional<boost::asio::ssl::context> tls_;
  tcp::acceptor acceptor_{io_};  // used on the io thread only (after construction)
  uint16_t port_ = 0;
  std::thread io_thread_;

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool stopping_ = false;
  const bool keep_alive_;
  size_t accepted_ = 0;  // guarded by mu_
  std::deque<int> script_;
  int default_status_ = 200;
  std::chrono::milliseconds delay_{0};
  std::vector<RecordedRequest> requests_;
  size_t delivered_ = 0;
  std::set<int> open_sockets_;
  std::vector<std::thread> connections_;
};

}  // namespace gradwatch::notify::testing
