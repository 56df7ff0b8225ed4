#include "server/store/snapshots.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "tests/support/temp_dir.h"

using namespace gradwatch;
using gradwatch::store::SnapshotStore;

namespace {

std::string Payload(size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(bytes, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

}  // namespace

TEST_CASE("a snapshot reads back as written, replaced whole by the next one", "[snapshots]") {
  testing::TempDir dir("gradwatch-snapshots");
  const SnapshotStore store((dir.path() / "snapshots").string(), 42);
  CHECK(store.Read("run-a").status().code() == StatusCode::kNotFound);  // no directory yet

  const std::string first = Payload(100000, 1), second = Payload(300, 2);
  REQUIRE(store.Write("run-a", first).ok());
  REQUIRE(store.Write("run/with spaces and ünïcode", second).ok());
  auto a = store.Read("run-a");
  REQUIRE(a.ok());
  CHECK(*a == first);
  auto b = store.Read("run/with spaces and ünïcode");
  REQUIRE(b.ok());
  CHECK(*b == second);

  REQUIRE(store.Write("run-a", second).ok());
  CHECK(store.Read("run-a").value() == second);
  REQUIRE(store.Write("empty", "").ok());
  CHECK(store.Read("empty")->empty());
  CHECK(store.DiskBytes() > 2 * second.size());

  store.Remove("run-a");
  CHECK(store.Read("run-a").status().code() == StatusCode::kNotFound);
}

TEST_CASE("a damaged, truncated, foreign or misplaced snapshot is refused, never returned", "[snapshots]") {
  testing::TempDir dir("gradwatch-snapshots");
  const SnapshotStore store((dir.path() / "snapshots").string(), 42);
  const std::string payload = Payload(5000, 3);
  REQUIRE(store.Write("run", payload).ok());
  const std::string path = store.PathFor("run");
  const std::string good = ReadAll(path);

  SECTION("every byte flipped in turn (a sample of them)") {
    for (size_t i = 0; i < good.size(); i += 37) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ 0x10);
      WriteAll(path, bad);
      auto r = store.Read("run");
      INFO("byte " << i);
      CHECK(!r.ok());
    }
  }
  SECTION("every length short of the whole") {
    for (size_t n = 0; n < good.size(); n += n < 64 ? 1 : 101) {
      WriteAll(path, good.substr(0, n));
      INFO("length " << n);
      CHECK(!store.Read("run").ok());
    }
    WriteAll(path, good + "x");
    CHECK(!store.Read("run").ok());
  }
  SECTION("written by a build with another layout") {
    const SnapshotStore other((dir.path() / "snapshots").string(), 43);
    auto r = other.Read("run");
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK(r.status().message().find("another layout") != std::string::npos);
  }
  SECTION("the file of another run") {
    std::filesystem::copy_file(path, store.PathFor("other-run"));
    CHECK(store.Read("other-run").status().code() == StatusCode::kNotFound);
  }
  WriteAll(path, good);
  CHECK(store.Read("run").value() == payload);
}

TEST_CASE("snapshots of runs no longer held are deleted, and leftover temporary files", "[snapshots]") {
  testing::TempDir dir("gradwatch-snapshots");
  const SnapshotStore store((dir.path() / "snapshots").string(), 7);
  for (const char* run : {"kept-1", "kept-2", "gone-1", "gone-2"}) REQUIRE(store.Write(run, Payload(64, 4)).ok());
  WriteAll((dir.path() / "snapshots" / "0123456789abcdef.snap.tmp").string(), "half written");
  WriteAll((dir.path() / "snapshots" / "fedcba9876543210.snap").string(), "not a snapshot");
  WriteAll((dir.path() / "snapshots" / "README").string(), "someone's notes");

  CHECK(store.RemoveAllBut({"kept-1", "kept-2", "never-written"}) == 4);
  CHECK(store.Read("kept-1").ok());
  CHECK(store.Read("kept-2").ok());
  CHECK(store.Read("gone-1").status().code() == StatusCode::kNotFound);
  CHECK(std::filesystem::exists(dir.path() / "snapshots" / "README"));  // not ours: left alone
}

TEST_CASE("a snapshot that cannot be written fails cleanly and leaves the previous one", "[snapshots]") {
  testing::TempDir dir("gradwatch-snapshots");
  const auto snapshots = dir.path() / "snapshots";
  const SnapshotStore store(snapshots.string(), 42);
  REQUIRE(store.Write("run", "old").ok());
  if (::geteuid() == 0) {
    // Root ignores directory permissions: a path under a regular file fails for everyone.
    const SnapshotStore blocked((dir.path() / "file" / "snapshots").string(), 42);
    WriteAll((dir.path() / "file").string(), "x");
    CHECK(!blocked.Write("run", "new").ok());
  } else {
    std::filesystem::permissions(snapshots, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
    CHECK(!store.Write("run", "new").ok());
    std::filesystem::permissions(snapshots, std::filesystem::perms::owner_all);
  }
  CHECK(store.Read("run").value() == "old");
}

TEST_CASE("a snapshot written from chunks is the file written from the same bytes whole", "[snapshots]") {
  testing::TempDir dir("gradwatch-snapshots");
  const SnapshotStore store((dir.path() / "snapshots").string(), 42);
  const std::string payload = Payload(3 * ByteChunks::kChunkBytes + 12345, 9);
  ByteChunks chunks;
  chunks.Append(payload.data(), payload.size());
  REQUIRE(store.Write("run-a", chunks).ok());
  const std::string from_chunks = ReadAll(store.PathFor("run-a"));
  REQUIRE(store.Write("run-a", payload).ok());
  CHECK(ReadAll(store.PathFor("run-a")) == from_chunks);
  CHECK(store.Read("run-a").value() == payload);
}
