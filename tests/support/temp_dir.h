// A fresh temporary directory for a test, removed with everything in it when the TempDir goes
// (kept when GRADWATCH_KEEP_TEST_DIRS is set, to look at what a failed test left behind).
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace gradwatch::testing {

class TempDir {
 public:
  // Made under $TMPDIR (or /tmp) as <prefix>-XXXXXX.
  explicit TempDir(const std::string& prefix = "gradwatch-test") {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        (std::filesystem::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") / (prefix + "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("mkdtemp " + pattern + ": " + std::strerror(errno));
    }
    path_ = pattern;
  }
  ~TempDir() {
    if (path_.empty() || std::getenv("GRADWATCH_KEEP_TEST_DIRS") != nullptr) return;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(TempDir&& other) noexcept : path_(std::exchange(other.path_, {})) {}
  TempDir& operator=(TempDir&& other) noexcept {
    if (this != &other) {
      TempDir old(std::move(*this));
      path_ = std::exchange(other.path_, {});
    }
    return *this;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The journal a daemon or a test keeps in this directory.
  std::string db() const { return (path_ / "journal.db").string(); }
  // Writes `text` to the file `name` in this directory and returns its path.
  std::string Write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

}  // namespace gradwatch::testing
