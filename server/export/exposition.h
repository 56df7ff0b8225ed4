// One scrape's text: a sequence of chunks served in order. A collector fills the chunk of each
// family side by side while it visits the runs once (a family's samples must be contiguous), and
// the server writes (or compresses) the chunks one after the other, so the text is never copied
// into one string. Clear() keeps every chunk's capacity: an Exposition reused for the next scrape
// of the same daemon allocates nothing once warm.
#pragma once

#include <cstddef>
#include <deque>
#include <string>

namespace gradwatch::exporter {

class Exposition {
 public:
  // A new, empty chunk after the others, for the caller to append text to. The reference stays
  // valid until Clear.
  std::string& NewChunk() {
    if (used_ == chunks_.size()) chunks_.emplace_back();
    std::string& chunk = chunks_[used_++];
    chunk.clear();
    return chunk;
  }

  size_t chunk_count() const { return used_; }
  const std::string& chunk(size_t i) const { return chunks_[i]; }

  // Bytes of text in all chunks.
  size_t size() const {
    size_t total = 0;
    for (size_t i = 0; i < used_; ++i) total += chunks_[i].size();
    return total;
  }

  // The whole text in one string (tests).
  std::string Text() const {
    std::string text;
    text.reserve(size());
    for (size_t i = 0; i < used_; ++i) text += chunks_[i];
    return text;
  }

  void Clear() { used_ = 0; }

 private:
  std::deque<std::string> chunks_;  // a deque: NewChunk leaves the earlier chunks in place
  size_t used_ = 0;
};

}  // namespace gradwatch::exporter
