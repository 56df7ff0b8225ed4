#include "server/store/step_block.h"

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace gradwatch;
using namespace gradwatch::store;

namespace {

// A block of `steps` steps with one value per series per step, made by value(series, step).
template <typename ValueFn>
std::vector<CompletedStep> MakeSteps(size_t steps, uint32_t series, ValueFn value) {
  std::vector<CompletedStep> out(steps);
  for (size_t i = 0; i < steps; ++i) {
    CompletedStep& s = out[i];
    s.step = 1000 + i;
    s.wall_time = 1.7e9 + 0.37 * static_cast<double>(i);
    s.ranks_reported = 8;
    for (uint32_t id = 0; id < series; ++id) s.values.push_back({id, value(id, i)});
  }
  return out;
}

// Every field, and every value bit for bit.
void RequireSameSteps(const std::vector<CompletedStep>& a, const std::vector<CompletedStep>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].step == b[i].step);
    REQUIRE(std::bit_cast<uint64_t>(a[i].wall_time) == std::bit_cast<uint64_t>(b[i].wall_time));
    REQUIRE(a[i].partial == b[i].partial);
    REQUIRE(a[i].ranks_reported == b[i].ranks_reported);
    REQUIRE(a[i].client_dropped_steps == b[i].client_dropped_steps);
    REQUIRE(a[i].values.size() == b[i].values.size());
    for (size_t j = 0; j < a[i].values.size(); ++j) {
      REQUIRE(a[i].values[j].id == b[i].values[j].id);
      REQUIRE(std::bit_cast<uint64_t>(a[i].values[j].value) == std::bit_cast<uint64_t>(b[i].values[j].value));
    }
  }
}

// Encodes, decodes, checks equality; returns the encoded bytes per value.
double RoundTrip(const std::vector<CompletedStep>& steps) {
  std::string blob;
  EncodeStepBlock(steps, blob);
  std::vector<CompletedStep> back;
  const Status s = DecodeStepBlock(blob, back);
  REQUIRE(s.ok());
  RequireSameSteps(steps, back);
  size_t values = 0;
  for (const CompletedStep& step : steps) values += step.values.size();
  return static_cast<double>(blob.size()) / static_cast<double>(values);
}

// Blocks whose layout changes as steps arrive: in column order and full at first, then a step
// whose values break the order part way (the columns of every value before it are spelled out
// then), steps short of series, ids far beyond the values' count after dense ones, and a wide full
// block gathered in tiles of columns.
std::vector<std::vector<CompletedStep>> LayoutBlocks() {
  std::mt19937_64 rng(11);
  auto value = [&rng] { return std::bit_cast<double>(rng() & ~(uint64_t{0x7ff} << 52)); };
  std::vector<std::vector<CompletedStep>> blocks;
  {
    auto steps = MakeSteps(9, 40, [&](uint32_t, size_t) { return value(); });
    std::swap(steps[5].values[17], steps[5].values[3]);  // out of column order mid-block, mid-step
    blocks.push_back(steps);
  }
  {
    auto steps = MakeSteps(6, 12, [&](uint32_t, size_t) { return value(); });
    steps[2].values.resize(7);  // short of series, still in column order
    blocks.push_back(steps);
  }
  {
    auto steps = MakeSteps(5, 10, [&](uint32_t, size_t) { return value(); });
    steps[3].values.push_back({std::numeric_limits<SeriesId>::max() - 3, 1.5});  // far beyond the count
    steps[4].values.push_back({std::numeric_limits<SeriesId>::max() - 3, 2.5});
    steps[4].values.push_back({11, 3.5});  // dense again, after it
    blocks.push_back(steps);
  }
  blocks.push_back(MakeSteps(4, 1000, [&](uint32_t, size_t) { return value(); }));
  blocks.push_back(MakeSteps(3, 257, [&](uint32_t id, size_t i) { return 0.5 * id + static_cast<double>(i); }));
  return blocks;
}

// FNV-1a, 64 bits: a digest of a block's bytes.
uint64_t Fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325;
  for (const unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3;
  }
  return h;
}

}  // namespace

TEST_CASE("step blocks of float32 norms widened to double take under 3 bytes a value", "[store][step_block]") {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> noise(0.0, 0.01);
  // A norm per series drifting slowly, with 1 % noise, computed in float32 as a trainer does.
  const auto steps = MakeSteps(64, 2001, [&](uint32_t id, size_t i) {
    const float v = static_cast<float>((1.0 + 0.1 * id) * (1.0 + 1e-4 * static_cast<double>(i)) * (1.0 + noise(rng)));
    return static_cast<double>(v);
  });
  const double per_value = RoundTrip(steps);
  CAPTURE(per_value);
  REQUIRE(per_value < 3.0);
}

TEST_CASE("step blocks of decimal text with six significant digits take under 3 bytes a value", "[store][step_block]") {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> noise(0.0, 0.01);
  // As a W&B JSONL log writes them ("%.6g"), read back with strtod.
  const auto steps = MakeSteps(64, 2001, [&](uint32_t id, size_t i) {
    char text[32];
    std::snprintf(text, sizeof text, "%.6g",
                  (0.01 + 0.001 * id) * (1.0 + 1e-4 * static_cast<double>(i)) * (1.0 + noise(rng)));
    return std::strtod(text, nullptr);
  });
  const double per_value = RoundTrip(steps);
  CAPTURE(per_value);
  REQUIRE(per_value < 3.0);
}

TEST_CASE("step blocks of smooth computed doubles and of counters are tiny", "[store][step_block]") {
  const auto steps = MakeSteps(64, 500, [](uint32_t id, size_t i) {
    return id % 2 == 0 ? std::sqrt(100.0 + 1e-4 * static_cast<double>(i)) : static_cast<double>(i * 3 + id);
  });
  const double per_value = RoundTrip(steps);
  CAPTURE(per_value);
  REQUIRE(per_value < 1.5);
}

TEST_CASE("step blocks keep arbitrary doubles exactly", "[store][step_block]") {
  std::mt19937_64 rng(3);
  const auto steps = MakeSteps(40, 50, [&](uint32_t, size_t) {
    uint64_t bits = rng();
    return std::bit_cast<double>(bits);  // any bit pattern: NaNs with payloads, subnormals, infinities
  });
  const double per_value = RoundTrip(steps);
  REQUIRE(per_value <= 8.5);
}

TEST_CASE("step blocks keep special values and extreme exponents exactly", "[store][step_block]") {
  const double specials[] = {0.0,
                             -0.0,
                             std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN(),
                             -std::numeric_limits<double>::quiet_NaN(),
                             std::bit_cast<double>(uint64_t{0x7ff0000000000001}),  // signalling NaN
                             std::bit_cast<double>(uint64_t{0x7ff8dead00000000}),  // NaN with a payload
                             std::numeric_limits<double>::denorm_min(),
                             -std::numeric_limits<double>::denorm_min(),
                             std::numeric_limits<double>::min(),
                             std::numeric_limits<double>::max(),
                             -std::numeric_limits<double>::max(),
                             1e-300,
                             1e300,
                             0.1,
                             -0.3,
                             123456789.125,
                             static_cast<double>(std::numeric_limits<float>::max()),
                             static_cast<double>(std::numeric_limits<float>::denorm_min()),
                             9007199254740993.0};
  const size_t count = std::size(specials);
  // Each special alone in a column, and every special mixed into every column.
  SECTION("one kind per column") {
    RoundTrip(MakeSteps(5, static_cast<uint32_t>(count), [&](uint32_t id, size_t) { return specials[id]; }));
  }
  SECTION("mixed in each column") {
    RoundTrip(MakeSteps(count, 7, [&](uint32_t id, size_t i) { return specials[(i + id) % count]; }));
  }
  SECTION("one step") {
    RoundTrip(MakeSteps(1, static_cast<uint32_t>(count), [&](uint32_t id, size_t) { return specials[id]; }));
  }
  SECTION("a short decimal too large for the column's scale beside one that needs it") {
    // The block fuzz_step_block found: its values re-encode through a column whose decimal
    // scale takes one of them beyond an integer; that column is kept as doubles, and the value
    // is never converted (that conversion was undefined behaviour).
    const std::string found(
        "\x01\x01\x00\x64\x00\x00\xc4\x9f\xd5\xec\xc1\x01\x00\x00\x00\x00\x00\x02\x00\x00\x00\x00\x00\x03"
        "\x00\x03\x00\x00\x02\x29\x00\x01\x00\x00\x01\x00\x01\x02\x00\xff\xff\xff\xff\x01\x00\x02\x00\xb3"
        "\xfc\xcd\xf7\xe6\x93\xa8\xfb\xbf\x01\x00",
        58);
    std::vector<CompletedStep> decoded;
    REQUIRE(DecodeStepBlock(found, decoded).ok());
    RoundTrip(decoded);
  }
}

TEST_CASE("step blocks keep steps with differing series, order and duplicates", "[store][step_block]") {
  std::vector<CompletedStep> steps(6);
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].step = 10 + 3 * i + (i == 4 ? 100 : 0);  // a gap
    steps[i].wall_time = i == 2 ? 0.0 : 1.7e9 + static_cast<double>(i);
    steps[i].partial = i % 2 == 1;
    steps[i].ranks_reported = static_cast<uint32_t>(i);
    steps[i].client_dropped_steps = i == 5 ? std::numeric_limits<uint64_t>::max() : 0;
  }
  steps[0].values = {{5, 1.0}, {9, 2.0}};
  steps[1].values = {{9, 3.0}, {5, 4.0}};            // another order
  steps[2].values = {};                              // none
  steps[3].values = {{7, 5.0}, {5, 6.0}, {5, 6.5}};  // a new series and a duplicate
  steps[4].values = {{std::numeric_limits<SeriesId>::max(), 0.25}};
  steps[5].values = {{5, 7.0}, {9, 8.0}, {7, 9.0}};
  RoundTrip(steps);
}

TEST_CASE("a step block encoder fed step by step writes the block of the whole steps, and again when reused",
          "[store][step_block]") {
  const std::vector<std::vector<CompletedStep>> blocks = LayoutBlocks();
  StepBlockEncoder reused;
  for (int round = 0; round < 2; ++round) {
    for (const auto& steps : blocks) {
      std::string whole;
      EncodeStepBlock(steps, whole);
      for (const CompletedStep& step : steps) reused.Add(step);
      REQUIRE(reused.steps() == steps.size());
      REQUIRE(reused.first_step() == steps.front().step);
      REQUIRE(reused.last_step() == steps.back().step);
      REQUIRE(std::bit_cast<uint64_t>(reused.last_wall_time()) == std::bit_cast<uint64_t>(steps.back().wall_time));
      std::string step_by_step;
      reused.Finish(step_by_step);
      REQUIRE(reused.empty());
      REQUIRE(step_by_step == whole);
      std::vector<CompletedStep> back;
      REQUIRE(DecodeStepBlock(step_by_step, back).ok());
      RequireSameSteps(steps, back);
    }
  }
  // Clear drops what was added.
  reused.Add(blocks[0][0]);
  reused.Clear();
  REQUIRE(reused.empty());
  reused.Add(blocks[1][0]);
  std::string one, expected;
  reused.Finish(one);
  EncodeStepBlock(std::span(blocks[1]).first(1), expected);
  REQUIRE(one == expected);
}

TEST_CASE("step blocks are written byte for byte as the journals on disk hold them", "[store][step_block]") {
  // Sizes and digests of LayoutBlocks() as the encoder of e4b4a19 wrote them (version 1), before
  // sealing went step by step (6623adc): a change of the format shows here, not in a journal that
  // reads back differently.
  const std::vector<std::pair<size_t, uint64_t>> expected = {{3194, 0x4b565ed234b5567a},
                                                             {676, 0xac65543f071c1930},
                                                             {589, 0x6da6b652ba49cd6e},
                                                             {38789, 0x03583db04cfdd50c},
                                                             {1702, 0xc8fa2874e449f113}};
  const std::vector<std::vector<CompletedStep>> blocks = LayoutBlocks();
  REQUIRE(blocks.size() == expected.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    INFO("block " << b);
    std::string bytes;
    EncodeStepBlock(blocks[b], bytes);
    // Since the checksum (version 2): the same bytes with version 2 and 4 bytes of CRC-32C after.
    REQUIRE(bytes.size() == expected[b].first + 4);
    CHECK(static_cast<uint8_t>(bytes[0]) == 2);
    std::string layout = bytes.substr(0, bytes.size() - 4);
    layout[0] = 1;
    CHECK(Fnv1a(layout) == expected[b].second);
  }
}

TEST_CASE("step blocks of steps without values, and of one value", "[store][step_block]") {
  std::vector<CompletedStep> steps(3);
  for (size_t i = 0; i < steps.size(); ++i) steps[i].step = i;
  RoundTrip(steps);
  steps.resize(1);
  steps[0].values = {{1, 0.5}};
  RoundTrip(steps);
}

TEST_CASE("damaged step blocks are refused, never misread", "[store][step_block]") {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const auto steps =
      MakeSteps(16, 20, [&](uint32_t, size_t) { return static_cast<double>(static_cast<float>(u(rng))); });
  std::string blob;
  EncodeStepBlock(steps, blob);
  std::vector<CompletedStep> back;
  REQUIRE_FALSE(DecodeStepBlock("", back).ok());
  REQUIRE_FALSE(DecodeStepBlock(std::string(1, '\x02'), back).ok());  // unknown version
  // Every truncation fails: the decoder knows how long each part must be.
  for (size_t len = 0; len < blob.size(); ++len) {
    CAPTURE(len);
    REQUIRE_FALSE(DecodeStepBlock(std::string_view(blob).substr(0, len), back).ok());
  }
  REQUIRE_FALSE(DecodeStepBlock(blob + "x", back).ok());
  // A claim of more steps than a block may hold.
  std::string huge = "\x01\xff\xff\xff\x0f";
  REQUIRE_FALSE(DecodeStepBlock(huge, back).ok());
}

TEST_CASE("a block changed on disk is refused by its checksum, and blocks written before it still read",
          "[store][step_block]") {
  // Found by a hostile pass: 200 flipped bytes in a stopped journal were served as other values.
  const auto steps = MakeSteps(128, 40, [](size_t s, uint32_t c) { return 0.5 + 1e-3 * static_cast<double>(s * c); });
  std::string block;
  EncodeStepBlock(steps, block);
  REQUIRE(static_cast<uint8_t>(block[0]) == 2);
  std::vector<CompletedStep> decoded;
  REQUIRE(DecodeStepBlock(block, decoded).ok());
  RequireSameSteps(steps, decoded);
  size_t refused = 0;
  for (size_t at = 1; at < block.size(); at += 7) {
    for (const uint8_t flip : {uint8_t{0x01}, uint8_t{0x80}}) {
      std::string damaged = block;
      damaged[at] = static_cast<char>(static_cast<uint8_t>(damaged[at]) ^ flip);
      const gradwatch::Status s = DecodeStepBlock(damaged, decoded);
      REQUIRE_FALSE(s.ok());  // every single-bit change is caught, never decoded as other values
      refused += s.message().find("checksum mismatch") != std::string::npos;
    }
  }
  CHECK(refused > 0);
  // A version-1 block (no checksum) reads as before.
  std::string old = block.substr(0, block.size() - 4);
  old[0] = 1;
  REQUIRE(DecodeStepBlock(old, decoded).ok());
  RequireSameSteps(steps, decoded);
}
