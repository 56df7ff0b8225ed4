#include "client/cli/daemon_messages.h"

#include "client/cli/format.h"

namespace gradwatch::cli {

std::string ReasonShortName(const std::string& reason) {
  constexpr std::string_view kPrefix = "ERROR_REASON_";
  return reason.rfind(kPrefix, 0) == 0 ? reason.substr(kPrefix.size()) : reason;
}

void DaemonMessages::AddError(const v1::Error& e) {
  std::lock_guard lock(mu_);
  if (errors_seen_++ < kShown) errors_.push_back(e);
}

void DaemonMessages::AddAlert(const v1::Alert& a) {
  std::lock_guard lock(mu_);
  if (alerts_seen_++ < kShown) alerts_.push_back(a);
}

void DaemonMessages::Print(const std::string& file, const std::unordered_map<uint64_t, uint64_t>& line_of_step,
                           std::ostream& err) {
  std::vector<v1::Error> errors;
  std::vector<v1::Alert> alerts;
  bool announce_limit = false;
  {
    std::lock_guard lock(mu_);
    errors.swap(errors_);
    alerts.swap(alerts_);
    if (errors_seen_ > kShown && !limit_announced_) announce_limit = limit_announced_ = true;
  }
  for (const v1::Error& e : errors) {
    auto it = line_of_step.find(e.step());
    err << file;
    if (it != line_of_step.end()) err << ":" << it->second;
    err << ": daemon error at step " << e.step() << " (" << ReasonShortName(v1::ErrorReason_Name(e.reason()))
        << "): " << e.message() << "\n";
  }
  if (announce_limit) err << file << ": further daemon errors are only counted\n";
  for (const v1::Alert& a : alerts) {
    std::string state = v1::AlertState_Name(a.state());
    if (state.rfind("ALERT_STATE_", 0) == 0) state.erase(0, 12);
    err << "alert " << a.name() << " " << state << " at step " << a.step() << ", value " << FormatValue(a.value());
    if (auto s = a.annotations().find("summary"); s != a.annotations().end()) err << ": " << s->second;
    err << "\n";
  }
}

}  // namespace gradwatch::cli
