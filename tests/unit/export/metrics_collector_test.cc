#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/text_serializer.h>

#include "server/export/metrics_collector.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace std::chrono_literals;
using gradwatch::runs::testing::RecordingSink;

namespace {

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

runs::RunOptions EndAfterOneMinute() {
  runs::RunOptions options;
  options.end_after = 60s;
  return options;
}

// A run registry on a fake clock (a run ends 60 s after its last stream and step), its daemon
// stats, and a collector's view of both.
class CollectorFixture {
 protected:
  // Attaches rank 0 of run `id` (catalog: final_norm.weight, lm_head.weight in group "head").
  std::shared_ptr<runs::Run> Attach(const std::string& id) {
    runs::AttachInfo info;
    runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
    auto run = registry_.Attach(Meta(id), 0, &sink_, &info, &error);
    INFO(error.message);
    REQUIRE(run);
    return run;
  }

  // What a scrape would see now.
  std::vector<prometheus::MetricFamily> Collect() {
    exporter::MetricsCollector collector(&registry_, &stats_, nullptr);
    return collector.Collect();
  }

  FakeClock clock_;
  runs::DaemonStats stats_;
  RecordingSink sink_;
  runs::RunRegistry registry_{EndAfterOneMinute(), 8, &stats_, &clock_};
};

}  // namespace

TEST_CASE_METHOD(CollectorFixture, "the collector reports live runs' latest values with run, param and group labels",
                 "[export]") {
  auto run = Attach("live");
  RankStep step;
  step.step = 42;
  step.loss = 2.5;
  step.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(0.4), {}, {}}});
  step.params.push_back({.index = 0, .norms = {{}, NormContribution::FromNorm(340.0), {}}});
  REQUIRE_FALSE(run->AddStep(0, step, &sink_));
  stats_.CountError(runs::IngestErrorReason::kUnknownParam);

  const auto families = Collect();

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

TEST_CASE_METHOD(CollectorFixture, "an ended run's series leave the collector's output", "[export]") {
  auto run = Attach("finished");
  RankStep step;
  step.step = 1;
  step.loss = 1.0;
  REQUIRE_FALSE(run->AddStep(0, step, &sink_));
  run->Detach(0, &sink_);
  clock_.Advance(61s);
  registry_.Tick();

  const auto families = Collect();
  const auto* loss = FindFamily(families, "gradwatch_loss");
  REQUIRE(loss);
  CHECK(loss->metric.empty());
  const auto* last = FindFamily(families, "gradwatch_last_step");
  REQUIRE(last);
  CHECK(last->metric.empty());
  const auto* runs_family = FindFamily(families, "gradwatch_runs");
  REQUIRE(runs_family);
  for (const auto& m : runs_family->metric) {
    CHECK(m.gauge.value == (Label(m, "state") == "ended" ? 1 : 0));
  }
  CHECK(registry_.Find("finished"));  // still queryable
}
