// The TLS tests' certificates, made with openssl by tests/support/make_test_certs.sh in a
// temporary directory of their own (see that script for the names).
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include "tests/integration/daemon_process.h"
#include "tests/support/temp_dir.h"

namespace gradwatch::testing {

class Certs {
 public:
  Certs() : dir_("gradwatch-certs") {
    const CommandResult r = RunCommand(
        {"bash", std::string(GRADWATCH_SOURCE_DIR) + "/tests/support/make_test_certs.sh", dir_.path().string()},
        std::nullopt, std::chrono::seconds(120));
    if (r.exit_code != 0) throw std::runtime_error("make_test_certs.sh failed: " + r.err);
  }
  // The path of a file of the set: "ca.pem", "server.key", ...
  std::string operator()(const std::string& name) const { return (dir_.path() / name).string(); }
  const std::filesystem::path& dir() const { return dir_.path(); }

 private:
  TempDir dir_;
};

}  // namespace gradwatch::testing
