// Checks of a /metrics text that a parser alone does not make: every family's samples follow its
// own # TYPE line, contiguously, with one # TYPE per family (text format 0.0.4 requires it;
// Prometheus' parsers accept a family split in two); and `promtool check metrics` (Prometheus' own
// parser and linter) has nothing to say. Also a gzip decoder for compressed scrapes.
#pragma once

#include <zlib.h>
#include <catch2/catch.hpp>

#include <set>
#include <sstream>
#include <string>

#include "tests/integration/daemon_process.h"

namespace gradwatch {

inline void CheckFamiliesContiguous(const std::string& text) {
  std::istringstream in(text);
  std::string line, family, type;
  std::set<std::string> seen;
  size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    INFO("line " << number << ": " << line);
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream words(line.substr(7));
      words >> family >> type;
      CHECK(seen.insert(family).second);  // one TYPE line per family
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) {
      std::istringstream words(line.substr(7));
      std::string name;
      words >> name;
      CHECK(seen.count(name) == 0);  // the HELP line comes before its family's samples and TYPE
      continue;
    }
    REQUIRE(!line.empty());
    const std::string name = line.substr(0, line.find_first_of("{ "));
    bool ours = name == family;
    if (type == "histogram" || type == "summary") {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        if (name == family + suffix) ours = true;
      }
    }
    CHECK(ours);
  }
}

inline void CheckWithPromtool(const std::string& text) {
  if (testing::PromtoolPath().empty()) {
    WARN("promtool not found (Debian package prometheus): the text is not linted");
    return;
  }
  const testing::CommandResult lint = testing::RunCommand({testing::PromtoolPath(), "check", "metrics"}, text);
  INFO(lint.out << lint.err);
  CHECK(lint.exit_code == 0);
  CHECK(lint.out.empty());
}

// Decompresses a gzip stream; empty on a corrupt one.
inline std::string Gunzip(const std::string& in) {
  z_stream zs{};
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return {};
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  std::string out;
  int rc = Z_OK;
  char buf[65536];
  while (rc == Z_OK) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    out.append(buf, sizeof(buf) - zs.avail_out);
  }
  inflateEnd(&zs);
  return rc == Z_STREAM_END ? out : std::string();
}

}  // namespace gradwatch
