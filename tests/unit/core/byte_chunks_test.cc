#include "server/core/byte_chunks.h"

#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "server/core/state_io.h"

using gradwatch::ByteChunks;
using gradwatch::StateWriter;

TEST_CASE("bytes appended across chunk boundaries read back in order, and a cleared buffer is reused",
          "[byte_chunks]") {
  std::mt19937 rng(5);
  std::string expected;
  ByteChunks chunks;
  // Pieces of every size up to three chunks, so that writes start and end anywhere in a chunk.
  for (int i = 0; i < 40; ++i) {
    std::string piece(rng() % (3 * ByteChunks::kChunkBytes / 10), '\0');
    for (char& c : piece) c = static_cast<char>(rng());
    chunks.Append(piece.data(), piece.size());
    expected += piece;
  }
  CHECK(chunks.size() == expected.size());
  CHECK(chunks.ToString() == expected);
  std::vector<size_t> sizes;
  chunks.ForEachPiece([&](std::string_view piece) { sizes.push_back(piece.size()); });
  REQUIRE(sizes.size() == (expected.size() + ByteChunks::kChunkBytes - 1) / ByteChunks::kChunkBytes);
  for (size_t i = 0; i + 1 < sizes.size(); ++i) CHECK(sizes[i] == ByteChunks::kChunkBytes);

  const size_t mapped = chunks.capacity();
  chunks.Clear();
  CHECK(chunks.size() == 0);
  CHECK(chunks.ToString().empty());
  chunks.Append("abc", 3);
  CHECK(chunks.ToString() == "abc");
  CHECK(chunks.capacity() == mapped);  // no chunk mapped again
}

TEST_CASE("Reserve maps what is asked for ahead, and appending within it maps nothing more", "[byte_chunks]") {
  ByteChunks chunks;
  CHECK(chunks.capacity() == 0);
  chunks.Reserve(ByteChunks::kChunkBytes * 5 / 2);
  CHECK(chunks.capacity() == 3 * ByteChunks::kChunkBytes);
  const std::string block(ByteChunks::kChunkBytes / 4, 'x');
  for (int i = 0; i < 12; ++i) chunks.Append(block.data(), block.size());
  CHECK(chunks.capacity() == 3 * ByteChunks::kChunkBytes);
  CHECK(chunks.size() == 3 * ByteChunks::kChunkBytes);
  chunks.Append("y", 1);
  CHECK(chunks.capacity() == 4 * ByteChunks::kChunkBytes);
}

TEST_CASE("a StateWriter writes the same bytes into chunks as into a string", "[byte_chunks]") {
  std::string text;
  ByteChunks chunks;
  StateWriter a(text), b(chunks);
  const std::vector<double> values(300000, 1.5);  // 2.4 MB: spans chunks
  for (StateWriter* w : {&a, &b}) {
    w->Put<uint32_t>(7);
    w->PutString("final_norm.weight");
    w->PutVector(values);
    w->PutBools({true, false, true});
  }
  CHECK(a.size() == b.size());
  CHECK(chunks.ToString() == text);
}
