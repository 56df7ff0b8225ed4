#include "client/cli/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "client/cli/format.h"

namespace gradwatch::cli {
namespace {

constexpr char kEraseLine[] = "\033[K";
constexpr char kDot[] = " \u00b7 ";  // " · "

// `text` cut to at most `columns` characters (UTF-8: continuation bytes take no column).
std::string FitColumns(const std::string& text, int columns) {
  if (columns <= 0) return text;
  int used = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;
    if (used++ == columns) return text.substr(0, i);
  }
  return text;
}

}  // namespace

std::string FormatStepCount(uint64_t n) { return GroupedStep(static_cast<double>(n)); }

std::string FormatStepRate(double steps_per_second) {
  if (!std::isfinite(steps_per_second) || steps_per_second < 0.005) return "0 steps/s";
  return FormatValue(steps_per_second) + " steps/s";  // a slow job's 0.12 steps/s is not "0"
}

std::string FormatTimeTaken(double seconds) {
  if (!std::isfinite(seconds)) return "-";
  if (seconds < 59.95) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1fs", std::max(0.0, seconds));
    return buf;
  }
  return FormatDuration(seconds);
}

std::string StepCountText(uint64_t n) { return FormatStepCount(n) + (n == 1 ? " step" : " steps"); }

std::optional<double> EtaSeconds(uint64_t done, uint64_t total, std::optional<double> rate) {
  if (done >= total) return 0.0;
  if (!rate || !std::isfinite(*rate) || *rate < 0.005) return std::nullopt;
  return static_cast<double>(total - done) / *rate;
}

std::string FormatProgressLine(const ProgressSnapshot& s) {
  std::string line = s.label + ": ";
  if (s.total) {
    const uint64_t total = *s.total;
    if (total > 0) {
      char pct[16];
      std::snprintf(pct, sizeof pct, "%.1f%% ", std::min(100.0, 100.0 * static_cast<double>(s.done) / total));
      line += pct;
    }
    line += FormatStepCount(s.done) + "/" + StepCountText(total);
  } else {
    line += StepCountText(s.done);
  }
  if (s.rate) {
    line += kDot + FormatStepRate(*s.rate);
    if (s.total) {
      const std::optional<double> eta = EtaSeconds(s.done, *s.total, s.rate);
      // Rounded up: "ETA 0s" only once there is nothing left.
      line += kDot + std::string("ETA ") + (eta ? FormatDuration(std::ceil(*eta)) : "--");
    }
  }
  if (s.step) line += kDot + std::string("step ") + FormatStepCount(*s.step);
  return line;
}

void RateMeter::Add(double seconds, uint64_t count) {
  latest_ = {seconds, count};
  if (samples_.empty() || seconds - samples_.back().first >= min_spacing_) samples_.push_back(latest_);
  // Keep one sample at or before the window's start, so that the rate spans the whole window.
  while (samples_.size() > 1 && samples_[1].first <= seconds - window_) samples_.pop_front();
}

std::optional<double> RateMeter::rate() const {
  if (samples_.empty()) return std::nullopt;
  const auto& [from_seconds, from_count] = samples_.front();
  const double span = latest_.first - from_seconds;
  // A shorter span measures the clock's and the batching's jitter more than the rate.
  if (span < min_spacing_) return std::nullopt;
  return static_cast<double>(latest_.second >= from_count ? latest_.second - from_count : 0) / span;
}

bool ShouldDrawProgress(const std::ostream& err, bool quiet) {
  if (quiet || &err != &std::cerr || ::isatty(STDERR_FILENO) == 0) return false;
  const char* term = std::getenv("TERM");
  return term == nullptr || std::strcmp(term, "dumb") != 0;
}

int StderrColumns() {
  struct winsize size {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) != 0) return 0;
  return size.ws_col;
}

ProgressReporter::ProgressReporter(std::ostream& err, Options options, Clock::time_point start)
    : err_(err), options_(std::move(options)), start_(start), last_draw_(start), meter_(options_.rate_window_seconds) {
  meter_.Add(0, 0);
}

ProgressReporter::~ProgressReporter() {
  // A command that returns early leaves no half line behind for the shell's prompt.
  if (!finished_ && drawn_) err_ << "\r" << kEraseLine << std::flush;
}

void ProgressReporter::Update(Clock::time_point now, uint64_t done, std::optional<uint64_t> step) {
  done_ = done;
  if (step) step_ = step;
  meter_.Add(std::chrono::duration<double>(now - start_).count(), done);
  if (!options_.draw || finished_ || now - last_draw_ < options_.interval) return;
  last_draw_ = now;
  Draw();
}

void ProgressReporter::Draw() {
  const ProgressSnapshot snapshot{options_.label, done_, options_.total, meter_.rate(), step_};
  const int columns = options_.columns > 1 ? options_.columns - 1 : 0;
  err_ << "\r" << FitColumns(FormatProgressLine(snapshot), columns) << kEraseLine << std::flush;
  drawn_ = true;
}

std::ostream& ProgressReporter::Print() {
  if (drawn_) {
    err_ << "\r" << kEraseLine;
    drawn_ = false;
  }
  return err_;
}

void ProgressReporter::Finish(const std::string& summary) {
  Print();
  finished_ = true;
  if (!summary.empty()) err_ << summary << "\n";
  err_ << std::flush;
}

}  // namespace gradwatch::cli
