// The Prometheus text exposition format 0.0.4, written straight into strings: what a scrape of
// 100,000 series needs without building a metric-family tree first and serialising it through an
// ostream (prometheus-cpp's TextSerializer, about 1 µs a line).
//
// Values are written as Prometheus' own Go client writes them (expfmt's writeFloat:
// strconv.FormatFloat(v, 'g', -1, 64)): the shortest text that reads back as the same double
// (std::to_chars), in fixed notation for decimal exponents from -4 to 5 and in scientific
// notation otherwise ("1e+06", "1.5e-05"), and "NaN", "+Inf", "-Inf". Label values escape `\`,
// `"` and newline; HELP texts escape `\` and newline.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <prometheus/metric_family.h>

namespace gradwatch::exporter {

enum class MetricType { kCounter, kGauge, kHistogram, kSummary, kUntyped };

using Label = std::pair<std::string_view, std::string_view>;  // name, value (unescaped)

// Appends `value` as above.
void AppendValue(std::string& out, double value);
// Appends `value` in decimal (histogram and summary counts).
void AppendValue(std::string& out, uint64_t value);
// Appends `value` escaped for use between a label's double quotes.
void AppendLabelValue(std::string& out, std::string_view value);

// Appends `name="value"` (the value escaped), after a comma unless `first`.
void AppendLabel(std::string& out, std::string_view name, std::string_view value, bool first = false);

// Appends a family's `# HELP` (unless `help` is empty) and `# TYPE` lines. Every sample of the family must follow it
// before the next family's header.
void AppendFamilyHeader(std::string& out, std::string_view name, std::string_view help, MetricType type);

// Appends one sample line: `name{labels} value`. `labels` is the inside of the braces, already
// rendered (AppendLabel); empty for a sample without labels.
void AppendSample(std::string& out, std::string_view name, std::string_view labels, double value);
// The same with the labels given one by one (names must be valid label names).
void AppendSample(std::string& out, std::string_view name, std::initializer_list<Label> labels, double value);

// Appends a histogram's samples in prometheus-cpp's order: `name_count`, `name_sum`, then
// `name_bucket` per bound with its cumulative count (`le` last "+Inf", added when the bounds do not
// end with it). `cumulative` has one count per bound and, when longer, the +Inf
// count last; `count` is the number of observations.
void AppendHistogram(std::string& out, std::string_view name, std::string_view labels,
                     const std::vector<double>& bounds, const std::vector<uint64_t>& cumulative, double sum,
                     uint64_t count);

// Appends prometheus-cpp's metric families (a prometheus::Registry's Collect()), header and
// samples, in this format; sample timestamps are kept.
void AppendFamilies(std::string& out, const std::vector<prometheus::MetricFamily>& families);

}  // namespace gradwatch::exporter
