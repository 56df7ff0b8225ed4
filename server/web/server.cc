#include "server/web/server.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/core/detect_ssl.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <list>
#include <optional>
#include <thread>
#include <unordered_map>

#include "server/core/openssl_error.h"
#include "server/core/thread_annotations.h"
#include "server/core/thread_name.h"

namespace gradwatch::web {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;

std::string_view Request::Header(std::string_view name) const {
  for (const auto& [n, v] : headers) {
    if (n == name) return v;
  }
  return {};
}

Response Response::Text(int status, std::string text) {
  Response r;
  r.status = status;
  r.body = std::move(text);
  r.body += '\n';
  return r;
}

size_t Response::body_size() const {
  if (pieces.empty()) return body.size();
  size_t n = 0;
  for (std::string_view p : pieces) n += p.size();
  return n;
}

namespace {

constexpr size_t kMaxHeadBytes = 16 << 10;

std::string_view Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
  }
  return "Status";
}

// "HOST:PORT" ("[::1]:PORT" for IPv6) into an endpoint.
StatusOr<tcp::endpoint> ParseListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return Status::InvalidArgument("'" + listen + "' is not HOST:PORT");
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  unsigned port = 0;
  const std::string_view port_text = std::string_view(listen).substr(colon + 1);
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return Status::InvalidArgument("'" + listen + "': bad port");
  }
  if (host.empty() || host == "*") host = "0.0.0.0";
  if (host == "localhost") host = "127.0.0.1";
  boost::system::error_code error;
  const asio::ip::address address = asio::ip::make_address(host, error);
  if (error) return Status::InvalidArgument("'" + listen + "': " + host + " is not an IP address");
  return tcp::endpoint(address, static_cast<unsigned short>(port));
}

StatusOr<std::shared_ptr<ssl::context>> MakeTlsContext(const TlsFiles& files) {
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
  SSL_CTX* native = ctx->native_handle();
  SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
  SSL_CTX_set_options(native, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
  if (SSL_CTX_use_certificate_chain_file(native, files.cert_file.c_str()) != 1) {
    return Status::InvalidArgument("certificate " + files.cert_file + ": " + OpenSslError());
  }
  FILE* f = std::fopen(files.key_file.c_str(), "r");
  if (f == nullptr) return Status::InvalidArgument("key " + files.key_file + ": " + std::strerror(errno));
  EVP_PKEY* key = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  if (key == nullptr)
    return Status::InvalidArgument("key " + files.key_file + ": no PEM private key in it (" + OpenSslError() + ")");
  const bool matches = SSL_CTX_use_PrivateKey(native, key) == 1 && SSL_CTX_check_private_key(native) == 1;
  EVP_PKEY_free(key);
  if (!matches) {
    ERR_clear_error();
    return Status::InvalidArgument("key " + files.key_file + " is not the key of " + files.cert_file);
  }
  if (!files.client_ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(native, files.client_ca_file.c_str(), nullptr) != 1) {
      return Status::InvalidArgument("client CA " + files.client_ca_file + ": " + OpenSslError());
    }
    // Tells clients which CA's certificate to present.
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.client_ca_file.c_str());
    if (names == nullptr) {
      return Status::InvalidArgument("client CA " + files.client_ca_file + ": " + OpenSslError());
    }
    SSL_CTX_set_client_CA_list(native, names);
    SSL_CTX_set_verify(native, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return ctx;
}

std::string CertificateLine(const ssl::context& ctx, const TlsFiles& files) {
  X509* cert = SSL_CTX_get0_certificate(const_cast<ssl::context&>(ctx).native_handle());
  char subject[256] = "?";
  if (cert != nullptr) X509_NAME_oneline(X509_get_subject_name(cert), subject, sizeof subject);
  return std::string(subject) +
         (files.client_ca_file.empty() ? ", no client certificates asked" : ", client certificates required");
}

// What identifies the verified client certificate, as gRPC names its peer: the first subject
// alternative name (DNS, URI, e-mail or IP), else the common name.
std::string ClientIdentity(SSL* ssl) {
  X509* cert = SSL_get1_peer_certificate(ssl);
  if (cert == nullptr) return {};
  std::string identity;
  if (SSL_get_verify_result(ssl) == X509_V_OK) {
    auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
    for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names) && identity.empty(); ++i) {
      const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
      if (name->type == GEN_DNS || name->type == GEN_URI || name->type == GEN_EMAIL) {
        const ASN1_IA5STRING* text = name->d.ia5;
        identity.assign(reinterpret_cast<const char*>(ASN1_STRING_get0_data(text)), ASN1_STRING_length(text));
      } else if (name->type == GEN_IPADD) {
        const ASN1_OCTET_STRING* ip = name->d.ip;
        const unsigned char* bytes = ASN1_STRING_get0_data(ip);
        if (ASN1_STRING_length(ip) == 4) {
          identity = asio::ip::address_v4({bytes[0], bytes[1], bytes[2], bytes[3]}).to_string();
        } else if (ASN1_STRING_length(ip) == 16) {
          asio::ip::address_v6::bytes_type b;
          std::copy(bytes, bytes + 16, b.begin());
          identity = asio::ip::address_v6(b).to_string();
        }
      }
    }
    GENERAL_NAMES_free(names);
    if (identity.empty()) {
      char cn[256];
      const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn);
      if (n > 0) identity.assign(cn, static_cast<size_t>(n));
    }
  }
  X509_free(cert);
  return identity;
}

// The files' identity, to notice a renewal: size, mtime and inode of each.
std::string FilesStamp(const TlsFiles& files) {
  std::string stamp;
  for (const std::string* path : {&files.cert_file, &files.key_file, &files.client_ca_file}) {
    struct stat st {};
    if (path->empty() || ::stat(path->c_str(), &st) != 0) {
      stamp += "-;";
      continue;
    }
    stamp += std::to_string(st.st_size) + "," + std::to_string(st.st_mtim.tv_sec) + "." +
             std::to_string(st.st_mtim.tv_nsec) + "," + std::to_string(st.st_ino) + ";";
  }
  return stamp;
}

std::string Head(const Response& r, bool keep_alive, size_t body_size) {
  std::string head = "HTTP/1.1 " + std::to_string(r.status) + " " + std::string(Reason(r.status)) + "\r\n";
  head += "Content-Type: " + r.content_type + "\r\n";
  head += "Content-Length: " + std::to_string(body_size) + "\r\n";
  for (const auto& [name, value] : r.headers) head += name + ": " + value + "\r\n";
  head += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  head += "\r\n";
  return head;
}

// Whether bytes the peer sent wait unread on the socket `fd`.
bool BytesWaiting(int fd) {
  int n = 0;
  return fd >= 0 && ::ioctl(fd, FIONREAD, &n) == 0 && n > 0;
}

bool HasControlChars(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return c == '\r' || c == '\n' || c == '\0'; });
}

}  // namespace

struct Server::Impl {
  // A connection as the accept loop sees it. `waiting`: no request in progress (idle, sending a
  // head, or in its TLS handshake), since `since`; such a connection may be closed for a new one.
  struct Conn {
    std::string ip;
    asio::any_io_executor executor;  // its strand
    std::list<std::shared_ptr<Conn>>::iterator at;
    std::chrono::steady_clock::time_point since;  // guarded by conns_mu, as are the two below
    bool waiting = true;
    bool evicted = false;
    // The peer has sent something: a TLS hello, or a whole request. Connections that never did
    // (silent, or a head sent a byte at a time) are closed for a new one first.
    bool heard = false;
    // Its socket, to see whether bytes wait unread (a TLS hello not yet read when the machine is
    // busy). Read-only; should the number be reused after the socket closes, the worst outcome is
    // another victim.
    int fd = -1;
    beast::tcp_stream* lowest = nullptr;  // its socket's stream; touched on its strand only
  };

  // Declared before `io`: the connections it still holds when destroyed use them.
  ServerOptions options;
  std::vector<Route> routes;
  int port = 0;
  Mutex conns_mu;
  std::list<std::shared_ptr<Conn>> conns GUARDED_BY(conns_mu);  // in order of acceptance
  std::unordered_map<std::string, size_t> conns_by_ip GUARDED_BY(conns_mu);
  Mutex tls_mu;
  std::shared_ptr<ssl::context> tls_context GUARDED_BY(tls_mu);
  std::string tls_stamp GUARDED_BY(tls_mu);
  std::chrono::steady_clock::time_point tls_checked GUARDED_BY(tls_mu);

  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::vector<std::thread> threads;

  std::shared_ptr<ssl::context> CurrentTls() EXCLUDES(tls_mu) {
    MutexLock lock(&tls_mu);
    const auto now = std::chrono::steady_clock::now();
    if (now - tls_checked >= std::chrono::seconds(1)) {
      tls_checked = now;
      std::string stamp = FilesStamp(options.tls);
      if (stamp != tls_stamp) {
        tls_stamp = std::move(stamp);
        auto loaded = MakeTlsContext(options.tls);
        if (loaded.ok()) {
          tls_context = std::move(loaded).value();
          spdlog::info("HTTP: TLS files changed: new connections get {}", CertificateLine(*tls_context, options.tls));
        } else {
          spdlog::error("HTTP: TLS files changed but cannot be used ({}); new connections keep the last ones",
                        loaded.status().message());
        }
      }
    }
    return tls_context;
  }

  const Route* Find(std::string_view path) const {
    const Route* best = nullptr;
    for (const Route& r : routes) {
      const bool match = r.prefix ? path.substr(0, r.path.size()) == r.path : path == r.path;
      if (match && (best == nullptr || r.path.size() > best->path.size())) best = &r;
    }
    return best;
  }

  Response Dispatch(const Request& request) const {
    const Route* route = Find(request.path);
    if (route == nullptr) {
      std::string known;
      for (const Route& r : routes) known += (known.empty() ? "" : ", ") + r.path;
      return Response::Text(404, "no page at " + request.path + " (this listener serves " + known + ")");
    }
    const std::string_view method =
        request.method == "HEAD" ? std::string_view("GET") : std::string_view(request.method);
    if (std::find(route->methods.begin(), route->methods.end(), method) == route->methods.end()) {
      Response r = Response::Text(405, request.method + " is not allowed on " + request.path);
      std::string allow;
      for (const std::string& m : route->methods)
        allow += (allow.empty() ? "" : ", ") + m + (m == "GET" ? ", HEAD" : "");
      r.headers.emplace_back("Allow", allow);
      return r;
    }
    try {
      return route->handler(request);
    } catch (const std::exception& e) {
      spdlog::error("HTTP: {} {} failed: {}", request.method, request.path, e.what());
      return Response::Text(500, "internal error: " + std::string(e.what()));
    }
  }

  // Writes `response`; false when the connection broke.
  template <class Stream>
  asio::awaitable<bool> Write(Stream& stream, Response response, bool keep_alive, bool head_only) {
    for (const auto& [name, value] : response.headers) {
      if (HasControlChars(name) || HasControlChars(value)) {
        response = Response::Text(500, "internal error: a header with a line break");
        break;
      }
    }
    const size_t body_size = response.body_size();
    const std::string head = Head(response, keep_alive, body_size);
    std::vector<asio::const_buffer> buffers;
    buffers.emplace_back(head.data(), head.size());
    if (!head_only) {
      if (response.pieces.empty()) {
        buffers.emplace_back(response.body.data(), response.body.size());
      } else {
        for (std::string_view p : response.pieces) {
          if (!p.empty()) buffers.emplace_back(p.data(), p.size());
        }
      }
    }
    beast::get_lowest_layer(stream).expires_after(options.write_timeout);
    beast::error_code ec;
    co_await asio::async_write(stream, buffers, asio::redirect_error(asio::use_awaitable, ec));
    co_return !ec;
  }

  void SetWaiting(Conn& conn, bool waiting) EXCLUDES(conns_mu) {
    MutexLock lock(&conns_mu);
    conn.waiting = waiting;
    if (waiting) conn.since = std::chrono::steady_clock::now();
    if (!waiting) conn.heard = true;
  }

  void SetHeard(Conn& conn) EXCLUDES(conns_mu) {
    MutexLock lock(&conns_mu);
    conn.heard = true;
  }

  // Requests on one connection until it closes, idles out, is closed for a new one, or asks to
  // close.
  template <class Stream>
  asio::awaitable<void> Serve(Stream& stream, beast::flat_buffer& buffer, Conn& conn, const std::string& peer,
                              const std::string& identity, bool tls) {
    auto& lowest = beast::get_lowest_layer(stream);
    conn.lowest = &lowest;
    for (;;) {
      bhttp::request_parser<bhttp::string_body> parser;
      parser.header_limit(kMaxHeadBytes);
      parser.body_limit(options.max_body_bytes);
      SetWaiting(conn, true);
      beast::error_code ec;
      if (buffer.size() == 0) {  // idle until the next request's first byte
        lowest.expires_after(options.idle_timeout);
        const size_t n = co_await stream.async_read_some(buffer.prepare(kMaxHeadBytes),
                                                         asio::redirect_error(asio::use_awaitable, ec));
        if (ec) break;
        buffer.commit(n);
      }
      lowest.expires_after(options.header_timeout);  // then the whole head, at once
      co_await bhttp::async_read_header(stream, buffer, parser, asio::redirect_error(asio::use_awaitable, ec));
      if (!ec) {
        lowest.expires_after(options.idle_timeout);
        co_await bhttp::async_read(stream, buffer, parser, asio::redirect_error(asio::use_awaitable, ec));
      }
      if (!ec) SetWaiting(conn, false);  // a whole request: in progress until answered
      if (ec) {
        int status = 0;
        if (ec == bhttp::error::header_limit) status = 431;
        if (ec == bhttp::error::body_limit) status = 413;
        if (status == 0 && ec.category() == beast::error_code(bhttp::error::bad_target).category() &&
            ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
          status = 400;
        }
        if (status != 0) {
          spdlog::debug("HTTP: bad request from {}: {}", peer, ec.message());
          co_await Write(stream, Response::Text(status, "bad request: " + ec.message()), false, false);
        }
        break;
      }
      const auto& message = parser.get();
      Request request;
      request.method = std::string(message.method_string());
      const std::string_view target(message.target().data(), message.target().size());
      const size_t q = target.find('?');
      request.path = std::string(target.substr(0, q));
      if (q != std::string_view::npos) request.query = std::string(target.substr(q + 1));
      for (const auto& field : message) {
        std::string name(field.name_string());
        std::transform(name.begin(), name.end(), name.begin(),
                       [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
        request.headers.emplace_back(std::move(name), std::string(field.value()));
      }
      request.body = message.body();
      request.peer = peer;
      request.client_identity = identity;
      request.tls = tls;
      const bool keep_alive = message.keep_alive() && message.version() >= 11;
      if (!co_await Write(stream, Dispatch(request), keep_alive, request.method == "HEAD") || !keep_alive) break;
    }
  }

  asio::awaitable<void> Plain(beast::tcp_stream stream, beast::flat_buffer buffer, Conn& conn, std::string peer) {
    co_await Serve(stream, buffer, conn, peer, "", false);
    conn.lowest = nullptr;
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  }

  asio::awaitable<void> Tls(beast::tcp_stream tcp, beast::flat_buffer buffer, Conn& conn, std::string peer,
                            std::shared_ptr<ssl::context> context) {
    beast::ssl_stream<beast::tcp_stream> stream(std::move(tcp), *context);
    conn.lowest = &beast::get_lowest_layer(stream);
    beast::get_lowest_layer(stream).expires_after(options.header_timeout);
    beast::error_code ec;
    const size_t used = co_await stream.async_handshake(ssl::stream_base::server, buffer.data(),
                                                        asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      std::string why = ec.message();
      const long verify = SSL_get_verify_result(stream.native_handle());
      if (verify != X509_V_OK) why += std::string(" (") + X509_verify_cert_error_string(verify) + ")";
      spdlog::info("HTTP: TLS handshake with {} failed: {}", peer, why);
      co_return;
    }
    buffer.consume(used);
    const std::string identity = ClientIdentity(stream.native_handle());
    co_await Serve(stream, buffer, conn, peer, identity, true);
    beast::get_lowest_layer(stream).expires_after(std::chrono::seconds(2));
    co_await stream.async_shutdown(asio::redirect_error(asio::use_awaitable, ec));
    conn.lowest = nullptr;
  }

  // One connection: with TLS on, plain HTTP gets a 400 that says to use https://.
  asio::awaitable<void> Connection(tcp::socket socket, std::shared_ptr<Conn> conn) {
    struct Leave {
      Impl* impl;
      std::shared_ptr<Conn> conn;
      ~Leave() { impl->Forget(*conn); }
    } leave{this, conn};
    beast::error_code ec;
    const tcp::endpoint remote = socket.remote_endpoint(ec);
    const std::string peer = ec ? std::string("?") : remote.address().to_string() + ":" + std::to_string(remote.port());
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    if (!options.tls.enabled()) {
      co_await Plain(std::move(stream), std::move(buffer), *conn, peer);
      co_return;
    }
    conn->lowest = &stream;
    stream.expires_after(options.header_timeout);
    const bool is_tls = co_await beast::async_detect_ssl(stream, buffer, asio::redirect_error(asio::use_awaitable, ec));
    conn->lowest = nullptr;
    if (ec) co_return;
    if (is_tls) {
      SetHeard(*conn);
      co_await Tls(std::move(stream), std::move(buffer), *conn, peer, CurrentTls());
      co_return;
    }
    spdlog::info("HTTP: plain HTTP from {} on the TLS listener: answered 400", peer);
    co_await Write(stream,
                   Response::Text(400, "this listener serves HTTPS: use https://HOST:" + std::to_string(port) + "/"),
                   false, false);
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  }

  asio::awaitable<void> Accept() {
    for (;;) {
      beast::error_code ec;
      // Each connection on a strand of its own: its stream's timer and I/O handlers must not run
      // at once on the two I/O threads (Beast's basic_stream requires it).
      tcp::socket socket =
          co_await acceptor.async_accept(asio::make_strand(io), asio::redirect_error(asio::use_awaitable, ec));
      if (ec == asio::error::operation_aborted) co_return;
      if (ec) {
        spdlog::warn("HTTP: accept failed: {}", ec.message());
        continue;
      }
      auto conn = std::make_shared<Conn>();
      const tcp::endpoint remote = socket.remote_endpoint(ec);
      conn->ip = ec ? std::string("?") : remote.address().to_string();
      conn->executor = socket.get_executor();
      conn->fd = socket.native_handle();
      if (!Admit(conn)) {
        socket.close(ec);
        continue;
      }
      asio::co_spawn(conn->executor, Connection(std::move(socket), conn), asio::detached);
    }
  }

  // Counts a new connection in, making room if it must (see the header); false when there is no
  // room to make: every connection counted against the full limit has a request in progress.
  bool Admit(const std::shared_ptr<Conn>& conn) EXCLUDES(conns_mu) {
    std::shared_ptr<Conn> victim;
    {
      MutexLock lock(&conns_mu);
      const auto mine = conns_by_ip.find(conn->ip);
      const size_t from_peer = mine == conns_by_ip.end() ? 0 : mine->second;
      const bool peer_full = from_peer >= options.max_connections_per_peer;
      const bool full = conns.size() >= options.max_connections;
      if (peer_full || full) {
        for (const std::shared_ptr<Conn>& c : conns) {
          if (!c->waiting || c->evicted || (peer_full && c->ip != conn->ip)) continue;
          // Those that never sent anything first, then the longest waiting.
          if (!c->heard) c->heard = BytesWaiting(c->fd);
          if (victim == nullptr || (victim->heard && !c->heard) ||
              (victim->heard == c->heard && c->since < victim->since)) {
            victim = c;
          }
        }
        if (victim == nullptr) {
          spdlog::warn("HTTP: {} connections open{}, each with a request in progress: closed a new one from {}",
                       peer_full ? from_peer : conns.size(),
                       peer_full ? " from " + conn->ip + " (the most one address may hold)" : " (the most allowed)",
                       conn->ip);
          return false;
        }
        victim->evicted = true;
      }
      conn->since = std::chrono::steady_clock::now();
      conns.push_back(conn);
      conn->at = std::prev(conns.end());
      ++conns_by_ip[conn->ip];
    }
    if (victim != nullptr) {
      spdlog::debug("HTTP: closed a connection from {} that waited longest without a request, for a new one",
                    victim->ip);
      asio::post(victim->executor, [this, victim] {
        {
          MutexLock lock(&conns_mu);
          if (!victim->waiting) {  // a request began meanwhile: it stays
            victim->evicted = false;
            return;
          }
        }
        if (victim->lowest != nullptr) victim->lowest->cancel();
      });
    }
    return true;
  }

  void Forget(Conn& conn) EXCLUDES(conns_mu) {
    MutexLock lock(&conns_mu);
    conns.erase(conn.at);
    const auto it = conns_by_ip.find(conn.ip);
    if (it != conns_by_ip.end() && --it->second == 0) conns_by_ip.erase(it);
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options, std::vector<Route> routes) {
  auto endpoint = ParseListen(options.listen);
  if (!endpoint.ok()) return endpoint.status();
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->routes = std::move(routes);
  if (impl->options.tls.enabled()) {
    auto context = MakeTlsContext(impl->options.tls);
    if (!context.ok()) return Status::InvalidArgument("TLS: " + context.status().message());
    MutexLock lock(&impl->tls_mu);
    impl->tls_context = std::move(context).value();
    impl->tls_stamp = FilesStamp(impl->options.tls);
    impl->tls_checked = std::chrono::steady_clock::now();
  }
  beast::error_code ec;
  impl->acceptor.open(endpoint->protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint.value(), ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::Unavailable(ec.message());
  impl->port = impl->acceptor.local_endpoint(ec).port();
  Impl* raw = impl.get();
  asio::co_spawn(raw->io, raw->Accept(), asio::detached);
  const int threads = std::max(1, raw->options.threads);
  for (int i = 0; i < threads; ++i) {
    raw->threads.emplace_back([raw] {
      NameThisThread("gw-http");
      raw->io.run();
    });
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::~Server() {
  if (impl_ == nullptr) return;
  impl_->io.stop();
  for (std::thread& t : impl_->threads) t.join();
}

int Server::port() const { return impl_->port; }

bool Server::tls() const { return impl_->options.tls.enabled(); }

StatusOr<std::string> Server::ReloadTls() {
  if (!impl_->options.tls.enabled()) return std::string("off");
  auto loaded = MakeTlsContext(impl_->options.tls);
  if (!loaded.ok()) return loaded.status();
  const std::string line = CertificateLine(*loaded.value(), impl_->options.tls);
  MutexLock lock(&impl_->tls_mu);
  impl_->tls_context = std::move(loaded).value();
  impl_->tls_stamp = FilesStamp(impl_->options.tls);
  return line;
}

}  // namespace gradwatch::web
