// gradwatch_step_bench: the step path alone, in this process, without gRPC, journal or threads:
// one rank's reports through assembly, the series store, the analytics and the alerting (the
// default rules), as gradwatchd runs them. For issue 10's "CPU per sample at 10,000 parameters
// within 1.2x of that at 1,000": the figure of the daemon (gradwatch_bench) scatters with the
// machine's load; this one isolates the part whose cost grows with the run's working set.
//
//   gradwatch_step_bench [--params N]... [--warm STEPS] [--steps STEPS] [--repeat R]
//                        [--param-recent-points N] [--param-history-buckets N] [--param-max-buckets N]
//                        [--values float32|float64]
//
// For each N (default 1,000 and 10,000): a fresh run of N parameters (2N + 1 series a step) is
// fed --warm steps (300), then --steps more (300) are timed with the thread's CPU clock, --repeat
// times (3) on fresh runs; prints each run's memory and the CPU time of a query right after its
// last step (which applies the points the run set aside) and of the next one, the best ns per
// sample of each N, and the ratio of the largest N's to the first's; then this machine's CPU
// time for a cache line read at random in 4, 32 and 256 MB (RandomLineNs), and with several sizes
// the larger run's extra time per sample in such lines. Reports are built outside the timed
// calls. The --param-* options set the tier of the ordinary parameter series
// (store.param_recent_points, store.param_history_buckets, analytics.param_max_buckets; the
// daemon's defaults otherwise), to weigh their memory. --values: float64 (the default) varies
// every bit of each value; float32 sends float32 values widened, as an unsharded PyTorch trainer
// does (see FillReport).
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "alerts/rules.h"
#include "server/core/clock.h"
#include "server/daemon/alerting.h"
#include "server/runs/run.h"
#include "tests/bench/catalog.h"

using namespace gradwatch;
using namespace gradwatch::runs;

namespace {

// This process's resident set (VmRSS), bytes.
double RssBytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmRSS: %lf kB", &kb) == 1) break;
  }
  std::fclose(f);
  return kb * 1024;
}

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// This machine's CPU time for a cache line read at random in `bytes` of memory, the reads
// independent of each other (the most misses a core overlaps): the floor under what each line of
// a sample's state costs once the run's state outgrows the caches. 2^21 reads, ns each.
double RandomLineNs(size_t bytes) {
  constexpr size_t kWords = 64 / sizeof(uint64_t);
  const size_t lines = std::max<size_t>(1, bytes / 64);
  std::vector<uint64_t> memory(lines * kWords, 1);
  std::vector<uint32_t> order(size_t{1} << 21);
  std::mt19937_64 rng(7);
  for (uint32_t& line : order) line = static_cast<uint32_t>(rng() % lines);
  uint64_t sum = 0;
  const double t0 = ThreadCpuSeconds();
  for (const uint32_t line : order) sum += memory[line * kWords];
  const double ns = (ThreadCpuSeconds() - t0) * 1e9 / static_cast<double>(order.size());
  // Every word is 1: the sum keeps the reads, and checks them.
  if (sum != order.size()) std::abort();
  return ns;
}

// The catalog gradwatch_bench's trainers send (tests/bench/catalog.h).
RunMeta Meta(size_t params) {
  RunMeta m;
  m.run_id = "step-bench";
  for (const bench::BenchParam& b : bench::Catalog(params)) {
    ParamInfo p;
    p.numel = 4096;
    p.name = b.name;
    p.kind = b.kind;
    p.weight_decay = b.weight_decay;
    m.params.push_back(p);
  }
  return m;
}

// Noisy norms, 1 % wobble: no rule fires. With float32_values, the loss and the norms are float32
// values widened to double, as a PyTorch trainer computes them (gradwatch.torch sends a float32
// norm exactly: the square root of its square in double); otherwise every bit of the double
// varies, as in sums of squares from sharded ranks.
void FillReport(RankStep& r, uint64_t step, size_t params, bool float32_values) {
  auto value = [&](double v) { return float32_values ? static_cast<double>(static_cast<float>(v)) : v; };
  r.step = step;
  r.loss = value(2.0 + 0.01 * std::sin(static_cast<double>(step)));
  r.learning_rate = 3e-4;
  r.params.resize(params);
  for (size_t i = 0; i < params; ++i) {
    const double wobble = 1.0 + 0.01 * std::sin(0.37 * static_cast<double>(step + i));
    r.params[i] = {.index = static_cast<uint32_t>(i),
                   .norms = {NormContribution::FromNorm(value(0.2 / std::sqrt(static_cast<double>(params)) * wobble)),
                             NormContribution::FromNorm(value(50.0 * wobble)), NormContribution()}};
  }
}

// ns per sample of `steps` steps after `warm` on a fresh run of `params` parameters; prints what
// the run added to the process's RSS, and what its series store counts (Run::MemoryBytes), per series.
double Measure(size_t params, uint64_t warm, uint64_t steps, const RunOptions& base, bool float32_values) {
  const double rss0 = RssBytes();
  FakeClock clock;
  DaemonStats stats;
  auto rules = alerts::LoadDefaultRules();
  if (!rules.ok()) {
    std::fprintf(stderr, "the default rules do not load\n");
    std::exit(1);
  }
  daemon::Alerting alerting(std::move(rules).value());
  RunOptions options = base;
  options.listener = &alerting;
  Run run(Meta(params), options, nullptr, &stats, &clock, true);
  AttachInfo info;
  if (run.Attach(Meta(params), 0, nullptr, &info).has_value()) {
    std::fprintf(stderr, "attach failed\n");
    std::exit(1);
  }
  RankStep report;
  double cpu = 0;
  for (uint64_t s = 1; s <= warm + steps; ++s) {
    FillReport(report, s, params, float32_values);
    const double t0 = ThreadCpuSeconds();
    if (run.AddStep(0, report, nullptr).has_value()) {
      std::fprintf(stderr, "step %llu refused\n", static_cast<unsigned long long>(s));
      std::exit(1);
    }
    if (s > warm) cpu += ThreadCpuSeconds() - t0;
  }
  const double series = static_cast<double>(2 * params + 1);
  // A read right after a step applies the points the run set aside (Run::ApplySliceLocked: up to
  // 7 steps' worth in some slices, 3.5 on average) under the run's lock; the next read has none.
  double read_ms[2] = {0, 0};
  for (double& ms : read_ms) {
    const double t0 = ThreadCpuSeconds();
    if (!run.QuerySeries("grad/norm/total", 0, 0, 0).has_value()) {
      std::fprintf(stderr, "no total series\n");
      std::exit(1);
    }
    ms = (ThreadCpuSeconds() - t0) * 1e3;
  }
  std::printf(
      "params %zu: a query right after step %llu takes %.2f ms of CPU (it applies the points set aside), the "
      "next one %.2f ms\n",
      params, static_cast<unsigned long long>(warm + steps), read_ms[0], read_ms[1]);
  const double rss = RssBytes();
  std::printf(
      "params %zu: RSS %.1f KB per series (%.0f MB in all), the store's own count (Run::MemoryBytes) "
      "%.1f KB per series\n",
      params, (rss - rss0) / series / 1024, rss / 1048576, static_cast<double>(run.MemoryBytes()) / series / 1024);
  // A sample: the grad and param norm of each parameter, and the total grad norm (derived here).
  return cpu * 1e9 / static_cast<double>(steps * (2 * params + 1));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> params;
  uint64_t warm = 300, steps = 300;
  int repeat = 3;
  bool float32_values = false;
  RunOptions base;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--params" && i + 1 < argc) {
      params.push_back(std::strtoull(argv[++i], nullptr, 10));
    } else if (arg == "--warm" && i + 1 < argc) {
      warm = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--steps" && i + 1 < argc) {
      steps = std::max<uint64_t>(1, std::strtoull(argv[++i], nullptr, 10));
    } else if (arg == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--param-recent-points" && i + 1 < argc) {
      base.param_series.recent_points = std::max<size_t>(2, std::strtoull(argv[++i], nullptr, 10));
    } else if (arg == "--param-history-buckets" && i + 1 < argc) {
      base.param_series.history_buckets = std::max<size_t>(2, std::strtoull(argv[++i], nullptr, 10));
    } else if (arg == "--param-max-buckets" && i + 1 < argc) {
      base.analytics.param_max_buckets = std::max<size_t>(2, std::strtoull(argv[++i], nullptr, 10));
    } else if (arg == "--values" && i + 1 < argc &&
               (argv[i + 1] == std::string("float32") || argv[i + 1] == std::string("float64"))) {
      float32_values = argv[++i] == std::string("float32");
    } else {
      std::fprintf(stderr,
                   "usage: gradwatch_step_bench [--params N]... [--warm STEPS] [--steps STEPS] [--repeat R]\n"
                   "                            [--param-recent-points N] [--param-history-buckets N]\n"
                   "                            [--param-max-buckets N] [--values float32|float64]\n");
      return 2;
    }
  }
  if (params.empty()) params = {1000, 10000};
  // Repeats interleave the sizes, so that a change in the machine's load touches each alike.
  std::vector<double> best(params.size(), 1e300);
  for (int r = 0; r < repeat; ++r) {
    for (size_t p = 0; p < params.size(); ++p) {
      const double ns = Measure(params[p], warm, steps, base, float32_values);
      std::printf("params %zu: %.1f ns/sample (repeat %d)\n", params[p], ns, r + 1);
      std::fflush(stdout);
      best[p] = std::min(best[p], ns);
    }
  }
  for (size_t p = 0; p < params.size(); ++p) std::printf("best: params %zu: %.1f ns/sample\n", params[p], best[p]);
  // A step touches each series' state once: about 3 MB of it at 1,000 parameters (two dozen lines
  // a series), which the caches hold, and 30 MB at 10,000, which they do not.
  const double cached = RandomLineNs(size_t{4} << 20), cold = RandomLineNs(size_t{32} << 20);
  std::printf("a cache line read at random: %.1f ns in 4 MB, %.1f ns in 32 MB, %.1f ns in 256 MB\n", cached, cold,
              RandomLineNs(size_t{256} << 20));
  if (params.size() > 1) {
    std::printf("ratio %zu / %zu: %.2f\n", params.back(), params.front(), best.back() / best.front());
    if (cold > cached) {
      std::printf("the extra %.1f ns a sample at %zu parameters: %.1f lines read at random in 32 MB instead of 4\n",
                  best.back() - best.front(), params.back(), (best.back() - best.front()) / (cold - cached));
    }
  }
  return 0;
}
