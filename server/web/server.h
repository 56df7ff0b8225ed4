// gradwatchd's HTTP listener: HTTP/1.1 with keep-alive on Boost.Beast, plain or over TLS (with
// client certificates when asked), dispatching each request to the handler of its path.
// /metrics is one such handler (server/export/metrics_endpoint.h).
//
// Requests run on `threads` I/O threads; a handler runs on one of them, so it should answer in
// milliseconds. The TLS files are read again on ReloadTls (SIGHUP) and whenever they change (a
// check at most once a second, as connections arrive): a certificate renewed in place reaches new
// connections without a restart, and connections already open keep theirs.
//
// Hostile clients: a request's head is limited to 16 KiB and its body to max_body_bytes (431 and
// 413). A connection must send a request's whole head within header_timeout of its first byte
// (and finish a TLS handshake as fast), as Go's ReadHeaderTimeout asks; it may idle between
// requests for idle_timeout and be slower than write_timeout to read an answer, no longer. At most
// max_connections are open at once, max_connections_per_peer from one address; a new connection
// beyond either takes the place of one (of that address, for the second) without a request in
// progress (idle, or still sending a head or its handshake): one that never sent anything (no TLS
// hello, no whole request) first, else the one that has waited longest. So slow or silent clients
// cannot keep a scraper out, not even from the scraper's own address. Plain HTTP on a TLS
// listener gets a 400 that says to use https://.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/status.h"

namespace gradwatch::web {

struct Request {
  std::string method;                                        // "GET", "HEAD", ...
  std::string path;                                          // percent-encoding kept, no query
  std::string query;                                         // after '?', without it
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;
  std::string peer;             // "127.0.0.1:51234"
  std::string client_identity;  // a verified client certificate's first SAN, else its CN; else empty
  bool tls = false;

  // The value of header `name` (lower-case); empty when absent.
  std::string_view Header(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::vector<std::pair<std::string, std::string>> headers;  // besides Content-Type and Content-Length
  // The body: `body`, or when `pieces` is not empty, those in order; they point into memory that
  // `keeper` keeps alive until the response has been written (then it is released).
  std::string body;
  std::vector<std::string_view> pieces;
  std::shared_ptr<const void> keeper;

  // A text/plain response whose body is `text` and a newline.
  static Response Text(int status, std::string text);
  size_t body_size() const;
};

using Handler = std::function<Response(const Request&)>;

struct Route {
  std::string path;  // "/metrics"; with `prefix`, every path under it ("/runs/")
  bool prefix = false;
  std::vector<std::string> methods = {"GET"};  // GET allows HEAD too; others get 405
  Handler handler;
};

struct TlsFiles {
  std::string cert_file;       // PEM chain, the server's certificate first
  std::string key_file;        // PEM private key
  std::string client_ca_file;  // when set, clients must present a certificate this CA signed

  bool enabled() const { return !cert_file.empty(); }
};

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT; port 0: any free port
  int threads = 2;
  TlsFiles tls;
  size_t max_body_bytes = 1 << 20;
  size_t max_connections = 256;
  size_t max_connections_per_peer = 64;
  std::chrono::milliseconds header_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds write_timeout{std::chrono::seconds(60)};
};

class Server {
 public:
  // Listens and starts the I/O threads. Errors: an address it cannot listen on, TLS files it
  // cannot load (named, with OpenSSL's reason).
  static StatusOr<std::unique_ptr<Server>> Start(ServerOptions options, std::vector<Route> routes);

  // Stops listening, closes every connection and waits for the requests in progress.
  ~Server();

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const;
  bool tls() const;

  // Reads the TLS files again: new connections get them. On an error the ones in use stay, and
  // the error says which file and why. A line for the log on success ("CN=gradwatchd, ...").
  StatusOr<std::string> ReloadTls();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradwatch::web
