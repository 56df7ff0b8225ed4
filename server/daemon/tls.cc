#include "server/daemon/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "server/core/file_text.h"
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

constexpr size_t kMaxPemBytes = 1 << 20;

// A memory BIO over `text` (which outlives it).
BIO* TextBio(const std::string& text) { return BIO_new_mem_buf(text.data(), static_cast<int>(text.size())); }

// The first certificate of a PEM text; null with `error` set.
X509* FirstCertificate(const std::string& what, const std::string& path, const std::string& text, std::string* error) {
  BIO* bio = TextBio(text);
  X509* cert = bio == nullptr ? nullptr : PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) {
    *error = what + " " + path + ": " +
             (text.empty() ? std::string("is empty") : "no PEM certificate in it (" + OpenSslError() + ")");
  }
  ERR_clear_error();
  return cert;
}

// Loads a chain (the first certificate, then the rest) into ctx; an error when there is none.
Status UseChain(SSL_CTX* ctx, const TlsFiles& files, const std::string& text) {
  std::string error;
  X509* leaf = FirstCertificate("security.tls_cert_file", files.cert_file, text, &error);
  if (leaf == nullptr) return Status::InvalidArgument(error);
  const bool used = SSL_CTX_use_certificate(ctx, leaf) == 1;
  X509_free(leaf);
  if (!used) {
    return Status::InvalidArgument("security.tls_cert_file " + files.cert_file + ": " + OpenSslError());
  }
  BIO* bio = TextBio(text);
  X509* skip = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);  // the leaf, already used
  X509_free(skip);
  while (X509* ca = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    if (SSL_CTX_add0_chain_cert(ctx, ca) != 1) {
      X509_free(ca);
      BIO_free(bio);
      return Status::InvalidArgument("security.tls_cert_file " + files.cert_file + ": " + OpenSslError());
    }
  }
  BIO_free(bio);
  ERR_clear_error();  // the loop ends on "no start line"
  return Status::Ok();
}

}  // namespace

StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files) {
  TlsPem pem;
  auto cert = ReadRegularFile("security.tls_cert_file", files.cert_file, kMaxPemBytes);
  if (!cert.ok()) return Status::InvalidArgument(cert.status().message());
  auto key = ReadRegularFile("security.tls_key_file", files.key_file, kMaxPemBytes);
  if (!key.ok()) return Status::InvalidArgument(key.status().message());
  pem.cert = std::move(cert).value();
  pem.key = std::move(key).value();
  if (!files.client_ca_file.empty()) {
    auto ca = ReadRegularFile("security.tls_client_ca_file", files.client_ca_file, kMaxPemBytes);
    if (!ca.ok()) return Status::InvalidArgument(ca.status().message());
    pem.client_ca = std::move(ca).value();
  }
  return pem;
}

StatusOr<std::string> CheckTlsPem(const TlsFiles& files, const TlsPem& pem) {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return Status::Internal("TLS: " + OpenSslError());
  std::string error;
  if (Status chain = UseChain(ctx, files, pem.cert); !chain.ok()) {
    error = chain.message();
  } else {
    BIO* bio = TextBio(pem.key);
    EVP_PKEY* key = bio == nullptr ? nullptr : PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
    BIO_free(bio);
    if (key == nullptr) {
      error = "security.tls_key_file " + files.key_file + ": " +
              (pem.key.empty() ? std::string("is empty") : "not a PEM private key (" + OpenSslError() + ")");
    } else {
      if (SSL_CTX_use_PrivateKey(ctx, key) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
        error = "security.tls_key_file " + files.key_file + " is not the key of " + files.cert_file;
      }
      EVP_PKEY_free(key);
    }
    ERR_clear_error();
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
  X509* ca = FirstCertificate("security.tls_client_ca_file", files.client_ca_file, pem.client_ca, &error);
  if (ca == nullptr) return Status::InvalidArgument(error);
  line += ", client certificates required (CA " + Subject(ca) + ")";
  X509_free(ca);
  return line;
}

StatusOr<std::string> CheckTlsFiles(const TlsFiles& files) {
  if (!files.enabled()) return std::string("off");
  auto pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  return CheckTlsPem(files, *pem);
}

StatusOr<std::string> CheckCaFile(const std::string& setting, const std::string& path) {
  auto text = ReadRegularFile(setting, path, kMaxPemBytes);
  if (!text.ok()) return Status::InvalidArgument(text.status().message());
  std::string error;
  X509* ca = FirstCertificate(setting, path, *text, &error);
  if (ca == nullptr) return Status::InvalidArgument(error);
  std::string subject = Subject(ca);
  X509_free(ca);
  return subject;
}

namespace {

// Writes `text` to `path` (0600), fsynced, with modification time `mtime` (seconds).
Status WriteCopy(const std::string& path, const std::string& text, int64_t mtime) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IoError(path + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return Status::IoError(path + ": " + std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const struct timespec times[2] = {{mtime, 0}, {mtime, 0}};
  const bool ok = ::futimens(fd, times) == 0 && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::IoError(path + ": " + std::strerror(err));
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<TlsStage>> TlsStage::Create(const TlsFiles& source, const TlsPem& pem, std::string dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("TLS copies in " + dir + ": " + ec.message());
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  if (ec) return Status::IoError("TLS copies in " + dir + ": " + ec.message());
  // Generations a previous daemon left: the new ones start after them.
  uint64_t last = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("gen-", 0) == 0) last = std::max<uint64_t>(last, std::strtoull(name.c_str() + 4, nullptr, 10));
  }
  std::unique_ptr<TlsStage> stage(new TlsStage(source, std::move(dir)));
  MutexLock lock(&stage->mu_);
  stage->generation_ = last;
  if (Status s = stage->Stage(pem); !s.ok()) return s;
  auto line = CheckTlsPem(source, pem);
  stage->served_line_ = line.ok() ? *line : line.status().message();
  return stage;
}

TlsFiles TlsStage::staged() const {
  const std::string current = dir_ + "/current/";
  return {current + "cert.pem", current + "key.pem", source_.client_ca_file.empty() ? "" : current + "ca.pem"};
}

std::string TlsStage::served() const {
  MutexLock lock(&mu_);
  return served_line_;
}

Status TlsStage::Stage(const TlsPem& pem) {
  const uint64_t generation = generation_ + 1;
  const std::string gen_name = "gen-" + std::to_string(generation);
  const std::string gen_dir = dir_ + "/" + gen_name;
  std::error_code ec;
  std::filesystem::remove_all(gen_dir, ec);
  if (!std::filesystem::create_directory(gen_dir, ec) || ec) {
    return Status::IoError("TLS copies: " + gen_dir + ": " + (ec ? ec.message() : "exists"));
  }
  // gRPC tells a pair changed while it read it by the files' modification times, in seconds.
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  const int64_t mtime = std::max(now, last_mtime_ + 1);
  for (const auto& [name, text] : {std::pair<const char*, const std::string*>{"cert.pem", &pem.cert},
                                   {"key.pem", &pem.key},
                                   {"ca.pem", &pem.client_ca}}) {
    if (Status s = WriteCopy(gen_dir + "/" + name, *text, mtime); !s.ok()) return s;
  }
  const std::string link = dir_ + "/current";
  const std::string tmp = dir_ + "/current.tmp";
  std::filesystem::remove(tmp, ec);
  std::filesystem::create_directory_symlink(gen_name, tmp, ec);
  if (ec) return Status::IoError("TLS copies: " + tmp + ": " + ec.message());
  if (::rename(tmp.c_str(), link.c_str()) != 0)
    return Status::IoError("TLS copies: " + link + ": " + std::strerror(errno));
  // Keep the previous generation (gRPC may be reading it); older ones go.
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("gen-", 0) != 0) continue;
    if (std::strtoull(name.c_str() + 4, nullptr, 10) + 1 < generation) std::filesystem::remove_all(entry.path(), ec);
  }
  generation_ = generation;
  last_mtime_ = mtime;
  staged_pem_ = pem;
  return Status::Ok();
}

TlsStage::Refresh TlsStage::Reload() {
  Refresh out;
  auto pem = ReadTlsFiles(source_);
  MutexLock lock(&mu_);
  if (pem.ok() && *pem == staged_pem_) {
    refused_.reset();
    out.line = served_line_;
    return out;
  }
  // A file that cannot be read counts as a pair of its own: reported once, until it changes.
  const TlsPem seen = pem.ok() ? *pem : TlsPem{"", "", pem.status().message()};
  if (refused_ && *refused_ == seen) {
    out.status = Status::InvalidArgument(refused_why_);
    out.line = served_line_;
    return out;
  }
  out.changed = true;
  auto line = pem.ok() ? CheckTlsPem(source_, *pem) : StatusOr<std::string>(pem.status());
  Status staged = line.ok() ? Stage(*pem) : line.status();
  if (!staged.ok()) {
    refused_ = seen;
    refused_why_ = staged.message();
    out.status = std::move(staged);
    out.line = served_line_;
    return out;
  }
  refused_.reset();
  served_line_ = *line;
  out.line = *line;
  return out;
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
