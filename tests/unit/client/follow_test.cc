// LineFollower: tail -F's semantics, driven step by step. Next() calls keep_waiting at every poll
// while it has nothing to return; these tests change the file from that callback, so every change
// lands at a known point and nothing depends on timing.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "client/cli/follow.h"

using gradwatch::cli::LineFollower;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "gradwatch-follow-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

void Append(const std::filesystem::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::app | std::ios::binary);
  out << text;
}

LineFollower::Options Opts(const std::string& path, std::vector<std::string>* notices) {
  LineFollower::Options o;
  o.path = path;
  o.poll = std::chrono::milliseconds(1);
  o.notice = [notices](const std::string& text) { notices->push_back(text); };
  return o;
}

// Reads every line, running the next action each time the follower would wait; stops when the
// actions are used up and nothing more is there.
std::vector<std::string> Drive(LineFollower& follower, std::vector<std::function<void()>> actions) {
  std::vector<std::string> lines;
  size_t next = 0;
  const auto keep_waiting = [&] {
    if (next == actions.size()) return false;
    actions[next++]();
    return true;
  };
  std::string line;
  while (follower.Next(&line, keep_waiting)) lines.push_back(line);
  return lines;
}

bool Contains(const std::vector<std::string>& notices, const std::string& part) {
  for (const std::string& n : notices) {
    if (n.find(part) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("a followed file is waited for, read as it grows, and a line is whole before it is returned",
          "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  CHECK(follower.follows_file());
  const auto lines = Drive(follower, {
                                         [] {},  // not there yet
                                         [&] { Append(file, "first\nsec"); },
                                         [&] { Append(file, "ond\n"); },
                                         [&] { Append(file, "third\n"); },
                                     });
  CHECK(lines == std::vector<std::string>{"first", "second", "third"});
  CHECK(Contains(notices, "waiting for"));
  CHECK(Contains(notices, "following"));
}

TEST_CASE("a rotated file is read to its end, then the new file from its start", "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  Append(file, "old 1\n");
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  const auto lines = Drive(follower, {
                                         [&] {
                                           // Written just before the move: still read, from the old file.
                                           Append(file, "old 2\nold partial");
                                           std::filesystem::rename(file, dir / "job.log.1");
                                           Append(dir / "job.log.1", " end");
                                           Append(file, "new 1\n");
                                         },
                                         [&] { Append(file, "new 2\n"); },
                                     });
  CHECK(lines == std::vector<std::string>{"old 1", "old 2", "old partial end", "new 1", "new 2"});
  CHECK(follower.rotations() == 1);
  CHECK(Contains(notices, "replaced"));
}

TEST_CASE("a removed file is waited for and picked up when it comes back", "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  Append(file, "a\n");
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  const auto lines = Drive(follower, {
                                         [&] { std::filesystem::remove(file); },
                                         [] {},
                                         [&] { Append(file, "b\n"); },
                                     });
  CHECK(lines == std::vector<std::string>{"a", "b"});
  CHECK(Contains(notices, "removed"));
  CHECK(follower.rotations() == 1);
}

TEST_CASE("a truncated file is read again from its start", "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  Append(file, "one\ntwo\n");
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  const auto lines = Drive(follower, {
                                         [&] {
                                           std::ofstream truncate(file, std::ios::trunc);
                                           truncate << "x\n";
                                         },
                                         [] {},
                                     });
  CHECK(lines == std::vector<std::string>{"one", "two", "x"});
  CHECK(follower.truncations() == 1);
  CHECK(Contains(notices, "truncated"));
}

TEST_CASE("a file's unterminated last line is returned once the follower stops waiting", "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  Append(file, "whole\nhalf");
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  CHECK(Drive(follower, {}) == std::vector<std::string>{"whole", "half"});
}

TEST_CASE("a FIFO is read to its writer's end, its last line unterminated", "[client][tail]") {
  TempDir dir;
  const auto fifo = dir / "job.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::thread writer([&] {
    std::ofstream out(fifo);
    for (int i = 0; i < 1000; ++i) out << "line " << i << "\n";
    out << "last";
  });
  std::vector<std::string> notices;
  LineFollower follower(Opts(fifo.string(), &notices));
  CHECK_FALSE(follower.follows_file());
  std::vector<std::string> lines;
  std::string line;
  while (follower.Next(&line, [] { return true; })) lines.push_back(line);
  writer.join();
  REQUIRE(lines.size() == 1001);
  CHECK(lines[999] == "line 999");
  CHECK(lines.back() == "last");
}

TEST_CASE("a line longer than the bound is handed on in pieces, memory bounded", "[client][tail]") {
  TempDir dir;
  const auto file = dir / "job.log";
  Append(file, std::string(3u << 20, 'x') + "\nshort\n");
  std::vector<std::string> notices;
  LineFollower follower(Opts(file.string(), &notices));
  const auto lines = Drive(follower, {});
  REQUIRE(lines.size() >= 4);
  CHECK(lines.back() == "short");
  size_t total = 0;
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    CHECK(lines[i].size() <= (1u << 20) + (64u << 10));  // the bound, plus at most one read
    CHECK(lines[i].find_first_not_of('x') == std::string::npos);
    total += lines[i].size();
  }
  CHECK(total == 3u << 20);
}
