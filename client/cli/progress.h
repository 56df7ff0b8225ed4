// Progress of the commands that stream steps (`gradwatch replay`, `gradwatch tail`) on stderr: on a
// terminal, one line rewritten in place a few times a second; anywhere else (a log file, a pipe,
// --quiet) nothing, since a log full of carriage returns helps nobody, and the command's report at
// the end says what was done. The formatting is pure functions of counts and times, so that tests
// need no clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <ostream>
#include <string>

namespace gradwatch::cli {

// "30,000".
std::string FormatStepCount(uint64_t n);
// "1,820 steps/s", "12 steps/s", "2.5 steps/s", "0.12 steps/s", "0 steps/s".
std::string FormatStepRate(double steps_per_second);
// A time taken: "0.4s", "16.5s" under a minute, then as FormatDuration: "5m 2s", "2h 13m".
std::string FormatTimeTaken(double seconds);
// "1 step", "30,000 steps".
std::string StepCountText(uint64_t n);

// Seconds left to go from `done` to `total` at `rate` steps per second; nullopt when no estimate
// is honest: no rate measured yet, or nothing moving.
std::optional<double> EtaSeconds(uint64_t done, uint64_t total, std::optional<double> rate);

// What one progress line shows.
struct ProgressSnapshot {
  std::string label;  // "replay moe-6b"
  uint64_t done = 0;  // steps handled so far
  // The steps there are in all: known for a replay (its pre-scan counted them), not for a tail
  // (a followed file has no end).
  std::optional<uint64_t> total;
  std::optional<double> rate;    // steps per second, recent; nullopt until measured
  std::optional<uint64_t> step;  // the step reached, for a tail
};

// "replay moe-6b: 41.2% 12,345/30,000 steps · 1,820 steps/s · ETA 9s" with a total;
// "tail pretrain-7b: 12,345 steps · 1,820 steps/s · step 81,716" without one. The rate and ETA
// are left out until there is a rate; "ETA --" while nothing moves.
std::string FormatProgressLine(const ProgressSnapshot& snapshot);

// A recent rate: the count's growth over the last `window_seconds` (since the start while that is
// shorter), so that it follows a daemon that slows down or a job that pauses, which an average
// since the start would hide for ever longer. Samples are kept `min_spacing_seconds` apart, so
// Add() is cheap enough to call for every step and the memory is bounded.
class RateMeter {
 public:
  explicit RateMeter(double window_seconds = 5, double min_spacing_seconds = 0.25)
      : window_(window_seconds), min_spacing_(min_spacing_seconds) {}

  // The cumulative `count` at `seconds` (from any origin, never decreasing).
  void Add(double seconds, uint64_t count);
  // Steps per second; nullopt until `min_spacing_seconds` have been measured.
  std::optional<double> rate() const;

 private:
  double window_;
  double min_spacing_;
  std::deque<std::pair<double, uint64_t>> samples_;  // oldest first; the first at or before the window's start
  std::pair<double, uint64_t> latest_{0, 0};
};

// Whether progress is drawn on `err`: only on this process's stderr, only when that is a terminal
// that understands "erase line" (not TERM=dumb), and not with --quiet.
bool ShouldDrawProgress(const std::ostream& err, bool quiet);
// The width of the terminal on stderr, in columns; 0 when unknown.
int StderrColumns();

// Draws the progress line on `err` when told to (ShouldDrawProgress), at most once per
// `interval`: "\r", the line, "\033[K" (erase what a longer line left). Not thread-safe: every
// write to `err` while it draws goes through Print(), on the thread that calls Update().
class ProgressReporter {
 public:
  using Clock = std::chrono::steady_clock;

  struct Options {
    std::string label;
    std::optional<uint64_t> total;
    bool draw = false;
    int columns = 0;  // the line is cut to fit (one column spare: a full line would wrap); 0: never cut
    std::chrono::milliseconds interval{250};
    double rate_window_seconds = 5;
  };

  ProgressReporter(std::ostream& err, Options options, Clock::time_point start);
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // `done` steps handled at `now` (and the step reached, when the line shows it). Redraws the line
  // once `interval` has passed since it was last drawn; cheap otherwise, so call it per step.
  void Update(Clock::time_point now, uint64_t done, std::optional<uint64_t> step = std::nullopt);
  // Erases the line, if drawn, and returns the stream for a message (a warning, a daemon error),
  // which must end with "\n". The line comes back at the next redraw.
  std::ostream& Print();
  // Erases the line for good, then writes `summary` and "\n" unless it is empty.
  void Finish(const std::string& summary);

  std::optional<double> rate() const { return meter_.rate(); }

 private:
  void Draw();

  std::ostream& err_;
  Options options_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
  RateMeter meter_;
  uint64_t done_ = 0;
  std::optional<uint64_t> step_;
  bool drawn_ = false;  // a line is on the terminal
  bool finished_ = false;
};

}  // namespace gradwatch::cli
