// Helpers for tests of SaveState/LoadState (server/core/state_io.h): an object's state as bytes,
// a load that must succeed, and the damage (cuts, byte flips) a load must survive.
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/state_io.h"

namespace gradwatch::testing {

template <typename T>
std::string StateOf(const T& object) {
  std::string bytes;
  StateWriter out(bytes);
  object.SaveState(out);
  return bytes;
}

// Loads `bytes` into `object`: it must succeed and read every byte.
template <typename T>
void RequireLoads(T& object, std::string_view bytes) {
  StateReader in(bytes);
  const bool loaded = object.LoadState(in);
  INFO(in.why());
  REQUIRE(loaded);
  REQUIRE(!in.failed());
  REQUIRE(in.at_end());
}

// Cuts and byte flips of `bytes` (a state saved by an object that `make` constructs): every cut
// (every length for a small state, a few hundred for a large one) fails, and a state with a byte
// set (every byte of a small state, three ways) or 1 to 3 random bytes flipped either fails or
// loads into an object that `exercise` can go on using (run it under ASan and UBSan to see that
// it does so without undefined behaviour).
template <typename T, typename Make, typename Exercise>
void Damage(const std::string& bytes, Make make, Exercise exercise, uint64_t seed, int flip_trials = 600) {
  std::mt19937_64 rng(seed);
  std::vector<size_t> cuts;
  if (bytes.size() <= 4096) {
    for (size_t n = 0; n < bytes.size(); ++n) cuts.push_back(n);
  } else {
    for (int i = 0; i < 400; ++i) cuts.push_back(rng() % bytes.size());
    for (size_t n = 0; n < 64; ++n) cuts.push_back(n);
    cuts.push_back(bytes.size() - 1);
  }
  for (size_t n : cuts) {
    T object = make();
    StateReader in(std::string_view(bytes).substr(0, n));
    const bool loaded = object.LoadState(in);
    INFO("cut at " << n << " of " << bytes.size());
    REQUIRE(!loaded);
    REQUIRE(in.failed());
  }
  int loaded_count = 0;
  const auto load_damaged = [&](const std::string& damaged) {
    T object = make();
    StateReader in(damaged);
    const bool loaded = object.LoadState(in);
    // A load fails exactly when its reader does: the owner learns why.
    REQUIRE(loaded != in.failed());
    if (loaded) {
      ++loaded_count;
      exercise(object);
    }
  };
  // A small state: every byte set to 0, to 0xff and with its top bit flipped (a count, an index or
  // a flag out of range, or a sign).
  if (bytes.size() <= 4096) {
    for (size_t at = 0; at < bytes.size(); ++at) {
      for (const int value : {0x00, 0xff, (bytes[at] & 0xff) ^ 0x80}) {
        if ((bytes[at] & 0xff) == value) continue;
        std::string damaged = bytes;
        damaged[at] = static_cast<char>(value);
        load_damaged(damaged);
      }
    }
  }
  for (int trial = 0; trial < flip_trials; ++trial) {
    std::string damaged = bytes;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % damaged.size();
      if (rng() % 2 == 0) {
        damaged[at] = static_cast<char>(damaged[at] ^ (1 << (rng() % 8)));
      } else {
        damaged[at] = static_cast<char>(rng());
      }
    }
    load_damaged(damaged);
  }
  // Flips in values (not in the bookkeeping) load: `exercise` ran on some.
  if (flip_trials > 0) CHECK(loaded_count > 0);
}

}  // namespace gradwatch::testing
