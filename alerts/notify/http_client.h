// One HTTP or HTTPS request at a time, with a total timeout, over Boost.Beast and OpenSSL. The
// Boost and OpenSSL types stay in http_client.cc: this header exposes none of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "alerts/notify/status.h"

namespace gradwatch::notify {

struct Url {
  std::string scheme;  // "http" or "https", lower case
  std::string host;    // name or address; IPv6 without brackets
  uint16_t port = 0;   // the explicit port, else 80 or 443
  std::string target;  // path and query, "/" at least; the fragment is dropped
};

// Accepts http:// and https:// URLs with an optional port; rejects user info ("user@host"),
// other schemes, empty hosts and ports outside 1..65535.
Result<Url> ParseUrl(std::string_view url);

using Headers = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method = "POST";
  std::string url;
  Headers headers;  // Content-Type defaults to application/json when a body is sent
  std::string body;
};

struct HttpResult {
  enum class Error {
    kNone,            // a response came back: see status and body
    kNetwork,         // resolve, connect, write or read failed
    kTimeout,         // the total timeout expired first
    kTls,             // TLS handshake or certificate verification failed
    kInvalidRequest,  // the request could not be sent at all (bad URL, bad header)
    kAborted,         // HttpClient::Abort() was called
  };
  Error error = Error::kNone;
  std::string message;  // what went wrong, when error != kNone
  int status = 0;       // HTTP status code when error == kNone
  std::string body;     // response body, cut at max_response_bytes

  bool has_response() const { return error == Error::kNone; }
};

std::string_view HttpErrorName(HttpResult::Error error);

struct TlsOptions {
  // Verify the server's certificate chain and host name. Turn off only for tests.
  bool verify_peer = true;
  // Trust the system CA store (OpenSSL's default paths).
  bool use_system_ca = true;
  // Extra trusted CAs: a PEM file and/or PEM text (one or more certificates).
  std::string ca_file;
  std::string ca_pem;
};

struct HttpClientOptions {
  TlsOptions tls;
  // Bounds the whole request: resolve, connect, TLS handshake, write and read.
  std::chrono::milliseconds timeout{10'000};
  size_t max_response_bytes = 1 << 20;
  std::string user_agent = "gradwatch-notify/0.1";
};

// Keeps the connection of a response that allows it (HTTP/1.1 keep-alive) for the next request to
// the same scheme, host and port, for at most 30 s: a page then needs no new connection, nor a TLS
// handshake. A request that finds that connection closed by the peer before any answer is sent
// again on a new one (its Idempotency-Key lets a receiver drop the repeat, should it have been
// processed after all). Send() may be called by one thread at a time; Abort() from any thread.
class HttpClient {
 public:
  // Fails when the TLS settings cannot be loaded (e.g. an unreadable CA file).
  static Result<std::unique_ptr<HttpClient>> Create(HttpClientOptions options);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Never throws. Name resolution runs on a helper thread that cannot be interrupted, so a
  // hanging DNS lookup may hold Send() past its timeout until the resolver gives up.
  HttpResult Send(const HttpRequest& request);
  HttpResult Send(const HttpRequest& request, std::chrono::milliseconds timeout);

  // Makes the Send() in progress, and every later one, return kAborted promptly.
  void Abort();

 private:
  struct Impl;
  explicit HttpClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradwatch::notify
