// LineFollower: reads a job's output line by line as `tail -F` does. A regular file is read from
// its start and followed past its end: when it is truncated, reading starts over; when it is
// replaced (log rotation), the old file is read to its end and the new one from its start; a file
// that does not exist yet is waited for. Standard input ("-"), a pipe or a FIFO is read until
// its writer closes it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace gradwatch::cli {

class LineFollower {
 public:
  struct Options {
    std::string path;  // "-": standard input
    // How often a followed file is checked for new data, truncation and replacement.
    std::chrono::milliseconds poll{100};
    // Told (on the caller's thread) what happened to the file: "waiting for ...", "truncated",
    // "replaced", "removed".
    std::function<void(const std::string&)> notice;
  };

  explicit LineFollower(Options options);
  ~LineFollower();
  LineFollower(const LineFollower&) = delete;
  LineFollower& operator=(const LineFollower&) = delete;

  // The next line, without its '\n'. Waits for one while `keep_waiting()` is true (checked at
  // every poll). False when there will be no more: a stream's end (its last unterminated line
  // is returned first), or `keep_waiting()` turned false (a file's unterminated tail is then
  // returned as a line, once).
  bool Next(std::string* line, const std::function<bool()>& keep_waiting);

  bool follows_file() const { return follow_file_; }
  uint64_t truncations() const { return truncations_; }
  uint64_t rotations() const { return rotations_; }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  // Reads what is available into buffer_; false at a stream's end or an error.
  bool Fill();
  bool TakeLine(std::string* line);
  void CheckFile();
  bool OpenFile();
  void Notice(const std::string& text);

  Options options_;
  bool follow_file_ = true;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  uint64_t offset_ = 0;
  bool waiting_announced_ = false;
  bool removed_announced_ = false;
  bool stream_ended_ = false;
  std::string buffer_;
  size_t scan_from_ = 0;
  uint64_t truncations_ = 0;
  uint64_t rotations_ = 0;
  uint64_t bytes_read_ = 0;
};

}  // namespace gradwatch::cli
