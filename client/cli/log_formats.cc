#include "client/cli/log_formats.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>

#include "client/cli/replay_parser.h"

namespace gradwatch::cli {
namespace {

using nlohmann::json;

constexpr std::string_view kLossKey = "train/loss";
constexpr std::string_view kGradNormKey = "grad/norm/total";
constexpr std::string_view kParamsNormKey = "params/norm/total";
constexpr std::string_view kLearningRateKey = "optim/learning_rate";
constexpr std::string_view kSkippedKey = "train/skipped_iterations";
constexpr std::string_view kSkippedTotalKey = "train/skipped_iterations_total";
constexpr std::string_view kNanKey = "train/nan_iterations";
constexpr std::string_view kLossScaleKey = "train/loss_scale";
constexpr std::string_view kTokensPerSecondKey = "train/tokens_per_second";
constexpr std::string_view kEpochKey = "train/epoch";
constexpr std::string_view kValLossKey = "val/loss";
constexpr std::string_view kLossEvalKey = "train/loss_eval";
constexpr std::string_view kNumZerosKey = "train/num_zeros";

// No real number is longer; the bound keeps a hostile megabyte token from being copied.
constexpr size_t kMaxNumberLength = 64;

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsWordChar(char c) { return IsAlpha(c) || IsDigit(c) || c == '_'; }
char LowerChar(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

std::string_view TrimLeft(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && IsSpace(s[i])) ++i;
  return s.substr(i);
}

std::string_view TrimRight(std::string_view s) {
  size_t n = s.size();
  while (n > 0 && IsSpace(s[n - 1])) --n;
  return s.substr(0, n);
}

std::string_view Trim(std::string_view s) { return TrimRight(TrimLeft(s)); }

// A whole token as a number: decimal or exponent notation, or a spelling of NaN / ±infinity as
// Python, C printf and JSON writers print them. Hex floats and trailing text are rejected.
std::optional<double> ParseNumber(std::string_view text) {
  text = Trim(text);
  if (text.empty() || text.size() > kMaxNumberLength) return std::nullopt;
  const std::string lower = AsciiLower(text);
  std::string_view body = lower;
  double sign = 1.0;
  if (body[0] == '+' || body[0] == '-') {
    if (body[0] == '-') sign = -1.0;
    body.remove_prefix(1);
  }
  if (body == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (body == "inf" || body == "infinity") return sign * std::numeric_limits<double>::infinity();
  bool digit = false;
  for (char c : lower) {
    if (IsDigit(c)) {
      digit = true;
    } else if (c != '+' && c != '-' && c != '.' && c != 'e') {
      return std::nullopt;
    }
  }
  if (!digit) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(lower.c_str(), &end);
  if (end != lower.c_str() + lower.size()) return std::nullopt;
  return value;
}

// All-digit text that fits in 64 bits.
std::optional<uint64_t> ParseUint(std::string_view digits) {
  if (digits.empty()) return std::nullopt;
  uint64_t value = 0;
  for (char c : digits) {
    if (!IsDigit(c)) return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - d) / 10) return std::nullopt;
    value = value * 10 + d;
  }
  return value;
}

// A read position in a line, for the formats that are easiest to follow left to right.
class Cursor {
 public:
  explicit Cursor(std::string_view s, size_t pos = 0) : s_(s), pos_(pos < s.size() ? pos : s.size()) {}

  size_t pos() const { return pos_; }
  bool AtEnd() const { return pos_ >= s_.size(); }
  char Peek() const { return AtEnd() ? '\0' : s_[pos_]; }
  std::string_view Rest() const { return s_.substr(pos_); }

  void SkipSpaces() {
    while (!AtEnd() && IsSpace(s_[pos_])) ++pos_;
  }
  // Consumes `lit` if the text continues with it.
  bool Eat(std::string_view lit) {
    if (Rest().substr(0, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }
  // A run of digits; nullopt (and nothing consumed) when there is none, or when it overflows.
  std::optional<uint64_t> Uint() {
    size_t end = pos_;
    while (end < s_.size() && IsDigit(s_[end])) ++end;
    std::optional<uint64_t> value = ParseUint(s_.substr(pos_, end - pos_));
    if (value) pos_ = end;
    return value;
  }
  // Consumes a run of digits, whatever its length; false when there is none.
  bool SkipDigits() {
    const size_t begin = pos_;
    while (!AtEnd() && IsDigit(s_[pos_])) ++pos_;
    return pos_ > begin;
  }
  // After spaces, the text up to whitespace or one of `stops`.
  std::string_view Token(std::string_view stops) {
    SkipSpaces();
    const size_t begin = pos_;
    while (!AtEnd() && !IsSpace(s_[pos_]) && stops.find(s_[pos_]) == std::string_view::npos) ++pos_;
    return s_.substr(begin, pos_ - begin);
  }

 private:
  std::string_view s_;
  size_t pos_;
};

// Where `word` occurs at or after `from` with no letter, digit or '_' right before it; npos if nowhere.
size_t FindWord(std::string_view s, std::string_view word, size_t from = 0) {
  while ((from = s.find(word, from)) != std::string_view::npos) {
    if (from == 0 || !IsWordChar(s[from - 1])) return from;
    from += word.size();
  }
  return std::string_view::npos;
}

void Add(LogRecord& rec, std::string_view key, std::optional<double> value) {
  if (value) rec.values.emplace_back(std::string(key), *value);
}

LogRecord StepRecord(std::optional<uint64_t> step) {
  LogRecord rec;
  rec.kind = LogRecord::Kind::kStep;
  rec.step = step;
  return rec;
}

std::string StripAnsi(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '\x1b') {
      out += s[i++];
      continue;
    }
    if (i + 1 >= s.size()) break;
    const char kind = s[i + 1];
    size_t j = i + 2;
    if (kind == '[') {
      // Parameter and intermediate bytes, then one final byte.
      while (j < s.size() && static_cast<unsigned char>(s[j]) >= 0x20 && static_cast<unsigned char>(s[j]) <= 0x3f) {
        ++j;
      }
      if (j < s.size() && static_cast<unsigned char>(s[j]) >= 0x40 && static_cast<unsigned char>(s[j]) <= 0x7e) ++j;
    } else if (kind == ']') {
      // An unterminated OSC swallows the rest of the line, as a terminal would.
      while (j < s.size()) {
        if (s[j] == '\x07') {
          ++j;
          break;
        }
        if (s[j] == '\x1b' && j + 1 < s.size() && s[j + 1] == '\\') {
          j += 2;
          break;
        }
        ++j;
      }
    }
    i = j;
  }
  return out;
}

// The text a terminal would show after '\r' redraws: the last '\r'-separated segment that is not
// blank. A tqdm bar and a log line with no '\r' between them stay together.
std::string_view LastRedraw(std::string_view s) {
  std::string_view last;
  size_t begin = 0;
  while (begin <= s.size()) {
    size_t cr = s.find('\r', begin);
    if (cr == std::string_view::npos) cr = s.size();
    const std::string_view segment = s.substr(begin, cr - begin);
    if (!TrimLeft(segment).empty()) last = segment;
    begin = cr + 1;
  }
  return last;
}

// Removes one launcher prefix: "[rank0]:", "[default7]: " (torchrun: role then local rank),
// srun --label's "12: ", or "stdout: " / "stderr: ".
bool StripRankPrefix(std::string_view& s) {
  for (std::string_view p : {std::string_view("stdout: "), std::string_view("stderr: ")}) {
    if (s.starts_with(p)) {
      s.remove_prefix(p.size());
      return true;
    }
  }
  if (s.empty()) return false;
  size_t i = 0;
  if (s[0] == '[') {
    i = 1;
    const size_t role = i;
    while (i < s.size() && (IsAlpha(s[i]) || s[i] == '_')) ++i;
    if (i == role) return false;
    const size_t rank = i;
    while (i < s.size() && IsDigit(s[i])) ++i;
    if (i == rank || s.substr(i, 2) != "]:") return false;
    i += 2;
    if (i < s.size() && s[i] == ' ') ++i;
    s.remove_prefix(i);
    return true;
  }
  while (i < s.size() && IsDigit(s[i])) ++i;
  if (i == 0 || s.substr(i, 2) != ": ") return false;
  s.remove_prefix(i + 2);
  return true;
}

struct ProgressBar {
  uint64_t count = 0;
  size_t end = 0;  // just past the bar's closing ']', or the end of the line
};

// tqdm's default layout: "{percentage}|{bar}| {n}/{total} [{elapsed}<{remaining}, {rate}]".
std::optional<ProgressBar> FindProgressBar(std::string_view s) {
  size_t pos = 0;
  while ((pos = s.find(" [", pos)) != std::string_view::npos) {
    size_t total_begin = pos;
    while (total_begin > 0 && IsDigit(s[total_begin - 1])) --total_begin;
    if (total_begin < pos && total_begin > 0 && s[total_begin - 1] == '/') {
      const size_t slash = total_begin - 1;
      size_t count_begin = slash;
      while (count_begin > 0 && IsDigit(s[count_begin - 1])) --count_begin;
      size_t before = count_begin;
      while (before > 0 && s[before - 1] == ' ') --before;
      if (count_begin < slash && before > 0 && s[before - 1] == '|') {
        if (std::optional<uint64_t> count = ParseUint(s.substr(count_begin, slash - count_begin))) {
          const size_t close = s.find(']', pos);
          return ProgressBar{*count, close == std::string_view::npos ? s.size() : close + 1};
        }
      }
    }
    pos += 2;
  }
  return std::nullopt;
}

std::optional<double> JsonNumber(const json& v) {
  if (v.is_number()) return v.get<double>();
  if (!v.is_string()) return std::nullopt;
  const std::string& s = v.get_ref<const std::string&>();
  std::string lower = AsciiLower(s);
  std::string_view body = lower;
  if (!body.empty() && (body[0] == '-' || body[0] == '+')) body.remove_prefix(1);
  if (body != "nan" && body != "inf" && body != "infinity") return std::nullopt;
  return ParseNumber(lower);
}

std::optional<uint64_t> JsonStep(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d >= 0 && d < 18446744073709551616.0 && std::floor(d) == d) {
      return static_cast<uint64_t>(d);
    }
  }
  return std::nullopt;  // negative, fractional, or not a number
}

std::optional<LogRecord> ParseJsonl(std::string_view line) {
  const std::string_view t = Trim(line);
  if (t.empty() || t.front() != '{' || t.find("\"_step\"") == std::string_view::npos) return std::nullopt;
  std::string error;  // not JSON, or a key given twice: not a record
  const json obj = ParseJsonLine(t, &error);
  if (!obj.is_object()) return std::nullopt;
  const auto step_it = obj.find("_step");
  if (step_it == obj.end()) return std::nullopt;
  const std::optional<uint64_t> step = JsonStep(*step_it);
  if (!step) return std::nullopt;
  LogRecord rec = StepRecord(step);
  for (const auto& [key, value] : obj.items()) {
    if (!key.empty() && key[0] == '_') continue;
    if (key == "event" && value.is_string()) {
      rec.event = value.get<std::string>();
      continue;
    }
    if (key == "params" && value.is_array()) {
      if (auto problem = ParseCatalogChanges(value, &rec.catalog_update)) {
        rec.catalog_update.clear();
        rec.catalog_error = *problem;
      }
      continue;
    }
    Add(rec, key, JsonNumber(value));
  }
  if (rec.values.empty() && (!rec.catalog_update.empty() || !rec.catalog_error.empty())) {
    rec.kind = LogRecord::Kind::kCatalog;
  } else if (rec.values.empty() && !rec.event.empty()) {
    rec.kind = LogRecord::Kind::kEvent;
  }
  return rec;
}

// "tokens per gpu per second(tgs)", "tokens_per_gpu_per_second_tgs" → "tokens per gpu per second tgs":
// one spelling for the upstream "name: value" fields and the ALCF fork's "name=value" ones.
std::string NormalizeFieldName(std::string_view name) {
  std::string out;
  bool space = false;
  for (char c : name) {
    c = LowerChar(c);
    if (c == '_' || c == '(' || c == ')' || IsSpace(c)) {
      space = true;
      continue;
    }
    if (space && !out.empty()) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

// Splits "name: value" (or "name=value") into the normalized name and the value text.
std::optional<std::pair<std::string, std::string_view>> SplitField(std::string_view field) {
  size_t sep = field.rfind(':');
  if (sep == std::string_view::npos) sep = field.rfind('=');
  if (sep == std::string_view::npos) return std::nullopt;
  return std::make_pair(NormalizeFieldName(field.substr(0, sep)), field.substr(sep + 1));
}

std::optional<std::string_view> MegatronKey(const std::string& name) {
  static const std::pair<std::string_view, std::string_view> kKeys[] = {
      {"lm loss", kLossKey},
      {"grad norm", kGradNormKey},
      {"params norm", kParamsNormKey},
      {"learning rate", kLearningRateKey},
      {"loss scale", kLossScaleKey},
      {"number of skipped iterations", kSkippedKey},
      {"number of nan iterations", kNanKey},
      {"num zeros", kNumZerosKey},
      {"tokens per gpu per second tgs", kTokensPerSecondKey},
  };
  for (const auto& [field, key] : kKeys) {
    if (name == field) return key;
  }
  return std::nullopt;
}

// " validation loss at iteration 1000 | lm loss value: 2.724416E+00 | lm loss PPL: 1.5E+01 |", where the
// part before the first '|' can also read "iteration 1000 on validation set" or "the end of training
// for val data" (no step then).
std::optional<LogRecord> ParseMegatronValidation(std::string_view line) {
  constexpr std::string_view kLead = "validation loss at ";
  const size_t at = FindWord(line, kLead);
  if (at == std::string_view::npos) return std::nullopt;
  const size_t bar = line.find('|', at);
  if (bar == std::string_view::npos) return std::nullopt;
  Cursor c(line.substr(0, bar), at + kLead.size());
  std::optional<uint64_t> step;
  if (c.Eat("iteration ")) {
    c.SkipSpaces();
    step = c.Uint();
    if (!step) return std::nullopt;
  }
  LogRecord rec = StepRecord(step);
  std::string_view rest = line.substr(bar + 1);
  while (!rest.empty()) {
    const size_t next = rest.find('|');
    const std::string_view field = rest.substr(0, next);
    rest = next == std::string_view::npos ? std::string_view() : rest.substr(next + 1);
    const auto split = SplitField(field);
    if (split && split->first == "lm loss value") Add(rec, kValLossKey, ParseNumber(split->second));
  }
  if (rec.values.empty()) return std::nullopt;
  return rec;
}

std::optional<LogRecord> ParseMegatron(std::string_view line) {
  if (std::optional<LogRecord> val = ParseMegatronValidation(line)) return val;
  constexpr std::string_view kIteration = "iteration";
  for (size_t at = FindWord(line, kIteration); at != std::string_view::npos;
       at = FindWord(line, kIteration, at + kIteration.size())) {
    // " iteration      122/  250000 |" or the ALCF fork's " iteration=  1/ 317892 |".
    Cursor c(line, at + kIteration.size());
    c.SkipSpaces();
    if (c.Eat("=")) c.SkipSpaces();
    if (!IsDigit(c.Peek())) continue;
    const std::optional<uint64_t> step = c.Uint();
    if (!step) return std::nullopt;  // more digits than any step has
    c.SkipSpaces();
    if (!c.Eat("/")) continue;
    c.SkipSpaces();
    if (!c.SkipDigits()) continue;
    c.SkipSpaces();
    if (!c.Eat("|")) continue;

    LogRecord rec = StepRecord(step);
    std::string_view rest = c.Rest();
    while (!rest.empty()) {
      const size_t next = rest.find('|');
      const std::string_view field = rest.substr(0, next);
      rest = next == std::string_view::npos ? std::string_view() : rest.substr(next + 1);
      const auto split = SplitField(field);
      if (!split) continue;
      if (std::optional<std::string_view> key = MegatronKey(split->first)) Add(rec, *key, ParseNumber(split->second));
    }
    return rec;
  }
  return std::nullopt;
}

std::optional<LogRecord> ParseDeepSpeed(std::string_view line) {
  // loss_scaler.py's current wording, and the 2021 one printed through log_dist.
  for (std::string_view marker : {std::string_view("[deepspeed] OVERFLOW!"), std::string_view("Overflow detected")}) {
    if (const size_t at = line.find(marker); at != std::string_view::npos) {
      LogRecord rec;
      rec.kind = LogRecord::Kind::kEvent;
      rec.event = std::string(line.substr(at));
      return rec;
    }
  }
  // engine.py: "step={step}, skipped={skipped_steps}, lr={lr}, mom={mom}". FindWord keeps the timer
  // line's "micro_step=" and "global_step=" out.
  constexpr std::string_view kStep = "step=";
  for (size_t at = FindWord(line, kStep); at != std::string_view::npos; at = FindWord(line, kStep, at + kStep.size())) {
    Cursor c(line, at + kStep.size());
    if (!IsDigit(c.Peek())) continue;
    const std::optional<uint64_t> step = c.Uint();
    if (!step) return std::nullopt;
    if (!c.Eat(", skipped=")) continue;
    const std::optional<uint64_t> skipped = c.Uint();
    if (!skipped) return std::nullopt;

    LogRecord rec = StepRecord(step);
    // Cumulative over the run: the caller derives per-interval counts if it wants them.
    rec.values.emplace_back(std::string(kSkippedTotalKey), static_cast<double>(*skipped));
    if (c.Eat(", lr=[")) Add(rec, kLearningRateKey, ParseNumber(c.Token(",]")));  // one value per param group
    if (std::optional<ProgressBar> bar = FindProgressBar(line.substr(0, at))) rec.progress_step = bar->count;
    return rec;
  }
  return std::nullopt;
}

struct PyEntry {
  std::string key;
  std::string_view text;         // the value as printed
  std::optional<double> number;  // when the value is a number
};

// The end of a Python string literal starting at `i` (its quote), or npos when unterminated.
size_t SkipPyString(std::string_view s, size_t i) {
  const char quote = s[i];
  for (++i; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == quote) {
      return i + 1;
    }
  }
  return std::string_view::npos;
}

// A flat Python dict repr from `s[0] == '{'`: 'key': value pairs; values other than numbers (strings,
// True/False/None, nested containers) are kept as text. nullopt when truncated or malformed.
std::optional<std::vector<PyEntry>> ParsePyDict(std::string_view s) {
  std::vector<PyEntry> entries;
  size_t i = 1;
  auto skip_spaces = [&] {
    while (i < s.size() && IsSpace(s[i])) ++i;
  };
  skip_spaces();
  if (i < s.size() && s[i] == '}') return entries;
  while (true) {
    skip_spaces();
    if (i >= s.size() || (s[i] != '\'' && s[i] != '"')) return std::nullopt;
    const size_t key_end = SkipPyString(s, i);
    if (key_end == std::string_view::npos) return std::nullopt;
    PyEntry entry;
    entry.key = std::string(s.substr(i + 1, key_end - i - 2));
    i = key_end;
    skip_spaces();
    if (i >= s.size() || s[i] != ':') return std::nullopt;
    ++i;
    skip_spaces();
    const size_t value_begin = i;
    int depth = 0;
    while (i < s.size()) {
      const char c = s[i];
      if (c == '\'' || c == '"') {
        i = SkipPyString(s, i);
        if (i == std::string_view::npos) return std::nullopt;
        continue;
      }
      if (depth == 0 && (c == ',' || c == '}')) break;
      if (c == '(' || c == '[' || c == '{') ++depth;
      if (c == ')' || c == ']' || c == '}') --depth;
      if (depth < 0) return std::nullopt;
      ++i;
    }
    if (i >= s.size()) return std::nullopt;
    entry.text = Trim(s.substr(value_begin, i - value_begin));
    if (entry.text.empty()) return std::nullopt;
    entry.number = ParseNumber(entry.text);
    entries.push_back(std::move(entry));
    if (s[i] == ',') {
      ++i;
      skip_spaces();
      if (i < s.size() && s[i] == '}') return entries;  // a trailing comma
      continue;
    }
    return entries;  // s[i] == '}'
  }
}

std::string HfSeriesKey(std::string_view key) {
  std::string out = "hf/";
  for (char c : key) {
    out += (IsWordChar(c) || c == '.' || c == '/' || c == '-') ? c : '_';
  }
  return out;
}

std::string FormatShort(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Trainer.train's final metrics: one line for the whole run, so an event rather than a step.
LogRecord HfSummaryEvent(const std::vector<PyEntry>& entries) {
  std::string text = "training finished:";
  bool first = true;
  auto append = [&](std::string_view key, std::string_view shown) {
    text += first ? " " : ", ";
    first = false;
    text += key;
    text += '=';
    text += shown;
  };
  for (std::string_view want : {"train_runtime", "train_loss", "epoch"}) {
    for (const PyEntry& e : entries) {
      if (e.key != want || !e.number) continue;
      if (want == "train_runtime") {
        append(want, std::string(e.text) + " s");
      } else if (want == "train_loss") {
        append(want, FormatShort(*e.number));
      } else {
        append(want, e.text);
      }
    }
  }
  LogRecord rec;
  rec.kind = LogRecord::Kind::kEvent;
  rec.event = std::move(text);
  return rec;
}

std::optional<LogRecord> ParseHf(std::string_view line) {
  std::string_view t = TrimLeft(line);
  std::optional<ProgressBar> bar;
  if (!t.starts_with("{'")) {
    bar = FindProgressBar(t);
    if (bar) t = TrimLeft(t.substr(bar->end));
  }
  std::optional<std::vector<PyEntry>> entries;
  if (t.starts_with("{'")) entries = ParsePyDict(t);
  if (!entries) {
    if (!bar) return std::nullopt;
    LogRecord rec;
    rec.kind = LogRecord::Kind::kProgress;
    rec.step = bar->count;
    rec.progress_step = bar->count;
    return rec;
  }
  for (const PyEntry& e : *entries) {
    if (e.key == "train_runtime") {
      LogRecord rec = HfSummaryEvent(*entries);
      if (bar) rec.progress_step = bar->count;
      return rec;
    }
  }
  // The printed dict carries no step (it goes only to trainer_state.json).
  LogRecord rec = StepRecord(std::nullopt);
  if (bar) rec.progress_step = bar->count;
  for (const PyEntry& e : *entries) {
    if (!e.number) continue;
    if (e.key == "loss") {
      Add(rec, kLossKey, e.number);
    } else if (e.key == "grad_norm") {
      Add(rec, kGradNormKey, e.number);
    } else if (e.key == "learning_rate") {
      Add(rec, kLearningRateKey, e.number);
    } else if (e.key == "epoch") {
      Add(rec, kEpochKey, e.number);
    } else if (e.key == "eval_loss") {
      Add(rec, kValLossKey, e.number);
    } else {
      Add(rec, HfSeriesKey(e.key), e.number);
    }
  }
  // A dict of text only is some other print of the script, not a log dict.
  if (rec.values.empty()) return std::nullopt;
  return rec;
}

// "step: 14  loss:  3.24405  grad_norm:  0.8319  memory:  9.46GiB(64.99%)  tps: 7,282  tflops: 0.52  mfu: 0.17%"
std::optional<LogRecord> ParseTorchtitan(std::string_view line) {
  const size_t at = FindWord(line, "step:");
  if (at == std::string_view::npos || (at > 0 && !IsSpace(line[at - 1]))) return std::nullopt;
  Cursor c(line, at + 5);
  c.SkipSpaces();
  if (!IsDigit(c.Peek())) return std::nullopt;
  const std::optional<uint64_t> step = c.Uint();
  if (!step || !IsSpace(c.Peek())) return std::nullopt;
  const std::string_view rest = c.Rest();
  auto field = [&](std::string_view name) -> std::optional<std::string_view> {
    for (size_t i = rest.find(name); i != std::string_view::npos; i = rest.find(name, i + 1)) {
      if (i > 0 && IsSpace(rest[i - 1])) {
        Cursor v(rest, i + name.size());
        return v.Token("");
      }
    }
    return std::nullopt;
  };
  const std::optional<std::string_view> loss = field("loss:");
  if (!loss) return std::nullopt;
  LogRecord rec = StepRecord(step);
  Add(rec, kLossKey, ParseNumber(*loss));
  if (auto v = field("grad_norm:")) Add(rec, kGradNormKey, ParseNumber(*v));
  for (std::string_view name : {"tps:", "wps:"}) {
    if (auto v = field(name)) {
      std::string digits;
      for (char ch : *v) {
        if (ch != ',') digits += ch;
      }
      Add(rec, kTokensPerSecondKey, ParseNumber(digits));
      break;
    }
  }
  return rec;
}

// A "YYYY-mm-dd HH:MM:SS " prefix some users add to every line.
std::string_view StripDateTime(std::string_view s) {
  constexpr std::string_view kShape = "dddd-dd-dd dd:dd:dd ";
  if (s.size() < kShape.size()) return s;
  for (size_t i = 0; i < kShape.size(); ++i) {
    if (kShape[i] == 'd' ? !IsDigit(s[i]) : s[i] != kShape[i]) return s;
  }
  return TrimLeft(s.substr(kShape.size()));
}

std::optional<LogRecord> ParseNanoGpt(std::string_view line) {
  Cursor c(StripDateTime(TrimLeft(line)));
  if (c.Eat("iter ")) {
    // "iter N: loss X, time Yms, mfu Z%"
    const std::optional<uint64_t> step = c.Uint();
    if (!step || !c.Eat(": loss ")) return std::nullopt;
    const std::optional<double> loss = ParseNumber(c.Token(","));
    if (!loss || !(c.AtEnd() || c.Peek() == ',')) return std::nullopt;
    LogRecord rec = StepRecord(step);
    Add(rec, kLossKey, loss);
    return rec;
  }
  if (c.Eat("step ")) {
    // "step N: train loss X, val loss Y": both are estimates over eval batches.
    const std::optional<uint64_t> step = c.Uint();
    if (!step || !c.Eat(": train loss ")) return std::nullopt;
    const std::optional<double> train = ParseNumber(c.Token(","));
    if (!train || !c.Eat(", val loss ")) return std::nullopt;
    const std::optional<double> val = ParseNumber(c.Token(","));
    if (!val) return std::nullopt;
    LogRecord rec = StepRecord(step);
    Add(rec, kLossEvalKey, train);
    Add(rec, kValLossKey, val);
    return rec;
  }
  return std::nullopt;
}

// The number after `word` (a whole word) in `s`, e.g. "loss     nan (+nanz)" → NaN.
std::optional<double> NumberAfterWord(std::string_view s, std::string_view word) {
  for (size_t at = FindWord(s, word); at != std::string_view::npos; at = FindWord(s, word, at + word.size())) {
    const size_t after = at + word.size();
    if (after < s.size() && !IsSpace(s[after])) continue;
    Cursor c(s, after);
    return ParseNumber(c.Token("|(,"));
  }
  return std::nullopt;
}

std::optional<LogRecord> ParseLlmc(std::string_view line) {
  Cursor c(TrimLeft(line));
  if (c.Eat("val loss ")) {
    // No step: the caller attaches it to the last step it saw.
    const std::optional<double> val = ParseNumber(c.Rest());
    if (!val) return std::nullopt;
    LogRecord rec = StepRecord(std::nullopt);
    Add(rec, kValLossKey, val);
    return rec;
  }
  if (!c.Eat("step ")) return std::nullopt;
  c.SkipSpaces();
  const std::optional<uint64_t> step = c.Uint();
  if (!step) return std::nullopt;
  if (c.Eat("/")) {
    // train_gpt2.cu: "step   61/74 | loss 3.208939 (+nanz)| norm 1.4800 (+nanz)| lr 3.00e-04 | ...", and its
    // 2024 predecessors ("step N/T: train loss X norm Y lr Z (...)", "step N/T | train loss X | norm ...").
    if (!c.Uint()) return std::nullopt;
    c.SkipSpaces();
    if (!c.Eat("|") && !c.Eat(":")) return std::nullopt;
    const std::string_view rest = c.Rest();
    const std::optional<double> loss = NumberAfterWord(rest, "loss");
    if (!loss) return std::nullopt;
    LogRecord rec = StepRecord(step);
    Add(rec, kLossKey, loss);
    Add(rec, kGradNormKey, NumberAfterWord(rest, "norm"));
    Add(rec, kLearningRateKey, NumberAfterWord(rest, "lr"));
    return rec;
  }
  // train_gpt2.c (CPU): "step 0: train loss 5.356189 (took 1452.121000 ms)". The "(took" tells it from
  // nanoGPT's "step N: train loss X, val loss Y".
  if (!c.Eat(": train loss ")) return std::nullopt;
  const std::optional<double> loss = ParseNumber(c.Token(","));
  c.SkipSpaces();
  if (!loss || !c.Eat("(took ")) return std::nullopt;
  LogRecord rec = StepRecord(step);
  Add(rec, kLossKey, loss);
  return rec;
}

std::optional<LogRecord> Parse(LogFormat f, std::string_view line) {
  switch (f) {
    case LogFormat::kJsonl: return ParseJsonl(line);
    case LogFormat::kMegatron: return ParseMegatron(line);
    case LogFormat::kHfTrainer: return ParseHf(line);
    case LogFormat::kTorchtitan: return ParseTorchtitan(line);
    case LogFormat::kNanoGpt: return ParseNanoGpt(line);
    case LogFormat::kLlmc: return ParseLlmc(line);
    case LogFormat::kDeepSpeed: return ParseDeepSpeed(line);
  }
  return std::nullopt;
}

}  // namespace

std::string_view LogFormatName(LogFormat f) {
  switch (f) {
    case LogFormat::kJsonl: return "jsonl";
    case LogFormat::kMegatron: return "megatron";
    case LogFormat::kHfTrainer: return "hf";
    case LogFormat::kTorchtitan: return "torchtitan";
    case LogFormat::kNanoGpt: return "nanogpt";
    case LogFormat::kLlmc: return "llmc";
    case LogFormat::kDeepSpeed: return "deepspeed";
  }
  return "unknown";
}

std::optional<LogFormat> ParseLogFormatName(std::string_view name) {
  const std::string n = AsciiLower(name);
  if (n == "huggingface") return LogFormat::kHfTrainer;
  if (n == "llm.c") return LogFormat::kLlmc;
  if (n == "megatron-deepspeed") return LogFormat::kMegatron;
  for (LogFormat f : AllLogFormats()) {
    if (n == LogFormatName(f)) return f;
  }
  return std::nullopt;
}

const std::vector<LogFormat>& AllLogFormats() {
  static const std::vector<LogFormat> kAll = {LogFormat::kJsonl,      LogFormat::kMegatron, LogFormat::kHfTrainer,
                                              LogFormat::kTorchtitan, LogFormat::kNanoGpt,  LogFormat::kLlmc,
                                              LogFormat::kDeepSpeed};
  return kAll;
}

std::string CleanLogLine(std::string_view raw) {
  const std::string plain = StripAnsi(raw);
  std::string_view s = TrimRight(LastRedraw(plain));
  while (StripRankPrefix(s)) {
  }
  return std::string(s);
}

std::optional<LogTimeZone> ParseLogTimeZone(std::string_view text) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "local") return LogTimeZone{};
  if (lower == "utc" || lower == "z" || lower == "gmt") return LogTimeZone{.local = false, .offset_seconds = 0};
  if (lower.size() < 2 || (lower[0] != '+' && lower[0] != '-')) return std::nullopt;
  const int sign = lower[0] == '-' ? -1 : 1;
  std::string digits;
  for (size_t i = 1; i < lower.size(); ++i) {
    if (lower[i] == ':' && i == 3) continue;
    if (!std::isdigit(static_cast<unsigned char>(lower[i]))) return std::nullopt;
    digits += lower[i];
  }
  int hours = 0, minutes = 0;
  if (digits.size() <= 2) {
    hours = std::stoi(digits);
  } else if (digits.size() == 4) {
    hours = std::stoi(digits.substr(0, 2));
    minutes = std::stoi(digits.substr(2));
  } else {
    return std::nullopt;
  }
  if (hours > 14 || minutes > 59) return std::nullopt;
  return LogTimeZone{.local = false, .offset_seconds = sign * (hours * 3600 + minutes * 60)};
}

namespace {

// Reads `n` digits at text[at...] into *out; false when any is not a digit.
bool Digits(std::string_view text, size_t at, size_t n, int* out) {
  if (at + n > text.size()) return false;
  int v = 0;
  for (size_t i = at; i < at + n; ++i) {
    if (!IsDigit(text[i])) return false;
    v = v * 10 + (text[i] - '0');
  }
  *out = v;
  return true;
}

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
int64_t DaysFromCivil(int64_t y, int m, int d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

}  // namespace

std::optional<double> LineTime(std::string_view cleaned, const LogTimeZone& zone) {
  constexpr size_t kSearch = 80;
  const std::string_view head = cleaned.substr(0, std::min(cleaned.size(), kSearch + 19));
  for (size_t at = 0; at + 19 <= head.size() && at <= kSearch; ++at) {
    if (at > 0 && IsDigit(head[at - 1])) continue;
    int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
    if (!Digits(head, at, 4, &year) || head[at + 4] != '-' || !Digits(head, at + 5, 2, &month) || head[at + 7] != '-' ||
        !Digits(head, at + 8, 2, &day) || (head[at + 10] != ' ' && head[at + 10] != 'T') ||
        !Digits(head, at + 11, 2, &hour) || head[at + 13] != ':' || !Digits(head, at + 14, 2, &minute) ||
        head[at + 16] != ':' || !Digits(head, at + 17, 2, &second)) {
      continue;
    }
    if (year < 1970 || month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60) {
      continue;
    }
    // Fractional seconds, then an optional zone.
    size_t end = at + 19;
    double fraction = 0;
    if (end < cleaned.size() && (cleaned[end] == '.' || cleaned[end] == ',') && end + 1 < cleaned.size() &&
        IsDigit(cleaned[end + 1])) {
      double scale = 0.1;
      for (++end; end < cleaned.size() && IsDigit(cleaned[end]); ++end, scale /= 10) {
        fraction += (cleaned[end] - '0') * scale;
      }
    }
    std::optional<int> offset;
    if (end < cleaned.size() && cleaned[end] == 'Z') {
      offset = 0;
    } else if (end + 5 <= cleaned.size() && (cleaned[end] == '+' || cleaned[end] == '-')) {
      int oh = 0, om = 0;
      const size_t mm = cleaned[end + 3] == ':' ? end + 4 : end + 3;
      if (Digits(cleaned, end + 1, 2, &oh) && Digits(cleaned, mm, 2, &om) && oh <= 14 && om <= 59) {
        offset = (cleaned[end] == '-' ? -1 : 1) * (oh * 3600 + om * 60);
      }
    }
    const int64_t civil = DaysFromCivil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second;
    if (offset) return static_cast<double>(civil - *offset) + fraction;
    if (!zone.local) return static_cast<double>(civil - zone.offset_seconds) + fraction;
    std::tm tm{};
    tm.tm_year = year - 1900;
    tm.tm_mon = month - 1;
    tm.tm_mday = day;
    tm.tm_hour = hour;
    tm.tm_min = minute;
    tm.tm_sec = second;
    tm.tm_isdst = -1;  // as the local zone had it on that day
    const std::time_t t = std::mktime(&tm);
    if (t == static_cast<std::time_t>(-1)) return std::nullopt;
    return static_cast<double>(t) + fraction;
  }
  return std::nullopt;
}

std::optional<LogRecord> ParseLogLine(LogFormat f, std::string_view cleaned) {
  try {
    return Parse(f, cleaned);
  } catch (const std::exception&) {
    // Only allocation can fail here; a line that cannot be parsed is not one this format reports.
    return std::nullopt;
  }
}

std::optional<LogFormat> DetectLogFormat(std::string_view cleaned) {
  // Structured formats first (their lines are unambiguous), then those whose step lines are the most
  // distinctive; nanoGPT's bare "step N:" lines last, after llm.c's, which need "/T" or "(took".
  static constexpr LogFormat kOrder[] = {LogFormat::kJsonl,     LogFormat::kHfTrainer,  LogFormat::kMegatron,
                                         LogFormat::kDeepSpeed, LogFormat::kTorchtitan, LogFormat::kLlmc,
                                         LogFormat::kNanoGpt};
  for (LogFormat f : kOrder) {
    std::optional<LogRecord> rec = ParseLogLine(f, cleaned);
    if (rec && rec->kind == LogRecord::Kind::kStep) return f;
  }
  return std::nullopt;
}

}  // namespace gradwatch::cli
