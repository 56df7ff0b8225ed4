#include "server/store/point_log.h"

#include <algorithm>
#include <bit>
#include <type_traits>

namespace gradwatch::store {
namespace {

// Bits are written from the least significant end of each word. Writing at a position sets every
// later bit of its word (and of the next word it reaches) from the value, so a chunk reused
// after a truncation needs no clearing.
class BitWriter {
 public:
  BitWriter(uint64_t* words, uint32_t bit, uint32_t capacity) : words_(words), bit_(bit), capacity_(capacity) {}

  // Writes the n (1..64) low bits of v; v must have no higher bit set.
  void Put(uint64_t v, unsigned n) {
    if (overflow_ || bit_ + n > capacity_) {
      overflow_ = true;
      return;
    }
    const unsigned lo = bit_ & 63;
    const size_t w = bit_ >> 6;
    if (lo == 0) {
      words_[w] = v;
    } else {
      words_[w] = (words_[w] & ((uint64_t{1} << lo) - 1)) | (v << lo);
      if (lo + n > 64) words_[w + 1] = v >> (64 - lo);
    }
    bit_ += n;
  }
  uint32_t bit() const { return bit_; }
  bool overflow() const { return overflow_; }

 private:
  uint64_t* words_;
  uint32_t bit_;
  uint32_t capacity_;
  bool overflow_ = false;
};

class BitReader {
 public:
  BitReader(const uint64_t* words, uint32_t bit) : words_(words), bit_(bit) {}

  uint64_t Get(unsigned n) {
    const unsigned lo = bit_ & 63;
    const size_t w = bit_ >> 6;
    uint64_t v = words_[w] >> lo;
    if (lo + n > 64) v |= words_[w + 1] << (64 - lo);
    if (n < 64) v &= (uint64_t{1} << n) - 1;
    bit_ += n;
    return v;
  }
  bool GetBit() { return Get(1) != 0; }
  uint32_t bit() const { return bit_; }

 private:
  const uint64_t* words_;
  uint32_t bit_;
};

// A BitReader for bits read from a snapshot: a read past `end` fails, and reads nothing.
class CheckedBitReader {
 public:
  CheckedBitReader(const uint64_t* words, uint32_t bit, uint32_t end) : words_(words), bit_(bit), end_(end) {}

  bool Get(unsigned n, uint64_t& v) {
    if (bit_ > end_ || n > end_ - bit_) return false;
    BitReader r(words_, bit_);
    v = r.Get(n);
    bit_ = r.bit();
    return true;
  }
  bool GetBit(bool& b) {
    uint64_t v = 0;
    if (!Get(1, v)) return false;
    b = v != 0;
    return true;
  }
  uint32_t bit() const { return bit_; }

 private:
  const uint64_t* words_;
  uint32_t bit_;
  uint32_t end_;
};

constexpr int kMean = 0, kMin = 1, kMax = 2, kLast = 3;

// Delta-of-delta of the step, in Gorilla's classes; a delta that does not fit goes raw.
void PutStep(BitWriter& w, uint64_t delta, uint64_t previous_delta) {
  const auto dod = static_cast<int64_t>(delta - previous_delta);
  if (dod == 0) {
    w.Put(0, 1);
  } else if (dod >= -63 && dod <= 64) {
    w.Put(0b01, 2);
    w.Put(static_cast<uint64_t>(dod + 63), 7);
  } else if (dod >= -255 && dod <= 256) {
    w.Put(0b011, 3);
    w.Put(static_cast<uint64_t>(dod + 255), 9);
  } else if (dod >= -2047 && dod <= 2048) {
    w.Put(0b0111, 4);
    w.Put(static_cast<uint64_t>(dod + 2047), 12);
  } else {
    w.Put(0b1111, 4);
    w.Put(delta, 64);
  }
}

uint64_t GetDelta(BitReader& r, uint64_t previous_delta) {
  if (!r.GetBit()) return previous_delta;
  if (!r.GetBit()) return previous_delta + (r.Get(7) - 63);
  if (!r.GetBit()) return previous_delta + (r.Get(9) - 255);
  if (!r.GetBit()) return previous_delta + (r.Get(12) - 2047);
  return r.Get(64);
}

// An integer: one bit when it equals the previous one, else its width and its bits.
void PutUint(BitWriter& w, uint64_t v, uint64_t previous) {
  if (v == previous) {
    w.Put(0, 1);
    return;
  }
  const auto width = static_cast<unsigned>(std::max<uint64_t>(1, std::bit_width(v)));
  w.Put(1, 1);
  w.Put(width - 1, 6);
  w.Put(v, width);
}

uint64_t GetUint(BitReader& r, uint64_t previous) {
  if (!r.GetBit()) return previous;
  const auto width = static_cast<unsigned>(r.Get(6)) + 1;
  return r.Get(width);
}

// A value that fits in its field's window but would leave more than this many of the window's
// bits unused opens a new window instead: a new window's header takes 11 bits, and a margin of 2
// keeps a window from being reopened for a gain of a bit or two (11, 13 and 16 code the benches'
// noisy norms in the same bytes).
constexpr unsigned kMaxUnusedWindowBits = 13;

// A value XORed with the field's previous one: unchanged in 1 bit, within the field's window of
// meaningful bits in 2 + window, else 13 + meaningful bits (and the window moves).
//
// Unlike Gorilla's coder, which keeps a window as long as values fit in it, a value that would
// leave more than kMaxUnusedWindowBits of the window unused opens a narrower one: a window once
// wide would stay wide otherwise. Every chunk's first value is coded against zero (its
// window spans nearly all 64 bits), and noisy values, which change in all their low bits, always
// fit in it: the benches' noisy norms took about 60 bits each in 512-byte chunks, where 50 or so
// carry their change (7.9 bytes a sample held against 7.25 now, a bucket 33 bytes against 28).
// A decoder reads what the coder chose, so points coded either way decode the same.
void PutValue(BitWriter& w, uint8_t& window_leading, uint8_t& window_meaningful, double previous, double value) {
  const uint64_t x = std::bit_cast<uint64_t>(value) ^ std::bit_cast<uint64_t>(previous);
  if (x == 0) {
    w.Put(0, 1);
    return;
  }
  const auto leading = static_cast<unsigned>(std::min(std::countl_zero(x), 31));
  const auto trailing = static_cast<unsigned>(std::countr_zero(x));
  const unsigned window = window_meaningful;
  const unsigned window_trailing = 64 - window_leading - window;
  if (window != 0 && leading >= window_leading && trailing >= window_trailing &&
      (leading - window_leading) + (trailing - window_trailing) <= kMaxUnusedWindowBits) {
    w.Put(0b01, 2);  // 1 (changed), then 0 (within the window)
    w.Put(x >> window_trailing, window);
    return;
  }
  const unsigned meaningful = 64 - leading - trailing;
  w.Put(0b11, 2);
  w.Put(leading, 5);
  w.Put(meaningful - 1, 6);
  w.Put(x >> trailing, meaningful);
  window_leading = static_cast<uint8_t>(leading);
  window_meaningful = static_cast<uint8_t>(meaningful);
}

}  // namespace

bool PointLog::Encode(Chunk& chunk, CodecState& state, const Point& p) {
  CodecState s = state;
  BitWriter w(chunk.words.get(), s.bit, kChunkBits);
  const bool sample = IsSamplePoint(p);
  const uint64_t delta = p.step - s.prev.step;
  w.Put(sample ? 1 : 0, 1);
  PutStep(w, delta, s.delta);
  if (sample) {
    PutValue(w, s.leading[kLast], s.meaningful[kLast], s.prev.last, p.last);
  } else {
    PutUint(w, p.last_step - p.step, s.prev.last_step - s.prev.step);
    PutUint(w, p.count, s.prev.count);
    PutUint(w, p.nonfinite, s.prev.nonfinite);
    PutValue(w, s.leading[kMean], s.meaningful[kMean], s.prev.mean, p.mean);
    PutValue(w, s.leading[kMin], s.meaningful[kMin], s.prev.min, p.min);
    PutValue(w, s.leading[kMax], s.meaningful[kMax], s.prev.max, p.max);
    PutValue(w, s.leading[kLast], s.meaningful[kLast], s.prev.last, p.last);
  }
  if (w.overflow()) return false;
  s.delta = delta;
  s.prev = p;
  s.bit = w.bit();
  ++s.points;
  state = s;
  chunk.bits = s.bit;
  chunk.points = s.points;
  return true;
}

void PointLog::EncodeSampleInPlace(Chunk& chunk, CodecState& state, uint64_t step, double value) {
  BitWriter w(chunk.words.get(), state.bit, kChunkBits);
  const uint64_t delta = step - state.prev.step;
  w.Put(1, 1);
  PutStep(w, delta, state.delta);
  PutValue(w, state.leading[kLast], state.meaningful[kLast], state.prev.last, value);
  state.delta = delta;
  state.prev = SamplePoint(step, value);
  state.bit = w.bit();
  ++state.points;
  chunk.bits = state.bit;
  chunk.points = state.points;
}

bool PointLog::AppendSample(uint64_t step, double value, bool may_allocate) {
  if (chunks_used_ > 0 && write_.bit + kMaxSampleBits <= kChunkBits) {
    // It fits whatever its bits: coded in place, without Encode's copy of the state for an undo.
    EncodeSampleInPlace(slot(chunks_used_ - 1), write_, step, value);
    ++size_;
    return true;
  }
  return Append(SamplePoint(step, value), may_allocate);
}

Point PointLog::Decode(const Chunk& chunk, CodecState& state) {
  BitReader r(chunk.words.get(), state.bit);
  const auto get_value = [&](int field, double previous) {
    if (!r.GetBit()) return previous;
    uint64_t x = 0;
    if (!r.GetBit()) {
      const unsigned window = state.meaningful[field];
      x = r.Get(window) << (64 - state.leading[field] - window);
    } else {
      const auto leading = static_cast<unsigned>(r.Get(5));
      const auto meaningful = static_cast<unsigned>(r.Get(6)) + 1;
      x = r.Get(meaningful) << (64 - leading - meaningful);
      state.leading[field] = static_cast<uint8_t>(leading);
      state.meaningful[field] = static_cast<uint8_t>(meaningful);
    }
    return std::bit_cast<double>(std::bit_cast<uint64_t>(previous) ^ x);
  };

  const bool sample = r.GetBit();
  state.delta = GetDelta(r, state.delta);
  const uint64_t step = state.prev.step + state.delta;
  Point p;
  if (sample) {
    p = SamplePoint(step, get_value(kLast, state.prev.last));
  } else {
    p.step = step;
    p.last_step = step + GetUint(r, state.prev.last_step - state.prev.step);
    p.count = static_cast<uint32_t>(GetUint(r, state.prev.count));
    p.nonfinite = static_cast<uint32_t>(GetUint(r, state.prev.nonfinite));
    p.mean = get_value(kMean, state.prev.mean);
    p.min = get_value(kMin, state.prev.min);
    p.max = get_value(kMax, state.prev.max);
    p.last = get_value(kLast, state.prev.last);
  }
  state.prev = p;
  state.bit = r.bit();
  ++state.points;
  return p;
}

bool PointLog::DecodeChecked(const Chunk& chunk, uint32_t end_bit, CodecState& state) {
  CheckedBitReader r(chunk.words.get(), state.bit, end_bit);
  // As Decode's get_value, with the shifts kept in range as PutValue keeps them: a window read
  // needs one (of 1 to 64 − leading bits), a new window fits in 64 bits.
  const auto get_value = [&](int field, double previous, double& value) {
    bool changed = false, new_window = false;
    if (!r.GetBit(changed)) return false;
    if (!changed) {
      value = previous;
      return true;
    }
    if (!r.GetBit(new_window)) return false;
    uint64_t x = 0;
    if (!new_window) {
      const unsigned leading = state.leading[field];
      const unsigned window = state.meaningful[field];
      if (window == 0 || leading + window > 64 || !r.Get(window, x)) return false;
      x <<= 64 - leading - window;
    } else {
      uint64_t leading = 0, meaningful = 0;
      if (!r.Get(5, leading) || !r.Get(6, meaningful)) return false;
      ++meaningful;
      if (leading + meaningful > 64 || !r.Get(static_cast<unsigned>(meaningful), x)) return false;
      x <<= 64 - leading - meaningful;
      state.leading[field] = static_cast<uint8_t>(leading);
      state.meaningful[field] = static_cast<uint8_t>(meaningful);
    }
    value = std::bit_cast<double>(std::bit_cast<uint64_t>(previous) ^ x);
    return true;
  };
  const auto get_uint = [&](uint64_t previous, uint64_t& v) {
    bool changed = false;
    if (!r.GetBit(changed)) return false;
    if (!changed) {
      v = previous;
      return true;
    }
    uint64_t width = 0;
    return r.Get(6, width) && r.Get(static_cast<unsigned>(width) + 1, v);
  };

  bool sample = false;
  if (!r.GetBit(sample)) return false;
  // GetDelta's classes: up to four prefix bits, then the delta-of-delta or the raw delta.
  static constexpr unsigned kDodBits[] = {7, 9, 12};
  static constexpr uint64_t kDodBias[] = {63, 255, 2047};
  uint64_t delta = state.delta;
  bool more = false;
  if (!r.GetBit(more)) return false;
  if (more) {
    size_t cls = 0;
    for (; cls < 3; ++cls) {
      if (!r.GetBit(more)) return false;
      if (!more) break;
    }
    uint64_t v = 0;
    if (cls < 3) {
      if (!r.Get(kDodBits[cls], v)) return false;
      delta = state.delta + (v - kDodBias[cls]);
    } else {
      if (!r.Get(64, v)) return false;
      delta = v;
    }
  }
  const uint64_t step = state.prev.step + delta;
  Point p;
  if (sample) {
    double value = 0;
    if (!get_value(kLast, state.prev.last, value)) return false;
    p = SamplePoint(step, value);
  } else {
    uint64_t span = 0, count = 0, nonfinite = 0;
    if (!get_uint(state.prev.last_step - state.prev.step, span) || !get_uint(state.prev.count, count) ||
        !get_uint(state.prev.nonfinite, nonfinite)) {
      return false;
    }
    p.step = step;
    p.last_step = step + span;
    p.count = static_cast<uint32_t>(count);
    p.nonfinite = static_cast<uint32_t>(nonfinite);
    if (!get_value(kMean, state.prev.mean, p.mean) || !get_value(kMin, state.prev.min, p.min) ||
        !get_value(kMax, state.prev.max, p.max) || !get_value(kLast, state.prev.last, p.last)) {
      return false;
    }
  }
  state.delta = delta;
  state.prev = p;
  state.bit = r.bit();
  ++state.points;
  return true;
}

bool PointLog::SameState(const CodecState& a, const CodecState& b) {
  const auto same = [](double x, double y) { return std::bit_cast<uint64_t>(x) == std::bit_cast<uint64_t>(y); };
  return a.prev.step == b.prev.step && a.prev.last_step == b.prev.last_step && same(a.prev.mean, b.prev.mean) &&
         same(a.prev.min, b.prev.min) && same(a.prev.max, b.prev.max) && a.prev.count == b.prev.count &&
         a.prev.nonfinite == b.prev.nonfinite && same(a.prev.last, b.prev.last) && a.delta == b.delta &&
         a.leading == b.leading && a.meaningful == b.meaningful && a.bit == b.bit && a.points == b.points;
}

bool PointLog::OpenChunk(bool may_allocate) {
  if (chunks_used_ == slots_.size()) {
    if (!may_allocate) return false;
    // The new slot goes after the newest chunk: unwrap the ring first, keeping its order.
    std::rotate(slots_.begin(), slots_.begin() + static_cast<std::ptrdiff_t>(head_), slots_.end());
    head_ = 0;
    Chunk chunk;
    chunk.words = std::make_unique_for_overwrite<uint64_t[]>(kChunkWords);
    slots_.push_back(std::move(chunk));
  }
  Chunk& chunk = slot(chunks_used_);
  chunk.bits = 0;
  chunk.points = 0;
  ++chunks_used_;
  write_ = CodecState{};
  if (chunks_used_ == 1) front_ = CodecState{};
  return true;
}

bool PointLog::Append(const Point& p, bool may_allocate) {
  if (chunks_used_ == 0 || !Encode(slot(chunks_used_ - 1), write_, p)) {
    if (!OpenChunk(may_allocate)) return false;
    // Any point fits in an empty chunk.
    Encode(slot(chunks_used_ - 1), write_, p);
  }
  ++size_;
  return true;
}

size_t PointLog::NextGrowthBytes() const {
  if (chunks_used_ < slots_.size()) return 0;
  if (chunks_used_ > 0 && kChunkBits - write_.bit >= kMaxBucketBits) return 0;
  size_t bytes = kChunkBytes;
  if (slots_.size() == slots_.capacity()) {
    bytes += (std::max<size_t>(1, 2 * slots_.capacity()) - slots_.capacity()) * sizeof(Chunk);
  }
  return bytes;
}

Point PointLog::PopFront() {
  const Chunk& chunk = slot(0);
  const Point p = Decode(chunk, front_);
  --size_;
  if (front_.points == chunk.points) {
    // The oldest chunk is read: its slot becomes the spare after the newest.
    --chunks_used_;
    if (chunks_used_ > 0) {
      head_ = SlotIndex(1);
      front_ = CodecState{};
    }
  }
  return p;
}

void PointLog::Truncate(size_t count) {
  if (count >= size_) return;
  if (count == 0) {
    Clear();
    return;
  }
  size_t remaining = count;
  for (size_t i = 0; i < chunks_used_; ++i) {
    Chunk& chunk = slot(i);
    CodecState state = i == 0 ? front_ : CodecState{};
    const size_t in_chunk = chunk.points - state.points;
    if (remaining > in_chunk) {
      remaining -= in_chunk;
      continue;
    }
    for (; remaining > 0; --remaining) Decode(chunk, state);
    chunk.bits = state.bit;
    chunk.points = state.points;
    write_ = state;
    chunks_used_ = i + 1;
    size_ = count;
    return;
  }
}

void PointLog::Clear() {
  chunks_used_ = 0;
  size_ = 0;
}

// Coding states are written whole: no padding, so equal states give equal bytes.
static_assert(std::is_trivially_copyable_v<Point> &&
              sizeof(Point) == 2 * sizeof(uint64_t) + 4 * sizeof(double) + 2 * sizeof(uint32_t));

void PointLog::SaveState(StateWriter& out) const {
  static_assert(std::is_trivially_copyable_v<CodecState> &&
                sizeof(CodecState) == sizeof(Point) + sizeof(uint64_t) + 8 * sizeof(uint8_t) + 2 * sizeof(uint32_t));
  out.Put<uint64_t>(chunks_used_);
  out.Put<uint64_t>(size_);
  // With no chunk in use both states are stale (OpenChunk resets them): written as new ones.
  out.Put(chunks_used_ > 0 ? front_ : CodecState{});
  out.Put(chunks_used_ > 0 ? write_ : CodecState{});
  for (size_t i = 0; i < chunks_used_; ++i) {
    const Chunk& chunk = slot(i);
    out.Put(chunk.bits);
    out.Put(chunk.points);
    const uint32_t words = (chunk.bits + 63) / 64;
    for (uint32_t w = 0; w < words; ++w) {
      // The bits of the last word past chunk.bits are left over from earlier writes (the next
      // write sets them): zeroed, so that equal logs give equal bytes.
      const uint32_t used = std::min<uint32_t>(64, chunk.bits - 64 * w);
      out.Put(used == 64 ? chunk.words[w] : chunk.words[w] & ((uint64_t{1} << used) - 1));
    }
  }
}

bool PointLog::LoadState(StateReader& in) {
  uint64_t chunks = 0, size = 0;
  CodecState front, write;
  // A chunk in use takes its bits, its points and at least one word.
  if (!in.GetCount(chunks, 2 * sizeof(uint32_t) + sizeof(uint64_t)) || !in.Get(size) || !in.Get(front) ||
      !in.Get(write)) {
    return false;
  }
  // The chunks held before are freed: the log holds exactly the chunks it loads.
  slots_ = std::vector<Chunk>();
  head_ = 0;
  chunks_used_ = 0;
  size_ = 0;
  if (chunks == 0) {
    if (size != 0 || !SameState(front, CodecState{}) || !SameState(write, CodecState{})) {
      return in.Fail("an empty point log has points or a coding state");
    }
    front_ = write_ = CodecState{};
    return true;
  }
  slots_.reserve(chunks);
  uint64_t points = 0;
  for (uint64_t i = 0; i < chunks; ++i) {
    Chunk chunk;
    if (!in.Get(chunk.bits) || !in.Get(chunk.points)) return false;
    if (chunk.bits == 0 || chunk.bits > kChunkBits || chunk.points == 0) {
      return in.Fail("a point log's chunk has no point or too many bits");
    }
    chunk.words = std::make_unique_for_overwrite<uint64_t[]>(kChunkWords);
    for (uint32_t w = 0; w < (chunk.bits + 63) / 64; ++w) {
      if (!in.Get(chunk.words[w])) return false;
    }
    // Every point decoded once, checked: Decode may then read any of them, and the states saved
    // must be those its points lead to (the next point is coded against write_).
    const bool first = i == 0;
    if (first && front.points >= chunk.points) return in.Fail("a point log's oldest chunk is read past its end");
    CodecState state;
    while (state.points < chunk.points) {
      if (first && state.points == front.points && !SameState(state, front)) {
        return in.Fail("a point log's read position is not at a point");
      }
      if (!DecodeChecked(chunk, chunk.bits, state)) return in.Fail("a point log's chunk holds bits no point has");
    }
    if (state.bit != chunk.bits) return in.Fail("a point log's chunk has bits past its points");
    if (i + 1 == chunks && !SameState(state, write)) {
      return in.Fail("a point log's write position is not after its newest point");
    }
    points += first ? chunk.points - front.points : chunk.points;
    slots_.push_back(std::move(chunk));
  }
  if (points != size) return in.Fail("a point log's size is not its chunks' points");
  chunks_used_ = slots_.size();
  size_ = size;
  front_ = front;
  write_ = write;
  return true;
}

size_t PointLog::MemoryBytes() const { return slots_.size() * kChunkBytes + slots_.capacity() * sizeof(Chunk); }

size_t PointLog::MaxMemoryBytes(size_t points, size_t max_bits) {
  // A chunk is closed only when the next point does not fit: it then holds more than
  // kChunkBits − max_bits bits. One more chunk may be partly read (the oldest) and one emptied.
  const size_t per_chunk = std::max<size_t>(1, (kChunkBits - max_bits) / max_bits);
  const size_t chunks = (points + per_chunk - 1) / per_chunk + 2;
  // The ring of slots grows by doubling.
  return chunks * kChunkBytes + 2 * chunks * sizeof(Chunk);
}

}  // namespace gradwatch::store
