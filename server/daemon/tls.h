// TLS on gradwatchd's gRPC listener: the daemon's certificate and key, and for mutual TLS the CA
// that signs the clients' certificates, all PEM files (security.tls_* in the configuration).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "server/core/status.h"

namespace gradwatch::daemon {

struct TlsFiles {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;  // empty: clients are not asked for a certificate

  bool enabled() const { return !cert_file.empty(); }
};

// Reads the files as a TLS server would and checks that the key matches the certificate and
// that the certificate is valid now. Returns a line for the log ("CN=gradwatch, valid until
// 2027-12-01T00:00:00Z, client certificates required (CA CN=ops-ca)"); an error names the file
// and what is wrong with it.
StatusOr<std::string> CheckTlsFiles(const TlsFiles& files);

// Reads the first certificate of a CA file; its subject ("CN=ops-ca"), or an error that names
// `setting` and the file.
StatusOr<std::string> CheckCaFile(const std::string& setting, const std::string& path);

// Plain-text credentials when TLS is off. Otherwise TLS credentials whose files are read again
// every `refresh_seconds`: a certificate renewed in place (and checked on SIGHUP with
// CheckTlsFiles) is served to new connections without dropping the streams already open.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsFiles& files, unsigned refresh_seconds);

}  // namespace gradwatch::daemon
