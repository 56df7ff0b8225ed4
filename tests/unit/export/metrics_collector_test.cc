#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "server/export/metrics_collector.h"
#include "tests/integration/daemon_process.h"
#include "tests/unit/export/exposition_checks.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace std::chrono_literals;
using gradwatch::runs::testing::RecordingSink;

namespace {

using Samples = std::vector<testing::MetricSample>;

// The samples named `name`, in the order of the text.
Samples Named(const Samples& samples, const std::string& name) {
  Samples out;
  for (const auto& s : samples) {
    if (s.name == name) out.push_back(s);
  }
  return out;
}

std::string Label(const testing::MetricSample& s, const std::string& name) {
  auto it = s.labels.find(name);
  return it == s.labels.end() ? std::string() : it->second;
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

  // What a scrape would serve now.
  std::string Render() {
    exporter::Exposition out;
    collector_.Render(out);
    return out.Text();
  }

  FakeClock clock_;
  runs::DaemonStats stats_;
  RecordingSink sink_;
  runs::RunRegistry registry_{EndAfterOneMinute(), 8, &stats_, &clock_};
  exporter::MetricsCollector collector_{&registry_, &stats_, nullptr};
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

  const std::string text = Render();
  CheckFamiliesContiguous(text);
  const Samples samples = testing::ParseExposition(text);

  const Samples grad = Named(samples, "gradwatch_grad_norm");
  REQUIRE(grad.size() == 1);
  CHECK(grad[0].labels ==
        std::map<std::string, std::string>{{"run", "live"}, {"param", "lm_head.weight"}, {"group", "head"}});
  CHECK(grad[0].value == 0.4);

  const Samples param = Named(samples, "gradwatch_param_norm");
  REQUIRE(param.size() == 1);
  CHECK(Label(param[0], "group") == "norm_gain");
  CHECK(param[0].value == 340.0);

  const Samples total = Named(samples, "gradwatch_total_grad_norm");
  REQUIRE(total.size() == 1);
  CHECK(total[0].value == Approx(0.4));  // derived from the only grad reported

  const Samples last = Named(samples, "gradwatch_last_step");
  REQUIRE(last.size() == 1);
  CHECK(last[0].value == 42);

  CHECK(text.find("# TYPE gradwatch_ingest_errors_total counter\n") != std::string::npos);
  const Samples errors = Named(samples, "gradwatch_ingest_errors_total");
  CHECK(errors.size() == runs::AllIngestErrorReasons().size());
  for (const auto& m : errors) {
    CHECK(m.value == (Label(m, "reason") == "unknown_param" ? 1 : 0));
  }

  CHECK(text.find("# TYPE gradwatch_journal_commit_duration_seconds histogram\n") != std::string::npos);
  const Samples buckets = Named(samples, "gradwatch_journal_commit_duration_seconds_bucket");
  REQUIRE_FALSE(buckets.empty());
  CHECK(Label(buckets.back(), "le") == "+Inf");
  CHECK(Named(samples, "gradwatch_analytics_refused_series_total").size() == 1);

  CHECK(text.find("\ngradwatch_grad_norm{run=\"live\",param=\"lm_head.weight\",group=\"head\"} 0.4\n") !=
        std::string::npos);
  CheckWithPromtool(text);
}

TEST_CASE_METHOD(CollectorFixture,
                 "run ids and parameter names are escaped, and every run's samples stay in their family", "[export]") {
  RunMeta odd;
  odd.run_id = "say \"hi\" \\ there";
  odd.params = {{.name = "emb\"ed\\dings", .kind = ParamKind::kEmbedding, .group = "µ \"group\""}};
  runs::AttachInfo info;
  runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
  auto first = registry_.Attach(odd, 0, &sink_, &info, &error);
  REQUIRE(first);
  auto second = Attach("plain");
  for (auto* run : {first.get(), second.get()}) {
    RankStep step;
    step.step = 7;
    step.loss = 1.25;
    step.params.push_back(
        {.index = 0, .norms = {NormContribution::FromNorm(0.5), NormContribution::FromNorm(2.0), {}}});
    REQUIRE_FALSE(run->AddStep(0, step, &sink_));
  }

  const std::string text = Render();
  CheckFamiliesContiguous(text);
  const Samples samples = testing::ParseExposition(text);
  const Samples grad = Named(samples, "gradwatch_grad_norm");
  REQUIRE(grad.size() == 2);
  bool found = false;
  for (const auto& s : grad) {
    if (Label(s, "run") != odd.run_id) continue;
    found = true;
    CHECK(Label(s, "param") == "emb\"ed\\dings");
    CHECK(Label(s, "group") == "µ \"group\"");
    CHECK(s.value == 0.5);
  }
  CHECK(found);
  CHECK(Named(samples, "gradwatch_loss").size() == 2);
  CHECK(Named(samples, "gradwatch_last_step").size() == 2);
  CheckWithPromtool(text);
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

  const Samples samples = testing::ParseExposition(Render());
  CHECK(Named(samples, "gradwatch_loss").empty());
  CHECK(Named(samples, "gradwatch_last_step").empty());
  const Samples runs_family = Named(samples, "gradwatch_runs");
  CHECK(runs_family.size() == 3);
  for (const auto& m : runs_family) {
    CHECK(m.value == (Label(m, "state") == "ended" ? 1 : 0));
  }
  CHECK(registry_.Find("finished"));  // still queryable
}

namespace {

// A run of 6 parameters: a norm gain, the output layer, a weight-decay-0 bias and three weights
// with decay, each reporting its three norms for `steps` steps.
std::shared_ptr<runs::Run> AttachWide(runs::RunRegistry& registry, RecordingSink& sink, int steps) {
  RunMeta m;
  m.run_id = "wide";
  m.params = {{.name = "final_norm.weight", .kind = ParamKind::kNormGain},
              {.name = "lm_head.weight", .kind = ParamKind::kOutput, .weight_decay = 0.1},
              {.name = "layers.0.bias", .kind = ParamKind::kMlp, .weight_decay = 0.0},
              {.name = "layers.0.w1", .kind = ParamKind::kMlp, .weight_decay = 0.1},
              {.name = "layers.0.w2", .kind = ParamKind::kMlp, .weight_decay = 0.1},
              {.name = "layers.1.qkv", .kind = ParamKind::kAttention, .weight_decay = 0.1}};
  runs::AttachInfo info;
  runs::IngestError error{runs::IngestErrorReason::kInvalidHello, ""};
  auto run = registry.Attach(m, 0, &sink, &info, &error);
  REQUIRE(run);
  for (int s = 1; s <= steps; ++s) {
    RankStep step;
    step.step = static_cast<uint64_t>(s);
    step.loss = 2.5 - s * 1e-3;
    for (uint32_t i = 0; i < 6; ++i) {
      step.params.push_back(
          {.index = i,
           .norms = {NormContribution::FromNorm(0.1 + i * 0.01), NormContribution::FromNorm(10.0 + s * 0.01),
                     NormContribution::FromNorm(0.001)}});
    }
    REQUIRE_FALSE(run->AddStep(0, step, &sink));
  }
  return run;
}

std::set<std::string> LabelValues(const Samples& samples, const std::string& name, const std::string& label) {
  std::set<std::string> out;
  for (const auto& s : Named(samples, name)) out.insert(Label(s, label));
  return out;
}

Samples Scrape(runs::RunRegistry& registry, runs::DaemonStats& stats, exporter::ExportOptions options) {
  exporter::MetricsCollector collector(&registry, &stats, nullptr, std::move(options));
  exporter::Exposition out;
  collector.Render(out);
  CheckFamiliesContiguous(out.Text());
  return testing::ParseExposition(out.Text());
}

}  // namespace

TEST_CASE_METHOD(
    CollectorFixture,
    "by default /metrics shows per parameter only the norm gains, no-decay parameters and the output layer",
    "[export]") {
  auto run = AttachWide(registry_, sink_, 50);
  const std::set<std::string> key = {"final_norm.weight", "lm_head.weight", "layers.0.bias"};
  const std::set<std::string> all = {"final_norm.weight", "lm_head.weight", "layers.0.bias",
                                     "layers.0.w1",       "layers.0.w2",    "layers.1.qkv"};

  const Samples by_default = Scrape(registry_, stats_, {});
  for (const char* family :
       {"gradwatch_grad_norm", "gradwatch_param_norm", "gradwatch_update_norm", "gradwatch_grad_norm_share"}) {
    INFO(family);
    CHECK(LabelValues(by_default, family, "param") == key);
  }
  CHECK(LabelValues(by_default, "gradwatch_group_grad_norm_share", "group") ==
        std::set<std::string>{"norm_gain", "output", "mlp", "attention"});
  const std::set<std::string> slopes = LabelValues(by_default, "gradwatch_slope_per_kstep", "series");
  CHECK(slopes.count("grad/norm/total") == 1);
  CHECK(slopes.count("train/loss") == 1);
  CHECK(slopes.count("params/norm/final_norm.weight") == 1);
  CHECK(slopes.count("grad/norm/lm_head.weight") == 1);
  CHECK(slopes.count("params/norm/layers.0.w1") == 0);
  CHECK(slopes.count("updates/norm/layers.1.qkv") == 0);
  CHECK(Named(by_default, "gradwatch_run_series_capped").empty());

  const Samples everything = Scrape(registry_, stats_, {.params = {"*"}, .slope_series = {"*"}});
  CHECK(LabelValues(everything, "gradwatch_grad_norm", "param") == all);
  CHECK(LabelValues(everything, "gradwatch_slope_per_kstep", "series").count("updates/norm/layers.1.qkv") == 1);

  const Samples chosen = Scrape(registry_, stats_, {.params = {"layers.0.*"}, .slope_series = {"params/norm/*"}});
  CHECK(LabelValues(chosen, "gradwatch_param_norm", "param") ==
        std::set<std::string>{"layers.0.bias", "layers.0.w1", "layers.0.w2"});
  const std::set<std::string> chosen_slopes = LabelValues(chosen, "gradwatch_slope_per_kstep", "series");
  CHECK(chosen_slopes.size() == 6);
  for (const auto& k : chosen_slopes) CHECK(k.rfind("params/norm/", 0) == 0);
}

TEST_CASE_METHOD(CollectorFixture, "a run beyond metrics.max_series_per_run shows that many and the count left out",
                 "[export]") {
  auto run = AttachWide(registry_, sink_, 20);
  const Samples full =
      Scrape(registry_, stats_, {.params = {"*"}, .slope_series = {"*"}, .max_series_per_run = 1'000'000});
  size_t per_param = 0;
  for (const char* family :
       {"gradwatch_grad_norm", "gradwatch_param_norm", "gradwatch_update_norm", "gradwatch_param_weight_decay",
        "gradwatch_grad_norm_share", "gradwatch_norm_amplification", "gradwatch_growth_without_decay_factor",
        "gradwatch_slope_per_kstep"}) {
    per_param += Named(full, family).size();
  }
  REQUIRE(per_param > 40);

  const Samples capped = Scrape(registry_, stats_, {.params = {"*"}, .slope_series = {"*"}, .max_series_per_run = 30});
  size_t shown = 0;
  for (const char* family :
       {"gradwatch_grad_norm", "gradwatch_param_norm", "gradwatch_update_norm", "gradwatch_param_weight_decay",
        "gradwatch_grad_norm_share", "gradwatch_norm_amplification", "gradwatch_growth_without_decay_factor",
        "gradwatch_slope_per_kstep"}) {
    shown += Named(capped, family).size();
  }
  CHECK(shown <= 30);
  CHECK(shown >= 27);  // a parameter's norms and weight decay go together
  const Samples left_out = Named(capped, "gradwatch_run_series_capped");
  REQUIRE(left_out.size() == 1);
  CHECK(Label(left_out[0], "run") == "wide");
  CHECK(left_out[0].value == static_cast<double>(per_param - shown));
  // The run's scalars are not counted against the cap.
  CHECK(Named(capped, "gradwatch_total_grad_norm").size() == 1);
  CHECK(Named(capped, "gradwatch_loss").size() == 1);
}
