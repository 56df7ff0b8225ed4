#include "server/ingest/authorizer.h"

#include <openssl/evp.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>

#include "alerts/yaml_checks.h"
#include "server/core/file_text.h"
#include "server/core/types.h"

namespace gradwatch::ingest {

namespace {

constexpr std::string_view kScopeNames[kScopeCount] = {"read", "write", "silence", "ack", "admin"};

// The bearer token of the call's "authorization" metadata; empty when none.
// The token of an Authorization value "Bearer TOKEN": the scheme in any case (RFC 9110: it is
// case-insensitive), then one or more spaces; empty for any other value.
std::string_view BearerCredentials(std::string_view value) {
  constexpr std::string_view kBearer = "bearer";
  if (value.size() <= kBearer.size() + 1) return {};
  for (size_t i = 0; i < kBearer.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(value[i])) != kBearer[i]) return {};
  }
  if (value[kBearer.size()] != ' ') return {};
  value.remove_prefix(kBearer.size());
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  return value;
}

std::string_view BearerToken(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return {};
  return BearerCredentials(std::string_view(it->second.data(), it->second.size()));
}

std::string PeerIdentity(const grpc::ServerContextBase& context) {
  const auto auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return {};
  const auto identity = auth->GetPeerIdentity();
  return identity.empty() ? std::string() : std::string(identity.front().data(), identity.front().size());
}

Status ReadGrant(const YAML::Node& entry, const std::string& where, Grant* grant) {
  const YAML::Node scopes = entry["scopes"];
  if (!scopes || !scopes.IsSequence() || scopes.size() == 0) {
    return Status::InvalidArgument(where + ": scopes must list some of read, write, silence, ack, admin");
  }
  for (const auto& s : scopes) {
    const std::string name = s.as<std::string>();
    const auto found = std::find(std::begin(kScopeNames), std::end(kScopeNames), name);
    if (found == std::end(kScopeNames)) {
      return Status::InvalidArgument(where + ": unknown scope '" + name + "' (read, write, silence, ack, admin)");
    }
    grant->scopes[static_cast<size_t>(found - std::begin(kScopeNames))] = true;
  }
  if (const YAML::Node runs = entry["runs"]) {
    if (!runs.IsSequence()) return Status::InvalidArgument(where + ": runs must be a list of run patterns");
    for (const auto& r : runs) grant->runs.push_back(r.as<std::string>());
  }
  for (const auto& kv : entry) {
    const std::string key = kv.first.as<std::string>();
    if (key != "name" && key != "sha256" && key != "identity" && key != "scopes" && key != "runs") {
      return Status::InvalidArgument(where + ": unknown key '" + key + "'");
    }
  }
  return Status::Ok();
}

// The caller's grant and name ("token oncall", "certificate trainer"): its bearer token's, else
// its client certificate's; null and empty when the policy knows neither.
std::pair<const Grant*, std::string> Identify(const Policy& policy, std::string_view token, std::string_view identity) {
  if (!token.empty()) {
    const auto it = policy.by_token_sha256.find(TokenSha256(token));
    if (it != policy.by_token_sha256.end()) return {&it->second, "token " + it->second.name};
  }
  const auto it = identity.empty() ? policy.by_identity.end() : policy.by_identity.find(std::string(identity));
  if (it != policy.by_identity.end()) return {&it->second, "certificate " + std::string(identity)};
  return {nullptr, ""};
}

}  // namespace

std::string_view ScopeName(Scope scope) { return kScopeNames[static_cast<size_t>(scope)]; }

std::string TokenSha256(std::string_view token) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(token.data(), token.size(), digest, &size, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

StatusOr<std::shared_ptr<const Policy>> LoadPolicy(const std::string& path) {
  auto text = ReadRegularFile("security.tokens_file", path);  // a FIFO is refused, not waited on
  if (!text.ok()) return Status::InvalidArgument(text.status().message());
  if (Status s = alerts::CheckAliasExpansion(*text, "security.tokens_file " + path); !s.ok()) return s;
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument("security.tokens_file " + path + ": " + e.what());
  }
  auto policy = std::make_shared<Policy>();
  try {
    if (!root.IsMap())
      return Status::InvalidArgument("security.tokens_file " + path + ": expected tokens: and identities:");
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      if (key != "tokens" && key != "identities") {
        return Status::InvalidArgument("security.tokens_file " + path + ": unknown key '" + key + "'");
      }
    }
    size_t i = 0;
    for (const auto& entry : root["tokens"]) {
      const std::string where = "security.tokens_file " + path + ": tokens[" + std::to_string(i++) + "]";
      Grant grant;
      grant.name = entry["name"] ? entry["name"].as<std::string>() : "";
      std::string hash = entry["sha256"] ? entry["sha256"].as<std::string>() : "";
      std::transform(hash.begin(), hash.end(), hash.begin(), [](unsigned char c) { return std::tolower(c); });
      if (grant.name.empty()) return Status::InvalidArgument(where + ": name is required");
      if (hash.size() != 64 || hash.find_first_not_of("0123456789abcdef") != std::string::npos) {
        return Status::InvalidArgument(where + " (" + grant.name +
                                       "): sha256 must be the token's SHA-256 in hex (printf %s TOKEN | sha256sum), "
                                       "never the token itself");
      }
      if (Status s = ReadGrant(entry, where + " (" + grant.name + ")", &grant); !s.ok()) return s;
      if (!policy->by_token_sha256.emplace(hash, std::move(grant)).second) {
        return Status::InvalidArgument(where + ": the same token twice");
      }
    }
    i = 0;
    for (const auto& entry : root["identities"]) {
      const std::string where = "security.tokens_file " + path + ": identities[" + std::to_string(i++) + "]";
      Grant grant;
      grant.name = entry["identity"] ? entry["identity"].as<std::string>() : "";
      if (grant.name.empty()) return Status::InvalidArgument(where + ": identity is required (the certificate's name)");
      if (Status s = ReadGrant(entry, where + " (" + grant.name + ")", &grant); !s.ok()) return s;
      const std::string identity = grant.name;
      if (!policy->by_identity.emplace(identity, std::move(grant)).second) {
        return Status::InvalidArgument(where + ": identity '" + identity + "' twice");
      }
    }
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument("security.tokens_file " + path + ": " + e.what());
  }
  return std::shared_ptr<const Policy>(std::move(policy));
}

void Authorizer::SetPolicy(std::shared_ptr<const Policy> policy) {
  MutexLock lock(&mu_);
  policy_ = std::move(policy);
}

bool Authorizer::enabled() const { return policy() != nullptr; }

std::shared_ptr<const Policy> Authorizer::policy() const {
  MutexLock lock(&mu_);
  return policy_;
}

std::string Authorizer::Who(const grpc::ServerContextBase& context) const {
  const auto p = policy();
  return p == nullptr ? std::string() : Identify(*p, BearerToken(context), PeerIdentity(context)).second;
}

Authorizer::Decision Authorizer::Decide(std::string_view token, std::string_view identity, Scope scope,
                                        const std::string_view* run, std::string_view what, std::string_view peer,
                                        std::string_view how_to_send_a_token) const {
  const auto p = policy();
  if (p == nullptr) return {};
  const auto [grant, who] = Identify(*p, token, identity);
  if (grant == nullptr) {
    refusals_[kUnauthenticated].fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("refused {} from {}: {}", what, peer,
                 !token.empty()     ? "unknown token"
                 : identity.empty() ? "no token"
                                    : "no token, certificate " + std::string(identity) + " not in the policy");
    return {kUnauthenticated, token.empty() ? "this daemon requires a bearer token (security.tokens_file): " +
                                                  std::string(how_to_send_a_token)
                                            : "the bearer token is not one this daemon knows (security.tokens_file)"};
  }
  std::string denied;
  if (!grant->scopes[static_cast<size_t>(scope)]) {
    denied = who + " has no '" + std::string(ScopeName(scope)) + "' scope";
  } else if (scope == Scope::kWrite && run != nullptr && !grant->runs.empty() &&
             std::none_of(grant->runs.begin(), grant->runs.end(),
                          [&](const std::string& pattern) { return GlobMatches(pattern, *run); })) {
    denied = who + " may write only runs matching " + grant->runs.front() +
             (grant->runs.size() > 1 ? " (and " + std::to_string(grant->runs.size() - 1) + " more patterns)" : "") +
             ", not " + std::string(*run);
  }
  if (denied.empty()) return {};
  refusals_[kPermissionDenied].fetch_add(1, std::memory_order_relaxed);
  spdlog::warn("refused {} from {}: {}", what, peer, denied);
  return {kPermissionDenied, std::string(what) + ": " + denied};
}

grpc::Status Authorizer::Check(const grpc::ServerContextBase& context, Scope scope, std::string_view run,
                               std::string_view what) const {
  const Decision d = Decide(BearerToken(context), PeerIdentity(context), scope, &run, what, context.peer(),
                            "give one with --token-file or GRADWATCH_TOKEN");
  if (d.refusal == kNone) return grpc::Status::OK;
  return {d.refusal == kUnauthenticated ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::PERMISSION_DENIED,
          d.message};
}

grpc::Status Authorizer::CheckScope(const grpc::ServerContextBase& context, Scope scope, std::string_view what) const {
  const Decision d = Decide(BearerToken(context), PeerIdentity(context), scope, nullptr, what, context.peer(),
                            "give one with --token-file or GRADWATCH_TOKEN");
  if (d.refusal == kNone) return grpc::Status::OK;
  return {d.refusal == kUnauthenticated ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::PERMISSION_DENIED,
          d.message};
}

std::pair<int, std::string> Authorizer::CheckHttp(std::string_view authorization, std::string_view identity,
                                                  Scope scope, std::string_view what, std::string_view peer) const {
  const std::string_view token = BearerCredentials(authorization);
  const Decision d = Decide(token, identity, scope, nullptr, what, peer,
                            "send it as \"Authorization: Bearer TOKEN\" (Prometheus: authorization.credentials_file in "
                            "the scrape config)");
  if (d.refusal == kNone) return {200, ""};
  return {d.refusal == kUnauthenticated ? 401 : 403, d.message};
}

}  // namespace gradwatch::ingest
