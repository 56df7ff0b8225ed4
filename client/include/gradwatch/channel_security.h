// How the client's channels to gradwatchd are secured: TLS (the CA that signed the daemon's
// certificate, and for mutual TLS this client's certificate and key, all PEM files) and a bearer
// token sent with every call, for a daemon with security.tokens_file.
#pragma once

#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

namespace gradwatch::client {

struct ChannelSecurity {
  std::string ca_file;    // the daemon's CA; empty: the system's roots
  std::string cert_file;  // this client's certificate chain (mutual TLS)
  std::string key_file;   // its private key
  // The name the daemon's certificate is checked against, when it is not the address's host
  // (a certificate for "gradwatch.internal" reached at 10.0.0.5:7390).
  std::string server_name;
  // Sent as "authorization: Bearer <token>" with every call; empty: none.
  std::string token;

  // TLS is on when any file is given.
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// The options from GRADWATCH_TLS_CA, GRADWATCH_TLS_CERT, GRADWATCH_TLS_KEY,
// GRADWATCH_TLS_SERVER_NAME and GRADWATCH_TOKEN (unset: empty).
ChannelSecurity ChannelSecurityFromEnvironment();

// The token in a file (its first line, surrounding white space removed); false with `error` set
// when it cannot be read or is empty.
bool ReadTokenFile(const std::string& path, std::string* token, std::string* error);

// Adds the bearer token, if any, to a call's metadata.
void AddToken(const ChannelSecurity& security, grpc::ClientContext& context);

// Plain-text credentials when TLS is off; otherwise TLS credentials read from the files now.
// Null with `error` set ("cannot read the TLS CA file /x: No such file or directory", "a TLS
// certificate needs its key") when they cannot be made.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const ChannelSecurity& tls, std::string* error);

// Adds what the credentials cannot carry (the server name override) to a channel's arguments.
void AddTlsArguments(const ChannelSecurity& tls, grpc::ChannelArguments& args);

}  // namespace gradwatch::client
