// What the daemon says back on a trainer stream (errors about steps, alerts), for the commands
// that stream (replay, tail) to show on stderr.
#pragma once

#include <cstdint>
#include <mutex>
#include <ostream>
#include <string>
#include <unordered_map>
#include <vector>

#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

// "ERROR_REASON_STEP_OUT_OF_ORDER" → "STEP_OUT_OF_ORDER".
std::string ReasonShortName(const std::string& reason);

// Messages arrive on the Monitor's reader thread; the main thread prints them, so that `err` is
// only ever written from one thread. At most kShown of each kind are kept; the rest are counted
// by the Monitor's stats.
class DaemonMessages {
 public:
  static constexpr size_t kShown = 100;

  void AddError(const v1::Error& e);
  void AddAlert(const v1::Alert& a);
  // Prints what arrived since the last call: errors as `file[:line]: daemon error at step ...`
  // (the line from `line_of_step` when it has the step), alerts as `alert NAME STATE at step ...`.
  void Print(const std::string& file, const std::unordered_map<uint64_t, uint64_t>& line_of_step, std::ostream& err);

 private:
  std::mutex mu_;
  std::vector<v1::Error> errors_;
  std::vector<v1::Alert> alerts_;
  size_t errors_seen_ = 0;
  size_t alerts_seen_ = 0;
  bool limit_announced_ = false;
};

}  // namespace gradwatch::cli
