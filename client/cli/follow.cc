#include "client/cli/follow.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace gradwatch::cli {
namespace {

constexpr size_t kReadChunk = 1 << 16;
// A "line" longer than this without a newline is handed on as it is (its parser rejects it):
// memory stays bounded whatever a job prints.
constexpr size_t kMaxLine = 1 << 20;

}  // namespace

LineFollower::LineFollower(Options options) : options_(std::move(options)) {
  if (options_.path == "-") {
    follow_file_ = false;
    fd_ = STDIN_FILENO;
    return;
  }
  struct stat st {};
  if (::stat(options_.path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // A FIFO, /dev/stdin or another stream: read once, to its writer's end. Opening a FIFO waits
    // for its writer, as tail does.
    follow_file_ = false;
    fd_ = ::open(options_.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      Notice("cannot open " + options_.path + ": " + std::strerror(errno));
      stream_ended_ = true;
    }
  }
}

LineFollower::~LineFollower() {
  if (fd_ > STDIN_FILENO) ::close(fd_);
}

void LineFollower::Notice(const std::string& text) {
  if (options_.notice) options_.notice(text);
}

bool LineFollower::OpenFile() {
  const int fd = ::open(options_.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (!waiting_announced_) {
      waiting_announced_ = true;
      Notice(errno == ENOENT ? "waiting for " + options_.path + " to appear"
                             : "cannot open " + options_.path + " (" + std::strerror(errno) + "); retrying");
    }
    return false;
  }
  struct stat st {};
  ::fstat(fd, &st);
  fd_ = fd;
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  offset_ = 0;
  if (waiting_announced_) Notice("following " + options_.path);
  waiting_announced_ = false;
  removed_announced_ = false;
  return true;
}

bool LineFollower::Fill() {
  if (fd_ < 0 || stream_ended_) return false;
  if (!follow_file_) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(options_.poll.count()));
    if (ready == 0 || (ready < 0 && errno == EINTR)) return false;
  }
  const size_t old = buffer_.size();
  buffer_.resize(old + kReadChunk);
  ssize_t n;
  do {
    n = ::read(fd_, buffer_.data() + old, kReadChunk);
  } while (n < 0 && errno == EINTR);
  buffer_.resize(old + static_cast<size_t>(n > 0 ? n : 0));
  if (n > 0) {
    offset_ += static_cast<uint64_t>(n);
    bytes_read_ += static_cast<uint64_t>(n);
    return true;
  }
  if (!follow_file_) {
    if (n < 0) Notice("reading " + options_.path + ": " + std::strerror(errno));
    stream_ended_ = true;
  }
  return false;
}

bool LineFollower::TakeLine(std::string* line) {
  const size_t newline = buffer_.find('\n', scan_from_);
  if (newline == std::string::npos) {
    if (buffer_.size() < kMaxLine) {
      scan_from_ = buffer_.size();
      return false;
    }
    line->assign(buffer_, 0, kMaxLine);
    buffer_.erase(0, kMaxLine);
    scan_from_ = 0;
    return true;
  }
  line->assign(buffer_, 0, newline);
  buffer_.erase(0, newline + 1);
  scan_from_ = 0;
  return true;
}

void LineFollower::CheckFile() {
  if (fd_ < 0) {
    OpenFile();
    return;
  }
  struct stat by_path {};
  if (::stat(options_.path.c_str(), &by_path) != 0) {
    // Removed (rotation in two moves, or a cleanup): the open file may still be written; the
    // next file of that name is picked up when it appears.
    if (!removed_announced_) {
      removed_announced_ = true;
      Notice(options_.path + " was removed; waiting for a new file of that name");
    }
    return;
  }
  if (by_path.st_dev != dev_ || by_path.st_ino != ino_) {
    while (Fill()) {
    }
    // The old file's unterminated last line ends with it: it is not joined to the new file's first.
    if (!buffer_.empty() && buffer_.back() != '\n') buffer_ += '\n';
    ::close(fd_);
    fd_ = -1;
    if (OpenFile()) {
      ++rotations_;
      Notice(options_.path + " was replaced; following the new file from its start");
    }
    return;
  }
  struct stat open_file {};
  if (::fstat(fd_, &open_file) == 0 && static_cast<uint64_t>(open_file.st_size) < offset_) {
    if (!buffer_.empty() && buffer_.back() != '\n') buffer_ += '\n';
    ::lseek(fd_, 0, SEEK_SET);
    offset_ = 0;
    ++truncations_;
    Notice(options_.path + " was truncated; reading it from its start");
  }
}

bool LineFollower::Next(std::string* line, const std::function<bool()>& keep_waiting) {
  for (;;) {
    if (TakeLine(line)) return true;
    if (Fill()) continue;
    if (!follow_file_) {
      if (!stream_ended_ && keep_waiting()) continue;
    } else {
      CheckFile();
      if (TakeLine(line)) return true;
      if (Fill()) continue;
      if (keep_waiting()) {
        std::this_thread::sleep_for(options_.poll);
        continue;
      }
    }
    if (buffer_.empty()) return false;
    line->swap(buffer_);
    buffer_.clear();
    scan_from_ = 0;
    return true;
  }
}

}  // namespace gradwatch::cli
