// How much longer the tests allow for anything timed: the one place deadlines, readiness waits and
// time bounds of the tests are stretched for a slow build. A sanitizer build runs 2-15x slower, so
// tests/CMakeLists.txt compiles GRADWATCH_TEST_TIME_SCALE_DEFAULT into the tests of such a build;
// the environment variable GRADWATCH_TEST_TIME_SCALE (a number >= 1) overrides it at run time.
// The normal build's default is 1: its bounds are the ones the tests promise.
#pragma once

#include <chrono>
#include <cstdlib>

#ifndef GRADWATCH_TEST_TIME_SCALE_DEFAULT
#define GRADWATCH_TEST_TIME_SCALE_DEFAULT 1
#endif

namespace gradwatch::testing {

inline double TimeScale() {
  static const double scale = [] {
    const char* text = std::getenv("GRADWATCH_TEST_TIME_SCALE");
    const double value = text != nullptr && *text != '\0' ? std::strtod(text, nullptr) : 0.0;
    return value >= 1.0 ? value : static_cast<double>(GRADWATCH_TEST_TIME_SCALE_DEFAULT);
  }();
  return scale;
}

// `limit` stretched by TimeScale(), in the same duration type.
template <typename Rep, typename Period>
std::chrono::duration<Rep, Period> Scaled(std::chrono::duration<Rep, Period> limit) {
  return std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(
      std::chrono::duration<double, Period>(limit.count() * TimeScale()));
}

}  // namespace gradwatch::testing
