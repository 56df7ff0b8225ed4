#include <catch2/catch.hpp>

#include <cmath>

#include <prometheus/text_serializer.h>

#include "server/export/metrics_collector.h"

using namespace gradwatch;
using namespace std::chrono_literals;

namespace {

class NullSink final : public runs::StreamSink {
 public:
  void SendAck(uint64_t, uint64_t) override {}
  void SendError(const runs::IngestError&) override {}
  void Supersede() override {}
  void SendAlert(const alerts::Alert&) override {}
};

const prometheus::MetricFamily* FindFamily(const std::vector<prometheus::MetricFamily>& families,
                                           const std::string& name) {
  for (const auto& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string Label(const prometheus::ClientMetric& m, const std::string& name) {
  for (const auto& l : m.label) {
    if (l.name == name) return l.value;
  }
  return {};
}

RunMeta Meta(const std::string& id) {
  RunMeta m;
  m.run_id = id;
  m.params = {{.name = "final_norm.weight", .kind = ParamKind::kNormGain},
              {.name = "lm_head.weight", .kind = ParamKind::kOutput, .group = "head"}};
  return m;
}

}  // namespace

TEST_CASE("the collector reports live runs' latest values with run, param and group labels", "[export]") {
  FakeClock clock;
  runs::DaemonStats stats;
  runs::RunOptions options;
  options.end_after = 60s;
  runs::RunRegistry registry(options, 8, &stats, &clock);
  NullSink sink;
  runs::AttachInfo info;
  runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
  auto run = registry.Attach(Meta("live"), 0, &sink, &info, &error);
  REQUIRE(run);
  RankStep step;
  step.step = 42;
  step.loss = 2.5;
  step.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(0.4), {}, {}}});
  step.params.push_back({.index = 0, .norms = {{}, NormContribution::FromNorm(340.0), {}}});
  REQUIRE_FALSE(run->AddStep(0, step, &sink));
  stats.CountError(runs::IngestErrorReason::kUnknownParam);

  exporter::MetricsCollector collector(&registry, &stats, nullptr);
  const auto families = collector.Collect();

  const auto* grad = FindFamily(families, "gradwatch_grad_norm");
  REQUIRE(grad);
  REQUIRE(grad->metric.size() == 1);
  CHECK(Label(grad->metric[0], "run") == "live");
  CHECK(Label(grad->metric[0], "param") == "lm_head.weight");
  CHECK(Label(grad->metric[0], "group") == "head");
  CHECK(grad->metric[0].gauge.value == Approx(0.4));

  const auto* param = FindFamily(families, "gradwatch_param_norm");
  REQUIRE(param);
  REQUIRE(param->metric.size() == 1);
  CHECK(Label(param->metric[0], "group") == "norm_gain");
  CHECK(param->metric[0].gauge.value == Approx(340.0));

  const auto* total = FindFamily(families, "gradwatch_total_grad_norm");
  REQUIRE(total);
  REQUIRE(total->metric.size() == 1);
  CHECK(total->metric[0].gauge.value == Approx(0.4));  // derived from the only grad reported

  const auto* last = FindFamily(families, "gradwatch_last_step");
  REQUIRE(last);
  CHECK(last->metric[0].gauge.value == 42);

  const auto* errors = FindFamily(families, "gradwatch_ingest_errors_total");
  REQUIRE(errors);
  CHECK(errors->type == prometheus::MetricType::Counter);
  CHECK(errors->metric.size() == runs::AllIngestErrorReasons().size());
  for (const auto& m : errors->metric) {
    CHECK(m.counter.value == (Label(m, "reason") == "unknown_param" ? 1 : 0));
  }

  const auto* commit = FindFamily(families, "gradwatch_journal_commit_duration_seconds");
  REQUIRE(commit);
  CHECK(commit->type == prometheus::MetricType::Histogram);
  CHECK(std::isinf(commit->metric[0].histogram.bucket.back().upper_bound));

  // Serialises without trouble.
  const std::string text = prometheus::TextSerializer().Serialize(families);
  CHECK(text.find("gradwatch_grad_norm{run=\"live\",param=\"lm_head.weight\",group=\"head\"} 0.4") !=
        std::string::npos);
}

TEST_CASE("an ended run's series leave the collector's output", "[export]") {
  FakeClock clock;
  runs::DaemonStats stats;
  runs::RunOptions options;
  options.end_after = 60s;
  runs::RunRegistry registry(options, 8, &stats, &clock);
  NullSink sink;
  runs::AttachInfo info;
  runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
  auto run = registry.Attach(Meta("finished"), 0, &sink, &info, &error);
  RankStep step;
  step.step = 1;
  step.loss = 1.0;
  REQUIRE_FALSE(run->AddStep(0, step, &sink));
  run->Detach(0, &sink);
  clock.Advance(61s);
  registry.Tick();

  exporter::MetricsCollector collector(&registry, &stats, nullptr);
  const auto families = collector.Collect();
  CHECK(FindFamily(families, "gradwatch_loss")->metric.empty());
  CHECK(FindFamily(families, "gradwatch_last_step")->metric.empty());
  const auto* runs_family = FindFamily(families, "gradwatch_runs");
  REQUIRE(runs_family);
  for (const auto& m : runs_family->metric) {
    CHECK(m.gauge.value == (Label(m, "state") == "ended" ? 1 : 0));
  }
  CHECK(registry.Find("finished"));  // still queryable
}
