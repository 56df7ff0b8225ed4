// TLS for the client's channels to gradwatchd: the CA that signed the daemon's certificate, and
// for mutual TLS this client's certificate and key, all PEM files.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

namespace gradwatch::client {

struct TlsOptions {
  std::string ca_file;    // the daemon's CA; empty: the system's roots
  std::string cert_file;  // this client's certificate chain (mutual TLS)
  std::string key_file;   // its private key
  // The name the daemon's certificate is checked against, when it is not the address's host
  // (a certificate for "gradwatch.internal" reached at 10.0.0.5:7390).
  std::string server_name;

  // TLS is on when any file is given.
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// The options from GRADWATCH_TLS_CA, GRADWATCH_TLS_CERT, GRADWATCH_TLS_KEY and
// GRADWATCH_TLS_SERVER_NAME (unset: empty).
TlsOptions TlsOptionsFromEnvironment();

// Plain-text credentials when TLS is off; otherwise TLS credentials read from the files now.
// Null with `error` set ("cannot read the TLS CA file /x: No such file or directory", "a TLS
// certificate needs its key") when they cannot be made.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const TlsOptions& tls, std::string* error);

// Adds what the credentials cannot carry (the server name override) to a channel's arguments.
void AddTlsArguments(const TlsOptions& tls, grpc::ChannelArguments& args);

}  // namespace gradwatch::client
