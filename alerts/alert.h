// Alert identity and state, shared by the rule engine (alerts issue), the journal and the
// trainer streams. No gRPC or prometheus-cpp here: the daemon converts at its edges.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace gradwatch::alerts {

using LabelSet = std::map<std::string, std::string>;

enum class AlertState { kInactive = 0, kPending, kFiring, kResolved };

std::string_view AlertStateName(AlertState state);

struct Alert {
  std::string name;  // the rule's name; also the "alertname" label
  AlertState state = AlertState::kInactive;
  LabelSet labels;
  LabelSet annotations;
  uint64_t step = 0;     // step of the last state change
  double value = 0;      // the value that triggered the rule, in the series' unit
  double starts_at = 0;  // seconds since the Unix epoch; 0 when unset
  double ends_at = 0;
};

// Alertmanager's fingerprint: FNV-1a 64 over the label names and values sorted by name, each
// followed by the separator byte 0xff. Equal label sets give equal fingerprints.
uint64_t Fingerprint(const LabelSet& labels);
// The fingerprint as 16 lowercase hex digits, as Alertmanager prints it.
std::string FingerprintHex(const LabelSet& labels);

}  // namespace gradwatch::alerts
