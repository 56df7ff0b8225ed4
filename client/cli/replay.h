// `gradwatch replay`: streams a JSONL history to the daemon through a Monitor.
#pragma once

#include <chrono>
#include <cstdint>
#include <istream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "client/cli/options.h"
#include "client/cli/replay_parser.h"
#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

// How long a replay waits without any acknowledgement from the daemon before it gives up.
inline constexpr double kDefaultStallTimeoutSeconds = 60;

struct ReplayOptions {
  std::string file;
  std::string run;   // empty: the header's, else the file's stem
  double speed = 0;  // > 0: pace by _timestamp at this multiple of real time; 0: as fast as acks allow
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // --resume-from: the history resumes the run from its checkpoint at this step; overrides the
  // header's resume_from_step.
  std::optional<uint64_t> resume_from;
  // Once every step is acknowledged, say Goodbye: the daemon records the run as finished.
  bool finish = false;
  // Flow control, not a deadline: the replay waits as long as the daemon keeps acknowledging,
  // and gives up once it has acknowledged nothing for this long (seconds).
  double stall_timeout_seconds = kDefaultStallTimeoutSeconds;
  // --quiet: no progress line on a terminal's stderr (there is none elsewhere).
  bool quiet = false;

  std::chrono::milliseconds stall_timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(stall_timeout_seconds * 1000));
  }
};

struct BadLine {
  uint64_t line = 0;  // 1-based
  std::string reason;
};

// What the pre-scan learns about a file.
struct ReplayPlan {
  std::optional<HeaderRecord> header;
  ReplayCatalog catalog;
  uint64_t lines = 0;       // lines read, blank ones included
  uint64_t step_lines = 0;  // lines that carry metrics
  uint64_t events = 0;
  uint64_t catalog_updates = 0;  // lines with a step's "params"
  // The step number of every line that carries metrics, in file order.
  std::vector<uint64_t> step_numbers;
  uint64_t bad_line_count = 0;
  std::vector<BadLine> bad_lines;  // the first kMaxBadLinesKept
};

inline constexpr size_t kMaxBadLinesKept = 100;

// Reads the whole stream once: header, catalog, counts and bad lines.
ReplayPlan ScanReplay(std::istream& in);

// A file's stem with the characters the daemon does not accept in a run id replaced by '-', at
// most 128 bytes; empty for a name with no stem.
std::string RunIdFromFileName(const std::string& file);

// The run id: `flag` if set, else the header's, else the file's stem with characters the daemon
// does not accept in a run id replaced by '-'.
std::string ChooseRunId(const std::string& flag, const ReplayPlan& plan, const std::string& file);

// The step the replay resumes from: the flag's, else the header's, else none.
std::optional<uint64_t> ResumeFromStep(const ReplayPlan& plan, const ReplayOptions& options);

// The Hello for the replay; carries ResumeFromStep as resume_from_step.
v1::Hello BuildHello(const ReplayPlan& plan, const ReplayOptions& options, const std::string& run_id);

struct ReplaySummary {
  std::string file;
  std::string run;
  uint64_t lines = 0;
  uint64_t steps_sent = 0;
  uint64_t events_sent = 0;
  uint64_t catalog_updates_sent = 0;
  // Steps not sent because the daemon had already received them (a replay run again).
  uint64_t already_held_steps = 0;
  // The checkpoint step this replay resumed the run from, if it did.
  std::optional<uint64_t> resumed_from_step;
  uint64_t skipped_lines = 0;
  std::vector<BadLine> first_skipped;             // a few, for the report
  std::map<std::string, uint64_t> daemon_errors;  // ErrorReason name → count
  bool has_acked = false;
  uint64_t last_acked_step = 0;
  double seconds = 0;
  bool complete = false;  // every sent step acknowledged durable
  // Why the replay stopped before every step was acknowledged: "interrupted" (SIGINT, SIGTERM),
  // "stalled" (nothing acknowledged for the stall timeout), "rejected" (the daemon refused or
  // closed the stream); empty when it did not stop early. stop_detail says it for people.
  std::string stopped;
  std::string stop_detail;
  // The file's steps numbered after the last acknowledged step (all of them when none was): not
  // confirmed kept. A replay run again sends exactly those the daemon does not hold.
  uint64_t unacked_steps = 0;
  std::optional<uint64_t> first_unacked_step;
  std::optional<uint64_t> last_unacked_step;
  // With --finish: whether the daemon recorded the run as finished; nullopt without --finish.
  std::optional<bool> finished;
};

// Fills summary.unacked_steps and the first and last of them from the plan's step numbers and
// the summary's last acknowledged step: the daemon acknowledges a rank's steps in order, so every
// step up to that one is kept, and the steps after it are what a replay run again must send.
void CountUnackedSteps(const ReplayPlan& plan, ReplaySummary& summary);

nlohmann::ordered_json ReplaySummaryToJson(const ReplaySummary& summary);
// The replay in one line: "replayed moe.jsonl as run moe-6b: 30,000 steps in 16.5s (1,818 steps/s), all
// acknowledged", or how many steps were not and why. The text report's first line; with --json, where stdout is the
// JSON report, it goes to stderr.
std::string FormatReplaySummaryLine(const ReplaySummary& summary);
// The text report: FormatReplaySummaryLine, then a table of the details.
std::string FormatReplaySummary(const ReplaySummary& summary);

// Runs the command; returns the process exit code.
int RunReplay(const GlobalOptions& global, const ReplayOptions& options, std::ostream& out, std::ostream& err);

}  // namespace gradwatch::cli
