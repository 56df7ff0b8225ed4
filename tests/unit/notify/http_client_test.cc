#include "alerts/notify/http_client.h"

#include <catch2/catch.hpp>
#include <chrono>

#include "tests/unit/notify/test_receiver.h"

namespace notify = gradwatch::notify;
using notify::HttpResult;
using notify::testing::TestReceiver;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<notify::HttpClient> Client(notify::HttpClientOptions options = {}) {
  auto client = notify::HttpClient::Create(std::move(options));
  REQUIRE(client.ok());
  return std::move(client).value();
}

notify::HttpRequest Post(std::string url, std::string body = R"({"a":1})") {
  notify::HttpRequest request;
  request.url = std::move(url);
  request.body = std::move(body);
  return request;
}

// A port that was just free on 127.0.0.1: nothing listens there.
uint16_t ClosedPort() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return acceptor.local_endpoint().port();
}

}  // namespace

TEST_CASE("url parsing gives scheme, host, port and target", "[notify]") {
  struct Case {
    std::string url, scheme, host;
    uint16_t port;
    std::string target;
  };
  const std::vector<Case> cases = {
      {"http://127.0.0.1:9093/api/v2/alerts", "http", "127.0.0.1", 9093, "/api/v2/alerts"},
      {"HTTPS://hooks.slack.com/services/T/B/X", "https", "hooks.slack.com", 443, "/services/T/B/X"},
      {"http://localhost", "http", "localhost", 80, "/"},
      {"http://h:81?x=1&y=2#frag", "http", "h", 81, "/?x=1&y=2"},
      {"https://[::1]:8443/p?q", "https", "::1", 8443, "/p?q"},
  };
  for (const Case& c : cases) {
    INFO(c.url);
    auto url = notify::ParseUrl(c.url);
    REQUIRE(url.ok());
    CHECK(url->scheme == c.scheme);
    CHECK(url->host == c.host);
    CHECK(url->port == c.port);
    CHECK(url->target == c.target);
  }
  for (const std::string bad : {"ftp://h/", "127.0.0.1:80", "http://", "http://h:0/", "http://h:65536/", "http://h:x/",
                                "http://u:p@h/", "http://h/a b"}) {
    INFO(bad);
    CHECK_FALSE(notify::ParseUrl(bad).ok());
  }
}

TEST_CASE("http client posts JSON and returns status and body", "[notify]") {
  TestReceiver receiver;
  receiver.Script({503});
  auto client = Client();
  notify::HttpRequest request = Post(receiver.url("/hook?x=1"));
  request.headers = {{"Authorization", "Bearer t"}};

  const HttpResult first = client->Send(request, 5s);
  REQUIRE(first.has_response());
  CHECK(first.status == 503);
  const HttpResult second = client->Send(request, 5s);
  REQUIRE(second.has_response());
  CHECK(second.status == 200);
  CHECK(second.body == "{}");

  const auto requests = receiver.Requests();
  REQUIRE(requests.size() == 2);
  CHECK(requests[1].method == "POST");
  CHECK(requests[1].target == "/hook?x=1");
  CHECK(requests[1].body == R"({"a":1})");
  CHECK(requests[1].headers.at("content-type") == "application/json");
  CHECK(requests[1].headers.at("authorization") == "Bearer t");
  CHECK(requests[1].headers.at("host") == "127.0.0.1:" + std::to_string(receiver.port()));
}

TEST_CASE("http client reports a closed port as a network error", "[notify]") {
  auto client = Client();
  const HttpResult result = client->Send(Post("http://127.0.0.1:" + std::to_string(ClosedPort()) + "/"), 5s);
  CHECK(result.error == HttpResult::Error::kNetwork);
  CHECK_FALSE(result.message.empty());
}

TEST_CASE("http client gives up on a slow receiver at the total timeout", "[notify]") {
  TestReceiver receiver;
  receiver.SetDelay(2000ms);
  auto client = Client();
  const auto start = std::chrono::steady_clock::now();
  const HttpResult result = client->Send(Post(receiver.url()), 200ms);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(result.error == HttpResult::Error::kTimeout);
  CHECK(elapsed >= 150ms);
  CHECK(elapsed < 1500ms);
}

TEST_CASE("http client rejects a bad URL or header without sending", "[notify]") {
  auto client = Client();
  CHECK(client->Send(Post("ftp://127.0.0.1/"), 1s).error == HttpResult::Error::kInvalidRequest);
  TestReceiver receiver;
  notify::HttpRequest request = Post(receiver.url());
  request.headers = {{"X-Bad", "a\r\nInjected: 1"}};
  CHECK(client->Send(request, 1s).error == HttpResult::Error::kInvalidRequest);
  CHECK(receiver.Requests().empty());
}

TEST_CASE("abort makes a pending request return at once", "[notify]") {
  TestReceiver receiver;
  receiver.SetDelay(2000ms);
  auto client = Client();
  std::thread aborter([&] {
    std::this_thread::sleep_for(100ms);
    client->Abort();
  });
  const auto start = std::chrono::steady_clock::now();
  const HttpResult result = client->Send(Post(receiver.url()), 5s);
  aborter.join();
  CHECK(result.error == HttpResult::Error::kAborted);
  CHECK(std::chrono::steady_clock::now() - start < 1500ms);
  CHECK(client->Send(Post(receiver.url()), 5s).error == HttpResult::Error::kAborted);
}

TEST_CASE("https to a self-signed server works with its CA and fails verification without", "[notify]") {
  const auto cert = notify::testing::MakeSelfSignedCert();
  TestReceiver receiver(TestReceiver::Options{cert});
  REQUIRE(receiver.url().rfind("https://127.0.0.1:", 0) == 0);

  SECTION("CA given as PEM text") {
    notify::HttpClientOptions options;
    options.tls.ca_pem = cert.cert_pem;
    const HttpResult result = Client(options)->Send(Post(receiver.url("/secure")), 5s);
    INFO(result.message);
    REQUIRE(result.has_response());
    CHECK(result.status == 200);
    REQUIRE(receiver.Delivered().size() == 1);
    CHECK(receiver.Delivered()[0].target == "/secure");
  }
  SECTION("CA given as a file") {
    const notify::testing::TempFile ca(cert.cert_pem);
    notify::HttpClientOptions options;
    options.tls.ca_file = ca.path();
    options.tls.use_system_ca = false;
    const HttpResult result = Client(options)->Send(Post(receiver.url()), 5s);
    INFO(result.message);
    CHECK(result.status == 200);
  }
  SECTION("system CA store only: the self-signed certificate is refused") {
    const HttpResult result = Client()->Send(Post(receiver.url()), 5s);
    CHECK(result.error == HttpResult::Error::kTls);
    CHECK(result.message.find("certificate") != std::string::npos);
    CHECK(receiver.Requests().empty());
  }
  SECTION("the host name is checked: localhost is in the certificate") {
    notify::HttpClientOptions options;
    options.tls.ca_pem = cert.cert_pem;
    const std::string url = "https://localhost:" + std::to_string(receiver.port()) + "/";
    const HttpResult result = Client(options)->Send(Post(url), 5s);
    INFO(result.message);
    CHECK(result.status == 200);
  }
  SECTION("verification switched off for tests") {
    notify::HttpClientOptions options;
    options.tls.verify_peer = false;
    CHECK(Client(options)->Send(Post(receiver.url()), 5s).status == 200);
  }
}

TEST_CASE("https refuses a trusted certificate issued for another host name", "[notify]") {
  const auto cert = notify::testing::MakeSelfSignedCert("DNS:other.invalid");
  TestReceiver receiver(TestReceiver::Options{cert});
  notify::HttpClientOptions options;
  options.tls.ca_pem = cert.cert_pem;
  const HttpResult result = Client(options)->Send(Post(receiver.url()), 5s);
  CHECK(result.error == HttpResult::Error::kTls);
  CHECK(receiver.Requests().empty());
}

TEST_CASE("an unreadable CA file fails client creation", "[notify]") {
  notify::HttpClientOptions options;
  options.tls.ca_file = "/nonexistent/ca.pem";
  CHECK_FALSE(notify::HttpClient::Create(options).ok());
}

TEST_CASE("http client sends further requests on the connection a keep-alive receiver keeps open", "[notify]") {
  TestReceiver::Options keep;
  keep.keep_alive = true;
  TestReceiver receiver(keep);
  auto client = Client();
  for (int i = 0; i < 3; ++i) {
    const HttpResult result = client->Send(Post(receiver.url("/hook")), 5s);
    INFO(result.message);
    REQUIRE(result.has_response());
    CHECK(result.status == 200);
  }
  CHECK(receiver.Requests().size() == 3);
  CHECK(receiver.Connections() == 1);
  for (const auto& request : receiver.Requests()) CHECK(request.headers.count("connection") == 0);

  SECTION("another origin gets a connection of its own") {
    TestReceiver other(keep);
    REQUIRE(client->Send(Post(other.url("/hook")), 5s).status == 200);
    REQUIRE(client->Send(Post(receiver.url("/hook")), 5s).status == 200);
    CHECK(other.Connections() == 1);
    CHECK(receiver.Connections() == 2);
  }
}

TEST_CASE("http client opens a connection per request to a receiver that closes each", "[notify]") {
  TestReceiver receiver;
  auto client = Client();
  for (int i = 0; i < 3; ++i) REQUIRE(client->Send(Post(receiver.url("/hook")), 5s).status == 200);
  CHECK(receiver.Connections() == 3);
}

TEST_CASE("a request that finds its kept connection closed by the receiver is sent on a new one, once", "[notify]") {
  TestReceiver::Options keep;
  keep.keep_alive = true;
  TestReceiver receiver(keep);
  auto client = Client();
  REQUIRE(client->Send(Post(receiver.url("/hook"), R"({"n":1})"), 5s).status == 200);
  // As a server closes an idle connection: the client learns it only when it uses it.
  receiver.CloseConnections();
  const HttpResult result = client->Send(Post(receiver.url("/hook"), R"({"n":2})"), 5s);
  INFO(result.message);
  REQUIRE(result.has_response());
  CHECK(result.status == 200);
  const auto requests = receiver.Requests();
  REQUIRE(requests.size() == 2);
  CHECK(requests[1].body == R"({"n":2})");
  CHECK(receiver.Connections() == 2);
}

TEST_CASE("https keeps its connection, and its handshake, for the next request", "[notify]") {
  TestReceiver::Options keep;
  keep.tls = notify::testing::MakeSelfSignedCert();
  keep.keep_alive = true;
  TestReceiver receiver(keep);
  notify::HttpClientOptions options;
  options.tls.ca_pem = keep.tls->cert_pem;
  auto client = Client(options);
  for (int i = 0; i < 3; ++i) {
    const HttpResult result = client->Send(Post(receiver.url("/secure")), 5s);
    INFO(result.message);
    REQUIRE(result.status == 200);
  }
  CHECK(receiver.Connections() == 1);
  receiver.CloseConnections();
  const HttpResult after = client->Send(Post(receiver.url("/secure")), 5s);
  INFO(after.message);
  CHECK(after.status == 200);
  CHECK(receiver.Requests().size() == 4);
  CHECK(receiver.Connections() == 2);
}
