// Bytes appended into fixed-size chunks of their own mappings: what a snapshot is written into.
//
// A run's snapshot is copied under its lock and can be hundreds of megabytes. A contiguous buffer
// must either be sized beforehand (a guess: too small and it is grown under the lock, copying what
// it holds; too large and the daemon's RSS jumps by the excess) or grown as it is written. Chunks
// never move: the buffer grows by mapping one more chunk, Reserve maps (and faults in) what the
// caller expects before it takes the lock, and every chunk is unmapped when the buffer is
// destroyed, so the memory goes back to the system instead of staying in the allocator's free
// lists.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <vector>

namespace gradwatch {

class ByteChunks {
 public:
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  static constexpr size_t kPageBytes = 4096;  // at most the page size: every page is written

  ByteChunks() = default;
  ByteChunks(const ByteChunks&) = delete;
  ByteChunks& operator=(const ByteChunks&) = delete;
  ~ByteChunks() {
    for (char* c : chunks_) ::munmap(c, kChunkBytes);
  }

  // Appends `n` bytes. Throws std::bad_alloc when no chunk can be mapped.
  void Append(const void* data, size_t n) {
    // Most appends are a field's few bytes into the current chunk: a copy of a size the caller's
    // inlining makes constant.
    if (filled_ > 0 && n <= kChunkBytes - used_in_last_) {
      std::memcpy(chunks_[filled_ - 1] + used_in_last_, data, n);
      used_in_last_ += n;
      size_ += n;
      return;
    }
    AppendAcross(data, n);
  }

 private:
  void AppendAcross(const void* data, size_t n) {
    const char* from = static_cast<const char*>(data);
    while (n > 0) {
      if (used_in_last_ == kChunkBytes || filled_ == 0) NextChunk();
      const size_t take = std::min(n, kChunkBytes - used_in_last_);
      std::memcpy(chunks_[filled_ - 1] + used_in_last_, from, take);
      used_in_last_ += take;
      size_ += take;
      from += take;
      n -= take;
    }
  }

 public:
  // Maps chunks until `bytes` can be appended to an empty buffer without mapping another.
  void Reserve(size_t bytes) {
    while (chunks_.size() * kChunkBytes < bytes) chunks_.push_back(Map());
  }

  // Empties the buffer and keeps its chunks for the next use.
  void Clear() {
    filled_ = 0;
    used_in_last_ = 0;
    size_ = 0;
  }

  size_t size() const { return size_; }
  // The bytes mapped (what the buffer costs in memory at most).
  size_t capacity() const { return chunks_.size() * kChunkBytes; }

  // Calls f(std::string_view) on the bytes, in order, one piece per chunk in use.
  template <typename F>
  void ForEachPiece(F&& f) const {
    for (size_t i = 0; i < filled_; ++i) {
      f(std::string_view(chunks_[i], i + 1 == filled_ ? used_in_last_ : kChunkBytes));
    }
  }

  std::string ToString() const {
    std::string out;
    out.reserve(size_);
    ForEachPiece([&](std::string_view piece) { out.append(piece); });
    return out;
  }

 private:
  // Maps a chunk and writes to each of its pages, so that they are faulted in now (MAP_POPULATE
  // alone leaves a private mapping's pages to fault again at their first write: 99 ms for 72 MB
  // here, against 3 ms once written).
  static char* Map() {
    void* p = ::mmap(nullptr, kChunkBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    auto* bytes = static_cast<volatile char*>(p);
    for (size_t at = 0; at < kChunkBytes; at += kPageBytes) bytes[at] = 0;
    return static_cast<char*>(p);
  }

  void NextChunk() {
    if (filled_ == chunks_.size()) chunks_.push_back(Map());
    ++filled_;
    used_in_last_ = 0;
  }

  std::vector<char*> chunks_;  // mapped, kChunkBytes each; the first filled_ are in use
  size_t filled_ = 0;
  size_t used_in_last_ = 0;  // bytes used in chunk filled_ - 1
  size_t size_ = 0;
};

}  // namespace gradwatch
