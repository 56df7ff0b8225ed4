// The remote writer against a scriptable HTTP receiver: what it sends (decoded back from snappy and
// protobuf), its retries, its bounded queue and its progress across a restart.
#include "server/export/remote_write.h"

#include <snappy.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "prometheus/remote_write.pb.h"
#include "server/runs/run_analytics.h"
#include "server/store/remote_write_progress.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/notify/test_receiver.h"

namespace gradwatch::exporter {
namespace {

using namespace std::chrono_literals;
using notify::testing::TestReceiver;

// A run as the channel sees it: a catalog of two parameters and the series of the run's scalars.
struct FakeRun {
  RunMeta meta;
  std::vector<std::array<SeriesId, kNormFields>> param_series;
  runs::RunAnalytics analytics{runs::AnalyticsOptions{}};
  runs::RunActivity activity;

  FakeRun() {
    meta.run_id = "r1";
    meta.params = {ParamInfo{.name = "final_norm.weight", .kind = ParamKind::kNormGain},
                   ParamInfo{.name = "lm_head.weight", .kind = ParamKind::kOutput, .group = "head"}};
    // ids: 0 total grad norm, 1 loss, 2 final_norm grad, 3 final_norm param, 4 lm_head grad, 5 an extra.
    param_series = {{2, 3, kNoSeries}, {4, kNoSeries, kNoSeries}};
  }

  void Open(runs::RunChannel& c) const {
    c.OnSeries(0, std::string(keys::kTotalGradNorm));
    c.OnSeries(1, std::string(keys::kLoss));
    c.OnSeries(2, keys::GradNorm("final_norm.weight"));
    c.OnSeries(3, keys::ParamNorm("final_norm.weight"));
    c.OnSeries(4, keys::GradNorm("lm_head.weight"));
    c.OnSeries(5, "train/tokens");
  }

  void Step(runs::RunChannel& c, uint64_t step, double wall, bool restored = false) const {
    CompletedStep s;
    s.step = step;
    s.wall_time = wall;
    for (SeriesId id = 0; id < 6; ++id) s.values.push_back({id, static_cast<double>(step) + id / 10.0});
    c.OnStep(runs::PublishedStep{.step = s,
                                 .meta = meta,
                                 .param_series = param_series,
                                 .analytics = analytics,
                                 .activity = activity,
                                 .now = wall,
                                 .restored = restored});
    c.Deliver();
  }
};

remote_write::WriteRequest Decode(const notify::testing::RecordedRequest& r) {
  std::string raw;
  REQUIRE(snappy::Uncompress(r.body.data(), r.body.size(), &raw));
  remote_write::WriteRequest w;
  REQUIRE(w.ParseFromString(raw));
  return w;
}

std::string Name(const remote_write::TimeSeries& ts) {
  std::string out;
  for (const auto& l : ts.labels()) out += (out.empty() ? "" : ",") + l.name() + "=" + l.value();
  return out;
}

// Every sample the receiver accepted, by series (its labels as text): (timestamp ms, value).
std::map<std::string, std::vector<std::pair<int64_t, double>>> Accepted(const TestReceiver& receiver) {
  std::map<std::string, std::vector<std::pair<int64_t, double>>> out;
  for (const auto& r : receiver.Delivered()) {
    const remote_write::WriteRequest w = Decode(r);
    for (const auto& ts : w.timeseries()) {
      for (const auto& s : ts.samples()) out[Name(ts)].emplace_back(s.timestamp_ms(), s.value());
    }
  }
  return out;
}

RemoteWriteOptions Options(const TestReceiver& receiver) {
  RemoteWriteOptions o;
  o.name = "tsdb";
  o.url = receiver.url("/api/v1/write");
  o.timeout = 5s;
  o.min_backoff = 10ms;
  o.max_backoff = 50ms;
  return o;
}

bool WaitFor(const std::function<bool()>& condition, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(timeout);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

TEST_CASE("remote write: series are sent under the /metrics names, labels sorted by name") {
  const ParamInfo p{.name = "lm_head.weight", .kind = ParamKind::kOutput, .group = "head"};
  const RemoteSeries grad = RemoteSeriesFor("r", keys::GradNorm("lm_head.weight"), &p, 0);
  CHECK(grad.labels ==
        std::vector<std::pair<std::string, std::string>>{
            {"__name__", "gradwatch_grad_norm"}, {"group", "head"}, {"param", "lm_head.weight"}, {"run", "r"}});
  CHECK(RemoteSeriesFor("r", keys::ParamNorm("lm_head.weight"), &p, 1).labels.front().second == "gradwatch_param_norm");
  CHECK(RemoteSeriesFor("r", std::string(keys::kTotalGradNorm), nullptr, 0).labels ==
        std::vector<std::pair<std::string, std::string>>{{"__name__", "gradwatch_total_grad_norm"}, {"run", "r"}});
  CHECK(RemoteSeriesFor("r", "params/norm/total", nullptr, 0).labels ==
        std::vector<std::pair<std::string, std::string>>{
            {"__name__", "gradwatch_series"}, {"run", "r"}, {"series", "params/norm/total"}});
  for (const auto& s : {grad, RemoteSeriesFor("r", "x/y", nullptr, 0)}) {
    CHECK(std::is_sorted(s.labels.begin(), s.labels.end()));
  }
}

TEST_CASE("remote write: every step reaches the receiver with its wall time, in a snappy protobuf request") {
  TestReceiver receiver;
  auto writer = RemoteWriter::Create(Options(receiver));
  REQUIRE(writer.ok());
  REQUIRE((*writer)->Start(nullptr).ok());
  FakeRun run;
  auto channel = (*writer)->Open(run.meta, false);
  run.Open(*channel);
  const double t0 = 1.8e9;
  for (uint64_t step = 1; step <= 300; ++step) run.Step(*channel, step, t0 + step * 0.5);
  REQUIRE((*writer)->Drain(30s));

  const auto requests = receiver.Delivered();
  REQUIRE(!requests.empty());
  CHECK(requests.front().headers.at("content-encoding") == "snappy");
  CHECK(requests.front().headers.at("content-type") == "application/x-protobuf");
  CHECK(requests.front().headers.at("x-prometheus-remote-write-version") == "0.1.0");
  CHECK(requests.front().target == "/api/v1/write");
  // 7 samples a step (6 series and the step number) in batches of at most 2,000: whole steps.
  CHECK(requests.size() >= 2);
  for (const auto& r : requests) {
    size_t samples = 0;
    const remote_write::WriteRequest w = Decode(r);
    for (const auto& ts : w.timeseries()) samples += ts.samples_size();
    CHECK(samples <= 2000);
    CHECK(samples % 7 == 0);
  }
  const auto accepted = Accepted(receiver);
  const auto& total = accepted.at("__name__=gradwatch_total_grad_norm,run=r1");
  REQUIRE(total.size() == 300);
  for (size_t i = 0; i < total.size(); ++i) {
    CHECK(total[i].first == static_cast<int64_t>(std::llround((t0 + (i + 1) * 0.5) * 1000)));
    CHECK(total[i].second == static_cast<double>(i + 1));
  }
  CHECK(accepted.at("__name__=gradwatch_grad_norm,group=head,param=lm_head.weight,run=r1").size() == 300);
  CHECK(accepted.at("__name__=gradwatch_param_norm,group=norm_gain,param=final_norm.weight,run=r1").size() == 300);
  CHECK(accepted.at("__name__=gradwatch_series,run=r1,series=train/tokens").size() == 300);
  CHECK(accepted.at("__name__=gradwatch_last_step,run=r1").back().second == 300);
  const RemoteWriteStats stats = (*writer)->stats(t0 + 1000);
  CHECK(stats.sent_samples == 300 * 7);
  CHECK(stats.queued_samples == 0);
  CHECK(stats.lag_seconds == 0);
}

TEST_CASE("remote write: only the selected series go, and steps in one millisecond get increasing timestamps") {
  TestReceiver receiver;
  RemoteWriteOptions o = Options(receiver);
  o.series = {"grad/norm/total", "*final_norm*"};
  auto writer = RemoteWriter::Create(o);
  REQUIRE(writer.ok());
  REQUIRE((*writer)->Start(nullptr).ok());
  FakeRun run;
  auto channel = (*writer)->Open(run.meta, false);
  run.Open(*channel);
  for (uint64_t step = 1; step <= 5; ++step) run.Step(*channel, step, 1.8e9);  // one wall time
  REQUIRE((*writer)->Drain(30s));
  const auto accepted = Accepted(receiver);
  std::vector<std::string> names;
  for (const auto& [name, samples] : accepted) names.push_back(name);
  CHECK(names ==
        std::vector<std::string>{"__name__=gradwatch_grad_norm,group=norm_gain,param=final_norm.weight,run=r1",
                                 "__name__=gradwatch_last_step,run=r1",
                                 "__name__=gradwatch_param_norm,group=norm_gain,param=final_norm.weight,run=r1",
                                 "__name__=gradwatch_total_grad_norm,run=r1"});
  const auto& total = accepted.at("__name__=gradwatch_total_grad_norm,run=r1");
  REQUIRE(total.size() == 5);
  for (size_t i = 1; i < total.size(); ++i) CHECK(total[i].first == total[i - 1].first + 1);
}

TEST_CASE("remote write: 5xx and refused connections are retried, a 4xx batch is dropped and counted") {
  TestReceiver receiver;
  RemoteWriteOptions o = Options(receiver);
  o.max_samples_per_send = 7;  // one step a request
  auto writer = RemoteWriter::Create(o);
  REQUIRE(writer.ok());
  REQUIRE((*writer)->Start(nullptr).ok());
  FakeRun run;
  auto channel = (*writer)->Open(run.meta, false);
  run.Open(*channel);

  receiver.Script({503, 503, 400});  // step 1: twice unavailable, then refused for good
  run.Step(*channel, 1, 1.8e9);
  run.Step(*channel, 2, 1.8e9 + 1);
  REQUIRE((*writer)->Drain(30s));
  CHECK(receiver.Requests().size() == 4);
  auto stats = (*writer)->stats(1.8e9);
  CHECK(stats.retried_requests == 2);
  CHECK(stats.failed_samples == 7);
  CHECK(stats.sent_samples == 7);

  receiver.Down();
  run.Step(*channel, 3, 1.8e9 + 2);
  REQUIRE(WaitFor([&] { return (*writer)->stats(1.8e9).retried_requests >= 4; }));
  CHECK((*writer)->stats(1.8e9 + 12).lag_seconds == Approx(10));
  receiver.Up();
  REQUIRE((*writer)->Drain(30s));
  CHECK(Accepted(receiver).at("__name__=gradwatch_total_grad_norm,run=r1") ==
        std::vector<std::pair<int64_t, double>>{{1'800'000'001'000, 2.0}, {1'800'000'002'000, 3.0}});
}

TEST_CASE("remote write: a full queue drops its oldest steps, counted, and keeps the newest") {
  TestReceiver receiver;
  receiver.Down();
  RemoteWriteOptions o = Options(receiver);
  o.max_samples_per_send = 7;
  o.capacity_samples = 70;  // ten steps
  auto writer = RemoteWriter::Create(o);
  REQUIRE(writer.ok());
  REQUIRE((*writer)->Start(nullptr).ok());
  FakeRun run;
  auto channel = (*writer)->Open(run.meta, false);
  run.Open(*channel);
  run.Step(*channel, 1, 1.8e9 + 1);
  REQUIRE(WaitFor([&] { return (*writer)->stats(0).retried_requests >= 1; }));  // step 1 is in flight
  for (uint64_t step = 2; step <= 40; ++step) run.Step(*channel, step, 1.8e9 + step);
  const RemoteWriteStats full = (*writer)->stats(0);
  CHECK(full.dropped_samples == 29 * 7);
  CHECK(full.queued_samples == 11 * 7);  // ten queued and one in flight
  receiver.Up();
  REQUIRE((*writer)->Drain(30s));
  std::vector<double> steps;
  const auto accepted = Accepted(receiver);
  for (const auto& [ts, v] : accepted.at("__name__=gradwatch_total_grad_norm,run=r1")) steps.push_back(v);
  CHECK(steps == std::vector<double>{1, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40});
}

TEST_CASE("remote write: after a restart, the steps the receiver had not accepted are sent, the others not again") {
  gradwatch::testing::TempDir dir;
  const std::string db = (std::filesystem::path(dir.path()) / "journal.db").string();
  auto progress = store::RemoteWriteProgress::Open(db);
  REQUIRE(progress.ok());
  TestReceiver receiver;
  FakeRun run;
  {
    auto writer = RemoteWriter::Create(Options(receiver));
    REQUIRE(writer.ok());
    REQUIRE((*writer)->Start(progress->get()).ok());
    auto channel = (*writer)->Open(run.meta, false);
    run.Open(*channel);
    for (uint64_t step = 1; step <= 10; ++step) run.Step(*channel, step, 1.8e9 + step);
    REQUIRE((*writer)->Drain(30s));
    receiver.Down();
    for (uint64_t step = 11; step <= 15; ++step) run.Step(*channel, step, 1.8e9 + step);
    (*writer)->Stop();  // steps 11-15 never reached the receiver
  }
  auto saved = (*progress)->Load("tsdb");
  REQUIRE(saved.ok());
  CHECK(saved->at("r1") == 11);

  receiver.Up();
  auto writer = RemoteWriter::Create(Options(receiver));
  REQUIRE(writer.ok());
  REQUIRE((*writer)->Start(progress->get()).ok());
  auto channel = (*writer)->Open(run.meta, /*restored=*/true);
  // A snapshot through step 12 would hide steps 11 and 12 from the writer: refused.
  CHECK(channel->AcceptsRestoreThrough(10));
  CHECK_FALSE(channel->AcceptsRestoreThrough(12));
  run.Open(*channel);
  for (uint64_t step = 1; step <= 15; ++step) run.Step(*channel, step, 1.8e9 + step, /*restored=*/true);
  for (uint64_t step = 16; step <= 17; ++step) run.Step(*channel, step, 1.8e9 + step);
  REQUIRE((*writer)->Drain(30s));
  std::vector<double> steps;
  const auto accepted = Accepted(receiver);
  for (const auto& [ts, v] : accepted.at("__name__=gradwatch_total_grad_norm,run=r1")) steps.push_back(v);
  std::vector<double> expected;
  for (int s = 1; s <= 17; ++s) expected.push_back(s);
  CHECK(steps == expected);
  CHECK((*progress)->Load("tsdb")->at("r1") == 18);

  // A rewind to step 8: a restart sends the new branch from step 8 on.
  channel->OnRewind(8, 1.8e9 + 20);
  channel->Deliver();
  REQUIRE((*writer)->Drain(30s));
  CHECK((*progress)->Load("tsdb")->at("r1") == 8);
}

}  // namespace
}  // namespace gradwatch::exporter
