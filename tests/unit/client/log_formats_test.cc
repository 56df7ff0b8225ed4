#include "client/cli/log_formats.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <ctime>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

using namespace gradwatch::cli;
using Kind = LogRecord::Kind;

namespace {

// Lines of tests/fixtures/tail/<name>, as a pipe would deliver them (without the '\n').
std::vector<std::string> ReadFixture(const std::string& name) {
  const std::string path = std::string(GRADWATCH_FIXTURE_DIR) + "/tail/" + name;
  std::ifstream in(path, std::ios::binary);
  INFO(path);
  REQUIRE(in.good());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The record of fixture line `number` (1-based), cleaned first as `gradwatch tail` does.
std::optional<LogRecord> ParseFixtureLine(LogFormat f, const std::vector<std::string>& lines, size_t number) {
  REQUIRE(number >= 1);
  REQUIRE(number <= lines.size());
  return ParseLogLine(f, CleanLogLine(lines[number - 1]));
}

LogRecord StepLine(LogFormat f, const std::vector<std::string>& lines, size_t number) {
  std::optional<LogRecord> rec = ParseFixtureLine(f, lines, number);
  INFO("line " << number << ": " << lines[number - 1]);
  REQUIRE(rec);
  REQUIRE(rec->kind == Kind::kStep);
  return *rec;
}

std::optional<double> Value(const LogRecord& rec, const std::string& key) {
  for (const auto& [k, v] : rec.values) {
    if (k == key) return v;
  }
  return std::nullopt;
}

std::vector<std::string> Keys(const LogRecord& rec) {
  std::vector<std::string> keys;
  for (const auto& [k, v] : rec.values) keys.push_back(k);
  return keys;
}

struct Counts {
  int step = 0;
  int event = 0;
  int progress = 0;
  int none = 0;
};

Counts CountFixture(LogFormat f, const std::string& name) {
  Counts c;
  for (const std::string& line : ReadFixture(name)) {
    std::optional<LogRecord> rec = ParseLogLine(f, CleanLogLine(line));
    if (!rec) {
      ++c.none;
    } else if (rec->kind == Kind::kStep) {
      ++c.step;
    } else if (rec->kind == Kind::kEvent) {
      ++c.event;
    } else {
      ++c.progress;
    }
  }
  return c;
}

const std::map<std::string, LogFormat>& FixtureFormats() {
  static const std::map<std::string, LogFormat> kFixtures = {
      {"megatron_lm.log", LogFormat::kMegatron},
      {"megatron_deepspeed.log", LogFormat::kMegatron},
      {"deepspeed.log", LogFormat::kDeepSpeed},
      {"hf_trainer.log", LogFormat::kHfTrainer},
      {"torchtitan.log", LogFormat::kTorchtitan},
      {"nanogpt.log", LogFormat::kNanoGpt},
      {"llmc.log", LogFormat::kLlmc},
  };
  return kFixtures;
}

}  // namespace

TEST_CASE("log format names and aliases", "[client][tail]") {
  for (LogFormat f : AllLogFormats()) CHECK(ParseLogFormatName(LogFormatName(f)) == f);
  CHECK(AllLogFormats().size() == 7);
  CHECK(ParseLogFormatName("huggingface") == LogFormat::kHfTrainer);
  CHECK(ParseLogFormatName("llm.c") == LogFormat::kLlmc);
  CHECK(ParseLogFormatName("megatron-deepspeed") == LogFormat::kMegatron);
  CHECK(ParseLogFormatName("HF") == LogFormat::kHfTrainer);
  CHECK_FALSE(ParseLogFormatName("tensorboard"));
  CHECK_FALSE(ParseLogFormatName(""));
}

TEST_CASE("megatron_lm.log: iteration lines give their step and fields", "[client][tail]") {
  const auto lines = ReadFixture("megatron_lm.log");
  const LogFormat f = LogFormat::kMegatron;
  const Counts c = CountFixture(f, "megatron_lm.log");
  CHECK(c.step == 14);
  CHECK(c.event == 0);
  CHECK(c.progress == 0);
  CHECK(c.none == 1);

  LogRecord r = StepLine(f, lines, 1);
  CHECK(r.step == 122u);
  CHECK(Value(r, "train/loss") == Approx(2.504220));
  CHECK(Value(r, "grad/norm/total") == Approx(0.231));
  CHECK(Value(r, "optim/learning_rate") == Approx(9.150e-06));
  CHECK(Value(r, "train/loss_scale") == Approx(1.0));
  CHECK(Value(r, "train/skipped_iterations") == 0.0);
  CHECK(Value(r, "train/nan_iterations") == 0.0);
  CHECK_FALSE(Value(r, "params/norm/total"));
  CHECK_FALSE(Value(r, "train/num_zeros"));
  CHECK(r.values.size() == 6);

  r = StepLine(f, lines, 5);  // no leading space
  CHECK(r.step == 3383u);
  CHECK(Value(r, "train/loss") == Approx(0.7334521));

  // Megatron drops `lm loss` when the interval's loss is NaN or every step was skipped.
  r = StepLine(f, lines, 7);
  CHECK(r.step == 3633u);
  CHECK_FALSE(Value(r, "train/loss"));
  CHECK(Value(r, "grad/norm/total") == Approx(0.794));

  CHECK_FALSE(ParseFixtureLine(f, lines, 8));  // the fork's warning line

  r = StepLine(f, lines, 9);  // " [2024-03-30 20:02:40] iteration ..."
  CHECK(r.step == 10u);
  CHECK(Value(r, "train/loss") == Approx(0.2092005));
  CHECK(Value(r, "grad/norm/total") == Approx(51.010));
  CHECK(Value(r, "train/num_zeros") == 0.0);

  r = StepLine(f, lines, 12);  // "[default0]: " prefix, MoE load_balancing_loss, .6E learning rate
  CHECK(r.step == 1u);
  CHECK(Value(r, "train/loss") == Approx(11.92634));
  CHECK(Value(r, "optim/learning_rate") == Approx(1.5e-06));
  CHECK(Value(r, "params/norm/total") == Approx(238.330));
  CHECK(Value(r, "grad/norm/total") == Approx(5.960));
  CHECK(Value(r, "train/skipped_iterations") == 0.0);
  CHECK(r.values.size() == 8);

  r = StepLine(f, lines, 13);  // "[default7]: "
  CHECK(Value(r, "train/num_zeros") == 111393856.0);
  CHECK(Value(r, "params/norm/total") == Approx(2120.030));

  r = StepLine(f, lines, 15);  // microsecond timestamp
  CHECK(r.step == 45u);
  CHECK(Value(r, "train/loss") == Approx(6.415310));
  CHECK(Value(r, "optim/learning_rate") == Approx(1.318359e-04));
  CHECK(Value(r, "params/norm/total") == Approx(2241.458));
}

TEST_CASE("megatron_deepspeed.log: tgs spellings, nan grad norm and the ALCF key=value variant", "[client][tail]") {
  const auto lines = ReadFixture("megatron_deepspeed.log");
  const LogFormat f = LogFormat::kMegatron;
  const Counts c = CountFixture(f, "megatron_deepspeed.log");
  CHECK(c.step == 11);
  CHECK(c.none == 0);

  LogRecord r = StepLine(f, lines, 1);
  CHECK(r.step == 199u);
  CHECK(Value(r, "train/loss") == Approx(5.905366));
  CHECK(Value(r, "train/loss_scale") == 8192.0);
  CHECK(Value(r, "train/tokens_per_second") == Approx(1146.733));
  CHECK(Value(r, "optim/learning_rate") == Approx(2.407e-04));
  CHECK_FALSE(Value(r, "grad/norm/total"));

  r = StepLine(f, lines, 4);  // "tokens per gpu per second(tgs)", loss spike
  CHECK(r.step == 2u);
  CHECK(Value(r, "train/loss") == Approx(25.37718));
  CHECK(Value(r, "train/tokens_per_second") == Approx(807.159));

  r = StepLine(f, lines, 7);
  CHECK(r.step == 5426u);
  REQUIRE(Value(r, "grad/norm/total"));
  CHECK(std::isnan(*Value(r, "grad/norm/total")));
  CHECK_FALSE(Value(r, "train/loss"));

  r = StepLine(f, lines, 10);  // "stdout: " prefix
  CHECK(r.step == 2u);
  CHECK(Value(r, "train/loss") == Approx(8.539678));
  CHECK(Value(r, "grad/norm/total") == Approx(6048.672));
  CHECK(Value(r, "train/num_zeros") == 0.0);
  CHECK(Value(r, "train/loss_scale") == 4096.0);

  r = StepLine(f, lines, 11);  // ALCF: "iteration=  1/ 317892 | ... | lm loss=11.133188 | ..."
  CHECK(r.step == 1u);
  CHECK(Value(r, "train/loss") == Approx(11.133188));
  CHECK(Value(r, "optim/learning_rate") == Approx(1.88743e-08));
  CHECK(Value(r, "train/loss_scale") == 1.0);
  CHECK(Value(r, "train/skipped_iterations") == 0.0);
  CHECK(Value(r, "train/nan_iterations") == 0.0);
  CHECK(Value(r, "train/tokens_per_second") == Approx(1203.674));
}

TEST_CASE("Megatron validation lines give val/loss at their iteration", "[client][tail]") {
  const LogFormat f = LogFormat::kMegatron;
  auto r = ParseLogLine(f,
                        " validation loss at iteration 1000 | lm loss value: 2.724416E+00 | lm loss PPL: "
                        "1.524837E+01 | ");
  REQUIRE(r);
  CHECK(r->kind == Kind::kStep);
  CHECK(r->step == 1000u);
  CHECK(Keys(*r) == std::vector<std::string>{"val/loss"});
  CHECK(Value(*r, "val/loss") == Approx(2.724416));

  r = ParseLogLine(f, " validation loss at iteration 1000 on validation set | lm loss value: 2.5E+00 | ");
  REQUIRE(r);
  CHECK(r->step == 1000u);
  CHECK(Value(*r, "val/loss") == Approx(2.5));

  r = ParseLogLine(f, " validation loss at the end of training for val data | lm loss value: 2.0E+00 |");
  REQUIRE(r);
  CHECK_FALSE(r->step);
  CHECK(Value(*r, "val/loss") == Approx(2.0));

  CHECK_FALSE(ParseLogLine(f, " validation loss at iteration 1000 | lm loss PPL: 1.5E+01 |"));
}

TEST_CASE("deepspeed.log: step lines, cumulative skips, overflow events", "[client][tail]") {
  const auto lines = ReadFixture("deepspeed.log");
  const LogFormat f = LogFormat::kDeepSpeed;
  const Counts c = CountFixture(f, "deepspeed.log");
  CHECK(c.step == 7);
  CHECK(c.event == 4);
  CHECK(c.progress == 0);
  CHECK(c.none == 4);

  std::optional<LogRecord> e = ParseFixtureLine(f, lines, 1);
  REQUIRE(e);
  CHECK(e->kind == Kind::kEvent);
  CHECK_FALSE(e->step);
  CHECK(e->event == "Overflow detected. Skipping step. Attempted loss scale: 8.0, reducing to 4.0");
  CHECK(e->values.empty());

  LogRecord r = StepLine(f, lines, 2);
  CHECK(r.step == 25u);
  CHECK(Value(r, "train/skipped_iterations_total") == 5.0);
  CHECK(Value(r, "optim/learning_rate") == Approx(1.446140557591026e-05));
  CHECK_FALSE(Value(r, "train/skipped_iterations"));
  CHECK(r.values.size() == 2);
  CHECK_FALSE(r.progress_step);

  CHECK_FALSE(ParseFixtureLine(f, lines, 3));  // SamplesPerSec timer
  CHECK_FALSE(ParseFixtureLine(f, lines, 5));

  r = StepLine(f, lines, 6);  // tqdm bar and the step line on one physical line
  CHECK(r.step == 2000u);
  CHECK(r.progress_step == 1999u);
  CHECK(Value(r, "train/skipped_iterations_total") == 1995.0);
  CHECK(Value(r, "optim/learning_rate") == Approx(0.001));

  e = ParseFixtureLine(f, lines, 8);
  REQUIRE(e);
  CHECK(e->kind == Kind::kEvent);
  CHECK(e->event == "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768");

  CHECK_FALSE(ParseFixtureLine(f, lines, 9));   // epoch=0/micro_step=199/global_step=199 timer
  CHECK_FALSE(ParseFixtureLine(f, lines, 11));  // literal "^[c" then the time (ms) breakdown

  r = StepLine(f, lines, 10);  // one lr per param group: the first is reported
  CHECK(r.step == 200u);
  CHECK(Value(r, "optim/learning_rate") == Approx(0.000240653265864008));
  CHECK(Value(r, "train/skipped_iterations_total") == 4.0);

  r = StepLine(f, lines, 14);
  CHECK(r.step == 1u);
  CHECK(Value(r, "optim/learning_rate") == Approx(1.887433467970254e-08));
}

TEST_CASE("hf_trainer.log: log dicts, nan grad norms, extra keys and the final summary", "[client][tail]") {
  const auto lines = ReadFixture("hf_trainer.log");
  const LogFormat f = LogFormat::kHfTrainer;
  const Counts c = CountFixture(f, "hf_trainer.log");
  CHECK(c.step == 10);
  CHECK(c.event == 2);
  CHECK(c.none == 0);

  LogRecord r = StepLine(f, lines, 1);
  CHECK_FALSE(r.step);
  CHECK_FALSE(r.progress_step);
  CHECK(Keys(r) == std::vector<std::string>{"train/loss", "grad/norm/total", "optim/learning_rate", "train/epoch"});
  CHECK(Value(r, "train/loss") == Approx(1.5214));
  CHECK(Value(r, "grad/norm/total") == Approx(82.93941089686794));
  CHECK(Value(r, "optim/learning_rate") == Approx(1.4285714285714286e-06));
  CHECK(Value(r, "train/epoch") == Approx(0.01));

  r = StepLine(f, lines, 4);  // trailing tqdm padding
  CHECK(Value(r, "optim/learning_rate") == Approx(4.5833333333333334e-05));

  r = StepLine(f, lines, 6);  // axolotl's memory keys
  CHECK(Value(r, "hf/memory/max_mem_active_gib_") == Approx(25.45));
  CHECK(Value(r, "hf/memory/device_mem_reserved_gib_") == Approx(30.22));
  CHECK(Value(r, "train/epoch") == 1.0);
  CHECK(r.values.size() == 7);

  r = StepLine(f, lines, 8);
  CHECK(Value(r, "train/loss") == 0.0);
  REQUIRE(Value(r, "grad/norm/total"));
  CHECK(std::isnan(*Value(r, "grad/norm/total")));

  std::optional<LogRecord> e = ParseFixtureLine(f, lines, 11);
  REQUIRE(e);
  CHECK(e->kind == Kind::kEvent);
  CHECK(e->event == "training finished: train_runtime=4835.1682 s, train_loss=0.448108, epoch=2.99");
  e = ParseFixtureLine(f, lines, 12);
  REQUIRE(e);
  CHECK(e->kind == Kind::kEvent);
  CHECK(e->event == "training finished: train_runtime=1530.1399 s, train_loss=0.713985, epoch=9.7");
}

TEST_CASE("HF progress bars, bar and dict on one line, eval dicts and odd values", "[client][tail]") {
  const LogFormat f = LogFormat::kHfTrainer;
  const std::string bar = "  8%|\u2588\u2588\u2588\u2588      | 1999/24128 [1:52:09<20:27:23,  3.33s/it]";

  std::optional<LogRecord> r = ParseLogLine(f, bar);
  REQUIRE(r);
  CHECK(r->kind == Kind::kProgress);
  CHECK(r->step == 1999u);
  CHECK(r->progress_step == 1999u);
  CHECK(r->values.empty());

  r = ParseLogLine(f, CleanLogLine(bar + "{'loss': 1.5, 'learning_rate': 1e-05, 'epoch': 0.01}   "));
  REQUIRE(r);
  CHECK(r->kind == Kind::kStep);
  CHECK_FALSE(r->step);
  CHECK(r->progress_step == 1999u);
  CHECK(Value(*r, "train/loss") == 1.5);

  r = ParseLogLine(f, "{'eval_loss': 1.25, 'eval_runtime': 3.5, 'eval_samples/s': 12.0, 'epoch': 1.0}");
  REQUIRE(r);
  CHECK(r->kind == Kind::kStep);
  CHECK(Value(*r, "val/loss") == 1.25);
  CHECK(Value(*r, "hf/eval_runtime") == 3.5);
  CHECK(Value(*r, "hf/eval_samples/s") == 12.0);
  CHECK_FALSE(Value(*r, "train/loss"));

  r = ParseLogLine(f,
                   "{'loss': inf, 'grad_norm': -inf, 'flag': True, 'note': 'a, b}', 'none': None, "
                   "'list': [1, 2], \"it's\": 3, 'n': 5,}");
  REQUIRE(r);
  CHECK(std::isinf(*Value(*r, "train/loss")));
  CHECK(*Value(*r, "grad/norm/total") < 0);
  CHECK(Value(*r, "hf/it_s") == 3.0);
  CHECK(Value(*r, "hf/n") == 5.0);
  CHECK(r->values.size() == 4);

  CHECK_FALSE(ParseLogLine(f, "{'model': 'llama'}"));  // nothing numeric
  CHECK_FALSE(ParseLogLine(f, "config: {'loss': 1.0}"));
  CHECK_FALSE(ParseLogLine(f, "{\"loss\": 1.0}"));
}

TEST_CASE("torchtitan.log: step, loss, grad_norm and tps or wps", "[client][tail]") {
  const auto lines = ReadFixture("torchtitan.log");
  const LogFormat f = LogFormat::kTorchtitan;
  const Counts c = CountFixture(f, "torchtitan.log");
  CHECK(c.step == 11);
  CHECK(c.none == 2);

  LogRecord r = StepLine(f, lines, 1);
  CHECK(r.step == 14u);
  CHECK(Keys(r) == std::vector<std::string>{"train/loss", "grad/norm/total", "train/tokens_per_second"});
  CHECK(Value(r, "train/loss") == Approx(3.24405));
  CHECK(Value(r, "grad/norm/total") == Approx(0.8319));
  CHECK(Value(r, "train/tokens_per_second") == 7282.0);

  r = StepLine(f, lines, 4);  // no rank prefix, "step:  4"
  CHECK(r.step == 4u);
  CHECK(Value(r, "grad/norm/total") == Approx(26.625));
  CHECK(Value(r, "train/tokens_per_second") == 10050.0);

  CHECK_FALSE(ParseFixtureLine(f, lines, 6));   // [GC]
  CHECK_FALSE(ParseFixtureLine(f, lines, 10));  // WARNING

  r = StepLine(f, lines, 9);  // before grad_norm was logged
  CHECK(r.step == 22u);
  CHECK_FALSE(Value(r, "grad/norm/total"));
  CHECK(Value(r, "train/tokens_per_second") == 193831.0);

  r = StepLine(f, lines, 13);  // 2024: no [titan] tag, wps
  CHECK(r.step == 20u);
  CHECK(Value(r, "train/loss") == Approx(9.1087));
  CHECK(Value(r, "train/tokens_per_second") == 3812.0);

  r = *ParseLogLine(f,
                    "[titan] 2026-05-18 16:04:46,338 - root - INFO - step: 3  loss:      nan  grad_norm:     inf  "
                    "memory:  9.46GiB(64.99%)  tps: 1,234,567  tflops: 0.52  mfu: N/A");
  CHECK(std::isnan(*Value(r, "train/loss")));
  CHECK(std::isinf(*Value(r, "grad/norm/total")));
  CHECK(Value(r, "train/tokens_per_second") == 1234567.0);
}

TEST_CASE("nanogpt.log: iter lines and eval step lines", "[client][tail]") {
  const auto lines = ReadFixture("nanogpt.log");
  const LogFormat f = LogFormat::kNanoGpt;
  const Counts c = CountFixture(f, "nanogpt.log");
  CHECK(c.step == 14);
  CHECK(c.none == 0);

  LogRecord r = StepLine(f, lines, 1);
  CHECK(r.step == 0u);
  CHECK(Keys(r) == std::vector<std::string>{"train/loss_eval", "val/loss"});
  CHECK(Value(r, "train/loss_eval") == Approx(4.2874));
  CHECK(Value(r, "val/loss") == Approx(4.2823));

  r = StepLine(f, lines, 3);
  CHECK(r.step == 10u);
  CHECK(Keys(r) == std::vector<std::string>{"train/loss"});
  CHECK(Value(r, "train/loss") == Approx(3.1459));

  r = StepLine(f, lines, 8);  // before MFU
  CHECK(r.step == 799u);
  CHECK(Value(r, "train/loss") == Approx(0.6466));

  r = StepLine(f, lines, 11);  // timestamp prefix
  CHECK(r.step == 3000u);
  CHECK(Value(r, "val/loss") == Approx(4.0427));

  r = StepLine(f, lines, 13);
  CHECK(r.step == 3010u);
  CHECK(std::isnan(*Value(r, "train/loss")));
}

TEST_CASE("llmc.log: current and CPU step lines, nan losses, val loss without a step", "[client][tail]") {
  const auto lines = ReadFixture("llmc.log");
  const LogFormat f = LogFormat::kLlmc;
  const Counts c = CountFixture(f, "llmc.log");
  CHECK(c.step == 13);
  CHECK(c.none == 0);

  LogRecord r = StepLine(f, lines, 1);
  CHECK_FALSE(r.step);
  CHECK(Keys(r) == std::vector<std::string>{"val/loss"});
  CHECK(Value(r, "val/loss") == Approx(5.252026));

  r = StepLine(f, lines, 2);
  CHECK(r.step == 0u);
  CHECK(Keys(r) == std::vector<std::string>{"train/loss"});
  CHECK(Value(r, "train/loss") == Approx(5.356189));

  r = StepLine(f, lines, 4);
  CHECK(r.step == 61u);
  CHECK(Value(r, "train/loss") == Approx(3.208939));
  CHECK(Value(r, "grad/norm/total") == Approx(1.4800));
  CHECK(Value(r, "optim/learning_rate") == Approx(3.00e-04));
  CHECK(r.values.size() == 3);

  r = StepLine(f, lines, 8);
  CHECK(r.step == 19560u);
  CHECK(Value(r, "optim/learning_rate") == 0.0);

  r = StepLine(f, lines, 11);
  CHECK(r.step == 10u);
  CHECK(std::isnan(*Value(r, "train/loss")));
  CHECK(std::isnan(*Value(r, "grad/norm/total")));

  r = StepLine(f, lines, 13);
  CHECK_FALSE(r.step);
  CHECK(std::isnan(*Value(r, "val/loss")));

  // train_gpt2.cu's May 2024 layout.
  r = *ParseLogLine(f, "step    7/74: train loss 4.150000 norm 2.5000 lr 6.00e-05 (45.10 ms, 90000 tok/s)");
  CHECK(r.step == 7u);
  CHECK(Value(r, "train/loss") == Approx(4.15));
  CHECK(Value(r, "grad/norm/total") == Approx(2.5));
  CHECK(Value(r, "optim/learning_rate") == Approx(6e-05));
}

TEST_CASE("every fixture line is detected as its own format, and no other parser claims it", "[client][tail]") {
  for (const auto& [name, format] : FixtureFormats()) {
    const auto lines = ReadFixture(name);
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string cleaned = CleanLogLine(lines[i]);
      INFO(name << ":" << i + 1 << ": " << cleaned);
      const std::optional<LogRecord> own = ParseLogLine(format, cleaned);
      const bool is_step = own && own->kind == Kind::kStep;
      if (is_step) {
        CHECK(DetectLogFormat(cleaned) == format);
      } else {
        CHECK_FALSE(DetectLogFormat(cleaned));
      }
      for (LogFormat other : AllLogFormats()) {
        if (other == format) continue;
        INFO("parsed as " << LogFormatName(other));
        const std::optional<LogRecord> rec = ParseLogLine(other, cleaned);
        CHECK_FALSE((rec && rec->kind == Kind::kStep));
      }
    }
  }
}

TEST_CASE("JSONL lines with a _step", "[client][tail]") {
  const LogFormat f = LogFormat::kJsonl;
  std::optional<LogRecord> r = ParseLogLine(
      f, R"({"_step": 5, "_timestamp": 1.5, "train/loss": 2.5, "grad/norm/total": NaN, )"
         R"("grad/norm/layers.0.w": "Infinity", "params/norm/total": "-Infinity", "note": "x", "ok": true})");
  REQUIRE(r);
  CHECK(r->kind == Kind::kStep);
  CHECK(r->step == 5u);
  CHECK(r->values.size() == 4);
  CHECK(Value(*r, "train/loss") == 2.5);
  CHECK(std::isnan(*Value(*r, "grad/norm/total")));
  CHECK(*Value(*r, "grad/norm/layers.0.w") > 0);
  CHECK(std::isinf(*Value(*r, "params/norm/total")));
  CHECK(*Value(*r, "params/norm/total") < 0);
  CHECK(DetectLogFormat(R"({"_step": 5, "train/loss": 2.5})") == LogFormat::kJsonl);

  r = ParseLogLine(f, R"({"_step": 7.0, "event": "lr drop"})");
  REQUIRE(r);
  CHECK(r->kind == Kind::kEvent);
  CHECK(r->step == 7u);
  CHECK(r->event == "lr drop");

  CHECK_FALSE(ParseLogLine(f, R"({"train/loss": 1.0})"));
  CHECK_FALSE(ParseLogLine(f, R"({"_step": -1, "train/loss": 1.0})"));
  CHECK_FALSE(ParseLogLine(f, R"({"_step": 1.5, "train/loss": 1.0})"));
  CHECK_FALSE(ParseLogLine(f, R"({"_step": "3", "train/loss": 1.0})"));
  CHECK_FALSE(ParseLogLine(f, R"({"_step": 1e300})"));
  CHECK_FALSE(ParseLogLine(f, R"({"_step": 1, "train/loss": )"));
  CHECK_FALSE(ParseLogLine(f, R"(["_step", 1])"));
}

TEST_CASE("CleanLogLine removes ANSI codes, redraws, trailing space and rank prefixes", "[client][tail]") {
  // SOURCES-2.md's reconstruction of a coloured torchtitan line.
  const std::string coloured =
      "[rank0]:[titan] 2026-05-18 16:04:46,338 - root - INFO - \x1b[31mstep: 14  \x1b[32mloss:  3.24405  "
      "\x1b[38;2;180;60;0mgrad_norm:  0.8319  \x1b[38;2;54;234;195mmemory:  9.46GiB(64.99%)  \x1b[34mtps: 7,282  "
      "\x1b[36mtflops: 0.52  \x1b[35mmfu: 0.17%\x1b[39m";
  const std::string plain = CleanLogLine(coloured);
  CHECK(plain ==
        "[titan] 2026-05-18 16:04:46,338 - root - INFO - step: 14  loss:  3.24405  grad_norm:  0.8319  "
        "memory:  9.46GiB(64.99%)  tps: 7,282  tflops: 0.52  mfu: 0.17%");
  CHECK(plain == CleanLogLine(ReadFixture("torchtitan.log")[0]));
  CHECK(DetectLogFormat(plain) == LogFormat::kTorchtitan);

  CHECK(CleanLogLine("\x1b]0;job title\x07iter 1: loss 2.0") == "iter 1: loss 2.0");
  CHECK(CleanLogLine("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ text") == "link text");
  CHECK(CleanLogLine(std::string("\x1b") + "cstep=1") == "step=1");
  CHECK(CleanLogLine("\x1b[2K\x1b[1Gdone\x1b") == "done");
  CHECK(CleanLogLine("\x1b[") == "");
  CHECK(CleanLogLine("\x1b]unterminated") == "");

  CHECK(CleanLogLine(" 10%|#  | 1/10 [00:01<00:09]\r 20%|## | 2/10 [00:02<00:08]") == " 20%|## | 2/10 [00:02<00:08]");
  CHECK(CleanLogLine("iter 1: loss 2.0\r") == "iter 1: loss 2.0");
  CHECK(CleanLogLine("old\r{'loss': 1.0}\r   \r") == "{'loss': 1.0}");
  CHECK(CleanLogLine("\r\r") == "");
  CHECK(CleanLogLine("a line  \t ") == "a line");
  CHECK(CleanLogLine(" iteration  1/ 2 |") == " iteration  1/ 2 |");  // leading space is Megatron's

  CHECK(CleanLogLine("[rank0]:x") == "x");
  CHECK(CleanLogLine("[rank12]: x") == "x");
  CHECK(CleanLogLine("[default0]:x") == "x");
  CHECK(CleanLogLine("[default7]: x") == "x");
  CHECK(CleanLogLine("0: x") == "x");
  CHECK(CleanLogLine("12: x") == "x");
  CHECK(CleanLogLine("stdout: x") == "x");
  CHECK(CleanLogLine("stderr: x") == "x");
  CHECK(CleanLogLine("3: [rank3]: stdout: [default1]:x") == "x");
  CHECK(CleanLogLine("[titan] x") == "[titan] x");
  CHECK(CleanLogLine("[Rank 0] x") == "[Rank 0] x");
  CHECK(CleanLogLine("12:30 x") == "12:30 x");
  CHECK(CleanLogLine("iter 0: loss 1.0") == "iter 0: loss 1.0");
  CHECK(CleanLogLine("[rank]: x") == "[rank]: x");

  // tqdm's redraw, then DeepSpeed's logger on the same physical line: both survive.
  const std::string ds_line = ReadFixture("deepspeed.log")[5];
  const std::string redrawn = "\r  7%|#   | 1998/24128 [1:52:06<20:27:23,  3.33s/it]\r" + ds_line;
  const std::string cleaned = CleanLogLine(redrawn);
  CHECK(cleaned == ds_line);
  const std::optional<LogRecord> ds = ParseLogLine(LogFormat::kDeepSpeed, cleaned);
  REQUIRE(ds);
  CHECK(ds->step == 2000u);
  CHECK(ds->progress_step == 1999u);
  const std::optional<LogRecord> bar = ParseLogLine(LogFormat::kHfTrainer, cleaned);
  REQUIRE(bar);
  CHECK(bar->kind == Kind::kProgress);
  CHECK(bar->step == 1999u);
  CHECK(DetectLogFormat(cleaned) == LogFormat::kDeepSpeed);
}

TEST_CASE("hostile lines neither crash nor yield step records", "[client][tail]") {
  std::vector<std::string> hostile = {
      "",
      "     ",
      std::string("iter 1: loss\0 2.0", 17),
      std::string("\0\0\0", 3),
      "iteration 99999999999999999999999/1 |",
      " iteration 1/ |",
      "iteration 5/ 10",
      "step=-1",
      "step=1, skipped=",
      "step=99999999999999999999999, skipped=1, lr=[1]",
      "{'loss': ",
      "{'loss': 1.0",
      "{'loss': (1, 2}",
      "{'loss': [1, 2)}",
      "{'loss' 1.0}",
      "{'",
      "{",
      "{\"_step\": [1, 2",
      "{\"_step\": ",
      "step: ",
      "step: 99999999999999999999999  loss: 1.0",
      "step   1/",
      "step 1: train loss ",
      "iter : loss 1.0",
      "val loss ",
      "val loss 1.0 extra",
      " validation loss at iteration |",
      "| 1/ [",
      "|99999999999999999999999/1 [",
      "[rank0]:",
      "\x1b[31m",
      "\r",
  };
  hostile.push_back(std::string(1 << 20, 'a'));
  hostile.push_back(std::string(1 << 20, '{'));
  hostile.push_back(std::string(1 << 20, '['));
  hostile.push_back(std::string(1 << 20, '9'));
  hostile.push_back(std::string(1 << 20, '\x1b'));
  hostile.push_back("{'loss': '" + std::string(1 << 20, 'x'));
  std::string repeated;
  while (repeated.size() < (1 << 20)) repeated += "iteration 1/ step= step: | 1/2 [{'a': ";
  hostile.push_back(repeated);
  std::string long_number = "iter 1: loss " + std::string(1 << 20, '1');
  hostile.push_back(long_number);

  for (const std::string& raw : hostile) {
    INFO("line of " << raw.size() << " bytes: " << raw.substr(0, 60));
    std::string cleaned;
    REQUIRE_NOTHROW(cleaned = CleanLogLine(raw));
    for (const std::string& line : {raw, cleaned}) {
      for (LogFormat f : AllLogFormats()) {
        std::optional<LogRecord> rec;
        REQUIRE_NOTHROW(rec = ParseLogLine(f, line));
        CHECK_FALSE((rec && rec->kind == Kind::kStep));
      }
      CHECK_FALSE(DetectLogFormat(line));
    }
  }
}

TEST_CASE("random splices of real lines never crash", "[client][tail]") {
  std::vector<std::string> corpus;
  for (const auto& [name, format] : FixtureFormats()) {
    for (const std::string& line : ReadFixture(name)) corpus.push_back(line);
  }
  std::mt19937 rng(20240917);
  for (int i = 0; i < 3000; ++i) {
    const std::string& a = corpus[rng() % corpus.size()];
    const std::string& b = corpus[rng() % corpus.size()];
    const size_t cut_a = rng() % (a.size() + 1);
    const size_t cut_b = rng() % (b.size() + 1);
    std::string line = a.substr(0, cut_a) + b.substr(cut_b);
    if (!line.empty() && rng() % 4 == 0) line[rng() % line.size()] = static_cast<char>(rng() % 256);
    const std::string cleaned = CleanLogLine(line);
    for (LogFormat f : AllLogFormats()) {
      std::optional<LogRecord> rec;
      REQUIRE_NOTHROW(rec = ParseLogLine(f, cleaned));
      if (rec && rec->kind == Kind::kProgress) CHECK(rec->step == rec->progress_step);
    }
    REQUIRE_NOTHROW(DetectLogFormat(cleaned));
  }
}

TEST_CASE("a line's timestamp gives its step a time, in the zone the log was written in", "[tail][time]") {
  const LogTimeZone utc{.local = false, .offset_seconds = 0};
  // 2026-12-07 00:00:01 UTC is 1796601601.
  constexpr double kAt = 1796601601.0;
  CHECK(LineTime(" [2026-12-07 00:00:01] iteration      122/  250000 | lm loss: 2.5 |", utc) == kAt);
  CHECK(LineTime("[titan] 2026-12-07 00:00:01,338 - root - INFO - step: 14  loss:  3.24", utc) ==
        Approx(kAt + 0.338).epsilon(1e-12));
  CHECK(LineTime("[2026-12-07 00:00:01,608] [INFO] [logging.py:60:log_dist] [Rank 0] step=25", utc) ==
        Approx(kAt + 0.608).epsilon(1e-12));
  CHECK(LineTime("[2026-12-07 00:00:01.123456] iteration 1/ 10 |", utc) == Approx(kAt + 0.123456).epsilon(1e-12));
  // ISO 8601 with its own zone: the zone given is not used.
  CHECK(LineTime("2026-12-07T02:00:01+02:00 step 3", utc) == kAt);
  CHECK(LineTime("2026-12-07T00:00:01Z step 3", LogTimeZone{.local = false, .offset_seconds = 3600}) == kAt);
  // A zone for those that carry none.
  CHECK(LineTime("[2026-12-07 01:00:01] iteration 1/ 10 |", *ParseLogTimeZone("+01:00")) == kAt);
  CHECK(LineTime("[2026-12-06 19:00:01] iteration 1/ 10 |", *ParseLogTimeZone("-0500")) == kAt);
  // Local time, as the machine's zone reads it.
  std::tm tm{};
  tm.tm_year = 2026 - 1900;
  tm.tm_mon = 11;
  tm.tm_mday = 7;
  tm.tm_sec = 1;
  tm.tm_isdst = -1;
  CHECK(LineTime("[2026-12-07 00:00:01] iteration 1/ 10 |", LogTimeZone{}) == static_cast<double>(std::mktime(&tm)));
  // No time, or not one: nothing.
  CHECK_FALSE(LineTime(" iteration      122/  250000 | lm loss: 2.5 |", utc));
  CHECK_FALSE(LineTime("[2026-13-07 00:00:01] bad month", utc));
  CHECK_FALSE(LineTime("step 12026-12-07 00:00:01", utc));                    // digits before: not a date
  CHECK_FALSE(LineTime(std::string(100, 'x') + "2026-12-07 00:00:01", utc));  // past the line's head
}

TEST_CASE("the zone of a log (tail --log-tz) is local, UTC or an offset, and nothing else", "[tail][time]") {
  CHECK(ParseLogTimeZone("local")->local);
  CHECK(ParseLogTimeZone("UTC")->offset_seconds == 0);
  CHECK_FALSE(ParseLogTimeZone("utc")->local);
  CHECK(ParseLogTimeZone("+02:00")->offset_seconds == 7200);
  CHECK(ParseLogTimeZone("-0530")->offset_seconds == -(5 * 3600 + 30 * 60));
  CHECK(ParseLogTimeZone("+9")->offset_seconds == 9 * 3600);
  for (const char* bad : {"", "Europe/Paris", "+25:00", "+02:99", "2", "+0:300"}) {
    CAPTURE(bad);
    CHECK_FALSE(ParseLogTimeZone(bad));
  }
}
