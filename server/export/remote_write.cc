#include "server/export/remote_write.h"

#include <snappy.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "alerts/notify/http_client.h"
#include "prometheus/remote_write.pb.h"
#include "server/core/thread_name.h"
#include "server/export/text_format.h"
#include "server/store/remote_write_progress.h"

namespace gradwatch::exporter {

namespace {

double WallNow() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// Failures of one outage are logged at its start and then at most this often.
constexpr double kLogEverySeconds = 60;

}  // namespace

// What the writer keeps of a run: the series it sends, with addresses that stay put while
// queued steps point at them, and how far the receiver got.
struct RemoteWriter::RunState {
  std::string run_id;
  std::deque<RemoteSeries> series;  // appended under the run's lock, read by the writer's thread
  RemoteSeries last_step;           // gradwatch_last_step{run}
  uint64_t next_to_send = 0;        // the writer's thread only: every step below it was accepted
};

// One step as queued, or a rewind marker (`rewind`: the run's steps from `step` on are a new
// branch, to be sent again after a restart).
struct RemoteWriter::Step {
  std::shared_ptr<RunState> run;
  uint64_t step = 0;
  bool rewind = false;
  double wall = 0;  // seconds since the Unix epoch
  int64_t timestamp_ms = 0;
  std::vector<std::pair<const RemoteSeries*, double>> samples;
};

RemoteSeries RemoteSeriesFor(const std::string& run_id, const std::string& key, const ParamInfo* param, int field) {
  RemoteSeries s;
  auto name = [&](std::string n) { s.labels.emplace_back("__name__", std::move(n)); };
  if (param != nullptr) {
    static constexpr const char* kNames[kNormFields] = {"gradwatch_grad_norm", "gradwatch_param_norm",
                                                        "gradwatch_update_norm"};
    name(kNames[field]);
    s.labels.emplace_back("group", std::string(param->EffectiveGroup()));
    s.labels.emplace_back("param", param->name);
  } else if (key == keys::kTotalGradNorm) {
    name("gradwatch_total_grad_norm");
  } else if (key == keys::kLoss) {
    name("gradwatch_loss");
  } else if (key == keys::kZLoss) {
    name("gradwatch_z_loss");
  } else if (key == keys::kLearningRate) {
    name("gradwatch_learning_rate");
  } else {
    name("gradwatch_series");
  }
  s.labels.emplace_back("run", run_id);
  if (s.labels.front().second == "gradwatch_series") s.labels.emplace_back("series", key);
  return s;
}

// A run's channel: resolves each series id once to what it is sent as (or to nothing, when the
// receiver's selection leaves it out) and queues each step's samples.
class RemoteWriter::Channel final : public runs::RunChannel {
 public:
  Channel(RemoteWriter* writer, std::shared_ptr<RunState> run, std::optional<uint64_t> next_to_send)
      : writer_(writer), run_(std::move(run)), next_to_send_(next_to_send) {}

  void OnSeries(SeriesId id, const std::string& key) override {
    if (id >= keys_.size()) {
      keys_.resize(id + 1);
      targets_.resize(id + 1, kUnresolved);
    }
    keys_[id] = key;
    targets_[id] = kUnresolved;
  }

  void OnStep(const runs::PublishedStep& p) override {
    const uint64_t step = p.step.step;
    // A restored step goes out only when the receiver had not accepted it before the restart.
    if (p.restored && (!next_to_send_ || step < *next_to_send_)) return;
    Step out;
    out.run = run_;
    out.step = step;
    out.wall = p.step.wall_time > 0 ? p.step.wall_time : p.now;
    int64_t ms = static_cast<int64_t>(std::llround(out.wall * 1000.0));
    if (ms <= last_ms_) ms = last_ms_ + 1;
    last_ms_ = ms;
    out.timestamp_ms = ms;
    out.samples.reserve(p.step.values.size() + 1);
    bool rescanned = false;
    for (const SeriesValue& v : p.step.values) {
      if (v.id >= targets_.size()) continue;
      const RemoteSeries* target = targets_[v.id];
      if (target == kUnresolved) {
        if (!rescanned) {
          MapParamSeries(p.param_series);
          rescanned = true;
        }
        target = targets_[v.id] = Resolve(v.id, p.meta);
      }
      if (target != nullptr) out.samples.emplace_back(target, v.value);
    }
    out.samples.emplace_back(&run_->last_step, static_cast<double>(step));
    writer_->Enqueue(std::move(out));
  }

  void OnRewind(uint64_t from_step, double now) override {
    (void)now;
    if (next_to_send_) next_to_send_ = std::min(*next_to_send_, from_step);
    writer_->Rewind(run_, from_step);
  }

  void OnEnded(bool clean, double now) override {
    (void)clean;
    (void)now;
  }

  void Deliver() override { writer_->Wake(); }

  bool AcceptsRestoreThrough(uint64_t step) override {
    // Restored from a snapshot through `step`, the run would publish no step up to it: fine only
    // when the receiver has them all (or has nothing of this run: it is taken up from now).
    return !next_to_send_ || *next_to_send_ > step;
  }

 private:
  // Marks "not looked at yet"; nullptr is "not sent".
  static inline const RemoteSeries kUnresolvedMark{};
  static inline const RemoteSeries* const kUnresolved = &kUnresolvedMark;

  // Which catalog parameter's norm each series id is, for the ids not resolved yet.
  void MapParamSeries(const std::vector<std::array<SeriesId, kNormFields>>& param_series) {
    param_of_.assign(targets_.size(), {UINT32_MAX, 0});
    for (size_t i = 0; i < param_series.size(); ++i) {
      for (int f = 0; f < kNormFields; ++f) {
        const SeriesId id = param_series[i][f];
        if (id < param_of_.size()) param_of_[id] = {static_cast<uint32_t>(i), f};
      }
    }
  }

  const RemoteSeries* Resolve(SeriesId id, const RunMeta& meta) {
    const std::string& key = keys_[id];
    if (key.empty()) return nullptr;
    const auto& patterns = writer_->options_.series;
    if (!patterns.empty() &&
        std::none_of(patterns.begin(), patterns.end(), [&](const std::string& pat) { return GlobMatches(pat, key); })) {
      return nullptr;
    }
    const ParamInfo* param = nullptr;
    int field = 0;
    if (id < param_of_.size() && param_of_[id].first < meta.params.size()) {
      param = &meta.params[param_of_[id].first];
      field = param_of_[id].second;
    }
    run_->series.push_back(RemoteSeriesFor(run_->run_id, key, param, field));
    return &run_->series.back();
  }

  RemoteWriter* const writer_;
  const std::shared_ptr<RunState> run_;
  std::optional<uint64_t> next_to_send_;  // as loaded at open: restored steps below it were sent
  std::vector<std::string> keys_;         // by series id
  std::vector<const RemoteSeries*> targets_;
  std::vector<std::pair<uint32_t, int>> param_of_;  // by series id: catalog index, norm field
  int64_t last_ms_ = 0;
};

StatusOr<std::unique_ptr<RemoteWriter>> RemoteWriter::Create(RemoteWriteOptions options) {
  if (auto url = notify::ParseUrl(options.url); !url.ok()) {
    return Status::InvalidArgument("remote_write " + options.name + ": url '" + options.url +
                                   "': " + url.status().message());
  }
  notify::HttpClientOptions http_options;
  http_options.timeout = options.timeout;
  http_options.user_agent = "gradwatchd-remote-write/0.1";
  auto http = notify::HttpClient::Create(http_options);
  if (!http.ok()) return Status::InvalidArgument("remote_write " + options.name + ": " + http.status().message());
  options.max_samples_per_send = std::max<size_t>(1, options.max_samples_per_send);
  return std::unique_ptr<RemoteWriter>(new RemoteWriter(std::move(options), std::move(http).value()));
}

RemoteWriter::RemoteWriter(RemoteWriteOptions options, std::unique_ptr<notify::HttpClient> http)
    : options_(std::move(options)), http_(std::move(http)) {}

RemoteWriter::~RemoteWriter() { Stop(); }

Status RemoteWriter::Start(store::RemoteWriteProgress* progress) {
  progress_ = progress;
  std::map<std::string, uint64_t> saved;
  if (progress_ != nullptr) {
    auto loaded = progress_->Load(options_.name);
    if (!loaded.ok()) {
      return Status(loaded.status().code(), "remote_write " + options_.name + ": " + loaded.status().message());
    }
    saved = std::move(loaded).value();
  }
  {
    MutexLock lock(&mu_);
    if (started_) return Status::Ok();
    started_ = true;
    saved_progress_ = std::move(saved);
  }
  thread_ = std::thread([this] {
    NameThisThread("gw-remote-write");
    Loop();
  });
  spdlog::info("remote_write {}: sending to {}{}", options_.name, options_.url,
               options_.series.empty() ? std::string(", every series")
                                       : ", " + std::to_string(options_.series.size()) + " series patterns");
  return Status::Ok();
}

bool RemoteWriter::Drain(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (!stopping_ && !(queue_.empty() && !inflight_)) {
    if (!cv_.WaitUntil(&mu_, deadline)) break;
  }
  return queue_.empty() && !inflight_;
}

void RemoteWriter::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.SignalAll();
  http_->Abort();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<runs::RunChannel> RemoteWriter::Open(const RunMeta& meta, bool restored) {
  auto run = std::make_shared<RunState>();
  run->run_id = meta.run_id;
  run->last_step = RemoteSeries{{{"__name__", "gradwatch_last_step"}, {"run", meta.run_id}}};
  std::optional<uint64_t> next;
  {
    MutexLock lock(&mu_);
    if (auto it = saved_progress_.find(meta.run_id); it != saved_progress_.end()) next = it->second;
  }
  if (!next && !restored && progress_ != nullptr) {
    // A new run: from now on a restart sends what the receiver has not accepted.
    if (Status s = progress_->Save(options_.name, {{meta.run_id, 0}}); s.ok()) {
      next = 0;
      MutexLock lock(&mu_);
      saved_progress_[meta.run_id] = 0;
    } else {
      spdlog::warn("remote_write {}: run {}: cannot save its progress ({}); a restart may skip steps", options_.name,
                   meta.run_id, s.message());
    }
  }
  run->next_to_send = next.value_or(0);
  return std::make_shared<Channel>(this, std::move(run), next);
}

void RemoteWriter::OnRunLeftMemory(const std::string& run_id, double now) {
  (void)run_id;
  (void)now;
}

void RemoteWriter::Enqueue(Step step) {
  MutexLock lock(&mu_);
  queued_samples_ += step.samples.size();
  queue_.push_back(std::move(step));
  if (queued_samples_ <= options_.capacity_samples) return;
  // Full: the oldest steps go (rewind markers stay, in order).
  uint64_t dropped = 0, dropped_steps = 0;
  for (auto it = queue_.begin(); it != queue_.end() && queued_samples_ > options_.capacity_samples;) {
    if (it->rewind || std::next(it) == queue_.end()) {
      ++it;
      continue;
    }
    queued_samples_ -= it->samples.size();
    dropped += it->samples.size();
    ++dropped_steps;
    it = queue_.erase(it);
  }
  stats_.dropped_samples += dropped;
  const double now = WallNow();
  if (now - last_drop_log_ >= kLogEverySeconds) {
    last_drop_log_ = now;
    spdlog::warn(
        "remote_write {}: queue full ({} samples, remote_write.capacity_samples): dropped the oldest {} "
        "steps ({} samples); {} dropped in all",
        options_.name, options_.capacity_samples, dropped_steps, dropped, stats_.dropped_samples);
  }
}

void RemoteWriter::Rewind(const std::shared_ptr<RunState>& run, uint64_t from_step) {
  Step marker;
  marker.run = run;
  marker.step = from_step;
  marker.rewind = true;
  MutexLock lock(&mu_);
  queue_.push_back(std::move(marker));
}

void RemoteWriter::Wake() { cv_.SignalAll(); }  // Drain may wait on cv_ too

void RemoteWriter::Loop() {
  std::vector<Step> batch;
  double failing_since = 0;
  while (true) {
    batch.clear();
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
      if (stopping_) return;
      size_t samples = 0;
      while (!queue_.empty() &&
             (batch.empty() || (!queue_.front().rewind && !batch.front().rewind &&
                                samples + queue_.front().samples.size() <= options_.max_samples_per_send))) {
        samples += queue_.front().samples.size();
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      queued_samples_ -= samples;
      inflight_samples_ = samples;
      inflight_ = true;
      inflight_oldest_wall_ = batch.front().wall;
    }
    if (batch.front().rewind) {
      RunState& run = *batch.front().run;
      if (batch.front().step < run.next_to_send) {
        run.next_to_send = batch.front().step;
        if (progress_ != nullptr) {
          if (Status s = progress_->Save(options_.name, {{run.run_id, run.next_to_send}}); !s.ok()) {
            spdlog::warn("remote_write {}: run {}: cannot save its progress after a rewind: {}", options_.name,
                         run.run_id, s.message());
          }
        }
      }
      {
        MutexLock lock(&mu_);
        inflight_samples_ = 0;
        inflight_ = false;
      }
      cv_.SignalAll();
      continue;
    }
    std::chrono::milliseconds backoff = options_.min_backoff;
    while (!Send(batch)) {
      const double now = WallNow();
      if (failing_since == 0) failing_since = now;
      MutexLock lock(&mu_);
      if (stopping_) return;  // the batch stays unsent
      ++stats_.retried_requests;
      const auto until = std::chrono::steady_clock::now() + backoff;
      while (!stopping_ && cv_.WaitUntil(&mu_, until)) {
      }
      if (stopping_) return;
      backoff = std::min(options_.max_backoff, backoff * 2);
    }
    if (failing_since != 0) {
      {
        MutexLock lock(&mu_);
        last_retry_log_ = 0;
      }
      spdlog::info("remote_write {}: {} accepts samples again after {:.1f} s", options_.name, options_.url,
                   WallNow() - failing_since);
      failing_since = 0;
    }
    SaveProgress(batch);
    {
      MutexLock lock(&mu_);
      inflight_samples_ = 0;
      inflight_ = false;
    }
    cv_.SignalAll();  // Drain
  }
}

bool RemoteWriter::Send(const std::vector<Step>& batch) {
  remote_write::WriteRequest request;
  std::unordered_map<const RemoteSeries*, remote_write::TimeSeries*> by_series;
  uint64_t samples = 0;
  for (const Step& step : batch) {
    for (const auto& [series, value] : step.samples) {
      remote_write::TimeSeries*& ts = by_series[series];
      if (ts == nullptr) {
        ts = request.add_timeseries();
        for (const auto& [name, label_value] : series->labels) {
          remote_write::Label* label = ts->add_labels();
          label->set_name(name);
          label->set_value(label_value);
        }
      }
      remote_write::Sample* sample = ts->add_samples();
      sample->set_value(value);
      sample->set_timestamp_ms(step.timestamp_ms);
      ++samples;
    }
  }
  const std::string raw = request.SerializeAsString();
  std::string body;
  snappy::Compress(raw.data(), raw.size(), &body);
  notify::HttpRequest http_request;
  http_request.method = "POST";
  http_request.url = options_.url;
  http_request.headers = {{"Content-Type", "application/x-protobuf"},
                          {"Content-Encoding", "snappy"},
                          {"X-Prometheus-Remote-Write-Version", "0.1.0"}};
  if (!options_.bearer_token.empty())
    http_request.headers.emplace_back("Authorization", "Bearer " + options_.bearer_token);
  http_request.body = std::move(body);
  const notify::HttpResult result = http_->Send(http_request);
  // Stopping: the batch is not saved as sent, so the next start sends it again.
  if (result.error == notify::HttpResult::Error::kAborted) return false;
  const double now = WallNow();
  MutexLock lock(&mu_);
  ++stats_.sent_requests;
  if (result.has_response() && result.status >= 200 && result.status < 300) {
    stats_.sent_samples += samples;
    return true;
  }
  const bool retry = !result.has_response() || result.status == 429 || result.status >= 500;
  std::string why = result.has_response() ? "HTTP " + std::to_string(result.status) + ": " + result.body.substr(0, 300)
                                          : std::string(notify::HttpErrorName(result.error)) + ": " + result.message;
  while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
  if (retry) {
    if (now - last_retry_log_ >= kLogEverySeconds) {
      last_retry_log_ = now;
      spdlog::warn(
          "remote_write {}: {} did not take {} samples ({}); retrying with back-off, new steps queue "
          "up (at most {} samples)",
          options_.name, options_.url, samples, why, options_.capacity_samples);
    }
    return false;
  }
  stats_.failed_samples += samples;
  spdlog::error("remote_write {}: {} refused {} samples of {} steps for good ({}); they are dropped", options_.name,
                options_.url, samples, batch.size(), why);
  return true;
}

void RemoteWriter::SaveProgress(const std::vector<Step>& batch) {
  std::map<std::string, uint64_t> next;
  for (const Step& step : batch) {
    RunState& run = *step.run;
    if (step.step + 1 > run.next_to_send) run.next_to_send = step.step + 1;
    next[run.run_id] = run.next_to_send;
  }
  if (progress_ == nullptr) return;
  std::vector<std::pair<std::string, uint64_t>> rows(next.begin(), next.end());
  if (Status s = progress_->Save(options_.name, rows); !s.ok()) {
    spdlog::warn("remote_write {}: cannot save its progress ({}); a restart may send some steps again", options_.name,
                 s.message());
  }
}

RemoteWriteStats RemoteWriter::stats(double now) const {
  MutexLock lock(&mu_);
  RemoteWriteStats s = stats_;
  s.queued_samples = queued_samples_ + inflight_samples_;
  double oldest = inflight_samples_ > 0 ? inflight_oldest_wall_ : 0;
  for (const Step& step : queue_) {
    if (step.rewind) continue;
    if (oldest == 0) oldest = step.wall;
    break;
  }
  s.lag_seconds = oldest > 0 ? std::max(0.0, now - oldest) : 0;
  return s;
}

void RemoteWriter::RenderMetrics(const std::vector<const RemoteWriter*>& writers, std::string& out, double now) {
  if (writers.empty()) return;
  std::vector<RemoteWriteStats> stats;
  for (const RemoteWriter* w : writers) stats.push_back(w->stats(now));
  auto family = [&](std::string_view name, std::string_view help, MetricType type, auto field) {
    AppendFamilyHeader(out, name, help, type);
    for (size_t i = 0; i < writers.size(); ++i) {
      AppendSample(out, name, {{"receiver", writers[i]->options().name}}, static_cast<double>(field(stats[i])));
    }
  };
  family("gradwatch_remote_write_samples_sent_total", "Samples a remote-write receiver accepted.", MetricType::kCounter,
         [](const RemoteWriteStats& s) { return s.sent_samples; });
  family("gradwatch_remote_write_samples_failed_total",
         "Samples a remote-write receiver refused for good (HTTP 4xx other than 429); dropped.", MetricType::kCounter,
         [](const RemoteWriteStats& s) { return s.failed_samples; });
  family("gradwatch_remote_write_samples_dropped_total",
         "Samples dropped unsent because the remote-write queue was full (remote_write[].queue_config.capacity).",
         MetricType::kCounter, [](const RemoteWriteStats& s) { return s.dropped_samples; });
  family("gradwatch_remote_write_requests_total", "Remote-write requests made, whatever their outcome.",
         MetricType::kCounter, [](const RemoteWriteStats& s) { return s.sent_requests; });
  family("gradwatch_remote_write_retries_total", "Remote-write requests retried (network failure, HTTP 5xx or 429).",
         MetricType::kCounter, [](const RemoteWriteStats& s) { return s.retried_requests; });
  family("gradwatch_remote_write_queue_samples", "Samples waiting for the remote-write receiver or in flight.",
         MetricType::kGauge, [](const RemoteWriteStats& s) { return s.queued_samples; });
  family("gradwatch_remote_write_lag_seconds",
         "Age of the oldest step not yet accepted by the remote-write receiver (by its wall time); 0 when none.",
         MetricType::kGauge, [](const RemoteWriteStats& s) { return s.lag_seconds; });
}

}  // namespace gradwatch::exporter
