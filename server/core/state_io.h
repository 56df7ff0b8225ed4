// Writing and reading the in-memory state of the daemon's structures as bytes, for snapshots
// (server/store/snapshots.h): a snapshot lets a restart skip replaying the journal up to it.
//
// The format is this build's own: values are written as their bytes in memory (the machine's
// byte order), so a snapshot is only read by a daemon whose layout matches; the snapshot's header
// (snapshots.h) carries a fingerprint of the layouts, and a snapshot that does not match is not
// read: the journal is replayed instead. A StateReader never reads past its end and never trusts a
// count it reads: a truncated or damaged snapshot fails cleanly (failed() stays true), and its
// owner discards what it read.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "server/core/byte_chunks.h"

namespace gradwatch {

// Writes into a string, or into chunks (ByteChunks: a snapshot, which may be large), or only
// counts the bytes (Counting).
class StateWriter {
 public:
  explicit StateWriter(std::string& out) : string_(&out) {}
  explicit StateWriter(ByteChunks& out) : chunks_(&out) {}
  static StateWriter Counting() { return StateWriter(); }

  template <typename T>
  void Put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "only trivially copyable values are written as bytes");
    Append(&value, sizeof(T));
  }
  void PutString(std::string_view s) {
    Put<uint64_t>(s.size());
    Append(s.data(), s.size());
  }
  template <typename T>
  void PutVector(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>, "only trivially copyable values are written as bytes");
    Put<uint64_t>(v.size());
    if (!v.empty()) Append(v.data(), v.size() * sizeof(T));
  }
  // A bool vector (not contiguous): one byte a value.
  void PutBools(const std::vector<bool>& v) {
    Put<uint64_t>(v.size());
    for (bool b : v) Put<uint8_t>(b ? 1 : 0);
  }

  size_t size() const {
    if (chunks_ != nullptr) return chunks_->size();
    return string_ != nullptr ? string_->size() : counted_;
  }

 private:
  StateWriter() = default;

  void Append(const void* data, size_t n) {
    if (chunks_ != nullptr) {
      chunks_->Append(data, n);
    } else if (string_ != nullptr) {
      string_->append(static_cast<const char*>(data), n);
    } else {
      counted_ += n;
    }
  }

  std::string* string_ = nullptr;
  ByteChunks* chunks_ = nullptr;
  size_t counted_ = 0;
};

class StateReader {
 public:
  explicit StateReader(std::string_view in) : in_(in) {}

  // Reads a value; on failure (too few bytes left) returns false, leaves `value` unchanged and
  // marks the reader failed. Every later read fails too.
  template <typename T>
  bool Get(T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "only trivially copyable values are read as bytes");
    if (failed_ || in_.size() - pos_ < sizeof(T)) return Fail("truncated");
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // A bool written as one byte: 0 or 1, anything else fails.
  bool GetBool(bool& value) {
    uint8_t b = 0;
    if (!Get(b)) return false;
    if (b > 1) return Fail("a flag is neither 0 nor 1");
    value = b == 1;
    return true;
  }
  bool GetString(std::string& s) {
    uint64_t n = 0;
    if (!Get(n)) return false;
    if (n > in_.size() - pos_) return Fail("a string is longer than what is left");
    s.assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  // Reads a vector written by PutVector; its length is checked against what is left before
  // anything is allocated, and against `max_size`.
  template <typename T>
  bool GetVector(std::vector<T>& v, uint64_t max_size = UINT64_MAX) {
    static_assert(std::is_trivially_copyable_v<T>, "only trivially copyable values are read as bytes");
    uint64_t n = 0;
    if (!Get(n)) return false;
    if (n > max_size) return Fail("a list is longer than its bound");
    if (n > (in_.size() - pos_) / sizeof(T)) return Fail("a list is longer than what is left");
    v.resize(n);
    if (n > 0) std::memcpy(v.data(), in_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  bool GetBools(std::vector<bool>& v) {
    uint64_t n = 0;
    if (!Get(n)) return false;
    if (n > in_.size() - pos_) return Fail("a list is longer than what is left");
    v.assign(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      bool b = false;
      if (!GetBool(b)) return false;
      v[i] = b;
    }
    return true;
  }
  // A count of items that each take at least `min_item_bytes`: checked against what is left, so a
  // damaged count never makes the caller allocate for items that cannot be there.
  bool GetCount(uint64_t& n, size_t min_item_bytes, uint64_t max_count = UINT64_MAX) {
    if (!Get(n)) return false;
    if (n > max_count) return Fail("a count is beyond its bound");
    if (min_item_bytes > 0 && n > (in_.size() - pos_) / min_item_bytes) return Fail("a count is beyond what is left");
    return true;
  }
  // Marks the reader failed with `why` (a value read is out of its range); returns false.
  bool Fail(const char* why) {
    if (!failed_) why_ = why;
    failed_ = true;
    return false;
  }

  bool failed() const { return failed_; }
  const char* why() const { return why_; }
  bool at_end() const { return pos_ == in_.size(); }
  size_t position() const { return pos_; }

 private:
  std::string_view in_;
  size_t pos_ = 0;
  bool failed_ = false;
  const char* why_ = "";
};

}  // namespace gradwatch
