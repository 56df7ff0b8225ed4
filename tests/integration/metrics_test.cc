// The real gradwatchd's /metrics: valid text format 0.0.4 (promtool, families contiguous), the
// same text gzip-compressed when asked, names that need escaping read back as sent.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/unit/export/exposition_checks.h"

using namespace gradwatch;
using namespace gradwatch::testing;

namespace {

// Parameter names a trainer may send that a label value must escape (control characters are
// refused at Hello).
const std::vector<std::pair<std::string, v1::ParamKind>> kCatalog = {
    {"lm_head.weight", v1::PARAM_KIND_OUTPUT},
    {"say \"hi\"", v1::PARAM_KIND_MLP},
    {"back\\slash µ", v1::PARAM_KIND_ATTENTION},
};

v1::StepStats Step(uint64_t step) {
  v1::StepStats s;
  s.set_step(step);
  s.set_wall_time(1.7e9 + step);
  s.set_loss(2.0 + 1.0 / static_cast<double>(step));
  for (uint32_t i = 0; i < kCatalog.size(); ++i) {
    auto* p = s.add_params();
    p->set_index(i);
    p->mutable_grad()->set_norm(0.1 * (i + 1) + 1e-3 * static_cast<double>(step));
    p->mutable_param()->set_norm(10.0 * (i + 1));
  }
  return s;
}

// The text without exposer_transferred_bytes_total, exposer_scrapes_total and
// exposer_request_latencies, which change from one scrape to the next.
std::string WithoutServerMetrics(const std::string& text) { return text.substr(text.find("# HELP gradwatch_")); }

}  // namespace

TEST_CASE("/metrics is valid text with escaped names, and the same text gzip-compressed", "[integration]") {
  DaemonProcess daemon;
  // The streams stay open through both scrapes: one closing between them would change
  // gradwatch_open_streams, which the daemon counts down when it has finished the stream.
  std::vector<std::unique_ptr<StreamClient>> streams;
  for (const std::string run : {"metrics-a", "metrics-b"}) {
    StreamClient& stream = *streams.emplace_back(std::make_unique<StreamClient>(daemon.grpc_target()));
    REQUIRE(stream.Hello(MakeHello(run, 0, 1, kCatalog), 1));
    stream.WaitAccepted();
    for (uint64_t s = 1; s <= 5; ++s) REQUIRE(stream.Step(Step(s), 1 + s));
    CHECK(stream.WaitAck(5).durable_step() == 5);
  }

  const HttpResponse plain = HttpRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics");
  REQUIRE(plain.status == 200);
  CHECK(plain.headers.count("content-encoding") == 0);
  CheckFamiliesContiguous(plain.body);
  CheckWithPromtool(plain.body);
  for (const char* run : {"metrics-a", "metrics-b"}) {
    INFO(run);
    CHECK(ParseMetric(plain.body, "gradwatch_grad_norm", {{"run", run}, {"param", "say \"hi\""}, {"group", "mlp"}}) ==
          0.2 + 5e-3);
    CHECK(ParseMetric(plain.body, "gradwatch_param_norm",
                      {{"run", run}, {"param", "back\\slash µ"}, {"group", "attention"}}) == 30.0);
    CHECK(ParseMetric(plain.body, "gradwatch_loss", {{"run", run}}) == 2.2);
    CHECK(ParseMetric(plain.body, "gradwatch_last_step", {{"run", run}}) == 5);
  }

  const HttpResponse gzip =
      HttpRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics", "", {{"Accept-Encoding", "gzip"}});
  REQUIRE(gzip.status == 200);
  CHECK(gzip.headers.at("content-encoding") == "gzip");
  const std::string text = Gunzip(gzip.body);
  REQUIRE_FALSE(text.empty());
  CheckFamiliesContiguous(text);
  CheckWithPromtool(text);
  CHECK(ParseMetric(text, "exposer_scrapes_total") == 1);
  // Nothing ingested in between: the same samples, but the journal's own timings and the
  // speed, which follows the wall clock.
  auto stable = [](const std::string& body) {
    std::vector<MetricSample> out;
    for (MetricSample& s : ParseExposition(WithoutServerMetrics(body))) {
      if (s.name.rfind("gradwatch_journal_", 0) != 0 && s.name != "gradwatch_steps_per_second") {
        out.push_back(std::move(s));
      }
    }
    return out;
  };
  const auto a = stable(plain.body), b = stable(text);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(a[i].name == b[i].name);
    CHECK(a[i].labels == b[i].labels);
    CHECK((a[i].value == b[i].value || (std::isnan(a[i].value) && std::isnan(b[i].value))));
  }
}

TEST_CASE("a run's labels are on gradwatch_run_info alone, as label_<name>, never as job on other series",
          "[integration]") {
  DaemonProcess daemon;
  StreamClient stream(daemon.grpc_target());
  v1::Hello hello = MakeHello("labelled", 0, 1, kCatalog);  // labels job="it"
  (*hello.mutable_labels())["instance"] = "node-7";
  (*hello.mutable_labels())["cluster"] = "eu";
  REQUIRE(stream.Hello(hello, 1));
  stream.WaitAccepted();
  for (uint64_t s = 1; s <= 5; ++s) {
    v1::StepStats step = Step(s);
    if (s == 5) step.set_loss(NAN);  // NonFiniteValue fires at once: an alert carrying the run's labels
    REQUIRE(stream.Step(step, 1 + s));
  }
  CHECK(stream.WaitAck(5).durable_step() == 5);

  std::string body;
  REQUIRE(WaitUntil([&] {
    body = HttpRequest("GET", "127.0.0.1", daemon.metrics_port(), "/metrics").body;
    return ParseMetric(body, "gradwatch_alerts",
                       {{"alertname", "NonFiniteValue"},
                        {"alertstate", "firing"},
                        {"run", "labelled"},
                        {"series", "train/loss"},
                        {"severity", "warning"}})
        .has_value();
  }));
  CheckWithPromtool(body);
  CHECK(ParseMetric(
            body, "gradwatch_run_info",
            {{"run", "labelled"}, {"label_job", "it"}, {"label_instance", "node-7"}, {"label_cluster", "eu"}}) == 1);
  size_t with_run = 0;
  for (const MetricSample& s : ParseExposition(body)) {
    if (s.labels.count("run") == 0) continue;
    ++with_run;
    INFO(s.name);
    CHECK(s.labels.count("job") == 0);
    CHECK(s.labels.count("instance") == 0);
    CHECK(s.labels.count("cluster") == 0);
    if (s.name != "gradwatch_run_info") CHECK(s.labels.count("label_job") == 0);
  }
  CHECK(with_run > 20);
}
