#include "alerts/notify/http_client.h"

#include <openssl/ssl.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <cctype>
#include <charconv>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

namespace gradwatch::notify {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using Error = HttpResult::Error;

namespace {

HttpResult Failure(Error error, std::string message) {
  HttpResult result;
  result.error = error;
  result.message = std::move(message);
  return result;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool IsIpLiteral(const std::string& host) {
  boost::system::error_code ec;
  asio::ip::make_address(host, ec);
  return !ec;
}

std::string HostHeader(const Url& url) {
  const bool ipv6 = url.host.find(':') != std::string::npos;
  std::string host = ipv6 ? "[" + url.host + "]" : url.host;
  const uint16_t default_port = url.scheme == "https" ? 443 : 80;
  if (url.port != default_port) host += ":" + std::to_string(url.port);
  return host;
}

bool HasControlChars(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return c == '\r' || c == '\n' || c == '\0'; });
}

Error ClassifyError(const beast::error_code& ec) {
  if (ec == beast::error::timeout) return Error::kTimeout;
  if (ec.category() == asio::error::get_ssl_category()) return Error::kTls;
  return Error::kNetwork;
}

}  // namespace

// Named, not anonymous: the coroutine frames of HttpClient::Impl's members hold these.
namespace http_exchange {

// What an exchange on a connection leaves of it.
struct ExchangeEnd {
  // The response allows another request on the connection (HTTP/1.1 keep-alive), and was read whole.
  bool reusable = false;
  // The connection was found closed before any byte of a response: a connection kept from an
  // earlier request that the peer has since closed, on which the request is sent again.
  bool closed_before_answer = false;
};

// Writes the request and reads the response on a connected (and, for TLS, handshaken) stream.
// Every operation shares the deadline set on the lowest layer.
template <typename Stream>
asio::awaitable<ExchangeEnd> Exchange(Stream& stream, http::request<http::string_body>& request,
                                      size_t max_response_bytes, HttpResult& out) {
  ExchangeEnd end;
  beast::error_code ec;
  co_await http::async_write(stream, request, asio::redirect_error(asio::use_awaitable, ec));
  if (ec) {
    end.closed_before_answer = ec != beast::error::timeout;
    out = Failure(ClassifyError(ec), "write: " + ec.message());
    co_return end;
  }
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(max_response_bytes);
  co_await http::async_read(stream, buffer, parser, asio::redirect_error(asio::use_awaitable, ec));
  if (ec && !(ec == http::error::body_limit && parser.is_header_done())) {
    // A TLS peer that closed without a close_notify (as servers close idle connections) reads
    // as a truncated stream.
    end.closed_before_answer =
        !parser.got_some() && (ec == http::error::end_of_stream || ec == asio::error::connection_reset ||
                               ec == asio::error::eof || ec == ssl::error::stream_truncated);
    out = Failure(ClassifyError(ec), "read: " + ec.message());
    co_return end;
  }
  end.reusable = !ec && parser.keep_alive();
  out = HttpResult{};
  out.status = static_cast<int>(parser.get().result_int());
  out.body = parser.get().body();
  co_return end;
}

}  // namespace http_exchange

using http_exchange::Exchange;
using http_exchange::ExchangeEnd;

std::string_view HttpErrorName(HttpResult::Error error) {
  switch (error) {
    case Error::kNone: return "none";
    case Error::kNetwork: return "network";
    case Error::kTimeout: return "timeout";
    case Error::kTls: return "tls";
    case Error::kInvalidRequest: return "invalid_request";
    case Error::kAborted: return "aborted";
  }
  return "none";
}

Result<Url> ParseUrl(std::string_view text) {
  const size_t scheme_end = text.find("://");
  if (scheme_end == std::string_view::npos) return NotifyError("url: no scheme in '" + std::string(text) + "'");
  Url url;
  url.scheme = Lower(text.substr(0, scheme_end));
  if (url.scheme != "http" && url.scheme != "https") {
    return NotifyError("url: scheme must be http or https, not '" + url.scheme + "'");
  }
  std::string_view rest = text.substr(scheme_end + 3);
  const size_t authority_end = rest.find_first_of("/?#");
  std::string_view authority = rest.substr(0, authority_end);
  std::string_view tail = authority_end == std::string_view::npos ? std::string_view() : rest.substr(authority_end);
  if (authority.find('@') != std::string_view::npos) {
    return NotifyError("url: user info is not supported; use headers for credentials");
  }
  std::string_view port_text;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) return NotifyError("url: unterminated IPv6 address");
    url.host = std::string(authority.substr(1, close - 1));
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') return NotifyError("url: junk after IPv6 address");
      port_text = after.substr(1);
      if (port_text.empty()) return NotifyError("url: empty port");
    }
  } else {
    const size_t colon = authority.rfind(':');
    url.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) {
      port_text = authority.substr(colon + 1);
      if (port_text.empty()) return NotifyError("url: empty port");
    }
  }
  if (url.host.empty()) return NotifyError("url: empty host in '" + std::string(text) + "'");
  url.port = url.scheme == "https" ? 443 : 80;
  if (!port_text.empty()) {
    unsigned port = 0;
    auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 || port > 65535) {
      return NotifyError("url: bad port '" + std::string(port_text) + "'");
    }
    url.port = static_cast<uint16_t>(port);
  }
  const size_t fragment = tail.find('#');
  if (fragment != std::string_view::npos) tail = tail.substr(0, fragment);
  if (tail.empty() || tail.front() != '/') {
    url.target = "/" + std::string(tail);
  } else {
    url.target = std::string(tail);
  }
  if (HasControlChars(url.target) || url.target.find(' ') != std::string::npos) {
    return NotifyError("url: spaces or control characters in the path");
  }
  return url;
}

struct HttpClient::Impl {
  // A connection is kept for the next request at most this long: servers close idle ones (often
  // after 60 s or more), and a request sent on one they just closed is sent again on a new one.
  static constexpr std::chrono::seconds kKeepIdle{30};

  HttpClientOptions options;
  ssl::context tls{ssl::context::tls_client};

  std::mutex mu;
  asio::io_context* running = nullptr;  // guarded by mu
  bool aborted = false;                 // guarded by mu

  // Used by Send()'s thread only. The io_context lives from one request to the next with the
  // connection kept open on it; both are dropped after a request that did not finish (a timeout,
  // an abort), whose abandoned operations must never run.
  std::unique_ptr<asio::io_context> io;
  struct Kept {
    std::string origin;  // scheme://host:port
    std::unique_ptr<beast::tcp_stream> plain;
    std::unique_ptr<beast::ssl_stream<beast::tcp_stream>> secure;
    std::chrono::steady_clock::time_point since;
  };
  std::optional<Kept> kept;

  static std::string Origin(const Url& url) { return url.scheme + "://" + url.host + ":" + std::to_string(url.port); }

  void Drop() {
    kept.reset();  // its streams before the io_context they are registered with
    io.reset();
  }

  // Sends on the kept connection to url's origin, if there is one; true when that settled the
  // request (out is its result), false when a new connection is needed.
  asio::awaitable<bool> SendOnKept(const Url& url, http::request<http::string_body>& request,
                                   std::chrono::steady_clock::time_point deadline, HttpResult& out) {
    if (!kept) co_return false;
    Kept k = std::move(*kept);
    kept.reset();
    if (k.origin != Origin(url) || std::chrono::steady_clock::now() - k.since >= kKeepIdle) co_return false;
    ExchangeEnd end;
    if (k.secure) {
      beast::get_lowest_layer(*k.secure).expires_at(deadline);
      end = co_await Exchange(*k.secure, request, options.max_response_bytes, out);
    } else {
      k.plain->expires_at(deadline);
      end = co_await Exchange(*k.plain, request, options.max_response_bytes, out);
    }
    if (end.closed_before_answer) co_return false;
    if (end.reusable) {
      k.since = std::chrono::steady_clock::now();
      kept = std::move(k);
    }
    co_return true;
  }

  asio::awaitable<void> Run(const Url& url, http::request<http::string_body>& request,
                            std::chrono::steady_clock::time_point deadline, HttpResult& out) {
    if (co_await SendOnKept(url, request, deadline, out)) co_return;
    auto executor = co_await asio::this_coro::executor;
    beast::error_code ec;
    // An address is used as it is: asio's resolver runs getaddrinfo on a thread of its own, made
    // anew for each request's io_context.
    std::vector<tcp::endpoint> endpoints;
    if (const asio::ip::address address = asio::ip::make_address(url.host, ec); !ec) {
      endpoints.emplace_back(address, url.port);
    } else {
      tcp::resolver resolver(executor);
      const auto resolved = co_await resolver.async_resolve(url.host, std::to_string(url.port),
                                                            asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        out = Failure(Error::kNetwork, "resolve " + url.host + ": " + ec.message());
        co_return;
      }
      for (const auto& entry : resolved) endpoints.push_back(entry.endpoint());
    }
    if (url.scheme == "http") {
      auto stream = std::make_unique<beast::tcp_stream>(executor);
      stream->expires_at(deadline);
      co_await stream->async_connect(endpoints, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        out = Failure(ClassifyError(ec), "connect " + url.host + ":" + std::to_string(url.port) + ": " + ec.message());
        co_return;
      }
      if ((co_await Exchange(*stream, request, options.max_response_bytes, out)).reusable) {
        kept = Kept{Origin(url), std::move(stream), nullptr, std::chrono::steady_clock::now()};
      } else {
        stream->socket().shutdown(tcp::socket::shutdown_both, ec);
      }
      co_return;
    }

    auto secure = std::make_unique<beast::ssl_stream<beast::tcp_stream>>(executor, tls);
    auto& stream = *secure;
    if (!IsIpLiteral(url.host) && !SSL_set_tlsext_host_name(stream.native_handle(), url.host.c_str())) {
      out = Failure(Error::kTls, "cannot set SNI host name " + url.host);
      co_return;
    }
    if (options.tls.verify_peer) {
      stream.set_verify_mode(ssl::verify_peer);
      stream.set_verify_callback(ssl::host_name_verification(url.host));
    } else {
      stream.set_verify_mode(ssl::verify_none);
    }
    beast::get_lowest_layer(stream).expires_at(deadline);
    co_await beast::get_lowest_layer(stream).async_connect(endpoints, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      out = Failure(ClassifyError(ec), "connect " + url.host + ":" + std::to_string(url.port) + ": " + ec.message());
      co_return;
    }
    co_await stream.async_handshake(ssl::stream_base::client, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      std::string message = "TLS handshake with " + url.host + ": " + ec.message();
      const long verify = SSL_get_verify_result(stream.native_handle());
      if (verify != X509_V_OK) message += " (" + std::string(X509_verify_cert_error_string(verify)) + ")";
      out = Failure(ec == beast::error::timeout ? Error::kTimeout : Error::kTls, std::move(message));
      co_return;
    }
    if ((co_await Exchange(stream, request, options.max_response_bytes, out)).reusable) {
      kept = Kept{Origin(url), nullptr, std::move(secure), std::chrono::steady_clock::now()};
    } else {
      // Close without waiting for the peer's close_notify.
      beast::get_lowest_layer(stream).socket().shutdown(tcp::socket::shutdown_both, ec);
    }
  }
};

HttpClient::HttpClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpClient::~HttpClient() = default;

Result<std::unique_ptr<HttpClient>> HttpClient::Create(HttpClientOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  const TlsOptions& tls = impl->options.tls;
  SSL_CTX_set_min_proto_version(impl->tls.native_handle(), TLS1_2_VERSION);
  boost::system::error_code ec;
  if (tls.verify_peer) {
    impl->tls.set_verify_mode(ssl::verify_peer);
    if (tls.use_system_ca) {
      impl->tls.set_default_verify_paths(ec);
      if (ec) return NotifyError("TLS: cannot load the system CA store: " + ec.message());
    }
    if (!tls.ca_file.empty()) {
      impl->tls.load_verify_file(tls.ca_file, ec);
      if (ec) return NotifyError("TLS: cannot load CA file " + tls.ca_file + ": " + ec.message());
    }
    if (!tls.ca_pem.empty()) {
      impl->tls.add_certificate_authority(asio::buffer(tls.ca_pem), ec);
      if (ec) return NotifyError("TLS: cannot load the CA PEM text: " + ec.message());
    }
  } else {
    impl->tls.set_verify_mode(ssl::verify_none);
  }
  return std::unique_ptr<HttpClient>(new HttpClient(std::move(impl)));
}

HttpResult HttpClient::Send(const HttpRequest& request) { return Send(request, impl_->options.timeout); }

HttpResult HttpClient::Send(const HttpRequest& request, std::chrono::milliseconds timeout) {
  auto url = ParseUrl(request.url);
  if (!url.ok()) return Failure(Error::kInvalidRequest, url.status().message());
  if (request.method.empty() || HasControlChars(request.method) || request.method.find(' ') != std::string::npos) {
    return Failure(Error::kInvalidRequest, "bad method '" + request.method + "'");
  }
  for (const auto& [name, value] : request.headers) {
    if (name.empty() || HasControlChars(name) || HasControlChars(value) || name.find(':') != std::string::npos) {
      return Failure(Error::kInvalidRequest, "bad header '" + name + "'");
    }
  }

  HttpResult out = Failure(Error::kTimeout, "no response within " + std::to_string(timeout.count()) + " ms");
  try {
    http::request<http::string_body> req;
    req.method_string(request.method);
    req.target(url->target);
    req.version(11);
    req.set(http::field::host, HostHeader(url.value()));
    req.set(http::field::user_agent, impl_->options.user_agent);
    bool has_content_type = false;
    for (const auto& [name, value] : request.headers) {
      if (Lower(name) == "content-type") has_content_type = true;
      req.set(name, value);
    }
    if (!request.body.empty() && !has_content_type) req.set(http::field::content_type, "application/json");
    req.body() = request.body;
    req.prepare_payload();

    if (!impl_->io) impl_->io = std::make_unique<asio::io_context>();
    asio::io_context& io = *impl_->io;
    io.restart();
    {
      std::lock_guard lock(impl_->mu);
      if (impl_->aborted) return Failure(Error::kAborted, "aborted");
      impl_->running = &io;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool finished = false;
    std::string exception_message;
    asio::co_spawn(io, impl_->Run(url.value(), req, deadline, out), [&](std::exception_ptr e) {
      finished = true;
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        exception_message = ex.what();
      } catch (...) {
        exception_message = "unknown exception";
      }
    });
    // The stream's own deadline ends connect, handshake, write and read; this bound also covers
    // name resolution.
    io.run_until(deadline + std::chrono::milliseconds(50));
    bool aborted;
    {
      std::lock_guard lock(impl_->mu);
      impl_->running = nullptr;
      aborted = impl_->aborted;
    }
    if (!finished) {
      out = aborted ? Failure(Error::kAborted, "aborted")
                    : Failure(Error::kTimeout, "no response within " + std::to_string(timeout.count()) + " ms");
    } else if (!exception_message.empty()) {
      out = Failure(Error::kNetwork, exception_message);
    }
    // Destroying the io_context abandons whatever is still pending; those handlers never run.
    if (!finished || !exception_message.empty()) impl_->Drop();
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(impl_->mu);
      impl_->running = nullptr;
    }
    impl_->Drop();
    return Failure(Error::kInvalidRequest, e.what());
  }
  return out;
}

void HttpClient::Abort() {
  std::lock_guard lock(impl_->mu);
  impl_->aborted = true;
  if (impl_->running != nullptr) impl_->running->stop();
}

}  // namespace gradwatch::notify
