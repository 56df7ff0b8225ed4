#include "alerts/alert.h"

#include <cstdio>

namespace gradwatch::alerts {

std::string_view AlertStateName(AlertState state) {
  switch (state) {
    case AlertState::kInactive: return "inactive";
    case AlertState::kPending: return "pending";
    case AlertState::kFiring: return "firing";
    case AlertState::kResolved: return "resolved";
  }
  return "inactive";
}

namespace {
constexpr uint64_t kFnvOffset = 14695981039346656037ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;
constexpr unsigned char kSeparator = 0xff;

void Mix(uint64_t& h, std::string_view s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= kFnvPrime;
  }
}
void MixSeparator(uint64_t& h) {
  h ^= kSeparator;
  h *= kFnvPrime;
}
}  // namespace

uint64_t Fingerprint(const LabelSet& labels) {
  uint64_t h = kFnvOffset;
  for (const auto& [name, value] : labels) {  // std::map iterates sorted by name
    Mix(h, name);
    MixSeparator(h);
    Mix(h, value);
    MixSeparator(h);
  }
  return h;
}

std::string FingerprintHex(const LabelSet& labels) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(Fingerprint(labels)));
  return buf;
}

}  // namespace gradwatch::alerts
