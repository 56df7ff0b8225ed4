// gradwatch_bench: measures today's gradwatchd on loopback (see tests/bench/run.sh, which also runs
// the Pushgateway side and prints the table).
//
//   gradwatch_bench [--quick | --smoke] [--only PART]... --json FILE
//
// Parts (--only names them: ingest, ratio, ceilings, alerts, metrics, restart), each against the REAL
// gradwatchd binary started by DaemonProcess, journal on and the default alert rules on unless said
// otherwise:
//  - ingest: runs x ranks x params streamed over gRPC (callback streams on one channel, at most
//    kWindow unacknowledged steps per rank); daemon CPU from /proc/PID/stat, RSS from
//    /proc/PID/status, steps per second, and each step's send-to-ack latency;
//  - ratio: CPU per sample at 10,000 parameters against 1,000 in pairs of runs back to back
//    (RatioPart);
//  - ceilings: parsing the same serialized TrainerMessage frames in a loop, and the same streams
//    against an empty-handler Ingest server (this binary re-executed with --serve-empty) that only
//    answers Accepted and Ack;
//  - alert latency: a threshold rule with for_steps 0 fires on a crafted step; step send to the
//    Alert on the trainer's stream and to the webhook's receipt at a loopback HTTP receiver;
//  - metrics: /metrics time and size at about 10,000 and 100,000 series, plain and gzip-encoded
//    (as Prometheus asks), and ingest ack latency while /metrics is scraped without pause;
//  - with ingest: RSS per series, journal bytes per sample, restart time (SIGTERM, start, ready
//    with the run's durable step back);
//  - restart: the restart time from a large journal (LargeRestartPart).
// --smoke runs every part at toy sizes and fails (exit 1) when a part does not work end to end; it
// asserts no timing. Progress goes to stderr, the figures to the JSON file.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "gradwatch/v1/gradwatch.grpc.pb.h"
#include "server/store/journal.h"
#include "server/store/sqlite.h"
#include "tests/bench/catalog.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/support/latch.h"
#include "tests/support/time_scale.h"
#include "tests/unit/notify/test_receiver.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The start of every benchmarked daemon's config. The assembly timeout is stretched with the
// tests' time scale: in a sanitizer build (the smoke run) 64 slow ranks may outlive the default.
std::string DaemonConfig() {
  return "log: {format: text, level: warn}\nassembly: {timeout_seconds: " +
         std::to_string(static_cast<int>(30 * TimeScale())) + "}\n";
}

constexpr uint64_t kWindow = 16;  // unacknowledged steps a rank may have in flight
constexpr auto kPartTimeout = std::chrono::minutes(10);

void Log(const std::string& text) { std::fprintf(stderr, "[bench] %s\n", text.c_str()); }

[[noreturn]] void Fail(const std::string& text) { throw std::runtime_error(text); }

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// User + system CPU seconds in a /proc stat file (a process's or a thread's), and the name it
// gives; false when the file is gone (a thread that exited).
bool StatCpuSeconds(const std::string& path, double* seconds, std::string* name) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto open = text.find('('), close = text.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open) return false;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  *seconds = ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  if (name != nullptr) *name = text.substr(open + 1, close - open - 1);
  return true;
}

// User + system CPU seconds of a process, from /proc/PID/stat.
double ProcessCpuSeconds(pid_t pid) {
  double seconds = 0;
  if (!StatCpuSeconds("/proc/" + std::to_string(pid) + "/stat", &seconds, nullptr)) {
    Fail("cannot read /proc/" + std::to_string(pid) + "/stat");
  }
  return seconds;
}

// User + system CPU seconds of a process's live threads, summed by thread name (the daemon names
// its own: gw-journal, gw-http, ...; gRPC's are grpcpp_sync_ser, nexting_thread, ...).
std::map<std::string, double> ThreadCpuSecondsByName(pid_t pid) {
  std::map<std::string, double> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    double seconds = 0;
    std::string name;
    if (StatCpuSeconds((entry.path() / "stat").string(), &seconds, &name)) out[name] += seconds;
  }
  return out;
}

// Resident set size of a process in bytes, from VmRSS in /proc/PID/status.
double RssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  }
  Fail("no VmRSS for pid " + std::to_string(pid));
}

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The q-quantile (0..1) of `values` in the unit they are in; 0 when empty.
double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(q * static_cast<double>(values.size())));
  return values[i];
}

// A counter to wait on.
struct Shape {
  uint32_t runs = 1;
  uint32_t ranks = 1;
  uint32_t params = 1000;
  uint64_t steps = 100;
  uint64_t window = kWindow;  // unacknowledged steps a rank may have in flight
  std::string Name() const { return std::to_string(runs) + "x" + std::to_string(ranks) + "x" + std::to_string(params); }
  // Values one rank sends per step: grad and param norm of each parameter, and the total.
  uint64_t SamplesPerMessage() const { return 2ull * params + 1; }
  uint64_t Samples() const { return uint64_t{runs} * ranks * steps * SamplesPerMessage(); }
  uint64_t Series() const { return uint64_t{runs} * SamplesPerMessage(); }
};

// The trainers' hello: the catalog with each parameter's kind and weight decay.
v1::Hello BenchHello(const std::string& run, uint32_t rank, uint32_t world, uint32_t params) {
  const std::vector<bench::BenchParam> catalog = bench::Catalog(params);
  std::vector<std::pair<std::string, v1::ParamKind>> kinds;
  kinds.reserve(catalog.size());
  // The proto's kinds are numbered as ParamKind's (server/ingest/convert.cc relies on it too).
  for (const bench::BenchParam& p : catalog) kinds.emplace_back(p.name, static_cast<v1::ParamKind>(p.kind));
  v1::Hello hello = MakeHello(run, rank, world, kinds);
  for (int i = 0; i < hello.params_size(); ++i) hello.mutable_params(i)->set_weight_decay(catalog[i].weight_decay);
  return hello;
}

// One rank's step message, filled in place for each step (values drift slowly with the step).
void FillStep(v1::TrainerMessage* msg, const Shape& shape, uint64_t step) {
  msg->set_seq(step);
  v1::StepStats* s = msg->mutable_step();
  s->set_step(step);
  s->set_wall_time(1.7e9 + static_cast<double>(step));
  s->set_loss(3.0 - 1e-5 * static_cast<double>(step));
  const double ranks = shape.ranks;
  s->mutable_total_grad()->set_sq_sum((0.09 + 1e-7 * static_cast<double>(step)) / ranks);
  if (s->params_size() != static_cast<int>(shape.params)) {
    s->clear_params();
    for (uint32_t i = 0; i < shape.params; ++i) s->add_params()->set_index(i);
  }
  for (uint32_t i = 0; i < shape.params; ++i) {
    v1::ParamStats* p = s->mutable_params(static_cast<int>(i));
    p->mutable_grad()->set_sq_sum((1e-4 + 1e-9 * static_cast<double>(step % 97)) / ranks);
    p->mutable_param()->set_sq_sum((100.0 + 1e-4 * static_cast<double>(step)) / ranks);
  }
}

// One rank: Hello, then steps 1..steps with at most kWindow unacknowledged; half-closes once the
// last step is acked and counts `done` down when the call ends. Records each step's send-to-ack
// latency (an ack covers every step up to its durable_step).
class RankStream final : public grpc::ClientBidiReactor<v1::TrainerMessage, v1::DaemonMessage> {
 public:
  RankStream(v1::Ingest::Stub* stub, const Shape& shape, const std::string& run, uint32_t rank, Latch* done)
      : shape_(shape), rank_(rank), done_(done), sent_at_(shape.steps + 1) {
    *out_.mutable_hello() = BenchHello(run, rank, shape.ranks, shape.params);
    latencies_us_.reserve(shape.steps);
    stub->async()->Stream(&context_, this);
    StartRead(&in_);
    writing_ = true;
    StartWrite(&out_);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call broke; OnDone reports it
    {
      std::lock_guard lock(mu_);
      writing_ = false;
    }
    Pump();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (in_.has_error()) {
      std::lock_guard lock(mu_);
      if (problem_.empty()) problem_ = "error " + in_.error().message();
    } else if (in_.has_ack()) {
      const auto now = Clock::now();
      std::lock_guard lock(mu_);
      const uint64_t durable = std::min<uint64_t>(in_.ack().durable_step(), next_step_ - 1);
      for (uint64_t s = acked_ + 1; s <= durable; ++s) {
        latencies_us_.push_back(1e6 * Seconds(now - sent_at_[s]));
      }
      acked_ = std::max(acked_, durable);
    }
    Pump();
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    {
      std::lock_guard lock(mu_);
      if (!status.ok() && problem_.empty()) problem_ = "status " + status.error_message();
      if (acked_ < shape_.steps && problem_.empty()) problem_ = "ended before the last step was acked";
    }
    done_->CountDown();
  }

  void Cancel() { context_.TryCancel(); }
  uint64_t Acked() const {
    std::lock_guard lock(mu_);
    return acked_;
  }
  std::string Problem() const {
    std::lock_guard lock(mu_);
    return problem_.empty() ? problem_ : "rank " + std::to_string(rank_) + ": " + problem_;
  }
  std::vector<double> Latencies() const {
    std::lock_guard lock(mu_);
    return latencies_us_;
  }

 private:
  // Starts the next write when none is outstanding and the window allows, or half-closes once
  // every step is acked.
  void Pump() {
    enum { kNothing, kStep, kClose } action = kNothing;
    {
      std::lock_guard lock(mu_);
      if (writing_ || closed_) return;
      if (next_step_ <= shape_.steps && next_step_ <= acked_ + shape_.window) {
        FillStep(&out_, shape_, next_step_);
        sent_at_[next_step_] = Clock::now();
        ++next_step_;
        writing_ = true;
        action = kStep;
      } else if (acked_ >= shape_.steps) {
        closed_ = true;
        action = kClose;
      }
    }
    if (action == kStep) StartWrite(&out_);
    if (action == kClose) StartWritesDone();
  }

  const Shape shape_;
  const uint32_t rank_;
  Latch* const done_;
  grpc::ClientContext context_;
  v1::DaemonMessage in_;  // read path only
  mutable std::mutex mu_;
  v1::TrainerMessage out_;  // guarded by mu_ while filled; owned by the write in flight
  bool writing_ = false;
  bool closed_ = false;
  uint64_t next_step_ = 1;
  uint64_t acked_ = 0;
  std::vector<Clock::time_point> sent_at_;
  std::vector<double> latencies_us_;
  std::string problem_;
};

// The first fifth of a workload's steps is its warm-up (the catalog, the first allocation of
// every series and of its analytics): the rates are of the steps after it, the daemon's steady
// state; the figures with the warm-up are in the JSON too.
constexpr uint64_t kWarmupDivisor = 5;

struct IngestResult {
  Shape shape;
  double wall_s = 0;
  double cpu_s = 0;
  // At the end of the warm-up: CPU, wall time and samples acked so far.
  double warm_cpu_s = 0;
  double warm_wall_s = 0;
  uint64_t warm_samples = 0;
  double rss_before = 0;
  double rss_after = 0;
  std::vector<double> ack_us;
  // The steady state's CPU seconds by thread name (threads alive at the end of the warm-up and at
  // the end of the workload).
  std::map<std::string, double> thread_cpu_s;

  uint64_t SteadySamples() const { return shape.Samples() - warm_samples; }
  double SamplesPerCpuSecond() const {
    return static_cast<double>(SteadySamples()) / std::max(cpu_s - warm_cpu_s, 1e-3);
  }
  double StepsPerSecond() const {
    const double steps =
        static_cast<double>(SteadySamples()) / static_cast<double>(shape.SamplesPerMessage() * shape.ranks);
    return steps / std::max(wall_s - warm_wall_s, 1e-6);
  }
  json ToJson() const {
    return {{"shape", shape.Name()},
            {"runs", shape.runs},
            {"ranks", shape.ranks},
            {"params", shape.params},
            {"steps", shape.steps},
            {"window", shape.window},
            {"series", shape.Series()},
            {"samples", shape.Samples()},
            {"wall_s", wall_s},
            {"server_cpu_s", cpu_s},
            {"warmup_samples", warm_samples},
            {"warmup_server_cpu_s", warm_cpu_s},
            {"samples_per_cpu_s", SamplesPerCpuSecond()},
            {"cpu_ns_per_sample", 1e9 / SamplesPerCpuSecond()},
            {"samples_per_cpu_s_with_warmup", static_cast<double>(shape.Samples()) / std::max(cpu_s, 1e-3)},
            {"steps_per_s", StepsPerSecond()},
            {"rss_before_bytes", rss_before},
            {"rss_after_bytes", rss_after},
            // What the run's series added to the daemon's RSS (a fresh daemon's before the run).
            {"rss_per_series_bytes", (rss_after - rss_before) / static_cast<double>(shape.Series())},
            {"ack_p50_ms", Quantile(ack_us, 0.5) / 1e3},
            {"ack_p99_ms", Quantile(ack_us, 0.99) / 1e3},
            {"steady_thread_cpu_s", thread_cpu_s}};
  }
};

// Streams `shape` to the Ingest service at `target` (runs named <prefix>-<i>) and measures the
// server process `server_pid`. Throws when any stream fails or the whole outlives kPartTimeout.
IngestResult RunIngest(const std::string& target, pid_t server_pid, const Shape& shape, const std::string& prefix) {
  Log("ingest " + shape.Name() + " x " + std::to_string(shape.steps) + " steps -> " + target);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Ingest::NewStub(channel);
  IngestResult result;
  result.shape = shape;
  result.rss_before = RssBytes(server_pid);
  const double cpu0 = ProcessCpuSeconds(server_pid);
  const auto t0 = Clock::now();
  Latch done(size_t{shape.runs} * shape.ranks);
  std::vector<std::unique_ptr<RankStream>> streams;
  for (uint32_t r = 0; r < shape.runs; ++r) {
    for (uint32_t k = 0; k < shape.ranks; ++k) {
      streams.push_back(std::make_unique<RankStream>(stub.get(), shape, prefix + "-" + std::to_string(r), k, &done));
    }
  }
  // The end of the warm-up: every rank has a fifth of its steps acked (polled; an ack covers
  // every step before it, so the samples counted are exactly those processed).
  const uint64_t warm_steps = shape.steps / kWarmupDivisor;
  const auto warm_deadline = Clock::now() + kPartTimeout;
  while (Clock::now() < warm_deadline) {
    uint64_t least = shape.steps;
    uint64_t acked = 0;
    for (const auto& s : streams) {
      least = std::min(least, s->Acked());
      acked += s->Acked();
    }
    if (least >= warm_steps) {
      result.warm_cpu_s = ProcessCpuSeconds(server_pid) - cpu0;
      result.thread_cpu_s = ThreadCpuSecondsByName(server_pid);
      result.warm_wall_s = Seconds(Clock::now() - t0);
      result.warm_samples = acked * shape.SamplesPerMessage();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!done.WaitFor(kPartTimeout)) {
    for (auto& s : streams) s->Cancel();
    done.WaitFor(std::chrono::seconds(30));
    Fail("ingest " + shape.Name() + " did not finish within the time limit");
  }
  result.wall_s = Seconds(Clock::now() - t0);
  result.cpu_s = ProcessCpuSeconds(server_pid) - cpu0;
  {
    std::map<std::string, double> at_warm = std::move(result.thread_cpu_s);
    result.thread_cpu_s = ThreadCpuSecondsByName(server_pid);
    for (auto& [name, seconds] : result.thread_cpu_s) seconds -= at_warm.count(name) ? at_warm[name] : 0.0;
  }
  result.rss_after = RssBytes(server_pid);
  for (auto& s : streams) {
    if (const std::string p = s->Problem(); !p.empty()) Fail("ingest " + shape.Name() + ": " + p);
    const auto l = s->Latencies();
    result.ack_us.insert(result.ack_us.end(), l.begin(), l.end());
  }
  Log("  " + std::to_string(result.SamplesPerCpuSecond()) + " samples per server CPU-second, " +
      std::to_string(result.StepsPerSecond()) + " steps/s");
  return result;
}

// ---- ceilings ---------------------------------------------------------------------------------

json ParseCeiling(const Shape& shape, double min_seconds) {
  v1::TrainerMessage msg;
  FillStep(&msg, shape, 12345);
  const std::string frame = msg.SerializeAsString();
  v1::TrainerMessage parsed;
  uint64_t iterations = 0;
  const double cpu0 = ThreadCpuSeconds();
  double cpu = 0;
  while (iterations < 10'000'000 && cpu < min_seconds) {
    for (int i = 0; i < 64; ++i) {
      if (!parsed.ParseFromString(frame)) Fail("the step frame does not parse");
    }
    iterations += 64;
    cpu = ThreadCpuSeconds() - cpu0;
  }
  if (parsed.step().params_size() != static_cast<int>(shape.params)) Fail("parsed frame lost params");
  const double samples = static_cast<double>(iterations * shape.SamplesPerMessage());
  Log("parse ceiling: " + std::to_string(samples / cpu) + " samples per CPU-second");
  return {{"params", shape.params},
          {"frame_bytes", frame.size()},
          {"frames", iterations},
          {"cpu_s", cpu},
          {"samples_per_cpu_s", samples / cpu}};
}

// The empty-handler server: answers a Hello with Accepted and a step with an Ack of that step.
class EmptyStream final : public grpc::ServerBidiReactor<v1::TrainerMessage, v1::DaemonMessage> {
 public:
  EmptyStream() { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    std::unique_lock lock(mu_);
    if (!ok) {
      reading_done_ = true;
      MaybeFinish(lock);
      return;
    }
    v1::DaemonMessage answer;
    if (in_.has_hello()) {
      answer.mutable_accepted()->set_run_id(in_.hello().run_id());
      answer.mutable_accepted()->set_rank(in_.hello().rank());
    } else if (in_.has_step()) {
      answer.mutable_ack()->set_durable_step(in_.step().step());
      answer.mutable_ack()->set_seq(in_.seq());
    }
    queue_.push_back(std::move(answer));
    if (!writing_) {
      writing_ = true;
      lock.unlock();
      StartWrite(&queue_.front());
    } else {
      lock.unlock();
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    queue_.pop_front();
    if (ok && !queue_.empty()) {
      lock.unlock();
      StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    MaybeFinish(lock);
  }

  void OnDone() override { delete this; }

 private:
  void MaybeFinish(std::unique_lock<std::mutex>& lock) {
    if (!reading_done_ || writing_ || finished_) return;
    finished_ = true;
    lock.unlock();
    Finish(grpc::Status::OK);
  }

  v1::TrainerMessage in_;
  std::mutex mu_;
  std::deque<v1::DaemonMessage> queue_;  // front is being written while writing_
  bool writing_ = false;
  bool reading_done_ = false;
  bool finished_ = false;
};

class EmptyIngest final : public v1::Ingest::CallbackService {
  grpc::ServerBidiReactor<v1::TrainerMessage, v1::DaemonMessage>* Stream(grpc::CallbackServerContext*) override {
    return new EmptyStream;
  }
};

// --serve-empty PORT_FILE: serves the empty handler on a free loopback port, writes the port to
// PORT_FILE and serves until killed.
int ServeEmpty(const std::string& port_file) {
  EmptyIngest service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return 1;
  {
    std::ofstream out(port_file + ".tmp");
    out << port << "\n";
  }
  std::filesystem::rename(port_file + ".tmp", port_file);
  server->Wait();
  return 0;
}

// This binary run with --serve-empty in a child process.
class EmptyServerProcess {
 public:
  EmptyServerProcess() {
    const std::string port_file = (dir_.path() / "port").string();
    pid_ = fork();
    if (pid_ < 0) Fail("fork failed");
    if (pid_ == 0) {
      execl("/proc/self/exe", "gradwatch_bench", "--serve-empty", port_file.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!std::filesystem::exists(port_file)) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        Fail("the empty server exited before it was ready");
      }
      if (Clock::now() > deadline) Fail("the empty server was not ready within 30 s");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::ifstream(port_file) >> port_;
  }
  ~EmptyServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  TempDir dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// ---- alert latency ----------------------------------------------------------------------------

// A synchronous Ingest stream whose reader stamps each answer with its arrival time.
class TimedStream {
 public:
  explicit TimedStream(std::shared_ptr<grpc::Channel> channel) : stub_(v1::Ingest::NewStub(channel)) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    stream_ = stub_->Stream(&context_);
    reader_ = std::thread([this] {
      v1::DaemonMessage msg;
      while (stream_->Read(&msg)) {
        std::lock_guard lock(mu_);
        received_.emplace_back(msg, Clock::now());
        cv_.notify_all();
      }
      std::lock_guard lock(mu_);
      ended_ = true;
      cv_.notify_all();
    });
  }
  ~TimedStream() {
    stream_->WritesDone();
    context_.TryCancel();
    reader_.join();
    stream_->Finish().ok();
  }
  bool Send(const v1::TrainerMessage& msg) { return stream_->Write(msg); }
  // The first answer satisfying `pred` and when it arrived; throws after `timeout`.
  std::pair<v1::DaemonMessage, Clock::time_point> WaitFor(const std::function<bool(const v1::DaemonMessage&)>& pred,
                                                          Clock::duration timeout) {
    std::unique_lock lock(mu_);
    const auto deadline = Clock::now() + timeout;
    size_t checked = 0;
    while (true) {
      for (; checked < received_.size(); ++checked) {
        if (pred(received_[checked].first)) return received_[checked];
      }
      if (ended_) Fail("the stream ended before the awaited answer");
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && checked == received_.size()) {
        Fail("timed out waiting for an answer on the stream");
      }
    }
  }

 private:
  std::unique_ptr<v1::Ingest::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TrainerMessage, v1::DaemonMessage>> stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<v1::DaemonMessage, Clock::time_point>> received_;
  bool ended_ = false;
  std::thread reader_;
};

v1::TrainerMessage TotalStep(uint64_t step, double total) {
  v1::TrainerMessage m;
  m.set_seq(step + 1);
  m.mutable_step()->set_step(step);
  m.mutable_step()->mutable_total_grad()->set_norm(total);
  return m;
}

// `alerts` runs, each: steps 1 and 2 at norm 6 (acked; pending from step 1), then step 3 at norm
// 6, which fires BenchSpike (threshold 5, for_steps 2, a noise-free series). Latency from sending
// step 3 to its FIRING Alert on the stream, and to the webhook request carrying it.
json AlertLatency(uint32_t alerts) {
  Log("alert latency over " + std::to_string(alerts) + " alerts");
  // Keeps connections open between requests, as Go's HTTP servers (Alertmanager's) do.
  notify::testing::TestReceiver::Options keep_alive;
  keep_alive.keep_alive = true;
  notify::testing::TestReceiver receiver(keep_alive);
  TempDir data;
  const std::filesystem::path rules = data.path() / "bench_rules.yaml";
  std::ofstream(rules) << "groups:\n  - name: bench\n    rules:\n      - alert: BenchSpike\n"
                          "        kind: threshold\n        series: grad/norm/total\n        op: \">=\"\n"
                          "        value: 5\n        for_steps: 2\n        labels: {severity: page}\n"
                          "        annotations: {summary: \"spike in {{ run }}\"}\n";
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml = DaemonConfig() + "limits: {max_runs: " + std::to_string(alerts + 16) +
                        "}\nalerts:\n  rule_files: [" + rules.string() +
                        "]\n  receivers:\n    - {type: webhook, name: hook, url: " + receiver.url("/hook") + "}\n";
  DaemonProcess daemon(options);
  auto channel = grpc::CreateChannel(daemon.grpc_target(), grpc::InsecureChannelCredentials());
  std::map<std::string, Clock::time_point> sent_at;
  std::vector<double> stream_us;
  const auto deadline = Clock::now() + kPartTimeout;
  for (uint32_t i = 0; i < alerts && Clock::now() < deadline; ++i) {
    const std::string run = "alert-" + std::to_string(i);
    TimedStream stream(channel);
    v1::TrainerMessage hello;
    *hello.mutable_hello() = MakeHello(run, 0, 1, {});
    if (!stream.Send(hello)) Fail("hello failed");
    for (uint64_t s = 1; s <= 2; ++s) {
      if (!stream.Send(TotalStep(s, 6.0))) Fail("step failed");
    }
    stream.WaitFor([](const v1::DaemonMessage& m) { return m.has_ack() && m.ack().durable_step() >= 2; },
                   std::chrono::seconds(30));
    const auto t0 = Clock::now();
    sent_at[run] = t0;
    if (!stream.Send(TotalStep(3, 6.0))) Fail("step failed");
    const auto [alert, at] = stream.WaitFor(
        [](const v1::DaemonMessage& m) {
          return m.has_alert() && m.alert().name() == "BenchSpike" && m.alert().state() == v1::ALERT_STATE_FIRING;
        },
        std::chrono::seconds(30));
    if (alert.alert().step() != 3) Fail("BenchSpike fired at step " + std::to_string(alert.alert().step()));
    stream_us.push_back(1e6 * Seconds(at - t0));
  }
  if (stream_us.size() < alerts) Fail("alert latency did not finish within the time limit");
  // Every firing alert at the webhook, matched to its run's step 3 by the run label.
  std::map<std::string, double> webhook_us;
  const auto hook_deadline = Clock::now() + std::chrono::seconds(120);
  while (webhook_us.size() < alerts) {
    for (const auto& r : receiver.Delivered()) {
      const json body = json::parse(r.body);
      for (const json& a : body.at("alerts")) {
        const std::string run = a.at("labels").value("run", "");
        if (a.value("status", "") != "firing" || !sent_at.count(run) || webhook_us.count(run)) continue;
        webhook_us[run] = 1e6 * Seconds(r.received_at - sent_at[run]);
      }
    }
    if (webhook_us.size() >= alerts) break;
    if (Clock::now() > hook_deadline) {
      Fail("the webhook got " + std::to_string(webhook_us.size()) + " of " + std::to_string(alerts) + " alerts");
    }
    receiver.WaitForDelivered(receiver.Delivered().size() + 1, std::chrono::seconds(1));
  }
  std::vector<double> hook;
  for (const auto& [run, us] : webhook_us) hook.push_back(us);
  Log("  stream p99 " + std::to_string(Quantile(stream_us, 0.99) / 1e3) + " ms, webhook p99 " +
      std::to_string(Quantile(hook, 0.99) / 1e3) + " ms");
  return {{"alerts", alerts},
          {"stream_p50_ms", Quantile(stream_us, 0.5) / 1e3},
          {"stream_p99_ms", Quantile(stream_us, 0.99) / 1e3},
          {"webhook_p50_ms", Quantile(hook, 0.5) / 1e3},
          {"webhook_p99_ms", Quantile(hook, 0.99) / 1e3},
          {"webhook_requests", receiver.Delivered().size()}};
}

// ---- /metrics ---------------------------------------------------------------------------------

// A scraper as Prometheus's scrape loop is one: it keeps its read buffer from one scrape to the
// next, so what is timed is the daemon's rendering and the transfer, not the client's first
// touch of 50 MB of fresh memory. GET /metrics on loopback, the whole answer read into `buffer`;
// returns the body's size and whether it was gzip-encoded. Throws unless HTTP 200.
struct Scrape {
  size_t body_bytes = 0;
  bool gzip = false;
};
Scrape ScrapeInto(int port, bool gzip, std::string& buffer) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) Fail("socket: " + std::string(std::strerror(errno)));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{120, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    Fail("connect to /metrics: " + std::string(std::strerror(errno)));
  }
  const std::string request = std::string("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n") +
                              (gzip ? "Accept-Encoding: gzip\r\n" : "") + "\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size())) {
    ::close(fd);
    Fail("sending the scrape request failed");
  }
  size_t received = 0;
  for (;;) {
    if (buffer.size() < received + (1 << 20)) buffer.resize(std::max(2 * buffer.size(), received + (size_t{1} << 20)));
    const ssize_t n = ::recv(fd, buffer.data() + received, buffer.size() - received, 0);
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      Fail("reading /metrics: " + std::string(std::strerror(errno)));
    }
    received += static_cast<size_t>(n);
  }
  ::close(fd);
  const std::string_view raw(buffer.data(), received);
  const size_t head_end = raw.find("\r\n\r\n");
  if (head_end == std::string_view::npos || raw.substr(0, 12) != "HTTP/1.1 200") {
    Fail("/metrics answered: " + std::string(raw.substr(0, std::min<size_t>(received, 200))));
  }
  const std::string_view head = raw.substr(0, head_end);
  return {received - head_end - 4, head.find("Content-Encoding: gzip") != std::string_view::npos};
}

// The first scrape at a size is timed on its own: it allocates the exposition's buffers, which
// later scrapes reuse (Prometheus scrapes every 15 s or so: that is the steady state); then
// `count` scrapes each way.
json Scrapes(const DaemonProcess& daemon, int count, uint64_t series) {
  std::vector<double> ms, gzip_ms;
  size_t bytes = 0, gzip_bytes = 0;
  std::string buffer;
  const auto first_t0 = Clock::now();
  ScrapeInto(daemon.metrics_port(), false, buffer);
  const double first_ms = 1e3 * Seconds(Clock::now() - first_t0);
  for (int i = 0; i < count; ++i) {
    const auto t0 = Clock::now();
    bytes = ScrapeInto(daemon.metrics_port(), false, buffer).body_bytes;
    ms.push_back(1e3 * Seconds(Clock::now() - t0));
  }
  const std::string body = HttpGet("127.0.0.1", daemon.metrics_port(), "/metrics", std::chrono::seconds(120));
  const auto lines = static_cast<size_t>(std::count(body.begin(), body.end(), '\n'));
  // As Prometheus asks: it sends Accept-Encoding: gzip.
  for (int i = 0; i < count; ++i) {
    const auto t0 = Clock::now();
    const Scrape r = ScrapeInto(daemon.metrics_port(), true, buffer);
    gzip_ms.push_back(1e3 * Seconds(Clock::now() - t0));
    gzip_bytes = r.gzip ? r.body_bytes : 0;
  }
  Log("  /metrics at " + std::to_string(series) + " series: first " + std::to_string(first_ms) + " ms, then p50 " +
      std::to_string(Quantile(ms, 0.5)) + " ms, " + std::to_string(bytes) + " bytes; gzip p50 " +
      std::to_string(Quantile(gzip_ms, 0.5)) + " ms, " + std::to_string(gzip_bytes) + " bytes");
  return {{"series", series},
          {"scrapes", count},
          {"first_ms", first_ms},
          {"p50_ms", Quantile(ms, 0.5)},
          {"max_ms", Quantile(ms, 1.0)},
          {"bytes", bytes},
          {"lines", lines},
          {"gzip_p50_ms", Quantile(gzip_ms, 0.5)},
          {"gzip_bytes", gzip_bytes},  // 0: the answer was not gzip-encoded
          {"rss_bytes", RssBytes(daemon.pid())}};
}

// Ingest ack latency of a `params`-parameter run, one step in flight (each sent when the one
// before is acked, so the latency is the step's own, not a queue's), while another thread scrapes
// /metrics back to back, or without scrapes when `scrape` is false.
json IngestWhileScraping(const DaemonProcess& daemon, uint32_t params, uint64_t steps, uint64_t series, bool scrape,
                         const std::string& prefix, IngestResult* result) {
  std::atomic<bool> stop{false};
  std::atomic<int> during{0};
  std::string scrape_error;
  std::thread scraper([&] {
    try {
      while (scrape && !stop.load()) {
        HttpGet("127.0.0.1", daemon.metrics_port(), "/metrics", std::chrono::seconds(120));
        ++during;
      }
    } catch (const std::exception& e) {
      scrape_error = e.what();
    }
  });
  try {
    *result = RunIngest(daemon.grpc_target(), daemon.pid(),
                        {.runs = 1, .ranks = 1, .params = params, .steps = steps, .window = 1}, prefix);
  } catch (...) {
    stop = true;
    scraper.join();
    throw;
  }
  stop = true;
  scraper.join();
  if (!scrape_error.empty()) Fail("scrape during ingest: " + scrape_error);
  Log(std::string("  ack p99 ") + (scrape ? "while scraping " : "without scrapes ") + "at " + std::to_string(series) +
      " series: " + std::to_string(Quantile(result->ack_us, 0.99) / 1e3) + " ms");
  return {{"series", series},
          {"scrapes", during.load()},
          {"steps", steps},
          {"ack_p50_ms", Quantile(result->ack_us, 0.5) / 1e3},
          {"ack_p99_ms", Quantile(result->ack_us, 0.99) / 1e3}};
}

// Fills one daemon up to ~10,000 then ~100,000 series (runs of `params` parameters, a few steps
// each, short per-series history so 100,000 series fit in memory), times /metrics at each, and at
// each measures ingest ack latency while another thread scrapes without pause (at the first, also
// without scrapes, for comparison).
json MetricsPart(uint32_t params, uint32_t runs_small, uint32_t runs_large, uint64_t fill_steps, uint64_t probe_steps,
                 int scrapes) {
  DaemonOptions options;
  // Every series on /metrics (by default only the key parameters' are): the scrape's worst case.
  options.config_yaml = DaemonConfig() +
                        "store: {recent_points: 64, history_buckets: 16}\n"
                        "metrics: {params: ['*'], slope_series: ['*'], max_series_per_run: 100000000}\n"
                        "limits: {max_runs: " +
                        std::to_string(runs_large + 16) + "}\n";
  DaemonProcess daemon(options);
  const Shape fill{.runs = runs_small, .ranks = 1, .params = params, .steps = fill_steps};
  RunIngest(daemon.grpc_target(), daemon.pid(), fill, "fill-a");
  json out;
  out["small"] = Scrapes(daemon, scrapes, fill.Series());

  IngestResult idle, probe;
  out["ingest_without_scrapes"] = IngestWhileScraping(daemon, params, probe_steps, fill.Series(), false, "idle", &idle);
  out["ingest_while_scraping"] = IngestWhileScraping(daemon, params, probe_steps, fill.Series(), true, "probe", &probe);

  const Shape more{.runs = runs_large - runs_small, .ranks = 1, .params = params, .steps = fill_steps};
  RunIngest(daemon.grpc_target(), daemon.pid(), more, "fill-b");
  const uint64_t total = fill.Series() + more.Series() + idle.shape.Series() + probe.shape.Series();
  out["large"] = Scrapes(daemon, scrapes, total);
  IngestResult probe_large;
  out["ingest_while_scraping_large"] =
      IngestWhileScraping(daemon, params, probe_steps, total, true, "probe-large", &probe_large);
  return out;
}

// ---- RSS, journal, restart --------------------------------------------------------------------

std::uintmax_t JournalBytes(const std::filesystem::path& dir) {
  std::uintmax_t total = 0;
  for (const char* name : {"journal.db", "journal.db-wal"}) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(dir / name, ec);
    if (!ec) total += size;
  }
  return total;
}

// The 1 x 1 x params workload on a daemon of its own: the ingest figures, RSS per series, journal
// bytes per (assembled) sample after a clean stop, and the restart time to ready with the run back.
json SingleRunPart(const Shape& shape, json* ingest_rows) {
  TempDir data;
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml = DaemonConfig();
  options.ready_timeout = std::chrono::seconds(600);
  std::optional<DaemonProcess> daemon(std::in_place, options);
  const IngestResult r = RunIngest(daemon->grpc_target(), daemon->pid(), shape, "solo");
  ingest_rows->push_back(r.ToJson());
  const int stopped = daemon->Stop(SIGTERM, std::chrono::seconds(120));
  if (stopped != 0) Fail("the daemon exited " + std::to_string(stopped) + " on SIGTERM");
  const std::uintmax_t journal = JournalBytes(data.path());
  const uint64_t journaled_samples = shape.steps * shape.SamplesPerMessage();
  daemon.reset();

  const auto t0 = Clock::now();
  daemon.emplace(options);
  const double restart_s = Seconds(Clock::now() - t0);
  StreamClient check(daemon->grpc_target());
  check.Hello(BenchHello("solo-0", 0, 1, shape.params));
  const v1::Accepted accepted = check.WaitAccepted();
  if (!accepted.has_durable_step() || accepted.last_durable_step() != shape.steps) {
    Fail("after the restart the run's durable step is " + std::to_string(accepted.last_durable_step()));
  }
  check.Close();
  Log("  restart " + std::to_string(restart_s) + " s, journal " + std::to_string(journal) + " bytes");
  return {{"shape", shape.Name()},
          {"steps", shape.steps},
          {"series", shape.Series()},
          {"rss_per_series_bytes", (r.rss_after - r.rss_before) / static_cast<double>(shape.Series())},
          {"rss_bytes", r.rss_after},
          {"journal_bytes", journal},
          {"journal_samples", journaled_samples},
          {"journal_bytes_per_sample", static_cast<double>(journal) / static_cast<double>(journaled_samples)},
          {"restart_s", restart_s}};
}

// CPU per sample at `big_params` parameters against 1,000, in `pairs` pairs of 1 x 1 x N runs back
// to back, each on a fresh daemon as the ingest part's are: this machine's speed shifts by a third
// from one minute to the next (its neighbours' load), which two runs minutes apart read as a change
// of the ratio. The figures are the medians of the pairs' ratios and of each size's rates; every
// pair's figures are in the JSON.
json RatioPart(uint64_t steps, uint32_t big_params, int pairs) {
  json out = {{"steps", steps}, {"big_params", big_params}, {"pairs", json::array()}};
  std::vector<double> ratios, small_rates, big_rates;
  for (int i = 0; i < pairs; ++i) {
    std::vector<double> ns;
    for (const uint32_t params : {1000u, big_params}) {
      DaemonOptions options;
      options.config_yaml = DaemonConfig();
      DaemonProcess daemon(options);
      const Shape shape{.runs = 1, .ranks = 1, .params = params, .steps = steps};
      const IngestResult r = RunIngest(daemon.grpc_target(), daemon.pid(), shape, "ratio");
      (params == 1000u ? small_rates : big_rates).push_back(r.SamplesPerCpuSecond());
      ns.push_back(1e9 / r.SamplesPerCpuSecond());
    }
    ratios.push_back(ns[1] / ns[0]);
    out["pairs"].push_back({{"small_ns_per_sample", ns[0]}, {"big_ns_per_sample", ns[1]}, {"ratio", ratios.back()}});
    Log("  pair " + std::to_string(i + 1) + ": ratio " + std::to_string(ratios.back()));
  }
  const auto [least, most] = std::minmax_element(ratios.begin(), ratios.end());
  out["median_ratio"] = Quantile(ratios, 0.5);
  out["least_ratio"] = *least;
  out["most_ratio"] = *most;
  out["median_small_samples_per_cpu_s"] = Quantile(small_rates, 0.5);
  out["median_big_samples_per_cpu_s"] = Quantile(big_rates, 0.5);
  return out;
}

// Counts what a journal hands out, keeping the series ids and the last step of each run.
struct JournalCounter final : store::JournalVisitor {
  std::map<std::string, std::vector<SeriesId>> series;
  std::map<std::string, uint64_t> last_step;
  uint64_t samples = 0;
  bool OnRun(const RunMeta&, const RunEnd&) override { return true; }
  void OnSeries(const std::string& run_id, SeriesId id, const std::string&) override { series[run_id].push_back(id); }
  void OnRankProgress(const store::RankProgress&) override {}
  void OnStep(const std::string& run_id, const CompletedStep& step) override {
    samples += step.values.size();
    last_step[run_id] = step.step;
  }
  void OnEvent(const std::string&, const EventRecord&) override {}
  void OnRewind(const std::string&, uint64_t) override {}
  void OnRunFailed(const std::string& run_id, const Status& why) override {
    Fail("journal: run " + run_id + " cannot be read: " + why.ToString());
  }
};

// Restart from a large journal: a 1 x 1 x 1,000 run is ingested for a few steps (so that its
// catalog and series are the daemon's own), the daemon stopped, and `extra_steps` more steps of
// every series (float32 norms drifting with 1 % noise, as a trainer sends them) are written
// through the journal's own API, with the rank's progress. Then: journal bytes per sample, the
// time the journal alone takes to read everything back (store::Journal::Load, no daemon), and the
// daemon's start to ready with the run back at its last step.
json LargeRestartPart(uint64_t extra_steps) {
  TempDir data;
  DaemonOptions options;
  options.data_dir = data.path();
  // At info: the snapshot pass logs how long it held the run's lock.
  options.config_yaml = "log: {format: text, level: info}\n";
  options.ready_timeout = std::chrono::seconds(1800);
  const Shape shape{.runs = 1, .ranks = 1, .params = 1000, .steps = 20};
  {
    DaemonProcess daemon(options);
    RunIngest(daemon.grpc_target(), daemon.pid(), shape, "large");
    if (daemon.Stop(SIGTERM, std::chrono::seconds(120)) != 0) Fail("the daemon did not stop cleanly");
  }
  const std::string run = "large-0";
  const std::string path = (data.path() / "journal.db").string();
  uint64_t last = 0;
  std::vector<SeriesId> ids;
  double write_s = 0;
  {
    auto journal = store::Journal::Open({.path = path}, nullptr);
    if (!journal.ok()) Fail("opening the journal: " + journal.status().ToString());
    JournalCounter before;
    if (Status s = (*journal)->Load(before); !s.ok()) Fail("reading the journal: " + s.ToString());
    ids = before.series[run];
    last = before.last_step[run];
    if (ids.empty() || last != shape.steps) Fail("the ingested run is not in the journal as expected");
    Log("writing " + std::to_string(extra_steps) + " steps of " + std::to_string(ids.size()) +
        " series to the journal");
    std::mt19937_64 rng(1);
    std::normal_distribution<double> noise(0.0, 0.01);
    const auto t0 = Clock::now();
    for (uint64_t step = last + 1; step <= last + extra_steps; ++step) {
      store::StepJournalRecord record = (*journal)->AcquireStepRecord();
      record.run_id = run;
      record.step.step = step;
      record.step.wall_time = 1.7e9 + static_cast<double>(step);
      record.step.partial = false;
      record.step.ranks_reported = 1;
      record.step.client_dropped_steps = 0;
      record.step.values.clear();
      for (size_t i = 0; i < ids.size(); ++i) {
        const double norm =
            (1.0 + 0.01 * static_cast<double>(i)) * (1.0 + 1e-6 * static_cast<double>(step)) * (1.0 + noise(rng));
        record.step.values.push_back({ids[i], static_cast<double>(static_cast<float>(norm))});
      }
      record.progress.assign(1, store::RankProgress{run, 0, step, step});
      while ((*journal)->Enqueue(std::move(record)) == 0) {
        if (Status s = (*journal)->Flush(); !s.ok()) Fail("writing the journal: " + s.ToString());
        record = (*journal)->AcquireStepRecord();  // never reached with the default queue
      }
      if (step % 256 == 0) {
        if (Status s = (*journal)->Flush(); !s.ok()) Fail("writing the journal: " + s.ToString());
      }
    }
    if (Status s = (*journal)->Flush(); !s.ok()) Fail("writing the journal: " + s.ToString());
    (*journal)->Stop();
    write_s = Seconds(Clock::now() - t0);
    last += extra_steps;
  }
  {
    // The alert engine of a daemon that journaled these steps would have evaluated them and saved
    // how far (every 200 ms): the restart rebuilds the run, it does not evaluate them all again.
    auto db = store::sqlite::Database::Open(path);
    if (!db.ok()) Fail("opening the journal: " + db.status().ToString());
    if (Status s = db->Exec("INSERT OR REPLACE INTO alert_progress(run, evaluated_step) VALUES('" + run + "', " +
                            std::to_string(last) + ")");
        !s.ok()) {
      Fail("saving the alert progress: " + s.ToString());
    }
  }
  const std::uintmax_t bytes = JournalBytes(data.path());
  double read_s = 0;
  uint64_t samples = 0;
  {
    auto journal = store::Journal::Open({.path = path}, nullptr);
    if (!journal.ok()) Fail("opening the journal: " + journal.status().ToString());
    JournalCounter all;
    const auto t0 = Clock::now();
    if (Status s = (*journal)->Load(all); !s.ok()) Fail("reading the journal: " + s.ToString());
    read_s = Seconds(Clock::now() - t0);
    samples = all.samples;
    if (all.last_step[run] != last) Fail("the journal does not end at step " + std::to_string(last));
  }
  // The snapshot the first daemon wrote at its clean stop covers only its own 20 steps: this
  // restart replays every step written since (as without snapshots), then stops cleanly and
  // snapshots the run through its last step; the next restart loads that snapshot and replays
  // nothing.
  std::filesystem::remove_all(data.path() / "snapshots");
  auto restart = [&](const char* what) {
    const auto t0 = Clock::now();
    DaemonProcess daemon(options);
    StreamClient check(daemon.grpc_target());
    check.Hello(BenchHello(run, 0, 1, shape.params));
    const v1::Accepted accepted = check.WaitAccepted();
    const double seconds = Seconds(Clock::now() - t0);
    if (!accepted.has_durable_step() || accepted.last_durable_step() != last) {
      Fail(std::string("after the restart (") + what + ") the run's durable step is " +
           std::to_string(accepted.last_durable_step()));
    }
    check.Close();
    const auto stop0 = Clock::now();
    if (daemon.Stop(SIGTERM, std::chrono::seconds(600)) != 0) Fail("the daemon did not stop cleanly");
    const double stop_s = Seconds(Clock::now() - stop0);
    // The snapshot pass logs how long it held a run's lock to copy its state.
    double lock_ms = 0;
    const std::string log = daemon.LogText();
    if (const size_t at = log.find("lock held at most "); at != std::string::npos) {
      lock_ms = std::strtod(log.c_str() + at + std::strlen("lock held at most "), nullptr);
    }
    return std::tuple(seconds, stop_s, lock_ms);
  };
  const auto [restart_s, replayed_stop_s, snapshot_lock_ms] = restart("the whole journal replayed");
  std::uintmax_t snapshot_bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(data.path() / "snapshots")) {
    snapshot_bytes += entry.file_size();
  }
  const double snapshot_restart_s = std::get<0>(restart("from the snapshot"));
  Log("  large journal: " + std::to_string(samples) + " samples, " + std::to_string(bytes) + " bytes, read " +
      std::to_string(read_s) + " s, restart " + std::to_string(restart_s) + " s replaying it all, " +
      std::to_string(snapshot_restart_s) + " s from a snapshot of " + std::to_string(snapshot_bytes) +
      " bytes (stop with the snapshot written: " + std::to_string(replayed_stop_s) + " s)");
  return {{"samples", samples},
          {"steps", last},
          {"series", ids.size()},
          {"journal_bytes", bytes},
          {"journal_bytes_per_sample", static_cast<double>(bytes) / static_cast<double>(samples)},
          {"write_s", write_s},
          {"journal_read_s", read_s},
          {"restart_s", restart_s},
          {"snapshot_bytes", snapshot_bytes},
          {"snapshot_stop_s", replayed_stop_s},
          {"snapshot_lock_ms", snapshot_lock_ms},
          {"snapshot_restart_s", snapshot_restart_s}};
}

struct Sizes {
  std::string mode;
  uint64_t solo_steps, wide_steps, mixed_steps, big_steps;
  uint32_t big_params;
  uint32_t alerts;
  uint32_t metrics_params, metrics_runs_small, metrics_runs_large;
  uint64_t metrics_fill_steps, metrics_probe_steps;
  int scrapes;
  double parse_seconds;
  uint64_t ceiling_steps;
  int ratio_pairs;
};

Sizes SizesFor(const std::string& mode) {
  if (mode == "smoke") return {"smoke", 20, 3, 5, 3, 2000, 5, 100, 2, 4, 2, 20, 2, 0.05, 20, 1};
  // The 10,000-parameter run takes as many steps as the 1,000-parameter one: its CPU per sample is
  // compared with that run's, in the same steady state (a param series' 256 recent points full,
  // its oldest points moving into history), and its RSS per series is read there.
  if (mode == "quick") return {"quick", 300, 20, 60, 300, 10000, 200, 1000, 5, 50, 3, 200, 3, 1.0, 3000, 5};
  return {"full", 3000, 200, 500, 3000, 10000, 500, 1000, 5, 50, 5, 1000, 5, 3.0, 20000, 3};
}

// The parts RunAll knows, in the order it runs them.
const std::vector<std::string> kParts = {"ingest", "ratio", "ceilings", "alerts", "metrics", "restart"};

// Runs the parts named in `parts` (every part when empty).
json RunAll(const Sizes& z, const std::vector<std::string>& parts) {
  auto wanted = [&](const std::string& part) {
    return parts.empty() || std::find(parts.begin(), parts.end(), part) != parts.end();
  };
  json out;
  out["mode"] = z.mode;
  if (wanted("ingest")) {
    out["ingest"] = json::array();
    const Shape solo{.runs = 1, .ranks = 1, .params = 1000, .steps = z.solo_steps};
    out["single_run"] = SingleRunPart(solo, &out["ingest"]);
    for (const Shape& shape : {Shape{.runs = 1, .ranks = 64, .params = 1000, .steps = z.wide_steps},
                               Shape{.runs = 8, .ranks = 8, .params = 200, .steps = z.mixed_steps},
                               Shape{.runs = 1, .ranks = 1, .params = z.big_params, .steps = z.big_steps}}) {
      DaemonOptions options;
      options.config_yaml = DaemonConfig();
      DaemonProcess daemon(options);
      out["ingest"].push_back(RunIngest(daemon.grpc_target(), daemon.pid(), shape, "load").ToJson());
    }
  }
  if (wanted("ratio")) out["ratio"] = RatioPart(z.big_steps, z.big_params, z.ratio_pairs);
  if (wanted("ceilings")) {
    const Shape solo{.runs = 1, .ranks = 1, .params = 1000, .steps = z.solo_steps};
    out["parse_ceiling"] = ParseCeiling(solo, z.parse_seconds);
    EmptyServerProcess empty;
    const Shape shape{.runs = 1, .ranks = 1, .params = 1000, .steps = z.ceiling_steps};
    out["empty_stream_ceiling"] = RunIngest(empty.target(), empty.pid(), shape, "empty").ToJson();
  }
  if (wanted("alerts")) out["alert_latency"] = AlertLatency(z.alerts);
  if (wanted("metrics")) {
    out["metrics"] = MetricsPart(z.metrics_params, z.metrics_runs_small, z.metrics_runs_large, z.metrics_fill_steps,
                                 z.metrics_probe_steps, z.scrapes);
  }
  if (wanted("restart")) {
    // 2,001 series a step: about 0.4 M, 20 M and 200 M journaled samples.
    out["large_restart"] = LargeRestartPart(z.mode == "smoke" ? 200 : z.mode == "quick" ? 10000 : 100000);
  }
  return out;
}

int Usage(int code) {
  std::fprintf(code == 0 ? stdout : stderr,
               "Usage: gradwatch_bench [--quick | --smoke] [--only PART]... [--json FILE]\n"
               "Measures the gradwatchd at GRADWATCHD_PATH (see tests/bench/run.sh); figures go to FILE as JSON\n"
               "(stdout without --json), progress to stderr. --smoke: toy sizes, fails unless every part works.\n"
               "--only PART: run only that part (ingest, ratio, ceilings, alerts, metrics, restart; repeatable); the\n"
               "JSON then lacks the others, so tests/bench/report.py cannot print the table from it.\n");
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "full";
  std::string json_path;
  std::vector<std::string> parts;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--serve-empty" && i + 1 < argc) return ServeEmpty(argv[i + 1]);
    if (arg == "--quick") {
      mode = "quick";
    } else if (arg == "--smoke") {
      mode = "smoke";
    } else if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--only" && i + 1 < argc &&
               std::find(kParts.begin(), kParts.end(), argv[i + 1]) != kParts.end()) {
      parts.push_back(argv[++i]);
    } else if (arg == "--help" || arg == "-h") {
      return Usage(0);
    } else {
      return Usage(2);
    }
  }
  signal(SIGPIPE, SIG_IGN);
  try {
    const json out = RunAll(SizesFor(mode), parts);
    if (json_path.empty()) {
      std::printf("%s\n", out.dump(2).c_str());
    } else {
      std::ofstream(json_path) << out.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[bench] FAILED: %s\n", e.what());
    return 1;
  }
  return 0;
}
