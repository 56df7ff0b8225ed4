#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "server/core/file_text.h"

using gradwatch::ReadRegularFile;

namespace {

struct Dir {
  std::filesystem::path path;
  Dir() {
    char tmpl[] = "/tmp/gradwatch-file-text-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~Dir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("a regular file is read whole, and anything else is an error at once", "[core]") {
  Dir dir;
  const std::string file = (dir.path / "tokens.yaml").string();
  std::ofstream(file) << "tokens: []\n";
  auto text = ReadRegularFile("security.tokens_file", file);
  REQUIRE(text.ok());
  CHECK(*text == "tokens: []\n");

  // A FIFO with no writer: opening it for reading would block for ever.
  const std::string fifo = (dir.path / "fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto from_fifo = ReadRegularFile("security.tokens_file", fifo);
  REQUIRE_FALSE(from_fifo.ok());
  CHECK(from_fifo.status().message() == "security.tokens_file " + fifo + ": is a FIFO, not a regular file");

  auto from_dir = ReadRegularFile("rules file", dir.path.string());
  REQUIRE_FALSE(from_dir.ok());
  CHECK_THAT(from_dir.status().message(), Catch::EndsWith("is a directory, not a regular file"));

  auto missing = ReadRegularFile("config file", (dir.path / "nope").string());
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(missing.status().message(), Catch::EndsWith("nope: no such file"));

  auto large = ReadRegularFile("config file", file, 4);
  REQUIRE_FALSE(large.ok());
  CHECK_THAT(large.status().message(), Catch::Contains("is 11 bytes, more than the 4 allowed"));
}
