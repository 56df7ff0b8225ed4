// The engine's silences and acknowledgements (AlertEngine::AddSilence, Ack, IsMuted): which
// alerts a silence mutes, and the acks kept by fingerprint.
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "alerts/state_machine.h"

namespace gradwatch::alerts {
namespace {

std::optional<uint64_t> ParseFingerprint(std::string_view hex) {
  if (hex.empty() || hex.size() > 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : hex) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

bool SilenceMatches(const Silence& s, const Alert& alert, double now) {
  if (!(s.starts_at <= now && now < s.ends_at)) return false;
  for (const Matcher& m : s.matchers) {
    if (!m.Matches(alert.labels)) return false;
  }
  return true;
}

}  // namespace

Status AlertEngine::AddSilence(Silence silence) {
  if (silence.id.empty()) return Status::InvalidArgument("a silence needs an id");
  if (Status s = CheckSilenceMatchers(silence.matchers); !s.ok()) return s;
  if (!(silence.ends_at > silence.starts_at)) {
    return Status::InvalidArgument("a silence must end after it starts");
  }
  std::lock_guard lock(mu_);
  TouchSilence(silence.id);
  silences_[silence.id] = std::move(silence);
  PublishLocked({});
  return Status::Ok();
}

Status AlertEngine::RemoveSilence(std::string_view id) {
  std::lock_guard lock(mu_);
  auto it = silences_.find(id);
  if (it == silences_.end()) return Status::NotFound("no silence with id '" + std::string(id) + "'");
  TouchSilence(it->first);
  silences_.erase(it);
  PublishLocked({});
  return Status::Ok();
}

std::vector<Silence> AlertEngine::Silences() const {
  std::lock_guard lock(mu_);
  std::vector<Silence> out;
  out.reserve(silences_.size());
  for (const auto& [id, s] : silences_) out.push_back(s);
  return out;
}

Status AlertEngine::Ack(std::string_view fingerprint, std::string by, std::string comment, double now) {
  const std::optional<uint64_t> fp = ParseFingerprint(fingerprint);
  if (!fp) {
    return Status::InvalidArgument("bad fingerprint '" + std::string(fingerprint) + "': 16 hex digits");
  }
  std::lock_guard lock(mu_);
  auto it = instances_.find(*fp);
  if (it == instances_.end()) {
    return Status::NotFound("no active alert with fingerprint " + std::string(fingerprint));
  }
  if (it->second.alert.state != AlertState::kFiring) {
    return Status::FailedPrecondition("alert " + std::string(fingerprint) +
                                      " is pending: only a firing alert can be acknowledged");
  }
  it->second.ack = Acknowledgement{std::move(by), std::move(comment), now};
  Touch(it->first);
  PublishLocked({});
  return Status::Ok();
}

std::optional<Acknowledgement> AlertEngine::AckOf(std::string_view fingerprint) const {
  const std::optional<uint64_t> fp = ParseFingerprint(fingerprint);
  if (!fp) return std::nullopt;
  std::lock_guard lock(mu_);
  auto it = instances_.find(*fp);
  if (it == instances_.end()) return std::nullopt;
  return it->second.ack;
}

std::vector<std::string> AlertEngine::SilencesMuting(const Alert& alert, double now) const {
  std::lock_guard lock(mu_);
  std::vector<std::string> ids;
  for (const auto& [id, s] : silences_) {
    if (SilenceMatches(s, alert, now)) ids.push_back(id);
  }
  return ids;
}

bool AlertEngine::IsMuted(const Alert& alert, double now) const {
  std::lock_guard lock(mu_);
  return IsMutedLocked(alert, now);
}

bool AlertEngine::IsMutedLocked(const Alert& alert, double now) const {
  for (const auto& [id, s] : silences_) {
    if (SilenceMatches(s, alert, now)) return true;
  }
  if (alert.state != AlertState::kFiring) return false;
  auto it = instances_.find(Fingerprint(alert.labels));
  return it != instances_.end() && it->second.ack.has_value() && it->second.alert.state == AlertState::kFiring;
}

}  // namespace gradwatch::alerts
