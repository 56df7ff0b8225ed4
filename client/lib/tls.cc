#include "client/lib/tls.h"

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

TlsOptions TlsOptionsFromEnvironment() {
  TlsOptions tls;
  tls.ca_file = Env("GRADWATCH_TLS_CA");
  tls.cert_file = Env("GRADWATCH_TLS_CERT");
  tls.key_file = Env("GRADWATCH_TLS_KEY");
  tls.server_name = Env("GRADWATCH_TLS_SERVER_NAME");
  return tls;
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const TlsOptions& tls, std::string* error) {
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

void AddTlsArguments(const TlsOptions& tls, grpc::ChannelArguments& args) {
  if (tls.enabled() && !tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
}

}  // namespace gradwatch::client
