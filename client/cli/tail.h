// `gradwatch tail`: follows a training job's output (a log file, as `tail -F`, or a pipe) and
// streams the metrics its lines print into a run, for jobs nobody can change.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "client/cli/log_formats.h"
#include "client/cli/options.h"
#include "client/cli/replay.h"

namespace gradwatch::cli {

struct TailOptions {
  std::string file;    // "-": standard input
  std::string run;     // empty: the file's stem
  std::string format;  // empty: detected from the first line that one of the formats reports
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // Hugging Face Trainer dicts print no step: without a progress bar on the same output, the k-th
  // training dict is step k * step_interval (the Trainer's logging_steps).
  uint64_t step_interval = 1;
  // When the input ends (a stream's writer closed it, or --pid exited), say Goodbye: the run is
  // recorded as finished.
  bool finish = false;
  int pid = 0;  // > 0: stop following once this process has exited (as tail --pid)
  double stall_timeout_seconds = kDefaultStallTimeoutSeconds;
  // --quiet: no progress line on a terminal's stderr (there is none elsewhere).
  bool quiet = false;
  // --log-tz: the zone of the lines' timestamps that carry none ("local", "UTC", "+02:00"). A step
  // takes its time from its line (LineTime), else the time the line was read.
  std::string log_tz = "local";
};

struct TailSummary {
  std::string file;
  std::string run;
  std::string format;  // empty when no line was recognised
  uint64_t lines = 0;
  uint64_t metric_lines = 0;  // lines that gave a step
  uint64_t steps_sent = 0;
  uint64_t events_sent = 0;
  uint64_t catalog_changes_sent = 0;     // `"params"` lines: catalog changes from their step on
  uint64_t catalog_changes_refused = 0;  // `"params"` lines that could not be sent (printed)
  uint64_t repeated_steps = 0;           // lines naming a step already read (every rank prints it): merged, sent once
  uint64_t already_held_steps = 0;       // held by the daemon before this tail started
  uint64_t resumes = 0;                  // the step went back: the job resumed from a checkpoint
  uint64_t unparsed_lines = 0;
  std::vector<BadLine> first_unparsed;
  uint64_t truncations = 0;
  uint64_t rotations = 0;
  uint64_t dropped_steps = 0;
  std::map<std::string, uint64_t> daemon_errors;
  bool has_acked = false;
  uint64_t last_acked_step = 0;
  double seconds = 0;     // from the start of the tail to its last acknowledgement
  bool complete = false;  // every step sent was acknowledged durable
  std::string ended;      // "end of input", "SIGTERM", "process N exited"
  std::optional<bool> finished;
};

nlohmann::ordered_json TailSummaryToJson(const TailSummary& summary);
// The tail in one line: "followed job.log as run pretrain-7b: 12,345 steps in 5m 3s (41 steps/s), all
// acknowledged; end of input". The text report's first line; with --json, where stdout is the JSON report, it goes
// to stderr.
std::string FormatTailSummaryLine(const TailSummary& summary);
// The text report: FormatTailSummaryLine, then a table of the details.
std::string FormatTailSummary(const TailSummary& summary);

// Runs the command; returns the process exit code.
int RunTail(const GlobalOptions& global, const TailOptions& options, std::ostream& out, std::ostream& err);

}  // namespace gradwatch::cli
