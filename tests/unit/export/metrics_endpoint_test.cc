#include <catch2/catch.hpp>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "server/export/metrics_endpoint.h"
#include "server/export/text_format.h"
#include "tests/integration/daemon_process.h"
#include "tests/unit/export/exposition_checks.h"

using namespace gradwatch;

namespace {

// A family of `n` samples in one chunk, then an empty chunk, then a second family.
void RenderTestFamilies(exporter::Exposition& out, int n, std::atomic<int>* renders) {
  ++*renders;
  std::string& big = out.NewChunk();
  exporter::AppendFamilyHeader(big, "test_value", "A test gauge.", exporter::MetricType::kGauge);
  std::string labels;
  for (int i = 0; i < n; ++i) {
    labels.clear();
    exporter::AppendLabel(labels, "series", "s" + std::to_string(i), true);
    exporter::AppendSample(big, "test_value", labels, i * 0.5);
  }
  out.NewChunk();
  std::string& small = out.NewChunk();
  exporter::AppendFamilyHeader(small, "test_last", "A second family.", exporter::MetricType::kGauge);
  exporter::AppendSample(small, "test_last", std::string_view(), 1);
}

// The endpoint on a listener of its own, as the daemon serves it.
struct TestServer {
  explicit TestServer(int samples)
      : endpoint(std::vector<exporter::MetricsEndpoint::Renderer>{
            [this, samples](exporter::Exposition& out) { RenderTestFamilies(out, samples, &renders); }}) {
    web::Route route;
    route.path = "/metrics";
    route.handler = [this](const web::Request& r) { return endpoint.Handle(r); };
    auto started = web::Server::Start({}, {route});
    INFO(started.status().message());
    REQUIRE(started.ok());
    server = std::move(started).value();
    REQUIRE(server->port() > 0);
  }
  testing::HttpResponse Get(const std::map<std::string, std::string>& headers = {}) const {
    return testing::HttpRequest("GET", "127.0.0.1", server->port(), "/metrics", "", headers);
  }
  std::atomic<int> renders{0};
  exporter::MetricsEndpoint endpoint;
  std::unique_ptr<web::Server> server;
};

}  // namespace

TEST_CASE("the metrics endpoint serves the rendered text, and the same gzip-compressed when asked", "[export]") {
  TestServer t(50000);
  const testing::HttpResponse plain = t.Get();
  REQUIRE(plain.status == 200);
  CHECK(plain.headers.at("content-type") == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(plain.headers.count("content-encoding") == 0);
  CHECK(plain.headers.at("content-length") == std::to_string(plain.body.size()));
  CheckFamiliesContiguous(plain.body);
  CheckWithPromtool(plain.body);
  CHECK(testing::ParseMetric(plain.body, "test_value", {{"series", "s49999"}}) == 49999 * 0.5);
  CHECK(testing::ParseMetric(plain.body, "exposer_scrapes_total") == 0);  // counted after the scrape

  const testing::HttpResponse gzip = t.Get({{"Accept-Encoding", "gzip, deflate"}});
  REQUIRE(gzip.status == 200);
  CHECK(gzip.headers.at("content-encoding") == "gzip");
  CHECK(gzip.body.size() < plain.body.size() / 4);
  const std::string text = Gunzip(gzip.body);
  REQUIRE_FALSE(text.empty());
  CHECK(testing::ParseMetric(text, "exposer_scrapes_total") == 1);
  CHECK(testing::ParseMetric(text, "exposer_transferred_bytes_total") == static_cast<double>(plain.body.size()));
  // The same text but for the server's own metrics, which come first.
  auto without_own = [](const std::string& s) { return s.substr(s.find("# HELP test_value")); };
  CHECK(without_own(text) == without_own(plain.body));
  CHECK(t.renders.load() == 2);
}

TEST_CASE("the metrics endpoint answers other paths with 404 and other methods with 405", "[export]") {
  TestServer t(10);
  CHECK(testing::HttpRequest("GET", "127.0.0.1", t.server->port(), "/other").status == 404);
  CHECK(testing::HttpRequest("POST", "127.0.0.1", t.server->port(), "/metrics", "x").status == 405);
  CHECK(t.renders.load() == 0);
  CHECK(t.Get().status == 200);
}

TEST_CASE("concurrent scrapes each get a whole text", "[export]") {
  TestServer t(20000);
  std::vector<std::thread> scrapers;
  std::atomic<int> whole{0};
  for (int i = 0; i < 4; ++i) {
    scrapers.emplace_back([&, i] {
      for (int k = 0; k < 3; ++k) {
        const auto r = i % 2 ? t.Get({{"Accept-Encoding", "gzip"}}) : t.Get();
        const std::string text = i % 2 ? Gunzip(r.body) : r.body;
        if (r.status == 200 && testing::ParseMetric(text, "test_value", {{"series", "s19999"}}) == 19999 * 0.5 &&
            text.size() > 20000 * 20) {
          ++whole;
        }
      }
    });
  }
  for (auto& s : scrapers) s.join();
  CHECK(whole.load() == 12);
  CHECK(t.renders.load() == 12);
}
