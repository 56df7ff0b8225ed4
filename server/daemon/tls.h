// TLS on gradwatchd's gRPC listener: the daemon's certificate and key, and for mutual TLS the CA
// that signs the clients' certificates, all PEM files (security.tls_* in the configuration).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace gradwatch::daemon {

struct TlsFiles {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;  // empty: clients are not asked for a certificate

  bool enabled() const { return !cert_file.empty(); }
};

// The files' texts, read once, so that what is checked is what is served.
struct TlsPem {
  std::string cert;  // the chain, the server's certificate first
  std::string key;
  std::string client_ca;  // empty when no client CA is configured
  bool operator==(const TlsPem&) const = default;
};

// Reads the files (regular files of at most 1 MiB: a FIFO is refused, not waited on).
StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files);

// Checks the texts as a TLS server would: a certificate chain, a private key that matches it, a
// certificate valid now, and a client CA certificate when one is configured. Returns a line for
// the log ("CN=gradwatch, valid until 2027-12-01T00:00:00Z, client certificates required (CA
// CN=ops-ca)"); an error names the file (from `files`) and what is wrong with it.
StatusOr<std::string> CheckTlsPem(const TlsFiles& files, const TlsPem& pem);

// ReadTlsFiles, then CheckTlsPem.
StatusOr<std::string> CheckTlsFiles(const TlsFiles& files);

// Reads the first certificate of a CA file; its subject ("CN=ops-ca"), or an error that names
// `setting` and the file.
StatusOr<std::string> CheckCaFile(const std::string& setting, const std::string& path);

// The copies of the TLS files that the gRPC listener reads. gRPC reads its files itself, every
// refresh interval, and aborts the process on an empty one; a renewal written in place (`cp`, a
// shell `>`) passes through empty, half-written and mismatched states. So gRPC is given copies:
// a pair is copied only once it reads as complete and valid (CheckTlsPem), into a new generation
// directory that one rename of the `current` link makes live; the generations' modification
// times differ by at least a second, so gRPC, which rereads a pair whose files changed while it
// read them, sees the old pair or the new one, never a mix. A broken pair keeps the last good one.
class TlsStage {
 public:
  // Stages `pem` (already checked) from `source` under `dir` (created 0700; the copies are 0600).
  static StatusOr<std::unique_ptr<TlsStage>> Create(const TlsFiles& source, const TlsPem& pem, std::string dir);

  // The copies: what MakeServerCredentials watches.
  TlsFiles staged() const;

  // Reads the source files again. `changed` when they differ from the pair staged and from the
  // last broken pair reported (so a broken pair is reported once); `status` is Ok when the files
  // are what is served, else why they are not; `line` is CheckTlsPem's line of the pair served.
  // Thread-safe.
  struct Refresh {
    bool changed = false;
    Status status;
    std::string line;
  };
  Refresh Reload();

  // The line of the pair being served.
  std::string served() const;

 private:
  TlsStage(TlsFiles source, std::string dir) : source_(std::move(source)), dir_(std::move(dir)) {}
  Status Stage(const TlsPem& pem) REQUIRES(mu_);

  const TlsFiles source_;
  const std::string dir_;
  mutable Mutex mu_;
  TlsPem staged_pem_ GUARDED_BY(mu_);
  std::string served_line_ GUARDED_BY(mu_);
  std::optional<TlsPem> refused_ GUARDED_BY(mu_);  // the last broken pair reported
  std::string refused_why_ GUARDED_BY(mu_);
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  int64_t last_mtime_ GUARDED_BY(mu_) = 0;  // seconds, of the generation served
};

// Plain-text credentials when TLS is off. Otherwise TLS credentials whose files (TlsStage's
// copies) are read again every `refresh_seconds`: a certificate renewed in place reaches new
// connections without dropping the streams already open.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsFiles& files, unsigned refresh_seconds);

}  // namespace gradwatch::daemon
