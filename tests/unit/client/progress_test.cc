// The progress line of `gradwatch replay` and `gradwatch tail`, and their one-line summaries: pure functions of
// counts and times, and the reporter on a string stream, told whether it draws as on a terminal. No clock is read:
// every time is made up.
#include "client/cli/progress.h"

#include <catch2/catch.hpp>
#include <sstream>

#include "client/cli/replay.h"
#include "client/cli/tail.h"

using namespace gradwatch::cli;
using namespace std::chrono_literals;
using Clock = ProgressReporter::Clock;

TEST_CASE("counts get thousands separators, rates keep two digits when slow, times taken their tenths", "[client]") {
  CHECK(FormatStepCount(0) == "0");
  CHECK(FormatStepCount(999) == "999");
  CHECK(FormatStepCount(1000) == "1,000");
  CHECK(FormatStepCount(30000) == "30,000");
  CHECK(FormatStepCount(1234567) == "1,234,567");
  CHECK(StepCountText(1) == "1 step");
  CHECK(StepCountText(12345) == "12,345 steps");

  CHECK(FormatStepRate(1820.4) == "1,820 steps/s");
  CHECK(FormatStepRate(12.4) == "12.4 steps/s");
  CHECK(FormatStepRate(2.5) == "2.5 steps/s");
  CHECK(FormatStepRate(0.123) == "0.123 steps/s");  // a slow job is not "0"
  CHECK(FormatStepRate(0) == "0 steps/s");
  CHECK(FormatStepRate(0.001) == "0 steps/s");
  CHECK(FormatStepRate(-1) == "0 steps/s");

  CHECK(FormatTimeTaken(0.04) == "0.0s");
  CHECK(FormatTimeTaken(16.5) == "16.5s");
  CHECK(FormatTimeTaken(59.9) == "59.9s");
  CHECK(FormatTimeTaken(302) == "5m 2s");
  CHECK(FormatTimeTaken(2 * 3600 + 13 * 60) == "2h 13m");
}

TEST_CASE("the ETA is what is left at the recent rate, and none without a rate", "[client]") {
  CHECK(EtaSeconds(12345, 30000, 1820.0).value() == Approx((30000 - 12345) / 1820.0));
  CHECK(EtaSeconds(30000, 30000, std::nullopt).value() == 0);
  CHECK_FALSE(EtaSeconds(10, 30000, std::nullopt).has_value());  // not measured yet
  CHECK_FALSE(EtaSeconds(10, 30000, 0.0).has_value());           // nothing moves: no honest estimate
}

TEST_CASE("the progress line shows the percentage and ETA with a total, the step reached without one", "[client]") {
  ProgressSnapshot replay{.label = "replay moe-6b", .done = 12345, .total = 30000, .rate = 1820.0};
  // 17,655 steps left at 1,820 steps/s: 9.7 s, rounded up.
  CHECK(FormatProgressLine(replay) == "replay moe-6b: 41.1% 12,345/30,000 steps \u00b7 1,820 steps/s \u00b7 ETA 10s");
  replay.done = 12360;
  replay.rate = 0.0;
  CHECK(FormatProgressLine(replay) == "replay moe-6b: 41.2% 12,360/30,000 steps \u00b7 0 steps/s \u00b7 ETA --");
  replay.rate.reset();  // the first quarter second: no rate, no ETA
  CHECK(FormatProgressLine(replay) == "replay moe-6b: 41.2% 12,360/30,000 steps");
  replay.done = 30000;
  replay.rate = 2000.0;
  CHECK(FormatProgressLine(replay) == "replay moe-6b: 100.0% 30,000/30,000 steps \u00b7 2,000 steps/s \u00b7 ETA 0s");
  replay.rate = 0.5;
  replay.done = 29000;
  CHECK(FormatProgressLine(replay) == "replay moe-6b: 96.7% 29,000/30,000 steps \u00b7 0.5 steps/s \u00b7 ETA 33m 20s");

  const ProgressSnapshot tail{.label = "tail pretrain-7b", .done = 12345, .rate = 1820.0, .step = 81716};
  CHECK(FormatProgressLine(tail) == "tail pretrain-7b: 12,345 steps \u00b7 1,820 steps/s \u00b7 step 81,716");
  const ProgressSnapshot waiting{.label = "tail pretrain-7b"};
  CHECK(FormatProgressLine(waiting) == "tail pretrain-7b: 0 steps");
}

TEST_CASE("the rate is the recent one: a replay that slows down shows it, where the average would not", "[client]") {
  RateMeter meter(/*window_seconds=*/5, /*min_spacing_seconds=*/0.25);
  meter.Add(0, 0);
  CHECK_FALSE(meter.rate().has_value());
  // 10 s at 1,000 steps/s, then 10 s at 100 steps/s, a sample every 10 ms (as a step would bring them).
  uint64_t count = 0;
  double t = 0;
  for (int i = 1; i <= 1000; ++i) {
    meter.Add(t = i * 0.01, count += 10);
    if (i == 10) CHECK_FALSE(meter.rate().has_value());  // 0.1 s: too short to say
  }
  CHECK(meter.rate().value() == Approx(1000).epsilon(0.01));
  for (int i = 1; i <= 1000; ++i) meter.Add(t = 10 + i * 0.01, count += 1);
  CHECK(meter.rate().value() == Approx(100).epsilon(0.06));
  CHECK(count / t == Approx(550));  // the average since the start
  // The job pauses: the rate falls to nothing within the window, however long it ran before.
  meter.Add(t + 3, count);
  CHECK(meter.rate().value() < 50);
  meter.Add(t + 10, count);
  CHECK(meter.rate().value() == 0);
}

TEST_CASE("on a terminal the line is rewritten in place at most every interval and erased for messages", "[client]") {
  std::ostringstream err;
  const Clock::time_point start{};
  ProgressReporter progress(err, {.label = "replay moe-6b", .total = 30000, .draw = true}, start);
  progress.Update(start + 100ms, 200);
  CHECK(err.str().empty());  // not before the first interval
  progress.Update(start + 250ms, 500);
  CHECK(err.str() == "\rreplay moe-6b: 1.7% 500/30,000 steps \u00b7 2,000 steps/s \u00b7 ETA 15s\033[K");
  err.str("");
  progress.Update(start + 400ms, 800);
  CHECK(err.str().empty());  // within the interval of the last draw
  progress.Update(start + 500ms, 1000);
  CHECK(err.str() == "\rreplay moe-6b: 3.3% 1,000/30,000 steps \u00b7 2,000 steps/s \u00b7 ETA 15s\033[K");

  // A warning takes the line off first, and only once.
  err.str("");
  progress.Print() << "moe.jsonl:7: daemon error at step 7\n";
  progress.Print() << "alert GradNormHigh FIRING at step 8\n";
  CHECK(err.str() == "\r\033[Kmoe.jsonl:7: daemon error at step 7\nalert GradNormHigh FIRING at step 8\n");

  // The end: the line is redrawn at the next interval, then erased for good before the summary.
  err.str("");
  progress.Update(start + 750ms, 1500);
  CHECK_THAT(err.str(), Catch::StartsWith("\rreplay moe-6b: 5.0% 1,500/30,000"));
  err.str("");
  progress.Finish("replayed moe.jsonl as run moe-6b: 30,000 steps in 15.0s (2,000 steps/s), all acknowledged");
  CHECK(err.str() ==
        "\r\033[Kreplayed moe.jsonl as run moe-6b: 30,000 steps in 15.0s (2,000 steps/s), all acknowledged\n");
  err.str("");
  progress.Update(start + 2s, 30000);
  CHECK(err.str().empty());  // finished: nothing more
}

TEST_CASE("a tail's line has no total (steps, rate, the step reached), and a narrow terminal cuts it", "[client]") {
  std::ostringstream err;
  const Clock::time_point start{};
  ProgressReporter progress(err, {.label = "tail pretrain-7b", .draw = true, .columns = 31, .rate_window_seconds = 30},
                            start);
  progress.Update(start + 1s, 40, 81716);
  // 30 columns (one spare, or the terminal would wrap the line): "·" is one column of two bytes.
  CHECK(err.str() == "\rtail pretrain-7b: 40 steps \u00b7 4\033[K");
  err.str("");
  progress.Finish("");
  CHECK(err.str() == "\r\033[K");
}

TEST_CASE("off a terminal, or with --quiet, the only output is the summary line", "[client]") {
  std::ostringstream err;
  const Clock::time_point start{};
  {
    ProgressReporter progress(err, {.label = "replay moe-6b", .total = 30000, .draw = false}, start);
    for (int i = 1; i <= 100; ++i) progress.Update(start + i * 100ms, i * 300);
    progress.Print() << "a warning\n";
    progress.Finish("replayed moe.jsonl as run moe-6b: 30,000 steps in 10.0s (3,000 steps/s), all acknowledged");
    CHECK(progress.rate().value() == Approx(3000));  // measured all the same
  }
  CHECK(err.str() ==
        "a warning\nreplayed moe.jsonl as run moe-6b: 30,000 steps in 10.0s (3,000 steps/s), all "
        "acknowledged\n");

  // Whether to draw: never on a stream that is not this process's stderr, never with --quiet.
  std::ostringstream other;
  CHECK_FALSE(ShouldDrawProgress(other, false));
  CHECK_FALSE(ShouldDrawProgress(other, true));
}

TEST_CASE("a reporter left without Finish (an early return) erases its line", "[client]") {
  std::ostringstream err;
  const Clock::time_point start{};
  {
    ProgressReporter progress(err, {.label = "replay x", .total = 10, .draw = true}, start);
    progress.Update(start + 1s, 5);
  }
  CHECK_THAT(err.str(), Catch::EndsWith("\033[K\r\033[K"));
}

TEST_CASE("the replay's and the tail's summary lines say what was sent, how fast, and what is not kept", "[client]") {
  ReplaySummary replay;
  replay.file = "moe.jsonl";
  replay.run = "moe-6b";
  replay.steps_sent = 30000;
  replay.seconds = 16.5;
  replay.complete = true;
  CHECK(FormatReplaySummaryLine(replay) ==
        "replayed moe.jsonl as run moe-6b: 30,000 steps in 16.5s (1,818 steps/s), all acknowledged");
  // The text report leads with it, once; the time is not repeated in the table.
  const std::string report = FormatReplaySummary(replay);
  CHECK_THAT(report, Catch::StartsWith(FormatReplaySummaryLine(replay) + "\n"));
  CHECK(report.find("steps/s") == report.rfind("steps/s"));
  CHECK_THAT(report, !Catch::Contains("\ntime "));

  replay.already_held_steps = 133;
  replay.steps_sent = 467;
  replay.seconds = 3.1;
  replay.skipped_lines = 1;
  replay.daemon_errors = {{"ERROR_REASON_NEGATIVE_NORM", 2}};
  CHECK(FormatReplaySummaryLine(replay) ==
        "replayed moe.jsonl as run moe-6b: 467 steps (133 already held) in 3.1s "
        "(150.6 steps/s), all acknowledged; 1 line skipped; 2 daemon errors");

  ReplaySummary stopped;
  stopped.file = "wide.jsonl";
  stopped.run = "big1000";
  stopped.steps_sent = 446;
  stopped.seconds = 8.7;
  stopped.stopped = "interrupted";
  stopped.stop_detail = "interrupted by SIGINT";
  stopped.unacked_steps = 486;
  CHECK(FormatReplaySummaryLine(stopped) ==
        "replayed wide.jsonl as run big1000: 446 steps in 8.7s (51.26 steps/s), 486 not acknowledged (interrupted)");

  TailSummary tail;
  tail.file = "job.log";
  tail.run = "pretrain-7b";
  tail.steps_sent = 12345;
  tail.seconds = 303;
  tail.complete = true;
  tail.ended = "end of input";
  CHECK(FormatTailSummaryLine(tail) ==
        "followed job.log as run pretrain-7b: 12,345 steps in 5m 3s (40.74 steps/s), all acknowledged; end of input");
  CHECK_THAT(FormatTailSummary(tail), Catch::StartsWith(FormatTailSummaryLine(tail) + "\n"));
  tail.complete = false;
  tail.dropped_steps = 7;
  tail.ended = "SIGTERM";
  CHECK(FormatTailSummaryLine(tail) ==
        "followed job.log as run pretrain-7b: 12,345 steps in 5m 3s (40.74 steps/s), not "
        "all acknowledged; 7 dropped; SIGTERM");
  const auto json = TailSummaryToJson(tail);
  CHECK(json["seconds"] == 303);
  CHECK(json["steps_per_second"].get<double>() == Approx(12345 / 303.0));
}
