// Fuzzes the journal's step block decoder, which reads rows from disk (a damaged or foreign
// journal): any input is refused or decoded; what decodes encodes again into a block that decodes
// to the very same steps, bit for bit.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "server/store/step_block.h"

using namespace gradwatch;
using namespace gradwatch::store;

namespace {

bool Same(const std::vector<CompletedStep>& a, const std::vector<CompletedStep>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].step != b[i].step || std::bit_cast<uint64_t>(a[i].wall_time) != std::bit_cast<uint64_t>(b[i].wall_time) ||
        a[i].partial != b[i].partial || a[i].ranks_reported != b[i].ranks_reported ||
        a[i].client_dropped_steps != b[i].client_dropped_steps || a[i].values.size() != b[i].values.size()) {
      return false;
    }
    for (size_t j = 0; j < a[i].values.size(); ++j) {
      if (a[i].values[j].id != b[i].values[j].id ||
          std::bit_cast<uint64_t>(a[i].values[j].value) != std::bit_cast<uint64_t>(b[i].values[j].value)) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<CompletedStep> steps;
  if (!DecodeStepBlock(std::string_view(reinterpret_cast<const char*>(data), size), steps).ok()) return 0;
  std::string again;
  EncodeStepBlock(steps, again);
  std::vector<CompletedStep> back;
  if (!DecodeStepBlock(again, back).ok() || !Same(steps, back)) std::abort();
  return 0;
}
