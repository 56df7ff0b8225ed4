#include "server/export/text_format.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>

namespace gradwatch::exporter {

namespace {

// Go's 'g' with the shortest precision writes decimal exponents in [-4, 6) in fixed notation.
constexpr int kMinFixedExponent = -4;
constexpr int kMaxFixedExponent = 5;

// The shortest round-trip digits of a finite, non-zero |value| in scientific notation
// ("d.ddde±XX"), rewritten in fixed notation when the exponent is in the fixed range.
void AppendFinite(std::string& out, double value) {
  char sci[32];
  const auto [end, ec] = std::to_chars(sci, sci + sizeof(sci), value, std::chars_format::scientific);
  (void)ec;  // 32 bytes hold any double (at most 24 characters)
  const char* e = static_cast<const char*>(std::memchr(sci, 'e', static_cast<size_t>(end - sci)));
  int exponent = 0;
  std::from_chars(e + (e[1] == '+' ? 2 : 1), end, exponent);
  if (exponent < kMinFixedExponent || exponent > kMaxFixedExponent) {
    out.append(sci, end);  // already Go's form: at least two exponent digits, with its sign
    return;
  }
  const char* p = sci;
  char fixed[32];
  char* f = fixed;
  if (*p == '-') *f++ = *p++;
  char digits[20];
  int count = 0;
  for (; p < e; ++p) {
    if (*p != '.') digits[count++] = *p;
  }
  if (exponent < 0) {
    *f++ = '0';
    *f++ = '.';
    for (int i = -1; i > exponent; --i) *f++ = '0';
    std::memcpy(f, digits, static_cast<size_t>(count));
    f += count;
  } else {
    const int integer_digits = exponent + 1;
    for (int i = 0; i < integer_digits; ++i) *f++ = i < count ? digits[i] : '0';
    if (count > integer_digits) {
      *f++ = '.';
      std::memcpy(f, digits + integer_digits, static_cast<size_t>(count - integer_digits));
      f += count - integer_digits;
    }
  }
  out.append(fixed, f);
}

}  // namespace

void AppendValue(std::string& out, double value) {
  if (std::isnan(value)) {
    out.append("NaN");
  } else if (std::isinf(value)) {
    out.append(value > 0 ? "+Inf" : "-Inf");
  } else if (value == 0) {
    out.push_back('0');  // -0 too, as Go's client writes it
  } else if (std::fabs(value) < 1e6 && value == std::trunc(value)) {
    char buf[8];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), static_cast<int32_t>(value));
    (void)ec;
    out.append(buf, end);
  } else {
    AppendFinite(out, value);
  }
}

void AppendValue(std::string& out, uint64_t value) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  (void)ec;
  out.append(buf, end);
}

void AppendLabelValue(std::string& out, std::string_view value) {
  // Most values need no escaping: one scan, one append.
  bool plain = true;
  for (const char c : value) plain &= c != '\\' && c != '"' && c != '\n';
  if (plain) {
    out.append(value);
    return;
  }
  size_t start = 0;
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    if (c != '\\' && c != '"' && c != '\n') continue;
    out.append(value.data() + start, i - start);
    out.push_back('\\');
    out.push_back(c == '\n' ? 'n' : c);
    start = i + 1;
  }
  out.append(value.data() + start, value.size() - start);
}

void AppendLabel(std::string& out, std::string_view name, std::string_view value, bool first) {
  if (!first) out.push_back(',');
  out.append(name);
  out.append("=\"");
  AppendLabelValue(out, value);
  out.push_back('"');
}

void AppendFamilyHeader(std::string& out, std::string_view name, std::string_view help, MetricType type) {
  if (!help.empty()) {
    out.append("# HELP ");
    out.append(name);
    out.push_back(' ');
    for (const char c : help) {
      if (c == '\\') {
        out.append("\\\\");
      } else if (c == '\n') {
        out.append("\\n");
      } else {
        out.push_back(c);
      }
    }
    out.push_back('\n');
  }
  out.append("# TYPE ");
  out.append(name);
  switch (type) {
    case MetricType::kCounter: out.append(" counter\n"); break;
    case MetricType::kGauge: out.append(" gauge\n"); break;
    case MetricType::kHistogram: out.append(" histogram\n"); break;
    case MetricType::kSummary: out.append(" summary\n"); break;
    case MetricType::kUntyped: out.append(" untyped\n"); break;
  }
}

void AppendSample(std::string& out, std::string_view name, std::string_view labels, double value) {
  out.append(name);
  if (!labels.empty()) {
    out.push_back('{');
    out.append(labels);
    out.push_back('}');
  }
  out.push_back(' ');
  AppendValue(out, value);
  out.push_back('\n');
}

void AppendSample(std::string& out, std::string_view name, std::initializer_list<Label> labels, double value) {
  out.append(name);
  if (labels.size() > 0) {
    out.push_back('{');
    bool first = true;
    for (const auto& [label, label_value] : labels) {
      AppendLabel(out, label, label_value, first);
      first = false;
    }
    out.push_back('}');
  }
  out.push_back(' ');
  AppendValue(out, value);
  out.push_back('\n');
}

namespace {

// `name` + `suffix` + `{labels[,extra="value"]}` + ' ': the head of a histogram's or summary's line.
void AppendHead(std::string& out, std::string_view name, std::string_view suffix, std::string_view labels,
                std::string_view extra_name = {}, double extra_value = 0) {
  out.append(name);
  out.append(suffix);
  if (!labels.empty() || !extra_name.empty()) {
    out.push_back('{');
    out.append(labels);
    if (!extra_name.empty()) {
      if (!labels.empty()) out.push_back(',');
      out.append(extra_name);
      out.append("=\"");
      AppendValue(out, extra_value);
      out.push_back('"');
    }
    out.push_back('}');
  }
  out.push_back(' ');
}

void AppendTail(std::string& out, int64_t timestamp_ms) {
  if (timestamp_ms != 0) {
    out.push_back(' ');
    out.append(std::to_string(timestamp_ms));
  }
  out.push_back('\n');
}

}  // namespace

void AppendHistogram(std::string& out, std::string_view name, std::string_view labels,
                     const std::vector<double>& bounds, const std::vector<uint64_t>& cumulative, double sum,
                     uint64_t count) {
  AppendHead(out, name, "_count", labels);
  AppendValue(out, count);
  out.push_back('\n');
  AppendHead(out, name, "_sum", labels);
  AppendValue(out, sum);
  out.push_back('\n');
  double last = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < cumulative.size(); ++i) {
    last = i < bounds.size() ? bounds[i] : std::numeric_limits<double>::infinity();
    AppendHead(out, name, "_bucket", labels, "le", last);
    AppendValue(out, cumulative[i]);
    out.push_back('\n');
  }
  if (last != std::numeric_limits<double>::infinity()) {
    AppendHead(out, name, "_bucket", labels, "le", std::numeric_limits<double>::infinity());
    AppendValue(out, count);
    out.push_back('\n');
  }
}

void AppendFamilies(std::string& out, const std::vector<prometheus::MetricFamily>& families) {
  std::string labels;
  for (const prometheus::MetricFamily& f : families) {
    MetricType type = MetricType::kUntyped;
    switch (f.type) {
      case prometheus::MetricType::Counter: type = MetricType::kCounter; break;
      case prometheus::MetricType::Gauge: type = MetricType::kGauge; break;
      case prometheus::MetricType::Summary: type = MetricType::kSummary; break;
      case prometheus::MetricType::Histogram: type = MetricType::kHistogram; break;
      default: break;
    }
    AppendFamilyHeader(out, f.name, f.help, type);
    for (const prometheus::ClientMetric& m : f.metric) {
      labels.clear();
      for (const auto& l : m.label) AppendLabel(labels, l.name, l.value, labels.empty());
      switch (type) {
        case MetricType::kCounter:
        case MetricType::kGauge:
        case MetricType::kUntyped:
          AppendHead(out, f.name, "", labels);
          AppendValue(out, type == MetricType::kCounter ? m.counter.value
                           : type == MetricType::kGauge ? m.gauge.value
                                                        : m.untyped.value);
          AppendTail(out, m.timestamp_ms);
          break;
        case MetricType::kSummary:
          AppendHead(out, f.name, "_count", labels);
          AppendValue(out, m.summary.sample_count);
          AppendTail(out, m.timestamp_ms);
          AppendHead(out, f.name, "_sum", labels);
          AppendValue(out, m.summary.sample_sum);
          AppendTail(out, m.timestamp_ms);
          for (const auto& q : m.summary.quantile) {
            AppendHead(out, f.name, "", labels, "quantile", q.quantile);
            AppendValue(out, q.value);
            AppendTail(out, m.timestamp_ms);
          }
          break;
        case MetricType::kHistogram: {
          std::vector<double> bounds;
          std::vector<uint64_t> cumulative;
          for (const auto& b : m.histogram.bucket) {
            bounds.push_back(b.upper_bound);
            cumulative.push_back(b.cumulative_count);
          }
          AppendHistogram(out, f.name, labels, bounds, cumulative, m.histogram.sample_sum, m.histogram.sample_count);
          break;
        }
      }
    }
  }
}

}  // namespace gradwatch::exporter
