#include "server/daemon/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <cstdio>
#include <ctime>

#include "server/core/openssl_error.h"

namespace gradwatch::daemon {

namespace {

std::string Subject(X509* cert) {
  char text[256];
  X509_NAME_oneline(X509_get_subject_name(cert), text, sizeof text);
  return text;
}

std::string NotAfter(X509* cert) {
  std::tm t{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert), &t) != 1) return "?";
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &t);
  return text;
}

// The first certificate of a PEM file; null with `error` set.
X509* ReadCertificate(const std::string& what, const std::string& path, std::string* error) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    *error = what + " " + path + ": cannot be read";
    return nullptr;
  }
  X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  if (cert == nullptr) *error = what + " " + path + ": no PEM certificate in it (" + OpenSslError() + ")";
  return cert;
}

EVP_PKEY* ReadKey(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return nullptr;
  EVP_PKEY* key = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  return key;
}

}  // namespace

StatusOr<std::string> CheckTlsFiles(const TlsFiles& files) {
  if (!files.enabled()) return std::string("off");
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return Status::Internal("TLS: " + OpenSslError());
  std::string error;
  if (SSL_CTX_use_certificate_chain_file(ctx, files.cert_file.c_str()) != 1) {
    error =
        "security.tls_cert_file " + files.cert_file + ": not a readable PEM certificate chain (" + OpenSslError() + ")";
  } else if (EVP_PKEY* key = ReadKey(files.key_file); key == nullptr) {
    error = "security.tls_key_file " + files.key_file + ": not a readable PEM private key (" + OpenSslError() + ")";
  } else {
    if (SSL_CTX_use_PrivateKey(ctx, key) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
      ERR_clear_error();
      error = "security.tls_key_file " + files.key_file + " is not the key of " + files.cert_file;
    }
    EVP_PKEY_free(key);
  }
  std::string line;
  if (error.empty()) {
    X509* cert = SSL_CTX_get0_certificate(ctx);
    if (X509_cmp_current_time(X509_get0_notAfter(cert)) <= 0) {
      error = "security.tls_cert_file " + files.cert_file + " expired at " + NotAfter(cert);
    } else if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
      error = "security.tls_cert_file " + files.cert_file + " is not valid yet";
    } else {
      line = Subject(cert) + ", valid until " + NotAfter(cert);
    }
  }
  SSL_CTX_free(ctx);
  if (!error.empty()) return Status::InvalidArgument(error);
  if (files.client_ca_file.empty()) return line + ", no client certificates asked";
  auto ca = CheckCaFile("security.tls_client_ca_file", files.client_ca_file);
  if (!ca.ok()) return ca.status();
  return line + ", client certificates required (CA " + ca.value() + ")";
}

StatusOr<std::string> CheckCaFile(const std::string& setting, const std::string& path) {
  std::string error;
  X509* ca = ReadCertificate(setting, path, &error);
  if (ca == nullptr) return Status::InvalidArgument(error);
  std::string subject = Subject(ca);
  X509_free(ca);
  return subject;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const TlsFiles& files, unsigned refresh_seconds) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key_file, files.cert_file, files.client_ca_file, refresh_seconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca_file.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace gradwatch::daemon
