#include "client/cli/replay.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "client/cli/daemon_messages.h"
#include "client/cli/format.h"
#include "client/cli/progress.h"
#include "client/cli/signal_watch.h"
#include "gradwatch/monitor.h"
#include "gradwatch/monitor_set.h"
#include "gradwatch/query_client.h"
#include "gradwatch/version.h"

namespace gradwatch::cli {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

constexpr size_t kSkippedInSummary = 5;
// How often what the daemon said (errors, alerts) is printed while the replay runs.
constexpr auto kMessagesInterval = std::chrono::milliseconds(200);
// Steps read from the file ahead of the flow-control window: this many, and this many bytes.
constexpr size_t kReadAheadSteps = 64;
constexpr size_t kReadAheadBytes = 4 << 20;

// Calls fn(line_number, result) for every line that is not blank, allowing a header on the
// first of them, until fn returns false. Returns the number of lines read.
template <typename Fn>
uint64_t ForEachLine(std::istream& in, Fn fn) {
  std::string text;
  uint64_t line_number = 0;
  bool first = true;
  while (std::getline(in, text)) {
    ++line_number;
    LineResult result = ParseReplayLine(text, first);
    if (result.ok() && std::holds_alternative<BlankLine>(*result.line)) continue;
    first = false;
    if (!fn(line_number, result)) break;
  }
  return line_number;
}

}  // namespace

ReplayPlan ScanReplay(std::istream& in) {
  ReplayPlan plan;
  plan.lines = ForEachLine(in, [&plan](uint64_t line_number, LineResult& result) {
    if (!result.ok()) {
      ++plan.bad_line_count;
      if (plan.bad_lines.size() < kMaxBadLinesKept) {
        plan.bad_lines.push_back({line_number, std::move(result.error)});
      }
    } else if (auto* header = std::get_if<HeaderRecord>(&*result.line)) {
      plan.catalog.SetHeader(*header);
      plan.header = std::move(*header);
    } else {
      const auto& record = std::get<StepRecord>(*result.line);
      plan.catalog.AddFrom(record);
      if (record.event) ++plan.events;
      if (!record.catalog_update.empty()) ++plan.catalog_updates;
      if (record.is_step()) {
        ++plan.step_lines;
        plan.step_numbers.push_back(record.step);
      }
    }
    return true;
  });
  return plan;
}

std::string RunIdFromFileName(const std::string& file) {
  std::string stem = std::filesystem::path(file).stem().string();
  for (char& c : stem) {
    const bool allowed =
        std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
    if (!allowed) c = '-';
  }
  if (stem.size() > 128) stem.resize(128);
  return stem;
}

std::string ChooseRunId(const std::string& flag, const ReplayPlan& plan, const std::string& file) {
  if (!flag.empty()) return flag;
  if (plan.header && !plan.header->run.empty()) return plan.header->run;
  std::string stem = RunIdFromFileName(file);
  return stem.empty() ? "replay" : stem;
}

std::optional<uint64_t> ResumeFromStep(const ReplayPlan& plan, const ReplayOptions& options) {
  if (options.resume_from) return options.resume_from;
  if (plan.header) return plan.header->resume_from_step;
  return std::nullopt;
}

v1::Hello BuildHello(const ReplayPlan& plan, const ReplayOptions& options, const std::string& run_id) {
  v1::Hello hello;
  if (const auto resume = ResumeFromStep(plan, options)) hello.set_resume_from_step(*resume);
  hello.set_run_id(run_id);
  hello.set_rank(options.rank);
  hello.set_world_size(options.world_size);
  hello.set_client("gradwatch-cli/" GRADWATCH_CLIENT_VERSION);
  if (plan.header) {
    hello.mutable_labels()->insert(plan.header->labels.begin(), plan.header->labels.end());
    *hello.mutable_config() = plan.header->config;
  }
  for (v1::ParamInfo& p : plan.catalog.Params()) *hello.add_params() = std::move(p);
  return hello;
}

void CountUnackedSteps(const ReplayPlan& plan, ReplaySummary& summary) {
  summary.unacked_steps = 0;
  summary.first_unacked_step.reset();
  summary.last_unacked_step.reset();
  for (const uint64_t step : plan.step_numbers) {
    if (summary.has_acked && step <= summary.last_acked_step) continue;
    ++summary.unacked_steps;
    if (!summary.first_unacked_step || step < *summary.first_unacked_step) summary.first_unacked_step = step;
    if (!summary.last_unacked_step || step > *summary.last_unacked_step) summary.last_unacked_step = step;
  }
}

json ReplaySummaryToJson(const ReplaySummary& s) {
  json skipped = json::array();
  for (const BadLine& b : s.first_skipped) skipped.push_back({{"line", b.line}, {"reason", b.reason}});
  json errors = json::object();
  for (const auto& [reason, count] : s.daemon_errors) errors[reason] = count;
  return {
      {"file", s.file},
      {"run", s.run},
      {"lines", s.lines},
      {"steps_sent", s.steps_sent},
      {"events", s.events_sent},
      {"catalog_updates", s.catalog_updates_sent},
      {"already_held_steps", s.already_held_steps},
      {"resumed_from_step", s.resumed_from_step ? json(*s.resumed_from_step) : json(nullptr)},
      {"skipped_lines", s.skipped_lines},
      {"first_skipped", std::move(skipped)},
      {"daemon_errors", std::move(errors)},
      {"last_acked_step", s.has_acked ? json(s.last_acked_step) : json(nullptr)},
      {"seconds", s.seconds},
      {"steps_per_second", s.seconds > 0 ? s.steps_sent / s.seconds : 0.0},
      {"complete", s.complete},
      {"stopped", s.stopped.empty() ? json(nullptr) : json(s.stopped)},
      {"unacked_steps", s.unacked_steps},
      {"first_unacked_step", s.first_unacked_step ? json(*s.first_unacked_step) : json(nullptr)},
      {"last_unacked_step", s.last_unacked_step ? json(*s.last_unacked_step) : json(nullptr)},
      {"finished", s.finished ? json(*s.finished) : json(nullptr)},
  };
}

namespace {

// Errors that refused something for good: a STORAGE_UNAVAILABLE refusal is retried, and once
// every step is acknowledged it cost nothing.
uint64_t PermanentErrors(const ReplaySummary& s) {
  uint64_t n = 0;
  for (const auto& [reason, count] : s.daemon_errors) {
    if (reason != v1::ErrorReason_Name(v1::ERROR_REASON_STORAGE_UNAVAILABLE)) n += count;
  }
  return n;
}

}  // namespace

std::string FormatReplaySummaryLine(const ReplaySummary& s) {
  std::string line = "replayed " + s.file + " as run " + s.run + ": " + StepCountText(s.steps_sent);
  if (s.already_held_steps > 0) line += " (" + FormatStepCount(s.already_held_steps) + " already held)";
  line +=
      " in " + FormatTimeTaken(s.seconds) + " (" + FormatStepRate(s.seconds > 0 ? s.steps_sent / s.seconds : 0) + ")";
  if (s.complete) {
    line += ", all acknowledged";
  } else {
    // Why, in a word: the report's table and the message on stderr say it in full.
    line += ", " + FormatStepCount(s.unacked_steps) + " not acknowledged" +
            (s.stopped.empty() ? "" : " (" + s.stopped + ")");
  }
  if (s.skipped_lines > 0) {
    line += "; " + FormatStepCount(s.skipped_lines) + (s.skipped_lines == 1 ? " line" : " lines") + " skipped";
  }
  uint64_t errors = 0;
  for (const auto& [reason, count] : s.daemon_errors) errors += count;
  if (errors > 0) {
    const uint64_t retried = errors - PermanentErrors(s);
    line += "; " + FormatStepCount(errors) + (errors == 1 ? " daemon error" : " daemon errors");
    if (retried > 0) line += " (" + FormatStepCount(retried) + " retried: the daemon could not store for a while)";
  }
  return line;
}

std::string FormatReplaySummary(const ReplaySummary& s) {
  std::string skipped = std::to_string(s.skipped_lines) + " skipped";
  if (!s.first_skipped.empty()) {
    skipped += " (line";
    skipped += s.first_skipped.size() > 1 ? "s " : " ";
    for (size_t i = 0; i < s.first_skipped.size(); ++i) {
      skipped += (i ? ", " : "") + std::to_string(s.first_skipped[i].line);
    }
    if (s.skipped_lines > s.first_skipped.size()) skipped += ", ...";
    skipped += ")";
  }
  std::string errors;
  for (const auto& [reason, count] : s.daemon_errors) {
    errors += (errors.empty() ? "" : ", ") + ReasonShortName(reason) + " " + std::to_string(count);
  }
  std::vector<std::vector<std::string>> rows = {
      {"lines", std::to_string(s.lines) + ", " + skipped},
      {"steps sent",
       std::to_string(s.steps_sent) +
           (s.already_held_steps > 0 ? " (" + std::to_string(s.already_held_steps) + " already held)" : "")},
      {"events", std::to_string(s.events_sent)},
      {"catalog updates", std::to_string(s.catalog_updates_sent)},
      {"daemon errors", errors.empty() ? "none" : errors},
      {"last acked step", s.has_acked ? std::to_string(s.last_acked_step) : "none"},
  };
  if (!s.stopped.empty()) {
    std::string unacked = std::to_string(s.unacked_steps);
    if (s.first_unacked_step) {
      unacked +=
          " (steps " + std::to_string(*s.first_unacked_step) + " to " + std::to_string(*s.last_unacked_step) + ")";
    }
    rows.push_back({"stopped", s.stop_detail});
    rows.push_back({"not acked", unacked});
  }
  if (s.resumed_from_step) {
    rows.insert(rows.begin() + 2, {"resumed from", "the checkpoint at step " + std::to_string(*s.resumed_from_step)});
  }
  if (s.finished) rows.push_back({"finished", *s.finished ? "yes (Goodbye acknowledged)" : "no"});
  // The time and the rate are in the first line, which is also the line --json writes to stderr.
  return FormatReplaySummaryLine(s) + "\n" + FormatTable(rows);
}

namespace {

// The replay reads its input twice (the catalog first, then the steps). A regular file is opened
// as it is; anything else ("-" for standard input, a pipe, a FIFO, /dev/stdin) is read once, to its
// end, into an unlinked temporary file, which is then read as the file. False with `why` set when
// the input cannot be opened or copied.
bool OpenReplayInput(const std::string& path, std::ifstream& in, std::string* why) {
  struct stat st {};
  const bool standard_input = path == "-";
  if (!standard_input && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    in.open(path);
    if (!in) *why = std::strerror(errno);
    return static_cast<bool>(in);
  }
  const int from = standard_input ? STDIN_FILENO : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (from < 0) {
    *why = std::strerror(errno);
    return false;
  }
  const char* tmpdir = std::getenv("TMPDIR");
  std::string spool = std::string(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") + "/gradwatch-replay-XXXXXX";
  const int to = ::mkstemp(spool.data());
  bool ok = to >= 0;
  if (!ok) *why = "creating a temporary copy in " + spool + ": " + std::strerror(errno);
  char buffer[1 << 16];
  while (ok) {
    const ssize_t n = ::read(from, buffer, sizeof buffer);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      *why = std::string("reading: ") + std::strerror(errno);
      ok = false;
      break;
    }
    for (ssize_t done = 0; ok && done < n;) {
      const ssize_t w = ::write(to, buffer + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        *why = "writing a temporary copy to " + spool + ": " + std::strerror(errno);
        ok = false;
      } else {
        done += w;
      }
    }
  }
  if (!standard_input) ::close(from);
  if (to >= 0) {
    if (ok) in.open(spool);
    ::close(to);
    ::unlink(spool.c_str());  // the stream keeps the copy open; nothing is left behind
    if (ok && !in) {
      *why = "reopening its temporary copy: " + std::string(std::strerror(errno));
      ok = false;
    }
  }
  return ok;
}

}  // namespace

int RunReplay(const GlobalOptions& global, const ReplayOptions& options, std::ostream& out, std::ostream& err) {
  std::ifstream in;
  if (std::string why; !OpenReplayInput(options.file, in, &why)) {
    err << "gradwatch: cannot open " << options.file << ": " << why << "\n";
    return kExitFailure;
  }
  ReplayPlan plan = ScanReplay(in);
  for (const BadLine& bad : plan.bad_lines) {
    err << options.file << ":" << bad.line << ": " << bad.reason << "; line skipped\n";
  }
  if (plan.bad_line_count > plan.bad_lines.size()) {
    err << options.file << ": " << plan.bad_line_count - plan.bad_lines.size() << " more bad lines not shown\n";
  }
  if (plan.step_lines == 0 && plan.events == 0 && plan.catalog_updates == 0) {
    // An empty or unreadable file must not create an empty run on the daemon.
    err << "gradwatch: " << options.file << " holds no step to replay (" << plan.lines << " lines, "
        << plan.bad_line_count << " skipped); nothing was sent\n";
    return kExitFailure;
  }

  ReplaySummary summary;
  summary.file = options.file;
  summary.run = ChooseRunId(options.run, plan, options.file);
  summary.lines = plan.lines;
  summary.skipped_lines = plan.bad_line_count;
  for (size_t i = 0; i < plan.bad_lines.size() && i < kSkippedInSummary; ++i) {
    summary.first_skipped.push_back(plan.bad_lines[i]);
  }

  // One target per daemon address (--addr a,b sends every step to each: replicas watching one
  // run). Each has its own stream, resume point and summary; a daemon that stops acknowledging
  // gets no more steps while the others go on.
  struct Target {
    std::string address;
    DaemonMessages messages;
    std::mutex accepted_mu;
    std::optional<v1::Accepted> first_accepted;
    std::unique_ptr<client::Monitor> monitor;
    std::optional<uint64_t> resume_after;
    bool lagging = false;  // left behind: not accepted, or stalled
    std::string lag_reason;
    ReplaySummary summary;
    client::MonitorStats stats;
  };
  std::vector<std::string> addresses = client::SplitAddresses(global.address);
  if (addresses.empty()) addresses.push_back(global.address);
  std::vector<std::unique_ptr<Target>> targets;
  for (const std::string& address : addresses) {
    auto t = std::make_unique<Target>();
    t->address = address;
    t->summary = summary;
    client::MonitorOptions monitor_options;
    monitor_options.address = address;
    monitor_options.tls = global.tls;
    monitor_options.hello = BuildHello(plan, options, summary.run);
    // The file is the buffer: the Monitor holds the flow-control window and a little read-ahead,
    // so memory stays bounded whatever the file's size.
    monitor_options.queue_capacity = monitor_options.max_unacked_steps + kReadAheadSteps;
    monitor_options.queue_capacity_bytes = monitor_options.max_unacked_bytes + kReadAheadBytes;
    monitor_options.warnings = false;  // the replay reports a daemon away or refusing in its own words
    Target* raw = t.get();
    monitor_options.on_error = [raw](const v1::Error& e) { raw->messages.AddError(e); };
    monitor_options.on_alert = [raw](const v1::Alert& a) { raw->messages.AddAlert(a); };
    monitor_options.on_accepted = [raw](const v1::Accepted& a) {
      std::lock_guard lock(raw->accepted_mu);
      if (!raw->first_accepted) raw->first_accepted = a;
    };
    t->monitor = std::make_unique<client::Monitor>(std::move(monitor_options));
    targets.push_back(std::move(t));
  }
  const bool several = targets.size() > 1;
  // Messages about one daemon name it when there are several.
  auto at = [several](const Target& t) { return several ? " (daemon " + t.address + ")" : std::string(); };
  // Before the Monitors start their threads, so that they leave SIGINT and SIGTERM to the watch. A
  // signal stops the Monitors: every wait below returns, and the replay reports what was kept.
  SignalWatch signals([&targets](int) {
    for (auto& t : targets) t->monitor->Stop();
  });
  for (auto& t : targets) t->monitor->Start();
  const auto stall_timeout = options.stall_timeout();

  size_t accepted = 0;
  const auto accept_deadline = Clock::now() + global.timeout();
  for (auto& t : targets) {
    const auto left = std::max<Clock::duration>(std::chrono::milliseconds(1), accept_deadline - Clock::now());
    if (t->monitor->WaitAccepted(std::chrono::duration_cast<std::chrono::milliseconds>(left))) {
      ++accepted;
      continue;
    }
    const client::MonitorStats stats = t->monitor->Stats();
    t->lagging = true;
    if (signals.received() != 0) {
      t->lag_reason = "interrupted by " + SignalName(signals.received()) + " before the daemon accepted the stream";
    } else if (stats.rejected) {
      t->lag_reason = "the daemon at " + t->address + " refused run " + summary.run + " rank " +
                      std::to_string(options.rank) + ": " + stats.last_error;
    } else {
      // The Monitor waits for the daemon without failing; a fail-fast call says why it cannot.
      const auto probe = client::QueryClient(t->address, std::chrono::seconds(1), global.tls).ListRuns();
      std::string why = probe.ok() ? stats.last_error : probe.status.error_message();
      t->lag_reason = "cannot reach the daemon at " + t->address + " within " + FormatValue(global.timeout_seconds) +
                      " s" + (why.empty() ? "" : ": " + why);
    }
    t->monitor->Stop();
  }
  if (accepted == 0) {
    for (auto& t : targets) {
      err << "gradwatch: " << t->lag_reason << (signals.received() != 0 ? "; nothing was sent" : "") << "\n";
    }
    return kExitFailure;
  }
  for (auto& t : targets) {
    if (t->lagging) {
      err << "gradwatch: " << t->lag_reason << "; it gets nothing, the other daemons get every step\n";
      continue;
    }
    // The daemon refuses steps older than the last one it received from this rank, so a replay
    // that is run again resumes after it instead of drawing an error for every line. Steps it
    // received but has not committed are not sent again: the Monitor waits for their acks.
    {
      std::lock_guard lock(t->accepted_mu);
      if (t->first_accepted && t->first_accepted->has_received_step()) {
        t->resume_after = t->first_accepted->last_received_step();
      }
    }
    // A resume replaces what the daemon holds from the checkpoint on: those steps are sent again
    // (the daemon has rewound its progress to before the checkpoint; this holds even if it had not).
    t->summary.resumed_from_step = ResumeFromStep(plan, options);
    if (const auto resume = t->summary.resumed_from_step) {
      if (*resume == 0) {
        t->resume_after.reset();
      } else if (t->resume_after) {
        t->resume_after = std::min(*t->resume_after, *resume - 1);
      }
      err << "gradwatch: resuming run " << summary.run << " from the checkpoint at step " << *resume
          << ": the daemon replaces what it held from there on" << at(*t) << "\n";
    }
    if (t->resume_after) {
      err << "gradwatch: the daemon" << (several ? " at " + t->address : std::string()) << " already holds run "
          << summary.run << " rank " << options.rank << " through step " << *t->resume_after
          << "; sending only later steps\n";
    }
  }

  const auto started = Clock::now();
  // The pre-scan counted the file's steps: the progress line has a total, a percentage and an ETA. Every write to
  // `err` from here on goes through progress.Print(), which takes the line off the terminal first.
  ProgressReporter progress(err,
                            {.label = "replay " + summary.run,
                             .total = plan.step_lines,
                             .draw = ShouldDrawProgress(err, options.quiet),
                             .columns = StderrColumns()},
                            started);
  uint64_t steps_read = 0;  // the file's steps handed on (or held by every daemon already)
  auto last_messages = started;
  std::unordered_map<uint64_t, uint64_t> line_of_step;
  std::optional<double> first_timestamp;
  Clock::time_point paced_from;
  auto print_messages = [&] {
    std::ostringstream text;
    for (auto& t : targets) {
      t->messages.Print(several ? options.file + " (" + t->address + ")" : options.file, line_of_step, text);
    }
    if (text.tellp() > 0) progress.Print() << text.str() << std::flush;
  };
  // Hands the record to one daemon; false once that daemon is left behind.
  auto send_to = [&](Target& t, const StepRecord& record) {
    const bool held = t.resume_after && record.step <= *t.resume_after;
    if (held && record.is_step()) ++t.summary.already_held_steps;
    // Events and catalog changes are sent even at steps the daemon holds: it may hold those steps
    // but not the event (refused while its storage failed, say), and it keeps one copy of an event
    // sent twice.
    if (held && !record.event && record.catalog_update.empty()) return true;
    // Both wait for room as long as the daemon keeps acknowledging; they fail once it has
    // acknowledged nothing for the stall timeout, or when a signal stopped the Monitor.
    if (record.event) {
      if (!t.monitor->EventBlocking(record.step, *record.event, stall_timeout)) return false;
      ++t.summary.events_sent;
    }
    if (!record.catalog_update.empty()) {
      v1::CatalogUpdate update;
      update.set_from_step(record.step);
      for (const v1::ParamChange& c : record.catalog_update) *update.add_params() = c;
      if (!t.monitor->CatalogUpdateBlocking(std::move(update), stall_timeout)) return false;
      ++t.summary.catalog_updates_sent;
    }
    if (!held && record.is_step()) {
      if (!t.monitor->LogBlocking(ToStepStats(record, plan.catalog), stall_timeout)) return false;
      ++t.summary.steps_sent;
    }
    return true;
  };
  auto send = [&](uint64_t line_number, LineResult& result) {
    if (!result.ok()) return true;
    const auto* record = std::get_if<StepRecord>(&*result.line);
    if (record == nullptr) return true;
    const bool held_everywhere = std::all_of(targets.begin(), targets.end(), [&](const auto& t) {
      return t->lagging || (t->resume_after && record->step <= *t->resume_after);
    });
    if (!held_everywhere && options.speed > 0 && record->timestamp) {
      if (!first_timestamp) {
        first_timestamp = record->timestamp;
        paced_from = Clock::now();
      }
      const double offset = std::max(0.0, (*record->timestamp - *first_timestamp) / options.speed);
      if (!signals.SleepUntil(paced_from +
                              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(offset)))) {
        return false;
      }
    }
    if (record->is_step()) line_of_step[record->step] = line_number;
    size_t going = 0;
    for (auto& t : targets) {
      if (t->lagging) continue;
      if (send_to(*t, *record)) {
        ++going;
        continue;
      }
      if (signals.received() != 0) return false;
      t->lagging = true;
      t->lag_reason = t->monitor->Stats().rejected
                          ? "the daemon at " + t->address + " closed the stream"
                          : "the daemon at " + t->address + " acknowledged nothing for " +
                                FormatValue(options.stall_timeout_seconds) + " s (--stall-timeout)";
      if (several) {
        progress.Print() << "gradwatch: " << t->lag_reason << "; it gets no more steps, the other daemons go on\n";
      }
    }
    if (going == 0) return false;
    if (record->is_step()) ++steps_read;
    const auto now = Clock::now();
    if (now - last_messages >= kMessagesInterval) {
      last_messages = now;
      print_messages();
    }
    progress.Update(now, steps_read);
    return true;
  };
  bool read_everything = true;
  in.clear();
  in.seekg(0);
  ForEachLine(in, [&](uint64_t line_number, LineResult& result) {
    read_everything = send(line_number, result);
    return read_everything;
  });

  for (auto& t : targets) {
    ReplaySummary& ts = t->summary;
    ts.complete = read_everything && !t->lagging && t->monitor->FlushWhileProgressing(stall_timeout);
    if (options.finish) {
      ts.finished =
          ts.complete && t->monitor->Finish(global.timeout(), v1::GOODBYE_REASON_FINISHED, "replayed " + options.file);
    }
    ts.seconds = std::chrono::duration<double>(Clock::now() - started).count();
    t->stats = t->monitor->Stats();
    t->monitor->Stop();
  }
  print_messages();

  bool any_failure = false, any_partial = false;
  size_t complete = 0;
  for (auto& t : targets) {
    ReplaySummary& ts = t->summary;
    const client::MonitorStats& stats = t->stats;
    ts.daemon_errors = stats.errors_by_reason;
    ts.has_acked = stats.has_acked;
    ts.last_acked_step = stats.acked_through_step;
    if (!ts.complete) {
      if (signals.received() != 0) {
        ts.stopped = "interrupted";
        ts.stop_detail = "interrupted by " + SignalName(signals.received());
      } else if (t->lagging && !t->lag_reason.empty()) {
        ts.stopped = stats.rejected ? "rejected" : "stalled";
        ts.stop_detail = t->lag_reason;
      } else if (stats.rejected) {
        ts.stopped = "rejected";
        ts.stop_detail = "the daemon at " + t->address + " closed the stream";
      } else {
        ts.stopped = "stalled";
        ts.stop_detail = "the daemon at " + t->address + " acknowledged nothing for " +
                         FormatValue(options.stall_timeout_seconds) + " s (--stall-timeout)";
      }
      CountUnackedSteps(plan, ts);
    } else {
      ++complete;
    }
  }
  // The text report starts with the summary line; with --json, stdout is the JSON report, and the line for people
  // goes to stderr instead, once, where the progress line was.
  std::string summary_lines;
  for (auto& t : targets) {
    if (!global.json) break;
    summary_lines += (summary_lines.empty() ? "" : "\n") + (several ? "daemon " + t->address + ": " : std::string()) +
                     FormatReplaySummaryLine(t->summary);
  }
  progress.Finish(summary_lines);

  nlohmann::ordered_json json_daemons = nlohmann::ordered_json::array();
  for (auto& t : targets) {
    ReplaySummary& ts = t->summary;
    const client::MonitorStats& stats = t->stats;
    if (global.json) {
      nlohmann::ordered_json j = ReplaySummaryToJson(ts);
      if (several) j["daemon"] = t->address;
      json_daemons.push_back(std::move(j));
    } else {
      if (several) out << "daemon " << t->address << "\n";
      out << FormatReplaySummary(ts);
    }
    if (!ts.complete) {
      err << "gradwatch: " << ts.stop_detail << "; "
          << (ts.has_acked ? "steps through " + std::to_string(ts.last_acked_step) + " are kept; "
                           : "no step was acknowledged; ")
          << ts.unacked_steps << " steps not acknowledged";
      if (ts.first_unacked_step) {
        err << " (" << *ts.first_unacked_step << " to " << *ts.last_unacked_step << ")";
      }
      err << (stats.last_error.empty() ? "" : " (last error: " + stats.last_error + ")")
          << ". Run the same command again to send them: the daemon says what it holds, and only "
             "the rest is sent\n";
      any_failure = true;
    } else if (ts.finished && !*ts.finished) {
      err << "gradwatch: the daemon at " << t->address << " did not confirm the end of run " << ts.run
          << (stats.last_error.empty() ? "" : " (last error: " + stats.last_error + ")") << "\n";
      any_failure = true;
    } else if (ts.skipped_lines > 0 || PermanentErrors(ts) > 0) {
      any_partial = true;  // a retried refusal (the daemon could not store for a while) lost nothing
    }
  }
  if (global.json) out << (several ? json_daemons : json_daemons.front()).dump(2) << "\n";
  // With several daemons, one that holds every step makes the replay a partial success.
  if (any_failure) return several && complete > 0 ? kExitPartial : kExitFailure;
  return any_partial ? kExitPartial : kExitOk;
}

}  // namespace gradwatch::cli
