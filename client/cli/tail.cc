#include "client/cli/tail.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <memory>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "client/cli/daemon_messages.h"
#include "client/cli/follow.h"
#include "client/cli/format.h"
#include "client/cli/progress.h"
#include "client/cli/signal_watch.h"
#include "gradwatch/monitor.h"
#include "gradwatch/monitor_set.h"
#include "gradwatch/query_client.h"
#include "gradwatch/version.h"

namespace gradwatch::cli {
namespace {

using json = nlohmann::ordered_json;

constexpr size_t kUnparsedInSummary = 5;
constexpr size_t kUnparsedShown = 100;  // with -v
constexpr size_t kLinesBeforeFormat = 1000;
// Steps held while the daemon is away: a pipe's job is never blocked, what does not fit is dropped
// (counted and reported); a file waits.
constexpr size_t kQueueCapacity = 10'000;
constexpr std::string_view kSkippedTotalKey = "train/skipped_iterations_total";
constexpr std::string_view kSkippedKey = "train/skipped_iterations";
constexpr std::string_view kGradPrefix = "grad/norm/";
constexpr std::string_view kParamPrefix = "params/norm/";
constexpr std::string_view kUpdatePrefix = "updates/norm/";
constexpr std::string_view kRadialPrefix = "updates/radial/";

// A per-parameter key of a JSONL line: its parameter and which value (0-2 its norms, 3 its radial
// update); nullopt for other keys.
std::optional<std::pair<std::string, int>> ParamKey(const std::string& key) {
  const std::pair<std::string_view, int> prefixes[] = {
      {kGradPrefix, 0}, {kParamPrefix, 1}, {kUpdatePrefix, 2}, {kRadialPrefix, 3}};
  for (const auto& [prefix, field] : prefixes) {
    if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0) {
      std::string param = key.substr(prefix.size());
      if (param == "total") return std::nullopt;
      return std::make_pair(std::move(param), field);
    }
  }
  return std::nullopt;
}

// The parameters the job's lines have named so far, in the order they were met: the index of a
// parameter in every step and every daemon's catalog.
struct Catalog {
  std::vector<v1::ParamInfo> params;
  std::unordered_map<std::string, uint32_t> index;

  uint32_t Index(const std::string& name) {
    auto it = index.find(name);
    if (it != index.end()) return it->second;
    const auto i = static_cast<uint32_t>(params.size());
    v1::ParamInfo p;
    p.set_name(name);
    p.set_kind(InferParamKind(name));
    if (p.kind() == v1::PARAM_KIND_NORM_GAIN) p.set_weight_decay(0);
    params.push_back(std::move(p));
    index.emplace(name, i);
    return i;
  }
};

// The stream to one daemon. It is made again (after every step it holds is durable) when the
// catalog grew, since a Hello carries the catalog, and when the job resumed from a checkpoint.
class Sender {
 public:
  Sender(const GlobalOptions& global, const TailOptions& options, std::string address, std::string run,
         const Catalog* catalog, std::function<void(const std::string&)> notice, DaemonMessages* messages)
      : global_(global),
        options_(options),
        address_(std::move(address)),
        run_(std::move(run)),
        catalog_(catalog),
        notice_(std::move(notice)),
        messages_(messages) {}

  ~Sender() { Close(); }

  const std::string& address() const { return address_; }

  // Opens (or reopens) the stream; false with `why` when the daemon refuses the run.
  bool Ensure(std::optional<uint64_t> resume_from, std::string* why) {
    const bool catalog_grew = catalog_->params.size() != catalog_sent_;
    if (monitor_ != nullptr && !catalog_grew && !resume_from) return true;
    Close();
    catalog_sent_ = catalog_->params.size();
    client::MonitorOptions mo;
    mo.address = address_;
    mo.tls = global_.tls;
    mo.queue_capacity = kQueueCapacity;
    mo.warnings = false;  // the tail reports a daemon away or refusing in its own words
    v1::Hello& hello = mo.hello;
    hello.set_run_id(run_);
    hello.set_rank(options_.rank);
    hello.set_world_size(options_.world_size);
    hello.set_client("gradwatch-tail/" GRADWATCH_CLIENT_VERSION);
    if (resume_from) hello.set_resume_from_step(*resume_from);
    for (const v1::ParamInfo& p : catalog_->params) *hello.add_params() = p;
    mo.on_error = [this](const v1::Error& e) { messages_->AddError(e); };
    mo.on_alert = [this](const v1::Alert& a) { messages_->AddAlert(a); };
    mo.on_accepted = [this](const v1::Accepted& a) {
      if (a.has_received_step()) last_received_.store(a.last_received_step() + 1);
    };
    monitor_ = std::make_unique<client::Monitor>(std::move(mo));
    monitor_->Start();
    if (!monitor_->WaitAccepted(global_.timeout())) {
      const client::MonitorStats stats = monitor_->Stats();
      if (stats.rejected) {
        *why = "the daemon at " + address_ + " refused run " + run_ + ": " + stats.last_error;
        Account();
        monitor_->Stop();
        monitor_.reset();
        return false;
      }
      // The Monitor keeps trying in the background: the job's lines are held (a bounded queue
      // for a pipe, the file itself for a file) until the daemon is back.
      notice_("the daemon at " + address_ + " is not reachable yet" +
              (stats.last_error.empty() ? "" : " (" + stats.last_error + ")") + "; steps are sent once it is");
    }
    if (resume_from) {
      held_through_.reset();
      if (*resume_from > 0) held_through_ = *resume_from - 1;
      return true;
    }
    if (const uint64_t r = last_received_.load(); r > 0 && !held_through_) held_through_ = r - 1;
    return true;
  }

  // The step through which the daemon held this rank's steps when the tail started.
  std::optional<uint64_t> held_through() const { return held_through_; }

  // Whether the stream takes another step without dropping one; false also once it was refused.
  bool HasRoom() const {
    const client::MonitorStats now = monitor_->Stats();
    return !now.rejected && now.queued + now.unacked < kQueueCapacity;
  }
  bool Refused() const { return monitor_->Stats().rejected; }

  // Never blocks: a step that does not fit is dropped (counted, and reported to the daemon).
  bool Log(v1::StepStats stats) { return monitor_->Log(std::move(stats)); }
  // A step the tail gave up waiting room for.
  void CountDrop() { ++dropped_; }

  bool Event(uint64_t step, std::string text) { return monitor_->Event(step, std::move(text)); }
  // Waits for room as long as the daemon makes progress (a catalog change is never dropped).
  bool CatalogUpdate(v1::CatalogUpdate update, std::chrono::milliseconds stall) {
    return monitor_->CatalogUpdateBlocking(std::move(update), stall);
  }

  client::Monitor* monitor() { return monitor_.get(); }

  // Waits for every step to be durable (as long as the daemon makes progress), then closes.
  bool Drain(std::chrono::milliseconds stall) {
    if (monitor_ == nullptr) return true;
    const bool ok = monitor_->FlushWhileProgressing(stall);
    Account();
    return ok;
  }

  void Close() {
    if (monitor_ == nullptr) return;
    monitor_->FlushWhileProgressing(options_.stall_timeout_seconds > 0 ? std::chrono::milliseconds(static_cast<int64_t>(
                                                                             options_.stall_timeout_seconds * 1000))
                                                                       : std::chrono::milliseconds(0));
    Account();
    monitor_->Stop();
    monitor_.reset();
  }

  // Totals over every stream this tail opened to the daemon.
  uint64_t dropped() const {
    return dropped_ + (monitor_ && accounted_ != monitor_.get() ? monitor_->Stats().dropped : 0);
  }
  std::map<std::string, uint64_t> errors() const {
    std::map<std::string, uint64_t> all = errors_;
    if (monitor_ && accounted_ != monitor_.get()) {
      for (const auto& [reason, n] : monitor_->Stats().errors_by_reason) all[reason] += n;
    }
    return all;
  }

 private:
  void Account() {
    if (monitor_ == nullptr || accounted_ == monitor_.get()) return;
    accounted_ = monitor_.get();
    const client::MonitorStats stats = monitor_->Stats();
    dropped_ += stats.dropped;
    for (const auto& [reason, n] : stats.errors_by_reason) errors_[reason] += n;
  }

  const GlobalOptions& global_;
  const TailOptions& options_;
  const std::string address_;
  std::string run_;
  const Catalog* catalog_;
  size_t catalog_sent_ = 0;
  std::function<void(const std::string&)> notice_;
  DaemonMessages* messages_;
  std::unique_ptr<client::Monitor> monitor_;
  const client::Monitor* accounted_ = nullptr;
  std::atomic<uint64_t> last_received_{0};  // last received step + 1; 0: none
  std::optional<uint64_t> held_through_;
  uint64_t dropped_ = 0;
  std::map<std::string, uint64_t> errors_;
};

}  // namespace

json TailSummaryToJson(const TailSummary& s) {
  json unparsed = json::array();
  for (const BadLine& b : s.first_unparsed) unparsed.push_back({{"line", b.line}, {"text", b.reason}});
  json errors = json::object();
  for (const auto& [reason, count] : s.daemon_errors) errors[reason] = count;
  return {
      {"file", s.file},
      {"run", s.run},
      {"format", s.format.empty() ? json(nullptr) : json(s.format)},
      {"lines", s.lines},
      {"metric_lines", s.metric_lines},
      {"steps_sent", s.steps_sent},
      {"events", s.events_sent},
      {"catalog_changes", s.catalog_changes_sent},
      {"catalog_changes_refused", s.catalog_changes_refused},
      {"repeated_steps", s.repeated_steps},
      {"already_held_steps", s.already_held_steps},
      {"resumes", s.resumes},
      {"unparsed_lines", s.unparsed_lines},
      {"first_unparsed", std::move(unparsed)},
      {"truncations", s.truncations},
      {"rotations", s.rotations},
      {"dropped_steps", s.dropped_steps},
      {"daemon_errors", std::move(errors)},
      {"last_acked_step", s.has_acked ? json(s.last_acked_step) : json(nullptr)},
      {"seconds", s.seconds},
      {"steps_per_second", s.seconds > 0 ? s.steps_sent / s.seconds : 0.0},
      {"complete", s.complete},
      {"ended", s.ended},
      {"finished", s.finished ? json(*s.finished) : json(nullptr)},
  };
}

std::string FormatTailSummaryLine(const TailSummary& s) {
  std::string line = "followed " + s.file + " as run " + s.run + ": " + StepCountText(s.steps_sent) + " in " +
                     FormatTimeTaken(s.seconds) + " (" + FormatStepRate(s.seconds > 0 ? s.steps_sent / s.seconds : 0) +
                     "), " + (s.complete ? "all acknowledged" : "not all acknowledged");
  uint64_t errors = 0;
  for (const auto& [reason, count] : s.daemon_errors) errors += count;
  if (errors > 0) line += "; " + FormatStepCount(errors) + (errors == 1 ? " daemon error" : " daemon errors");
  if (s.dropped_steps > 0) line += "; " + FormatStepCount(s.dropped_steps) + " dropped";
  return line + "; " + s.ended;
}

std::string FormatTailSummary(const TailSummary& s) {
  std::string errors;
  for (const auto& [reason, count] : s.daemon_errors) {
    errors += (errors.empty() ? "" : ", ") + ReasonShortName(reason) + " " + std::to_string(count);
  }
  std::string unparsed = std::to_string(s.unparsed_lines);
  if (!s.first_unparsed.empty()) {
    unparsed += " (line" + std::string(s.first_unparsed.size() > 1 ? "s " : " ");
    for (size_t i = 0; i < s.first_unparsed.size(); ++i) {
      unparsed += (i ? ", " : "") + std::to_string(s.first_unparsed[i].line);
    }
    unparsed += s.unparsed_lines > s.first_unparsed.size() ? ", ...; -v shows them)" : "; -v shows them)";
  }
  std::string sent = std::to_string(s.steps_sent);
  if (s.repeated_steps > 0) sent += ", " + std::to_string(s.repeated_steps) + " repeated lines sent once";
  if (s.already_held_steps > 0) sent += ", " + std::to_string(s.already_held_steps) + " already held";
  std::vector<std::vector<std::string>> rows = {
      {"format", s.format.empty() ? "none recognised" : s.format},
      {"lines", std::to_string(s.lines) + ", " + std::to_string(s.metric_lines) + " with metrics"},
      {"not parsed", unparsed},
      {"steps sent", sent},
      {"events", std::to_string(s.events_sent)},
      {"catalog changes",
       std::to_string(s.catalog_changes_sent) +
           (s.catalog_changes_refused > 0 ? ", " + std::to_string(s.catalog_changes_refused) + " not sent (printed)"
                                          : "")},
      {"daemon errors", errors.empty() ? "none" : errors},
      {"last acked step", s.has_acked ? std::to_string(s.last_acked_step) : "none"},
      {"ended", s.ended},
  };
  if (s.resumes > 0) rows.push_back({"resumed", std::to_string(s.resumes) + " times from a checkpoint"});
  if (s.rotations + s.truncations > 0) {
    rows.push_back(
        {"file", std::to_string(s.rotations) + " replaced, " + std::to_string(s.truncations) + " truncated"});
  }
  if (s.dropped_steps > 0)
    rows.push_back({"dropped", std::to_string(s.dropped_steps) + " steps (daemon away, queue full)"});
  if (s.finished) rows.push_back({"finished", *s.finished ? "yes (Goodbye acknowledged)" : "no"});
  return FormatTailSummaryLine(s) + "\n" + FormatTable(rows);
}

int RunTail(const GlobalOptions& global, const TailOptions& options, std::ostream& out, std::ostream& err) {
  std::optional<LogFormat> format;
  if (!options.format.empty()) {
    format = ParseLogFormatName(options.format);
    if (!format) {
      err << "gradwatch: unknown --format " << options.format << "\n";
      return kExitUsage;
    }
  }
  TailSummary summary;
  summary.file = options.file;
  summary.run = !options.run.empty() ? options.run : options.file == "-" ? "" : RunIdFromFileName(options.file);
  if (summary.run.empty()) {
    err << "gradwatch: standard input has no name: give the run with --run\n";
    return kExitUsage;
  }
  if (format) summary.format = std::string(LogFormatName(*format));

  // A followed file has no end, so the line has no total: the steps, the rate and the step reached. A job logs every
  // few seconds, so the rate is taken over half a minute rather than a replay's few seconds. Every write to `err`
  // from here on goes through progress.Print(), which takes the line off the terminal first.
  const auto started = std::chrono::steady_clock::now();
  ProgressReporter progress(err,
                            {.label = "tail " + summary.run,
                             .draw = ShouldDrawProgress(err, options.quiet),
                             .columns = StderrColumns(),
                             .rate_window_seconds = 30},
                            started);
  uint64_t steps_read = 0;  // steps handed on (or held by the daemons already), repeats not counted

  std::atomic<int> signalled{0};
  SignalWatch signals([&signalled](int s) { signalled.store(s); });
  const auto keep_waiting = [&] {
    if (signalled.load() != 0) return false;
    if (options.pid > 0 && ::kill(options.pid, 0) != 0 && errno == ESRCH) return false;
    return true;
  };

  LineFollower::Options fo;
  fo.path = options.file;
  fo.notice = [&progress](const std::string& text) { progress.Print() << "gradwatch tail: " << text << "\n"; };
  LineFollower follower(std::move(fo));
  // A file is its own buffer: while no daemon has room, the tail waits rather than drop. A pipe's
  // job is never blocked: what does not fit is dropped, counted and reported.
  const bool blocking = follower.follows_file();

  // One target per daemon address (--addr a,b sends every line to each: replicas watching one
  // run). Each has its own stream, resume point and summary; a daemon that refuses the run gets no
  // more steps while the others go on.
  struct Target {
    std::unique_ptr<Sender> sender;
    DaemonMessages messages;  // its errors and alerts (a page, with its recommendation), shown as they arrive
    TailSummary summary;
    bool connected = false;
    std::string failure;  // set once the daemon refused the run
  };
  Catalog catalog;
  std::vector<std::string> addresses = client::SplitAddresses(global.address);
  if (addresses.empty()) addresses.push_back(global.address);
  const bool several = addresses.size() > 1;
  std::vector<std::unique_ptr<Target>> targets;
  for (const std::string& address : addresses) {
    auto t = std::make_unique<Target>();
    t->sender = std::make_unique<Sender>(
        global, options, address, summary.run, &catalog,
        [&progress](const std::string& text) { progress.Print() << "gradwatch tail: " << text << "\n"; }, &t->messages);
    targets.push_back(std::move(t));
  }
  const auto live = [&targets] {
    return std::any_of(targets.begin(), targets.end(), [](const auto& t) { return t->failure.empty(); });
  };
  const std::unordered_map<uint64_t, uint64_t> no_line_numbers;
  const auto print_messages = [&] {
    std::ostringstream text;
    for (auto& t : targets) {
      t->messages.Print(several ? options.file + " (" + t->sender->address() + ")" : options.file, no_line_numbers,
                        text);
    }
    if (text.tellp() > 0) progress.Print() << text.str() << std::flush;
  };
  // False when no daemon is left; a daemon that refused the run is reported once.
  const auto ensure = [&](Target& t, std::optional<uint64_t> resume) {
    if (!t.failure.empty()) return false;
    if (t.sender->Ensure(resume, &t.failure)) return true;
    if (several) {
      progress.Print() << "gradwatch tail: " << t.failure << "; it gets no more steps, the other daemons go on\n";
    }
    return false;
  };
  const auto stall = std::chrono::milliseconds(static_cast<int64_t>(options.stall_timeout_seconds * 1000));

  std::optional<uint64_t> last_step;      // the last step read (and sent, or held by the daemons)
  std::optional<uint64_t> progress_step;  // HF: the progress bar's count
  std::optional<double> skipped_total;    // DeepSpeed's cumulative count
  uint64_t hf_dicts = 0;
  std::vector<std::pair<std::string, double>> stepless;  // values printed without a step: the next step's
  // The step being read: lines naming the same step (nanoGPT's eval and train lines, every rank's
  // copy of a line) are merged into it. It is sent when a line names another step, or as soon as
  // the input has nothing more for now.
  std::optional<uint64_t> held_step;
  std::vector<std::pair<std::string, double>> held_values;
  double held_time = 0;  // Unix seconds: the step's line's timestamp, or when it was read
  const LogTimeZone zone = ParseLogTimeZone(options.log_tz).value_or(LogTimeZone{});
  std::string line;

  // Sends one step's values to every daemon; false when none is left.
  const auto send_step = [&](uint64_t step, std::vector<std::pair<std::string, double>>& values,
                             double wall_time) -> bool {
    std::optional<uint64_t> resume;
    if (last_step && step <= *last_step) {
      if (step == *last_step) {
        ++summary.repeated_steps;
        return true;
      }
      // The job went back: it resumed from a checkpoint. The daemon replaces what it held from there on.
      resume = step;
      ++summary.resumes;
      progress.Print() << "gradwatch tail: step " << step << " follows step " << *last_step
                       << ": the job resumed from a checkpoint; the daemon replaces its steps from " << step << " on\n";
    }
    v1::StepStats stats;
    stats.set_step(step);
    stats.set_wall_time(wall_time);
    for (auto& [key, value] : values) {
      if (key == "train/loss") {
        stats.set_loss(value);
      } else if (key == "grad/norm/total") {
        stats.mutable_total_grad()->set_norm(value);
      } else if (key == "optim/learning_rate") {
        stats.set_learning_rate(value);
      } else if (key == "train/z_loss") {
        stats.set_z_loss(value);
      } else if (key == kSkippedTotalKey) {
        // DeepSpeed counts skipped steps since the start: the series is per logging interval, as Megatron's.
        const double interval = skipped_total && value >= *skipped_total ? value - *skipped_total : value;
        skipped_total = value;
        (*stats.mutable_extra())[std::string(kSkippedKey)] = interval;
      } else if (auto param = ParamKey(key)) {
        const uint32_t index = catalog.Index(param->first);
        v1::ParamStats* ps = nullptr;
        for (auto& p : *stats.mutable_params()) {
          if (p.index() == index) ps = &p;
        }
        if (ps == nullptr) {
          ps = stats.add_params();
          ps->set_index(index);
        }
        switch (param->second) {
          case 0: ps->mutable_grad()->set_norm(value); break;
          case 1: ps->mutable_param()->set_norm(value); break;
          case 2: ps->mutable_update()->set_norm(value); break;
          default: ps->mutable_radial_update()->set_radial(value); break;
        }
      } else if (key != "train/tokens") {
        (*stats.mutable_extra())[key] = value;
      }
    }
    last_step = step;
    ++steps_read;
    std::vector<Target*> sending;
    for (auto& t : targets) {
      if (!ensure(*t, resume)) continue;
      if (!t->connected) {
        t->connected = true;
        if (const auto held = t->sender->held_through()) {
          progress.Print() << "gradwatch tail: the daemon" << (several ? " at " + t->sender->address() : std::string())
                           << " already holds run " << summary.run << " rank " << options.rank << " through step "
                           << *held << "; sending only later steps\n";
        }
      }
      if (!resume && t->sender->held_through() && step <= *t->sender->held_through()) {
        ++t->summary.already_held_steps;
        continue;
      }
      sending.push_back(t.get());
    }
    if (!live()) return false;
    // A file waits while no daemon has room (a daemon away for long drops steps, counted, while
    // another takes them); given up (the tail stopped), the step is a drop for each.
    while (blocking && !sending.empty() &&
           std::none_of(sending.begin(), sending.end(), [](Target* t) { return t->sender->HasRoom(); })) {
      if (std::all_of(sending.begin(), sending.end(), [](Target* t) { return t->sender->Refused(); })) break;
      if (!keep_waiting()) {
        for (Target* t : sending) t->sender->CountDrop();
        return true;
      }
      progress.Update(std::chrono::steady_clock::now(), steps_read, last_step);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (Target* t : sending) {
      if (t->sender->Log(stats)) ++t->summary.steps_sent;
    }
    return true;
  };

  const auto flush_held = [&]() -> bool {
    if (!held_step) return true;
    const uint64_t step = *held_step;
    held_step.reset();
    return send_step(step, held_values, held_time);
  };
  // Called at every poll while the input has nothing new: the line's rate falls while the job is quiet.
  const auto keep_waiting_after_flush = [&] {
    const bool sent = flush_held();
    print_messages();
    progress.Update(std::chrono::steady_clock::now(), steps_read, last_step);
    return sent && keep_waiting();
  };

  // One cleaned line of a known format; false when no daemon is left.
  const auto handle = [&](uint64_t line_number, const std::string& cleaned) -> bool {
    std::optional<LogRecord> record = ParseLogLine(*format, cleaned);
    if (!record) {
      if (summary.first_unparsed.size() < kUnparsedInSummary) {
        summary.first_unparsed.push_back({line_number, cleaned.substr(0, 200)});
      }
      if (global.verbose && summary.unparsed_lines < kUnparsedShown) {
        progress.Print() << options.file << ":" << line_number << ": not parsed: " << cleaned.substr(0, 200) << "\n";
      }
      ++summary.unparsed_lines;
      return true;
    }
    if (record->progress_step) progress_step = record->progress_step;
    if (record->kind == LogRecord::Kind::kProgress) return true;
    if (!record->catalog_error.empty()) {
      progress.Print() << options.file << ":" << line_number << ": " << record->catalog_error
                       << "; this catalog change is not sent\n";
      ++summary.catalog_changes_refused;
    }
    if (!record->catalog_update.empty() && record->step) {
      // After the steps before it, and known to this tail's catalog: the Hellos of a reconnect
      // carry the new values.
      if (!flush_held()) return false;
      v1::CatalogUpdate update;
      update.set_from_step(*record->step);
      for (const v1::ParamChange& c : record->catalog_update) {
        *update.add_params() = c;
        v1::ParamInfo& p = catalog.params[catalog.Index(c.name())];
        if (c.has_weight_decay()) p.set_weight_decay(c.weight_decay());
        if (c.has_kind()) p.set_kind(c.kind());
        if (c.has_role()) p.set_role(c.role());
        if (c.has_group()) p.set_group(c.group());
      }
      for (auto& t : targets) {
        if (!ensure(*t, std::nullopt)) continue;
        t->connected = true;
        if (t->sender->CatalogUpdate(update, stall)) ++t->summary.catalog_changes_sent;
      }
    }
    if (record->kind == LogRecord::Kind::kCatalog) {
      if (!record->event.empty()) {
        for (auto& t : targets) {
          if (ensure(*t, std::nullopt) && t->sender->Event(*record->step, record->event)) ++t->summary.events_sent;
        }
      }
      return live();
    }
    if (record->kind == LogRecord::Kind::kEvent) {
      const uint64_t at = record->step ? *record->step : held_step ? *held_step : last_step.value_or(0);
      for (auto& t : targets) {
        if (!ensure(*t, std::nullopt)) continue;
        t->connected = true;
        if (t->sender->Event(at, record->event)) ++t->summary.events_sent;
      }
      return live();
    }
    std::optional<uint64_t> step = record->step;
    if (!step && *format == LogFormat::kHfTrainer) {
      ++hf_dicts;
      step = progress_step ? *progress_step : hf_dicts * options.step_interval;
    }
    ++summary.metric_lines;
    if (!step) {
      // Printed without a step (llm.c's "val loss"): it belongs to the step the job prints next.
      stepless.insert(stepless.end(), record->values.begin(), record->values.end());
      return true;
    }
    if (held_step && *held_step == *step) {
      ++summary.repeated_steps;
    } else {
      if (!flush_held()) return false;
      held_step = step;
      held_values.clear();
      held_time =
          LineTime(cleaned, zone)
              .value_or(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    }
    for (auto& value : stepless) record->values.insert(record->values.begin(), std::move(value));
    stepless.clear();
    for (auto& value : record->values) {
      const std::string& key = value.first;
      auto same = std::find_if(held_values.begin(), held_values.end(), [&](const auto& v) { return v.first == key; });
      if (same != held_values.end()) {
        same->second = value.second;
      } else {
        held_values.push_back(std::move(value));
      }
    }
    return true;
  };

  // Lines before the format is known are kept (a bounded number) and read once it is: an
  // overflow printed before the first step line is still an event.
  std::vector<std::pair<uint64_t, std::string>> before_format;
  while (follower.Next(&line, keep_waiting_after_flush)) {
    ++summary.lines;
    std::string cleaned = CleanLogLine(line);
    if (cleaned.empty()) continue;
    if (!format) {
      format = DetectLogFormat(cleaned);
      if (!format) {
        if (before_format.size() < kLinesBeforeFormat) {
          before_format.emplace_back(summary.lines, std::move(cleaned));
        } else {
          ++summary.unparsed_lines;
          if (summary.first_unparsed.size() < kUnparsedInSummary) {
            summary.first_unparsed.push_back({summary.lines, cleaned.substr(0, 200)});
          }
        }
        continue;
      }
      summary.format = std::string(LogFormatName(*format));
      progress.Print() << "gradwatch tail: " << options.file << ":" << summary.lines << ": format " << summary.format
                       << "\n";
      bool ok = true;
      for (const auto& [number, text] : before_format) {
        if (ok) ok = handle(number, text);
      }
      before_format.clear();
      if (!ok) break;
    }
    if (!handle(summary.lines, cleaned)) break;
    print_messages();
    progress.Update(std::chrono::steady_clock::now(), steps_read, last_step);
  }
  // No line was recognised: the lines kept are what was not parsed.
  for (const auto& [number, text] : before_format) {
    ++summary.unparsed_lines;
    if (summary.first_unparsed.size() < kUnparsedInSummary)
      summary.first_unparsed.push_back({number, text.substr(0, 200)});
    if (global.verbose && number <= kUnparsedShown) {
      progress.Print() << options.file << ":" << number << ": not parsed: " << text.substr(0, 200) << "\n";
    }
  }
  if (live()) flush_held();

  const int signal = signalled.load();
  if (signal != 0) {
    summary.ended = SignalName(signal);
  } else if (!live()) {
    summary.ended = "daemon unreachable";
  } else if (options.pid > 0 && follower.follows_file()) {
    summary.ended = "process " + std::to_string(options.pid) + " exited";
  } else {
    summary.ended = "end of input";
  }
  summary.truncations = follower.truncations();
  summary.rotations = follower.rotations();

  // Each daemon's summary: the file's figures, and what this daemon got.
  size_t complete = 0, failed = 0, partial = 0;
  nlohmann::ordered_json json_daemons = nlohmann::ordered_json::array();
  for (auto& t : targets) {
    Sender& sender = *t->sender;
    TailSummary ts = summary;
    ts.steps_sent = t->summary.steps_sent;
    ts.events_sent = t->summary.events_sent;
    ts.catalog_changes_sent = t->summary.catalog_changes_sent;
    ts.already_held_steps = t->summary.already_held_steps;
    ts.complete = t->failure.empty() && sender.Drain(stall);
    if (options.finish && ts.complete && signal == 0 && sender.monitor() != nullptr) {
      ts.finished = sender.monitor()->Finish(global.timeout(), v1::GOODBYE_REASON_FINISHED,
                                             "gradwatch tail: " + summary.ended + " of " + options.file);
    }
    if (client::Monitor* m = sender.monitor()) {
      const client::MonitorStats stats = m->Stats();
      ts.has_acked = stats.has_acked;
      ts.last_acked_step = stats.acked_through_step;
    }
    if (!t->failure.empty()) ts.ended = "daemon unreachable";
    ts.dropped_steps = sender.dropped();
    ts.daemon_errors = sender.errors();
    sender.Close();
    t->summary = std::move(ts);
  }
  print_messages();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // The text report starts with the summary line; with --json, stdout is the JSON report, and the line for people
  // goes to stderr instead, once, where the progress line was.
  std::string summary_lines;
  for (auto& t : targets) {
    t->summary.seconds = seconds;
    if (!global.json) continue;
    summary_lines += (summary_lines.empty() ? "" : "\n") +
                     (several ? "daemon " + t->sender->address() + ": " : std::string()) +
                     FormatTailSummaryLine(t->summary);
  }
  progress.Finish(summary_lines);

  for (auto& t : targets) {
    const TailSummary& ts = t->summary;
    const std::string& address = t->sender->address();
    if (global.json) {
      nlohmann::ordered_json j = TailSummaryToJson(ts);
      if (several) j["daemon"] = address;
      json_daemons.push_back(std::move(j));
    } else {
      if (several) out << "daemon " << address << "\n";
      out << FormatTailSummary(ts);
    }
    if (!t->failure.empty()) {
      err << "gradwatch: " << t->failure << "\n";
      ++failed;
    } else if (!ts.complete) {
      err << "gradwatch: the daemon at " << address << " did not acknowledge every step (last acked: "
          << (ts.has_acked ? std::to_string(ts.last_acked_step) : "none")
          << "); run the same command again: it sends only what the daemon does not hold\n";
      ++failed;
    } else if (ts.finished && !*ts.finished) {
      ++failed;
    } else {
      ++complete;
      if (!ts.daemon_errors.empty() || ts.dropped_steps > 0) ++partial;
    }
  }
  if (global.json) out << (several ? json_daemons : json_daemons.front()).dump(2) << "\n";
  if (summary.format.empty() && std::all_of(targets.begin(), targets.end(), [](const auto& t) {
        return t->summary.steps_sent == 0 && t->summary.events_sent == 0;
      })) {
    err << "gradwatch: no line of " << options.file << " was a metric line of a format gradwatch reads ("
        << summary.lines << " lines); nothing was sent. -v shows the lines; --format names the format\n";
    return kExitFailure;
  }
  // With several daemons, one that holds every step makes the tail a partial success.
  if (failed > 0) return complete > 0 ? kExitPartial : kExitFailure;
  return partial > 0 ? kExitPartial : kExitOk;
}

}  // namespace gradwatch::cli
