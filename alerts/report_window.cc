#include "alerts/report_window.h"

#include <algorithm>
#include <cmath>

namespace gradwatch::alerts {
namespace {

double MedianOf(double* first, size_t n) {
  double* mid = first + n / 2;
  std::nth_element(first, mid, first + n);
  if (n % 2 == 1) return *mid;
  const double upper = *mid;
  const double lower = *std::max_element(first, mid);
  // Two infinities of opposite sign have no mean: the lower one stands (neither holds).
  if (std::isinf(lower) && std::isinf(upper) && lower != upper) return lower;
  return lower / 2 + upper / 2;
}

}  // namespace

ReportWindow ReportWindow::FromRaw(const Raw& raw) {
  ReportWindow w;
  w.value_ = raw.value;
  w.hold_ = raw.hold;
  w.clear_ = raw.clear;
  w.count_ = raw.count;
  return w;
}

void ReportWindow::Add(double value, double hold, double clear) {
  const size_t i = count_ % kCapacity;
  value_[i] = value;
  hold_[i] = hold;
  clear_[i] = clear;
  ++count_;
}

const std::array<double, ReportWindow::kCapacity>& ReportWindow::Of(Column column) const {
  switch (column) {
    case Column::kValue: return value_;
    case Column::kHold: return hold_;
    case Column::kClear: return clear_;
  }
  return value_;
}

double ReportWindow::Median(Column column, size_t n) const {
  const size_t held = size();
  if (held == 0) return NAN;
  n = std::clamp<size_t>(n, 1, held);
  const auto& data = Of(column);
  std::array<double, kCapacity> scratch;
  for (size_t j = 0; j < n; ++j) scratch[j] = data[(count_ - 1 - j) % kCapacity];
  return MedianOf(scratch.data(), n);
}

double ReportWindow::Noise() const {
  const size_t held = size();
  std::array<double, kCapacity> diffs;
  size_t n = 0;
  for (size_t j = 1; j < held; ++j) {
    const double newer = hold_[(count_ - j) % kCapacity];
    const double older = hold_[(count_ - 1 - j) % kCapacity];
    if (std::isfinite(newer) && std::isfinite(older)) diffs[n++] = newer - older;
  }
  if (n < 2) return 0;
  const double center = MedianOf(diffs.data(), n);
  for (size_t j = 0; j < n; ++j) diffs[j] = std::fabs(diffs[j] - center);
  constexpr double kMadToSigma = 1.4826;
  return kMadToSigma * MedianOf(diffs.data(), n) / std::sqrt(2.0);
}

}  // namespace gradwatch::alerts
