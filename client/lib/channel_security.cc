#include "gradwatch/channel_security.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace gradwatch::client {

namespace {

bool ReadPem(const std::string& what, const std::string& path, std::string* out, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot read the TLS " + what + " file " + path + ": " + std::strerror(errno);
    return false;
  }
  std::ostringstream text;
  text << in.rdbuf();
  *out = text.str();
  if (out->find("-----BEGIN ") == std::string::npos) {
    *error = "the TLS " + what + " file " + path + " holds no PEM block (-----BEGIN ...)";
    return false;
  }
  return true;
}

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

}  // namespace

ChannelSecurity ChannelSecurityFromEnvironment() {
  ChannelSecurity tls;
  tls.ca_file = Env("GRADWATCH_TLS_CA");
  tls.cert_file = Env("GRADWATCH_TLS_CERT");
  tls.key_file = Env("GRADWATCH_TLS_KEY");
  tls.server_name = Env("GRADWATCH_TLS_SERVER_NAME");
  tls.token = Env("GRADWATCH_TOKEN");
  return tls;
}

bool ReadTokenFile(const std::string& path, std::string* token, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot read the token file " + path + ": " + std::strerror(errno);
    return false;
  }
  std::string line;
  std::getline(in, line);
  const size_t first = line.find_first_not_of(" \t\r");
  const size_t last = line.find_last_not_of(" \t\r");
  if (first == std::string::npos) {
    *error = "the token file " + path + " is empty";
    return false;
  }
  *token = line.substr(first, last - first + 1);
  return true;
}

void AddToken(const ChannelSecurity& security, grpc::ClientContext& context) {
  if (!security.token.empty()) context.AddMetadata("authorization", "Bearer " + security.token);
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const ChannelSecurity& tls, std::string* error) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    *error = tls.cert_file.empty() ? "a TLS key needs its certificate (--tls-cert)"
                                   : "a TLS certificate needs its key (--tls-key)";
    return nullptr;
  }
  grpc::SslCredentialsOptions ssl;
  if (!tls.ca_file.empty() && !ReadPem("CA", tls.ca_file, &ssl.pem_root_certs, error)) return nullptr;
  if (!tls.cert_file.empty()) {
    if (!ReadPem("certificate", tls.cert_file, &ssl.pem_cert_chain, error)) return nullptr;
    if (!ReadPem("key", tls.key_file, &ssl.pem_private_key, error)) return nullptr;
  }
  return grpc::SslCredentials(ssl);
}

void AddTlsArguments(const ChannelSecurity& tls, grpc::ChannelArguments& args) {
  if (tls.enabled() && !tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
}

}  // namespace gradwatch::client
