// Load: the real gradwatchd takes 1,024 concurrent rank streams (4 runs of world size 256) while
// /metrics is scraped and Query answers, with no error, every step acked, its memory bounded and
// the whole within a time bound on a busy 2-core machine.
//
// The streams share one channel (one HTTP/2 connection) and are callback reactors, so the test
// needs neither a thread nor a file descriptor per stream; the daemon serves them on gRPC's
// callback thread pool, likewise without a thread per stream.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/support/latch.h"

using namespace gradwatch;
using namespace gradwatch::testing;

namespace {

constexpr uint32_t kRuns = 4;
constexpr uint32_t kWorldSize = 256;  // ranks per run: 1,024 streams in all
constexpr uint64_t kSteps = 200;      // steps 1..kSteps from every rank
constexpr auto kTimeLimit = std::chrono::seconds(60);
// The daemon's resident memory must stay below this (it peaked at 73 MiB on a 2-core machine); not
// checked in a sanitizer build.
constexpr uint64_t kRssLimitBytes = 512ull << 20;

const std::vector<std::pair<std::string, v1::ParamKind>> kCatalog = {
    {"final_norm.weight", v1::PARAM_KIND_NORM_GAIN},
    {"lm_head.weight", v1::PARAM_KIND_OUTPUT},
    {"layers.0.attn.weight", v1::PARAM_KIND_ATTENTION},
    {"layers.0.mlp.weight", v1::PARAM_KIND_MLP},
};

// One rank: Hello, then steps 1..kSteps one write at a time; half-closes once the last step is
// acked as durable, and counts down `done` when the call ends.
class RankStream final : public grpc::ClientBidiReactor<v1::TrainerMessage, v1::DaemonMessage> {
 public:
  RankStream(v1::Ingest::Stub* stub, const std::string& run, uint32_t rank, Latch* done) : rank_(rank), done_(done) {
    *out_.mutable_hello() = MakeHello(run, rank, kWorldSize, kCatalog);
    stub->async()->Stream(&context_, this);
    StartRead(&in_);
    StartWrite(&out_);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call broke; OnDone reports its status
    if (next_step_ > kSteps) {
      MaybeWritesDone(/*all_written=*/true, /*all_acked=*/false);
      return;
    }
    out_.Clear();
    out_.set_seq(next_step_);
    v1::StepStats* s = out_.mutable_step();
    s->set_step(next_step_);
    s->set_wall_time(1.7e9 + static_cast<double>(next_step_));
    s->set_loss(3.0 - 1e-3 * static_cast<double>(next_step_));
    s->mutable_total_grad()->set_sq_sum(0.04 / kWorldSize);
    for (uint32_t i = 0; i < kCatalog.size(); ++i) {
      v1::ParamStats* p = s->add_params();
      p->set_index(i);
      p->mutable_grad()->set_sq_sum(0.01 / kWorldSize);
      p->mutable_param()->set_sq_sum(100.0 / kWorldSize);
    }
    written_.store(next_step_);
    ++next_step_;
    StartWrite(&out_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (in_.has_error()) {
      std::lock_guard lock(mu_);
      if (error_.empty()) error_ = in_.error().message();
    } else if (in_.has_ack()) {
      durable_.store(in_.ack().durable_step());
      if (in_.ack().durable_step() >= kSteps) MaybeWritesDone(/*all_written=*/false, /*all_acked=*/true);
    }
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    {
      std::lock_guard lock(mu_);
      status_ = status;
    }
    done_->CountDown();
  }

  void Cancel() { context_.TryCancel(); }
  bool acked() const { return acked_.load(); }
  // Where a stream that has not ended stands: for a load that did not finish in time.
  std::string Progress() const {
    return "rank " + std::to_string(rank_) + ": steps written through " + std::to_string(written_.load()) +
           ", durable through " + std::to_string(durable_.load()) + (acked_ ? ", all acked" : "");
  }
  // Empty when the stream went well; else what went wrong.
  std::string Problem() const {
    std::lock_guard lock(mu_);
    if (!error_.empty()) return "rank " + std::to_string(rank_) + ": error " + error_;
    if (!status_.ok()) return "rank " + std::to_string(rank_) + ": status " + status_.error_message();
    if (!acked_) return "rank " + std::to_string(rank_) + ": last step not acked";
    return {};
  }

 private:
  // Half-closes once every step is written and the last is acked (one write at a time: never
  // while a step write is outstanding).
  void MaybeWritesDone(bool all_written, bool all_acked) {
    bool start = false;
    {
      std::lock_guard lock(mu_);
      all_written_ = all_written_ || all_written;
      if (all_acked) acked_ = true;
      if (all_written_ && acked_ && !writes_done_) start = writes_done_ = true;
    }
    if (start) StartWritesDone();
  }

  const uint32_t rank_;
  Latch* const done_;
  grpc::ClientContext context_;
  v1::TrainerMessage out_;  // write path only
  v1::DaemonMessage in_;    // read path only
  uint64_t next_step_ = 1;  // write path only

  mutable std::mutex mu_;
  bool all_written_ = false;  // guarded by mu_
  std::atomic<bool> acked_{false};
  std::atomic<uint64_t> written_{0};  // the last step written (its write started)
  std::atomic<uint64_t> durable_{0};  // the last durable step acked
  bool writes_done_ = false;          // guarded by mu_
  std::string error_;                 // guarded by mu_: the first error the daemon sent
  grpc::Status status_;               // guarded by mu_
};

struct ProcessUsage {
  uint64_t rss_bytes = 0;
  uint64_t threads = 0;
  uint64_t open_fds = 0;
};

ProcessUsage ReadUsage(pid_t pid) {
  ProcessUsage usage;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      status >> usage.rss_bytes;
      usage.rss_bytes *= 1024;
    } else if (key == "Threads:") {
      status >> usage.threads;
    }
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++usage.open_fds;
  }
  return usage;
}

}  // namespace

TEST_CASE("1,024 concurrent rank streams are all acked while /metrics and Query are busy", "[integration][load]") {
  DaemonProcess daemon(DaemonOptions{.config_yaml = "log: {format: text, level: info}\n"});
  const auto start = std::chrono::steady_clock::now();

  auto channel = grpc::CreateChannel(daemon.grpc_target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Ingest::NewStub(channel);
  Latch done(kRuns * kWorldSize);
  std::vector<std::unique_ptr<RankStream>> streams;
  streams.reserve(kRuns * kWorldSize);
  for (uint32_t run = 0; run < kRuns; ++run) {
    for (uint32_t rank = 0; rank < kWorldSize; ++rank) {
      streams.push_back(std::make_unique<RankStream>(stub.get(), "load-" + std::to_string(run), rank, &done));
    }
  }

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> scrapes{0}, queries{0};
  std::mutex failures_mu;
  std::vector<std::string> failures;
  auto fail = [&](std::string what) {
    std::lock_guard lock(failures_mu);
    failures.push_back(std::move(what));
  };
  ProcessUsage peak;
  std::thread scraper([&] {
    while (!stop) {
      try {
        const std::vector<MetricSample> samples = ParseExposition(daemon.ScrapeMetrics());
        if (samples.empty()) fail("an empty scrape");
        ++scrapes;
      } catch (const std::exception& e) {
        fail(std::string("scrape: ") + e.what());
      }
      const ProcessUsage now = ReadUsage(daemon.pid());
      peak.rss_bytes = std::max(peak.rss_bytes, now.rss_bytes);
      peak.threads = std::max(peak.threads, now.threads);
      peak.open_fds = std::max(peak.open_fds, now.open_fds);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  std::thread querier([&] {
    auto query = v1::Query::NewStub(channel);
    while (!stop) {
      grpc::ClientContext list_ctx;
      list_ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(10)));
      v1::ListRunsResponse runs;
      grpc::Status s = query->ListRuns(&list_ctx, v1::ListRunsRequest(), &runs);
      if (!s.ok()) fail("ListRuns: " + s.error_message());
      grpc::ClientContext get_ctx;
      get_ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(10)));
      v1::GetRunRequest req;
      req.set_run_id("load-" + std::to_string(queries % kRuns));
      v1::RunSummary summary;
      s = query->GetRun(&get_ctx, req, &summary);
      // A run exists once its first Hello is in; until then NOT_FOUND is the right answer.
      if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) fail("GetRun: " + s.error_message());
      ++queries;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });

  const auto time_limit = Scaled(kTimeLimit);
  const bool finished = done.WaitFor(time_limit);
  if (!finished) {
    // What did not finish, and the daemon's last words, before the streams are cancelled.
    size_t unfinished = 0;
    for (size_t i = 0; i < streams.size(); ++i) {
      if (streams[i]->acked()) continue;
      if (unfinished++ < 8) UNSCOPED_INFO("run load-" << i / kWorldSize << " " << streams[i]->Progress());
    }
    UNSCOPED_INFO(unfinished << " of " << streams.size() << " streams without every step acked");
    const std::string log = daemon.LogText();
    UNSCOPED_INFO("the daemon's log, last 4,000 bytes:\n" << log.substr(log.size() > 4000 ? log.size() - 4000 : 0));
    for (auto& s : streams) s->Cancel();
    done.WaitFor(std::chrono::seconds(10));
  }
  stop = true;
  scraper.join();
  querier.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const ProcessUsage end = ReadUsage(daemon.pid());
  peak.rss_bytes = std::max(peak.rss_bytes, end.rss_bytes);

  WARN("load: " << streams.size() << " streams × " << kSteps << " steps in " << seconds << " s; " << scrapes
                << " scrapes, " << queries << " query rounds; daemon peak RSS " << peak.rss_bytes / (1 << 20)
                << " MiB, peak threads " << peak.threads << ", peak open fds " << peak.open_fds);
  REQUIRE(finished);
  size_t problems = 0;
  for (const auto& s : streams) {
    if (std::string p = s->Problem(); !p.empty() && problems++ < 5) UNSCOPED_INFO(p);
  }
  CHECK(problems == 0);
  {
    std::lock_guard lock(failures_mu);
    for (size_t i = 0; i < failures.size() && i < 5; ++i) UNSCOPED_INFO(failures[i]);
    CHECK(failures.empty());
  }
  CHECK(scrapes >= 3);
  CHECK(queries >= 3);
  CHECK(peak.rss_bytes > 0);
#ifndef GRADWATCH_TEST_SANITIZED
  // Not in a sanitizer build: ASan's quarantine and shadow memory and TSan's shadow inflate RSS by
  // several times, so the bound would measure the sanitizer, not the daemon.
  CHECK(peak.rss_bytes < kRssLimitBytes);
#endif
  CHECK(seconds < std::chrono::duration<double>(time_limit).count());

  const std::string metrics = daemon.ScrapeMetrics();
  for (const MetricSample& sample : ParseExposition(metrics)) {
    if (sample.name == "gradwatch_ingest_errors_total") {
      INFO(sample.labels.at("reason"));
      CHECK(sample.value == 0);
    }
  }
  for (uint32_t run = 0; run < kRuns; ++run) {
    auto query = v1::Query::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(10)));
    v1::GetRunRequest req;
    req.set_run_id("load-" + std::to_string(run));
    v1::RunSummary summary;
    REQUIRE(query->GetRun(&ctx, req, &summary).ok());
    CHECK(summary.info().step_count() == kSteps);
  }
}
