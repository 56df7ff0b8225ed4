// gradwatchd's HTTP listener (server/web/server.h) against real clients on loopback: routing,
// keep-alive, hostile requests, limits, and HTTPS with and without client certificates, with
// certificates made by openssl (tests/support/make_test_certs.sh), renewed in place.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>

#include "server/web/server.h"
#include "tests/integration/daemon_process.h"
#include "tests/support/test_certs.h"
#include "tests/support/time_scale.h"

using namespace gradwatch;
using testing::HttpRequest;
using testing::HttpsRequest;
using testing::TlsClient;

namespace {

std::unique_ptr<web::Server> StartServer(web::ServerOptions options, std::vector<web::Route> routes) {
  auto started = web::Server::Start(std::move(options), std::move(routes));
  INFO(started.status().message());
  REQUIRE(started.ok());
  return std::move(started).value();
}

// A route that echoes what the server parsed.
web::Route Echo(std::string path, bool prefix = false) {
  web::Route r;
  r.path = std::move(path);
  r.prefix = prefix;
  r.methods = {"GET", "POST"};
  r.handler = [](const web::Request& q) {
    return web::Response::Text(200, q.method + " " + q.path + " ?" + q.query +
                                        " x-test=" + std::string(q.Header("x-test")) + " body=" + q.body +
                                        " tls=" + (q.tls ? "yes" : "no") + " identity=" + q.client_identity);
  };
  return r;
}

// A raw loopback connection, for what the test clients do not send.
class Raw {
 public:
  explicit Raw(int port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("connect");
  }
  ~Raw() { ::close(fd_); }
  void Send(const std::string& s) {
    if (::send(fd_, s.data(), s.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(s.size()))
      throw std::runtime_error("send");
  }
  // Everything until the server closes the connection (or `limit` passes: then what came).
  std::string ReadUntilClosed(std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + testing::Scaled(limit);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) != 1) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  bool closed() const { return closed_; }

 private:
  int fd_;
  bool closed_ = false;
};

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the HTTP listener routes by path, and answers unknown paths and methods clearly", "[web]") {
  web::Route broken;
  broken.path = "/broken";
  broken.handler = [](const web::Request&) -> web::Response { throw std::runtime_error("the handler broke"); };
  auto server = StartServer({}, {Echo("/metrics"), Echo("/runs/", true), Echo("/runs/special"), broken});
  const int port = server->port();
  REQUIRE(port > 0);
  CHECK_FALSE(server->tls());

  auto r = HttpRequest("GET", "127.0.0.1", port, "/metrics?x=1&y=2", "", {{"X-Test", "Value"}});
  CHECK(r.status == 200);
  CHECK(r.body == "GET /metrics ?x=1&y=2 x-test=Value body= tls=no identity=\n");
  CHECK(r.headers.at("content-type") == "text/plain; charset=utf-8");
  CHECK(HttpRequest("POST", "127.0.0.1", port, "/metrics", "hello").body.find("body=hello") != std::string::npos);
  // The longest matching route wins; a prefix covers what is under it.
  CHECK(HttpRequest("GET", "127.0.0.1", port, "/runs/a/b").body.find("GET /runs/a/b") == 0);
  CHECK(HttpRequest("GET", "127.0.0.1", port, "/runs/special").status == 200);

  r = HttpRequest("GET", "127.0.0.1", port, "/nothing");
  CHECK(r.status == 404);
  CHECK(r.body.find("no page at /nothing (this listener serves /metrics, /runs/") == 0);
  r = HttpRequest("DELETE", "127.0.0.1", port, "/metrics");
  CHECK(r.status == 405);
  CHECK(r.headers.at("allow") == "GET, HEAD, POST");
  r = HttpRequest("HEAD", "127.0.0.1", port, "/metrics");
  CHECK(r.status == 200);
  CHECK(r.body.empty());
  CHECK(std::stoul(r.headers.at("content-length")) > 0);

  r = HttpRequest("GET", "127.0.0.1", port, "/broken");
  CHECK(r.status == 500);
  CHECK(r.body == "internal error: the handler broke\n");
  CHECK(HttpRequest("GET", "127.0.0.1", port, "/metrics").status == 200);  // still serving
}

TEST_CASE("the HTTP listener keeps a connection open for the next request, as scrapers do", "[web]") {
  std::atomic<int> calls{0};
  web::Route counted = Echo("/metrics");
  counted.handler = [&calls](const web::Request&) { return web::Response::Text(200, std::to_string(++calls)); };
  auto server = StartServer({}, {counted});
  Raw c(server->port());
  c.Send(
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string all = c.ReadUntilClosed();
  CHECK(c.closed());
  CHECK(Count(all, "HTTP/1.1 200 OK") == 3);
  CHECK(Count(all, "Connection: keep-alive") == 2);
  CHECK(Count(all, "Connection: close") == 1);
  CHECK(all.find("\r\n\r\n3\n") != std::string::npos);
}

TEST_CASE("hostile requests get a status that says what is wrong, and the listener goes on", "[web]") {
  web::ServerOptions options;
  options.max_body_bytes = 1000;
  auto server = StartServer(options, {Echo("/metrics")});
  const int port = server->port();
  SECTION("a head over 16 KiB: 431") {
    auto r = HttpRequest("GET", "127.0.0.1", port, "/metrics", "", {{"X-Big", std::string(20000, 'a')}});
    CHECK(r.status == 431);
  }
  SECTION("a body over the limit: 413") {
    auto r = HttpRequest("POST", "127.0.0.1", port, "/metrics", std::string(5000, 'b'));
    CHECK(r.status == 413);
  }
  SECTION("not HTTP: 400") {
    Raw c(port);
    c.Send("\x16\x03\x01 garbage that is no request\r\n\r\n");
    const std::string reply = c.ReadUntilClosed();
    CHECK(reply.rfind("HTTP/1.1 400 Bad Request", 0) == 0);
    CHECK(c.closed());
  }
  SECTION("a response header with a line break is never sent") {
    web::Route split = Echo("/split");
    split.handler = [](const web::Request&) {
      web::Response r = web::Response::Text(200, "x");
      r.headers.emplace_back("X-Injected", "a\r\nSet-Cookie: evil");
      return r;
    };
    auto other = StartServer({}, {split});
    auto r = HttpRequest("GET", "127.0.0.1", other->port(), "/split");
    CHECK(r.status == 500);
    CHECK(r.headers.count("set-cookie") == 0);
  }
  CHECK(HttpRequest("GET", "127.0.0.1", port, "/metrics").status == 200);
}

TEST_CASE("slow and idle connections are closed, and make room for new ones beyond the limits", "[web]") {
  SECTION("idle") {
    web::ServerOptions options;
    options.idle_timeout = std::chrono::milliseconds(300);
    auto server = StartServer(options, {Echo("/metrics")});
    Raw idle(server->port());
    idle.ReadUntilClosed();  // nothing sent: closed after the idle timeout
    CHECK(idle.closed());
  }
  SECTION("a head sent a line at a time is cut at the header timeout") {
    web::ServerOptions options;
    options.header_timeout = std::chrono::milliseconds(500);
    auto server = StartServer(options, {Echo("/metrics")});
    Raw slow(server->port());
    slow.Send("GET /metrics HTTP/1.1\r\n");
    const auto started = std::chrono::steady_clock::now();
    slow.ReadUntilClosed();
    CHECK(slow.closed());
    CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(60));  // not the 60 s idle timeout
  }
  SECTION("beyond the limit, a new connection takes the place of the one that waited longest") {
    web::ServerOptions options;
    options.max_connections = 2;
    auto server = StartServer(options, {Echo("/metrics")});
    const int port = server->port();
    Raw oldest(port);
    Raw slow_body(port);  // a whole head, then a body that never comes: still no request in progress
    slow_body.Send("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab");
    Raw third(port);  // keep-alive: it stays, idle once answered
    third.Send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(third.ReadUntilClosed(std::chrono::milliseconds(500)).rfind("HTTP/1.1 200 OK", 0) == 0);
    CHECK_FALSE(third.closed());
    CHECK(oldest.ReadUntilClosed().empty());  // closed without a word for the third
    CHECK(oldest.closed());
    Raw fourth(port);  // the slow body has waited longer than the third: its turn
    fourth.Send("GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    CHECK(fourth.ReadUntilClosed().rfind("HTTP/1.1 200 OK", 0) == 0);
    slow_body.ReadUntilClosed();
    CHECK(slow_body.closed());
  }
  SECTION("beyond the limit of one address, its own oldest makes room") {
    web::ServerOptions options;
    options.max_connections_per_peer = 3;
    auto server = StartServer(options, {Echo("/metrics")});
    std::vector<std::unique_ptr<Raw>> idle;
    for (int i = 0; i < 3; ++i) idle.push_back(std::make_unique<Raw>(server->port()));
    for (int scrape = 0; scrape < 5; ++scrape) {
      CHECK(HttpRequest("GET", "127.0.0.1", server->port(), "/metrics").status == 200);
    }
    idle[0]->ReadUntilClosed();
    CHECK(idle[0]->closed());
  }
}

TEST_CASE("the HTTP listener reports an address it cannot listen on", "[web]") {
  auto server = StartServer({}, {Echo("/metrics")});
  web::ServerOptions options;
  options.listen = "127.0.0.1:" + std::to_string(server->port());
  auto second = web::Server::Start(options, {});
  REQUIRE_FALSE(second.ok());
  CHECK_THAT(second.status().message(), Catch::Contains("in use"));
  options.listen = "nowhere:80";
  second = web::Server::Start(options, {});
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().message() == "'nowhere:80': nowhere is not an IP address");
}

TEST_CASE("HTTPS: the listener serves TLS, says so to plain HTTP, and checks client certificates", "[web][tls]") {
  const testing::Certs certs;
  const TlsClient client{certs("ca.pem"), "", "", ""};

  SECTION("server TLS") {
    web::ServerOptions options;
    options.tls = {certs("server.pem"), certs("server.key"), ""};
    auto server = StartServer(options, {Echo("/metrics")});
    CHECK(server->tls());
    const int port = server->port();
    auto r = HttpsRequest("GET", "127.0.0.1", port, "/metrics", client);
    CHECK(r.status == 200);
    CHECK(r.body.find("tls=yes identity=\n") != std::string::npos);
    CHECK(HttpsRequest("GET", "localhost", port, "/metrics", client).status == 200);

    r = HttpRequest("GET", "127.0.0.1", port, "/metrics");
    CHECK(r.status == 400);
    CHECK(r.body == "this listener serves HTTPS: use https://HOST:" + std::to_string(port) + "/\n");

    CHECK_THROWS_WITH(HttpsRequest("GET", "127.0.0.1", port, "/metrics", {certs("other-ca.pem"), "", "", ""}),
                      Catch::Contains("certificate verify failed"));
    CHECK_THROWS_WITH(
        HttpsRequest("GET", "127.0.0.1", port, "/metrics", {certs("ca.pem"), "", "", "elsewhere.example"}),
        Catch::Contains("hostname mismatch"));
  }

  SECTION("client certificates") {
    web::ServerOptions options;
    options.tls = {certs("server.pem"), certs("server.key"), certs("ca.pem")};
    auto server = StartServer(options, {Echo("/metrics")});
    const int port = server->port();
    auto r = HttpsRequest("GET", "127.0.0.1", port, "/metrics",
                          {certs("ca.pem"), certs("client.pem"), certs("client.key"), ""});
    CHECK(r.status == 200);
    CHECK(r.body.find("identity=trainer\n") != std::string::npos);
    CHECK_THROWS_WITH(HttpsRequest("GET", "127.0.0.1", port, "/metrics", client),
                      Catch::Contains("certificate required") || Catch::Contains("handshake failure") ||
                          Catch::Contains("refused client certificate"));
    CHECK_THROWS(HttpsRequest("GET", "127.0.0.1", port, "/metrics",
                              {certs("ca.pem"), certs("expired-client.pem"), certs("expired-client.key"), ""}));
    CHECK_THROWS(HttpsRequest("GET", "127.0.0.1", port, "/metrics",
                              {certs("ca.pem"), certs("other-client.pem"), certs("other-client.key"), ""}));
    CHECK(HttpsRequest("GET", "127.0.0.1", port, "/metrics",
                       {certs("ca.pem"), certs("client.pem"), certs("client.key"), ""})
              .status == 200);
  }

  SECTION("files that cannot be used are named at start") {
    web::ServerOptions options;
    options.tls = {certs("server.pem"), certs("client.key"), ""};
    auto started = web::Server::Start(options, {Echo("/metrics")});
    REQUIRE_FALSE(started.ok());
    CHECK(started.status().message() ==
          "TLS: key " + certs("client.key") + " is not the key of " + certs("server.pem"));
    options.tls = {certs("missing.pem"), certs("server.key"), ""};
    started = web::Server::Start(options, {Echo("/metrics")});
    REQUIRE_FALSE(started.ok());
    CHECK_THAT(started.status().message(), Catch::StartsWith("TLS: certificate " + certs("missing.pem")));
  }
}

TEST_CASE("HTTPS: a certificate renewed in place reaches new connections, on reload or by itself", "[web][tls]") {
  const testing::Certs certs;
  const testing::TempDir live("gradwatch-live-certs");
  const std::string cert = (live.path() / "tls.pem").string();
  const std::string key = (live.path() / "tls.key").string();
  auto install = [&](const std::string& name) {
    // As cert-manager does: new files renamed over the old ones.
    std::filesystem::copy_file(certs(name + ".pem"), cert + ".new", std::filesystem::copy_options::overwrite_existing);
    std::filesystem::copy_file(certs(name + ".key"), key + ".new", std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(cert + ".new", cert);
    std::filesystem::rename(key + ".new", key);
  };
  install("server");
  web::ServerOptions options;
  options.tls = {cert, key, ""};
  auto server = StartServer(options, {Echo("/metrics")});
  const int port = server->port();
  const TlsClient ours{certs("ca.pem"), "", "", ""};
  const TlsClient theirs{certs("other-ca.pem"), "", "", ""};
  CHECK(HttpsRequest("GET", "127.0.0.1", port, "/metrics", ours).status == 200);

  SECTION("ReloadTls (SIGHUP)") {
    install("other-server");
    auto reloaded = server->ReloadTls();
    REQUIRE(reloaded.ok());
    CHECK(reloaded.value() == "/CN=gradwatchd, no client certificates asked");
    CHECK(HttpsRequest("GET", "127.0.0.1", port, "/metrics", theirs).status == 200);
    CHECK_THROWS(HttpsRequest("GET", "127.0.0.1", port, "/metrics", ours));

    // Broken files: refused, and the certificate in use stays.
    std::filesystem::copy_file(certs("client.key"), key, std::filesystem::copy_options::overwrite_existing);
    auto broken = server->ReloadTls();
    REQUIRE_FALSE(broken.ok());
    CHECK_THAT(broken.status().message(), Catch::Contains("is not the key of"));
    CHECK(HttpsRequest("GET", "127.0.0.1", port, "/metrics", theirs).status == 200);
  }

  SECTION("without a reload: noticed as connections arrive") {
    install("other-server");
    bool switched = false;
    const auto deadline = std::chrono::steady_clock::now() + testing::Scaled(std::chrono::seconds(30));
    while (!switched && std::chrono::steady_clock::now() < deadline) {
      try {
        switched = HttpsRequest("GET", "127.0.0.1", port, "/metrics", theirs).status == 200;
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    CHECK(switched);
  }
}
