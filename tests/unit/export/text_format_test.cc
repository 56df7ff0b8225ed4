#include <catch2/catch.hpp>

#include <bit>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <prometheus/text_serializer.h>

#include "server/export/text_format.h"
#include "tests/integration/daemon_process.h"
#include "tests/unit/export/exposition_checks.h"

using namespace gradwatch;
using exporter::AppendValue;

namespace {

std::string Value(double v) {
  std::string out;
  AppendValue(out, v);
  return out;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

prometheus::ClientMetric::Label L(std::string name, std::string value) { return {std::move(name), std::move(value)}; }

prometheus::ClientMetric Gauge(std::vector<prometheus::ClientMetric::Label> labels, double v) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = v;
  return m;
}

prometheus::ClientMetric Counter(std::vector<prometheus::ClientMetric::Label> labels, double v) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.counter.value = v;
  return m;
}

// Families of every kind, with label values that need escaping, empty families, and values that
// prometheus-cpp's "%.16g" and the shortest round-trip text both write the same way.
std::vector<prometheus::MetricFamily> ReferenceFamilies() {
  std::vector<prometheus::MetricFamily> out;
  prometheus::MetricFamily gauge{
      "test_norm", "A gauge with \"quotes\" in its help.", prometheus::MetricType::Gauge, {}};
  gauge.metric.push_back(Gauge({L("run", "plain"), L("param", "layers.0.weight")}, 0.4));
  gauge.metric.push_back(Gauge({L("run", "back\\slash"), L("param", "say \"hi\"")}, 340));
  gauge.metric.push_back(Gauge({L("run", "two\nlines"), L("param", "µ-unicode")}, -2.5e-7));
  gauge.metric.push_back(Gauge({L("run", "")}, 1.5e300));
  gauge.metric.push_back(Gauge({}, 123456.75));
  gauge.metric.push_back(Gauge({L("run", "edges")}, kInf));
  gauge.metric.push_back(Gauge({L("run", "edges2")}, -kInf));
  gauge.metric.push_back(Gauge({L("run", "zero")}, 0));
  out.push_back(gauge);
  out.push_back({"test_empty_total", "A counter family without samples.", prometheus::MetricType::Counter, {}});
  out.push_back({"test_no_help", "", prometheus::MetricType::Gauge, {Gauge({}, 7)}});
  prometheus::MetricFamily counter{"test_events_total", "Events.", prometheus::MetricType::Counter, {}};
  counter.metric.push_back(Counter({L("reason", "a")}, 0));
  counter.metric.push_back(Counter({L("reason", "b")}, 42));
  counter.metric.push_back(Counter({L("reason", "c")}, 999999));
  out.push_back(counter);
  prometheus::MetricFamily histogram{"test_seconds", "A histogram.", prometheus::MetricType::Histogram, {}};
  {
    prometheus::ClientMetric m;
    m.histogram.sample_count = 5;
    m.histogram.sample_sum = 0.0625;
    m.histogram.bucket = {{1, 0.001}, {3, 0.01}, {5, 0.5}};  // no +Inf bucket: one is added
    histogram.metric.push_back(m);
    m.label = {L("disk", "b\"")};
    m.histogram.bucket.push_back({5, kInf});
    histogram.metric.push_back(m);
  }
  out.push_back(histogram);
  prometheus::MetricFamily summary{"test_latency", "A summary.", prometheus::MetricType::Summary, {}};
  {
    prometheus::ClientMetric m;
    m.summary.sample_count = 3;
    m.summary.sample_sum = 12.5;
    m.summary.quantile = {{0.5, 4}, {0.99, 6.25}};
    summary.metric.push_back(m);
  }
  out.push_back(summary);
  return out;
}

}  // namespace

TEST_CASE("values are written as Prometheus' Go client writes them", "[export]") {
  // strconv.FormatFloat(v, 'g', -1, 64), with expfmt's "NaN", "+Inf", "-Inf" and "0" for -0.
  const std::vector<std::pair<double, std::string>> cases = {
      {std::nan(""), "NaN"},
      {kInf, "+Inf"},
      {-kInf, "-Inf"},
      {0.0, "0"},
      {-0.0, "0"},
      {1.0, "1"},
      {-1.0, "-1"},
      {42.0, "42"},
      {999999.0, "999999"},
      {1e6, "1e+06"},
      {1234567.0, "1.234567e+06"},
      {-1234567.0, "-1.234567e+06"},
      {123456.789, "123456.789"},
      {0.0001, "0.0001"},
      {0.00012, "0.00012"},
      {0.00001, "1e-05"},
      {-2.5e-7, "-2.5e-07"},
      {0.1 + 0.2, "0.30000000000000004"},
      {0.4, "0.4"},
      {1.0 / 3.0, "0.3333333333333333"},
      {100.5, "100.5"},
      {1.5e300, "1.5e+300"},
      {5e-324, "5e-324"},
      {std::numeric_limits<double>::max(), "1.7976931348623157e+308"},
      {std::numeric_limits<double>::min(), "2.2250738585072014e-308"},
      {9007199254740993.0, "9.007199254740992e+15"},
      {999999.9999999999, "999999.9999999999"},
      {999999.99999999999, "1e+06"},  // the shortest digits round up to 1e+06
  };
  for (const auto& [value, text] : cases) {
    INFO(text);
    CHECK(Value(value) == text);
  }
}

TEST_CASE("every finite value reads back as the same double, in as few digits as std::to_chars gives", "[export]") {
  std::mt19937_64 rng(20261201);
  for (int i = 0; i < 200000; ++i) {
    const double v = std::bit_cast<double>(rng());
    if (!std::isfinite(v)) continue;
    const std::string text = Value(v);
    INFO(text);
    REQUIRE(std::strtod(text.c_str(), nullptr) == v);
    // Same significant digits as the shortest round-trip text.
    char shortest[32];
    const auto [end, ec] = std::to_chars(shortest, shortest + sizeof(shortest), v, std::chars_format::scientific);
    REQUIRE(ec == std::errc());
    const std::string sci(shortest, end);
    auto digits = [](const std::string& s) {
      std::string d;
      for (char c : s.substr(0, s.find('e'))) {
        if (c >= '0' && c <= '9') d += c;
      }
      d.erase(0, d.find_first_not_of('0'));
      d.erase(d.find_last_not_of('0') + 1);
      return d;
    };
    REQUIRE(digits(text) == digits(sci));
  }
}

TEST_CASE("label values escape backslash, double quote and newline, and nothing else", "[export]") {
  std::string out;
  exporter::AppendLabelValue(out, "a\\b\"c\nd\te µ");
  CHECK(out == "a\\\\b\\\"c\\nd\te µ");
  out.clear();
  exporter::AppendLabel(out, "param", "x\"", true);
  exporter::AppendLabel(out, "group", "");
  CHECK(out == "param=\"x\\\"\",group=\"\"");
}

TEST_CASE("families are written byte for byte as prometheus-cpp's TextSerializer writes them", "[export]") {
  const auto families = ReferenceFamilies();
  std::string ours;
  exporter::AppendFamilies(ours, families);
  CHECK(ours == prometheus::TextSerializer().Serialize(families));
}

TEST_CASE("NaN is written as Go writes it, where prometheus-cpp writes Nan", "[export]") {
  std::vector<prometheus::MetricFamily> families = {
      {"test_ratio", "A ratio.", prometheus::MetricType::Gauge, {Gauge({L("run", "r")}, std::nan(""))}}};
  std::string ours;
  exporter::AppendFamilies(ours, families);
  CHECK(ours == "# HELP test_ratio A ratio.\n# TYPE test_ratio gauge\ntest_ratio{run=\"r\"} NaN\n");
  CHECK(prometheus::TextSerializer().Serialize(families).find("} Nan\n") != std::string::npos);
}

TEST_CASE("help texts escape backslash and newline", "[export]") {
  std::string out;
  exporter::AppendFamilyHeader(out, "test_x", "one\\two\nthree", exporter::MetricType::kGauge);
  CHECK(out == "# HELP test_x one\\\\two\\nthree\n# TYPE test_x gauge\n");
}

TEST_CASE("the text parses back to the same samples and promtool accepts it", "[export]") {
  auto families = ReferenceFamilies();
  // promtool's linter asks for a HELP text.
  std::erase_if(families, [](const prometheus::MetricFamily& f) { return f.help.empty(); });
  families[0].metric.push_back(Gauge({L("run", "nan")}, std::nan("")));
  families[0].metric.push_back(Gauge({L("run", "tiny")}, 5e-324));
  std::string text;
  exporter::AppendFamilies(text, families);
  CheckFamiliesContiguous(text);

  const auto samples = testing::ParseExposition(text);
  auto find = [&](const std::string& name, const std::map<std::string, std::string>& labels) {
    for (const auto& s : samples) {
      if (s.name == name && s.labels == labels) return s.value;
    }
    FAIL("no sample " << name);
    return 0.0;
  };
  CHECK(find("test_norm", {{"run", "back\\slash"}, {"param", "say \"hi\""}}) == 340);
  CHECK(find("test_norm", {{"run", "two\nlines"}, {"param", "µ-unicode"}}) == -2.5e-7);
  CHECK(std::isnan(find("test_norm", {{"run", "nan"}})));
  CHECK(find("test_norm", {{"run", "tiny"}}) == 5e-324);
  CHECK(find("test_norm", {{"run", "edges2"}}) == -kInf);
  CHECK(find("test_seconds_bucket", {{"le", "+Inf"}}) == 5);
  CHECK(find("test_seconds_bucket", {{"disk", "b\""}, {"le", "0.01"}}) == 3);
  CHECK(find("test_latency", {{"quantile", "0.99"}}) == 6.25);
  CheckWithPromtool(text);
}
