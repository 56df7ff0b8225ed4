// The recent reports of one alert instance, for judging a noisy series by its level rather than
// by one sample (state_machine.h, "Noisy series").
//
// Each report has three numbers: the value shown to people, the measure the hold is judged on,
// and the measure the clearing is judged on (they differ for an estimate with an error bar; see
// evaluator.h LevelTest). The window keeps the last kCapacity reports.
//
// Noise() is the series' report-to-report noise: 1.4826 × the median absolute deviation of the
// successive differences of the hold measure, over √2. Differences cancel a trend, and the median
// ignores a jump or a lone spike, so it measures the scatter of the reports around their local
// level (for Gaussian noise of standard deviation σ it estimates σ). 0 for a noise-free series
// (a constant, a straight line, a step), which is what lets clean data keep the exact timing of
// `for_steps`.
//
// Pure data: no locks. Memory: 3 × kCapacity doubles.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace gradwatch::alerts {

class ReportWindow {
 public:
  static constexpr size_t kCapacity = 32;
  enum class Column { kValue, kHold, kClear };

  void Add(double value, double hold, double clear);
  // Reports held, at most kCapacity.
  size_t size() const { return count_ < kCapacity ? count_ : kCapacity; }
  // The median of the last n reports of a column (n is clamped to [1, size()]); NaN when empty.
  // An even count gives the mean of the two middle values.
  double Median(Column column, size_t n) const;
  // See above. Differences involving a non-finite measure are skipped; 0 with fewer than 2.
  double Noise() const;

  // Everything the window holds, for saving it across a restart and restoring it exactly.
  struct Raw {
    std::array<double, kCapacity> value{};
    std::array<double, kCapacity> hold{};
    std::array<double, kCapacity> clear{};
    uint64_t count = 0;  // reports ever added
    bool operator==(const Raw&) const = default;
  };
  Raw raw() const { return {value_, hold_, clear_, count_}; }
  static ReportWindow FromRaw(const Raw& raw);

 private:
  const std::array<double, kCapacity>& Of(Column column) const;

  std::array<double, kCapacity> value_{};
  std::array<double, kCapacity> hold_{};
  std::array<double, kCapacity> clear_{};
  uint64_t count_ = 0;  // reports ever added; the newest is at (count_ - 1) % kCapacity
};

}  // namespace gradwatch::alerts
