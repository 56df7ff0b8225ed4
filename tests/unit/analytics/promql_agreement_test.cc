// The same series given to `promtool test rules` (one step = one second) and to WindowedSlope:
// deriv(s[300s]) and predict_linear(s[300s], 600) must agree to 1e-9 relative.
//
// Both are also compared with the exact least-squares answer (two-pass, long double). Prometheus
// sums raw values, so on a series near 1e6 with a slope of 3e-3/s its own rounding reaches ~1e-9;
// WindowedSlope measures values from an origin and stays near 1e-13. That series ("offset") must
// agree within 1e-9 plus promtool's own error; the others within 1e-9 outright.
//
// promtool prints the value it got when a test fails, in full precision (Go's %E with the shortest
// round-trip digits), so the test file expects a deliberately wrong value and the "got:" lines are
// parsed. promtool 2.x includes the range's left edge ([T − 300s, T]); Prometheus 3 does not
// ((T − 300s, T]). count_over_time tells which one runs here, and the series then is compared with
// WindowedSlope(301) or WindowedSlope(300) respectively: the same samples either way.
#include <catch2/catch.hpp>

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "server/analytics/regression.h"
#include "tests/support/temp_dir.h"

#ifndef GRADWATCH_PROMTOOL
#define GRADWATCH_PROMTOOL ""
#endif

using namespace gradwatch::analytics;
using gradwatch::testing::TempDir;

namespace {

constexpr uint64_t kRangeSeconds = 300;
constexpr uint64_t kPredictSeconds = 600;
constexpr uint64_t kSeriesSeconds = 1200;
constexpr double kWrongValue = -123456789;

bool IsExecutable(const std::string& path) {
  return !path.empty() && ::access(path.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(path);
}

// The promtool CMake found, else the first on PATH; empty when there is none.
std::string FindPromtool() {
  const std::string configured = GRADWATCH_PROMTOOL;
  if (configured.find("NOTFOUND") == std::string::npos && IsExecutable(configured)) {
    return configured;
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && IsExecutable(dir + "/promtool")) {
      return dir + "/promtool";
    }
  }
  return "";
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    return result;
  }
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) {
    result.output.append(buf, n);
  }
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// Go's time.Duration.String() for whole seconds: "11s", "6m40s", "1h0m0s".
std::optional<uint64_t> ParseGoSeconds(const std::string& text) {
  uint64_t total = 0, number = 0;
  bool digits = false;
  for (char c : text) {
    if (c >= '0' && c <= '9') {
      number = number * 10 + static_cast<uint64_t>(c - '0');
      digits = true;
    } else if (digits && (c == 'h' || c == 'm' || c == 's')) {
      total += number * (c == 'h' ? 3600 : c == 'm' ? 60 : 1);
      number = 0;
      digits = false;
    } else {
      return std::nullopt;
    }
  }
  return digits ? std::nullopt : std::optional<uint64_t>(total);
}

// (recorded series name, evaluation second) → the value promtool got. Expects blocks like
//     expr: "regular:deriv", time: 6m40s,
//         exp: {__name__="regular:deriv"} -1.23456789E+08
//         got: {__name__="regular:deriv"} 2.484126741680608E+04
std::map<std::pair<std::string, uint64_t>, double> ParseGotValues(const std::string& output) {
  std::map<std::pair<std::string, uint64_t>, double> got;
  std::optional<std::pair<std::string, uint64_t>> current;
  std::stringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const size_t expr_at = line.find("expr: \"");
    if (expr_at != std::string::npos) {
      current.reset();
      const size_t name_from = expr_at + 7;
      const size_t name_to = line.find("\", time: ", name_from);
      const size_t time_to = line.rfind(',');
      if (name_to == std::string::npos || time_to == std::string::npos || time_to < name_to) {
        continue;
      }
      const size_t time_from = name_to + 9;
      auto seconds = ParseGoSeconds(line.substr(time_from, time_to - time_from));
      if (seconds) {
        current.emplace(line.substr(name_from, name_to - name_from), *seconds);
      }
      continue;
    }
    const size_t got_at = line.find("got: {");
    if (got_at != std::string::npos && current) {
      const size_t value_at = line.rfind(' ');
      got[*current] = std::strtod(line.c_str() + value_at + 1, nullptr);
      current.reset();
    }
  }
  return got;
}

struct Series {
  std::string name;  // "regular" → input series gw_regular, rules regular:*
  // Whether Prometheus's own arithmetic is good to well below 1e-9 on it.
  bool well_conditioned = true;
  std::vector<std::optional<double>> values;  // one per second; nullopt: no sample
};

// At an evaluation second with a sample: what WindowedSlope(300) and (301) say, and the exact
// least-squares answer over the same samples. Index 0: (T − 300, T]; index 1: [T − 300, T].
struct Ours {
  uint64_t second;
  size_t count[2];
  double deriv[2];
  double predict[2];
  double exact_deriv[2];
  double exact_predict[2];
};

// Two-pass least squares in long double over the samples in [from, to].
std::pair<double, double> ExactSlopeAndPrediction(const Series& series, uint64_t from, uint64_t to,
                                                  uint64_t predict_at) {
  long double n = 0, mean_x = 0, mean_y = 0;
  for (uint64_t t = from; t <= to; ++t) {
    if (series.values[t]) {
      n += 1;
      mean_x += t;
      mean_y += *series.values[t];
    }
  }
  mean_x /= n;
  mean_y /= n;
  long double sxx = 0, sxy = 0;
  for (uint64_t t = from; t <= to; ++t) {
    if (series.values[t]) {
      sxx += (t - mean_x) * (t - mean_x);
      sxy += (t - mean_x) * (*series.values[t] - mean_y);
    }
  }
  const long double slope = sxy / sxx;
  return {static_cast<double>(slope), static_cast<double>(mean_y + slope * (predict_at - mean_x))};
}

std::vector<Series> MakeSeries() {
  std::mt19937_64 rng(1234);
  std::normal_distribution<double> noise(0.0, 1.0);
  Series regular{"regular", true, {}}, irregular{"irregular", true, {}}, offset{"offset", false, {}};
  for (uint64_t t = 0; t < kSeriesSeconds; ++t) {
    const double x = static_cast<double>(t);
    // Rising 0.37/s, falling 0.2/s after 600 s, a wiggle, noise; 40 s missing from 700 s.
    const double trend = t < 600 ? 50 + 0.37 * x : 50 + 0.37 * 600 - 0.2 * (x - 600);
    const double r = trend + 2 * std::sin(x / 7) + 0.5 * noise(rng);
    regular.values.push_back(t >= 700 && t < 740 ? std::nullopt : std::optional<double>(r));
    // Every 10 s, then every second, a 100 s gap, then every 3 s.
    const bool present = (t < 600 && t % 10 == 0) || (t >= 600 && t < 900) || (t >= 1000 && t % 3 == 0);
    const double i = 1000 + 3e-2 * x + 0.1 * noise(rng);
    irregular.values.push_back(present ? std::optional<double>(i) : std::nullopt);
    // Near 1e6 with a small slope, every second.
    offset.values.push_back(1e6 + 3e-3 * x + 0.01 * noise(rng));
  }
  return {regular, irregular, offset};
}

std::vector<Ours> Evaluate(const Series& series) {
  WindowedSlope open_window(kRangeSeconds), closed_window(kRangeSeconds + 1);
  std::vector<Ours> picks;
  uint64_t last_pick = 0;
  for (uint64_t t = 0; t < series.values.size(); ++t) {
    if (!series.values[t]) {
      continue;
    }
    open_window.AddSample(t, *series.values[t]);
    closed_window.AddSample(t, *series.values[t]);
    auto open_fit = open_window.Fit();
    auto closed_fit = closed_window.Fit();
    if (!open_fit || !closed_fit || t < last_pick + 37) {
      continue;
    }
    last_pick = t;
    Ours ours{t,
              {open_fit->samples, closed_fit->samples},
              {open_fit->slope_per_step, closed_fit->slope_per_step},
              {open_fit->PredictAt(t + kPredictSeconds), closed_fit->PredictAt(t + kPredictSeconds)},
              {},
              {}};
    for (int w = 0; w < 2; ++w) {
      const uint64_t reach = kRangeSeconds - (w == 0 ? 1 : 0);
      const auto [slope, prediction] =
          ExactSlopeAndPrediction(series, t >= reach ? t - reach : 0, t, t + kPredictSeconds);
      ours.exact_deriv[w] = slope;
      ours.exact_predict[w] = prediction;
    }
    picks.push_back(ours);
  }
  return picks;
}

std::string ValuesLine(const Series& series) {
  std::string line;
  char buf[40];
  for (const auto& v : series.values) {
    if (!line.empty()) {
      line += ' ';
    }
    if (v) {
      std::snprintf(buf, sizeof buf, "%.17g", *v);
      line += buf;
    } else {
      line += '_';
    }
  }
  return line;
}

double RelativeDifference(double ours, double theirs) {
  const double scale = std::max(std::fabs(theirs), std::fabs(ours));
  return scale == 0 ? 0 : std::fabs(ours - theirs) / scale;
}

}  // namespace

TEST_CASE("deriv and predict_linear agree with promtool to 1e-9 relative", "[analytics]") {
  const std::string promtool = FindPromtool();
  if (promtool.empty()) {
    WARN("promtool is not installed (Debian package prometheus): the agreement test is skipped");
    SUCCEED();
    return;
  }
  TempDir dir;
  REQUIRE_FALSE(dir.path().empty());

  const std::vector<Series> all_series = MakeSeries();
  std::vector<std::vector<Ours>> ours;
  for (const Series& series : all_series) {
    ours.push_back(Evaluate(series));
    REQUIRE(ours.back().size() > 20);
  }

  const auto rules_path = dir.path() / "rules.yml";
  const auto test_path = dir.path() / "test.yml";
  {
    std::ofstream rules(rules_path);
    rules << "groups:\n- name: gradwatch-agreement\n  interval: 1s\n  rules:\n";
    for (const Series& series : all_series) {
      const std::string selector = "gw_" + series.name + "[" + std::to_string(kRangeSeconds) + "s]";
      rules << "  - record: " << series.name << ":deriv\n    expr: deriv(" << selector << ")\n"
            << "  - record: " << series.name << ":predict\n    expr: predict_linear(" << selector << ", "
            << kPredictSeconds << ")\n"
            << "  - record: " << series.name << ":count\n    expr: count_over_time(" << selector << ")\n";
    }
    std::ofstream test(test_path);
    test << "rule_files: ['" << rules_path.string() << "']\nevaluation_interval: 1s\ntests:\n"
         << "- interval: 1s\n  input_series:\n";
    for (const Series& series : all_series) {
      test << "  - series: 'gw_" << series.name << "'\n    values: '" << ValuesLine(series) << "'\n";
    }
    test << "  promql_expr_test:\n";
    for (size_t s = 0; s < all_series.size(); ++s) {
      for (const Ours& pick : ours[s]) {
        for (const char* what : {"deriv", "predict", "count"}) {
          const std::string name = all_series[s].name + ":" + what;
          test << "  - expr: " << name << "\n    eval_time: " << pick.second << "s\n"
               << "    exp_samples:\n    - labels: '" << name << "'\n      value: " << kWrongValue << "\n";
        }
      }
    }
    REQUIRE(rules.good());
    REQUIRE(test.good());
  }

  const CommandResult run = RunCommand("timeout 120 '" + promtool + "' test rules '" + test_path.string() + "'");
  {
    INFO(run.output.substr(0, 4000));
    // Every expectation is wrong on purpose: promtool must fail (1), not time out (124) or crash.
    REQUIRE(run.exit_code == 1);
  }
  const auto got = ParseGotValues(run.output);
  {
    INFO(run.output.substr(0, 4000));
    REQUIRE(got.size() == 3 * (ours[0].size() + ours[1].size() + ours[2].size()));
  }

  int closed_evidence = 0, open_evidence = 0;
  // Largest relative differences: ours vs promtool, ours vs exact, promtool vs exact.
  double ours_promtool = 0, ours_exact = 0, promtool_exact = 0;
  double ours_promtool_well_conditioned = 0;
  size_t compared = 0;
  for (size_t s = 0; s < all_series.size(); ++s) {
    const Series& series = all_series[s];
    for (const Ours& pick : ours[s]) {
      INFO(series.name << " at " << pick.second << "s");
      auto count = got.find({series.name + ":count", pick.second});
      auto deriv = got.find({series.name + ":deriv", pick.second});
      auto predict = got.find({series.name + ":predict", pick.second});
      REQUIRE(count != got.end());
      REQUIRE(deriv != got.end());
      REQUIRE(predict != got.end());
      // Which window holds the samples promtool used.
      const auto promtool_count = static_cast<size_t>(count->second);
      const bool open_matches = promtool_count == pick.count[0];
      const bool closed_matches = promtool_count == pick.count[1];
      REQUIRE((open_matches || closed_matches));
      if (open_matches != closed_matches) {
        (closed_matches ? closed_evidence : open_evidence)++;
      }
      const int w = closed_matches ? 1 : 0;
      const std::pair<double, double> figures[] = {{pick.deriv[w], deriv->second}, {pick.predict[w], predict->second}};
      const double exact[] = {pick.exact_deriv[w], pick.exact_predict[w]};
      for (int f = 0; f < 2; ++f) {
        INFO((f == 0 ? "deriv" : "predict_linear")
             << ": ours " << figures[f].first << ", promtool " << figures[f].second << ", exact " << exact[f]);
        const double vs_promtool = RelativeDifference(figures[f].first, figures[f].second);
        const double vs_exact = RelativeDifference(figures[f].first, exact[f]);
        const double promtool_error = RelativeDifference(figures[f].second, exact[f]);
        CHECK(vs_exact <= 1e-12);
        if (series.well_conditioned) {
          CHECK(vs_promtool <= 1e-9);
          ours_promtool_well_conditioned = std::max(ours_promtool_well_conditioned, vs_promtool);
        } else {
          CHECK(vs_promtool <= 1e-9 + promtool_error);
        }
        ours_promtool = std::max(ours_promtool, vs_promtool);
        ours_exact = std::max(ours_exact, vs_exact);
        promtool_exact = std::max(promtool_exact, promtool_error);
      }
      ++compared;
    }
  }
  // The edge convention was exercised, and promtool kept to one.
  CHECK(closed_evidence + open_evidence > 10);
  CHECK((closed_evidence == 0 || open_evidence == 0));
  WARN("promtool agreement over " << compared << " evaluations ("
                                  << (closed_evidence > 0 ? "[T-300s, T], Prometheus 2" : "(T-300s, T], Prometheus 3")
                                  << "), max relative differences: ours vs promtool " << ours_promtool_well_conditioned
                                  << " (well-conditioned series), " << ours_promtool << " (all); ours vs exact "
                                  << ours_exact << "; promtool vs exact " << promtool_exact);
}
