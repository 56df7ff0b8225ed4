// Who may do what over gRPC and HTTP: bearer tokens (stored as SHA-256 hashes) and mutual-TLS client
// identities, each granted scopes, `write` limited to runs matching given patterns. Loaded from
// security.tokens_file, replaced whole on SIGHUP. Without a policy every caller may do everything
// (a daemon on loopback, or one behind mutual TLS whose certificates are the access control).
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace gradwatch::ingest {

enum class Scope { kRead, kWrite, kSilence, kAck, kAdmin };
inline constexpr size_t kScopeCount = 5;
std::string_view ScopeName(Scope scope);

struct Grant {
  std::string name;  // shown in logs and refusals; never the secret
  std::array<bool, kScopeCount> scopes{};
  std::vector<std::string> runs;  // `write` only for runs matching one ('*' wildcard); empty: every run
};

struct Policy {
  std::map<std::string, Grant> by_token_sha256;  // lower-case hex
  std::map<std::string, Grant> by_identity;      // a client certificate's identity (SAN, else CN)
};

// Reads a tokens file:
//   tokens:
//     - {name: trainer, sha256: <hex of the token>, scopes: [write], runs: ["pretrain-*"]}
//   identities:
//     - {identity: oncall-laptop, scopes: [read, silence, ack]}
// Errors name the file and the entry.
StatusOr<std::shared_ptr<const Policy>> LoadPolicy(const std::string& path);

// The lower-case hex SHA-256 of a token, as the tokens file stores it.
std::string TokenSha256(std::string_view token);

class Authorizer {
 public:
  enum Refusal { kUnauthenticated = 0, kPermissionDenied = 1, kNone = 2 };

  // Null: no policy, every caller may do everything.
  void SetPolicy(std::shared_ptr<const Policy> policy) EXCLUDES(mu_);
  bool enabled() const EXCLUDES(mu_);

  // OK, or UNAUTHENTICATED (no token, or an unknown one, and no known certificate) or
  // PERMISSION_DENIED (known, without `scope`, or `write` to a run outside its patterns), with a
  // message that says what to do. Refusals are counted and logged, never with the secret.
  grpc::Status Check(const grpc::ServerContextBase& context, Scope scope, std::string_view run,
                     std::string_view what) const EXCLUDES(mu_);
  // Check without a run: the caller is known and has `scope` (a stream before its Hello names
  // its run). OK without a policy.
  grpc::Status CheckScope(const grpc::ServerContextBase& context, Scope scope, std::string_view what) const
      EXCLUDES(mu_);
  // An HTTP request's Authorization header (empty when absent) and verified client certificate
  // identity (empty without one) against `scope`: 200, or 401 (neither known to the policy) / 403
  // (known, without the scope) with a message; counted and logged as the gRPC refusals are.
  std::pair<int, std::string> CheckHttp(std::string_view authorization, std::string_view identity, Scope scope,
                                        std::string_view what, std::string_view peer) const EXCLUDES(mu_);
  // The caller's name in the policy ("token trainer", "certificate oncall-laptop"); empty when
  // unknown or without a policy.
  std::string Who(const grpc::ServerContextBase& context) const EXCLUDES(mu_);

  uint64_t refusals(Refusal r) const { return refusals_[r].load(std::memory_order_relaxed); }

 private:
  struct Decision {
    Refusal refusal = kNone;
    std::string message;
  };
  std::shared_ptr<const Policy> policy() const EXCLUDES(mu_);
  // The caller's token (empty: none) or certificate identity against `scope` (and `run` for
  // write); a refusal is counted and logged with `peer`. `how_to_send_a_token` ends the message
  // to a caller without one.
  // `run` null: no run to check (CheckScope).
  Decision Decide(std::string_view token, std::string_view identity, Scope scope, const std::string_view* run,
                  std::string_view what, std::string_view peer, std::string_view how_to_send_a_token) const
      EXCLUDES(mu_);

  mutable Mutex mu_;
  std::shared_ptr<const Policy> policy_ GUARDED_BY(mu_);
  mutable std::array<std::atomic<uint64_t>, 2> refusals_{};
};

}  // namespace gradwatch::ingest
