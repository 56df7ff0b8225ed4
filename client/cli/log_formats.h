// Parsing of the metric lines that training frameworks print on stdout, for `gradwatch tail`:
// Megatron-LM / Megatron-DeepSpeed, DeepSpeed, Hugging Face Trainer, torchtitan, nanoGPT, llm.c and
// W&B-history-style JSONL. No I/O here, so every rule is unit-testable and the parsers can be fuzzed.
// The line formats, with their sources, are described in tests/fixtures/tail/SOURCES*.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

enum class LogFormat { kJsonl, kMegatron, kHfTrainer, kTorchtitan, kNanoGpt, kLlmc, kDeepSpeed };

// "jsonl", "megatron" (also covers Megatron-DeepSpeed), "hf", "torchtitan", "nanogpt", "llmc", "deepspeed".
std::string_view LogFormatName(LogFormat f);
// The names above, and the aliases "huggingface", "llm.c" and "megatron-deepspeed"; case-insensitive.
std::optional<LogFormat> ParseLogFormatName(std::string_view name);
// Every format, in enum order.
const std::vector<LogFormat>& AllLogFormats();

// Removes ANSI escape sequences, carriage-return redraws (only the text after the last '\r' that is
// followed by non-blank text is kept), trailing whitespace, and leading rank prefixes ("[rank0]:",
// "[default7]: ", srun's "12: ", "stdout: ", "stderr: "), repeatedly. A tqdm bar and a log line that
// share a physical line without a '\r' between them are both kept.
std::string CleanLogLine(std::string_view raw);

// Series keys used: train/loss, grad/norm/total, params/norm/total, optim/learning_rate,
// train/skipped_iterations, train/skipped_iterations_total, train/nan_iterations, train/loss_scale,
// train/tokens_per_second, train/epoch, val/loss, train/loss_eval, train/num_zeros, and hf/<key> for the
// other numbers of a Hugging Face log dict.
struct LogRecord {
  // kCatalog: a JSONL line's `"params"` (a catalog change from its step on) without metrics.
  enum class Kind { kStep, kEvent, kProgress, kCatalog };
  Kind kind = Kind::kStep;
  // The step the line names; nullopt for lines that print none (Hugging Face dicts, llm.c "val loss",
  // events): the caller attaches those to the step it last saw or counts.
  std::optional<uint64_t> step;
  std::vector<std::pair<std::string, double>> values;  // NaN and ±inf are kept
  std::string event;                                   // kEvent: the text to record
  // A JSONL line's `"params"` (ParseCatalogChanges), or why it cannot be sent.
  std::vector<v1::ParamChange> catalog_update;
  std::string catalog_error;
  // The count of a tqdm progress bar on the line (Hugging Face, DeepSpeed), when there is one.
  std::optional<uint64_t> progress_step;
};

// The zone of log timestamps that carry none of their own: the machine's local time (as Megatron's
// datetime.now() and Python's logging print it), or a fixed offset from UTC.
struct LogTimeZone {
  bool local = true;
  int offset_seconds = 0;  // east of UTC, when !local
};
// "local", "UTC" (or "Z"), or an offset "+02:00", "-0530", "+2"; nullopt for anything else.
std::optional<LogTimeZone> ParseLogTimeZone(std::string_view text);

// The time a cleaned line was written, as Unix seconds, when it carries one within its first 80
// characters: YYYY-MM-DD, a space or T, HH:MM:SS, optional fractional seconds after '.' or ','
// (Megatron's "[2026-12-07 00:00:01]", torchtitan's and Python logging's "2026-05-18
// 16:04:46,338", DeepSpeed's "[2024-03-07 15:27:02,646]", ISO 8601), and an optional zone (Z,
// +HH:MM); a time without one is read in `zone`. nullopt when the line has no valid time.
std::optional<double> LineTime(std::string_view cleaned, const LogTimeZone& zone);

// Parses one line cleaned by CleanLogLine as format f. nullopt: the line is not one this format
// reports (banner, warning, argument dump...). Never throws.
std::optional<LogRecord> ParseLogLine(LogFormat f, std::string_view cleaned);

// The format whose parser returns a kStep record for this cleaned line, trying JSONL first, then the
// others in an order that avoids false positives; nullopt if none.
std::optional<LogFormat> DetectLogFormat(std::string_view cleaned);

}  // namespace gradwatch::cli
