#include "server/store/step_block.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <unordered_map>

#include "server/store/crc32c.h"

namespace gradwatch::store {

namespace {

// Version 1 blocks (journals before the checksum) are read unverified; blocks are written as
// version 2: the same layout followed by the CRC-32C of every byte before it (4 bytes,
// little-endian), so that a block changed on disk is refused rather than read as other values.
constexpr uint8_t kBlockVersionUnchecked = 1;
constexpr uint8_t kBlockVersion = 2;

enum class ValueKind : uint8_t { kFloat32 = 0, kDecimal = 1, kFloat64 = 2 };
enum class Frame : uint8_t { kReference = 0, kDelta = 1, kDelta2 = 2 };

// Powers of ten that are exact doubles (10^22 is the last).
constexpr int kMaxDecimalExponent = 22;
constexpr std::array<double, kMaxDecimalExponent + 1> kPow10 = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                                                1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                                                1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
// The largest |m| whose double is exact.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

uint64_t Zigzag(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
int64_t Unzigzag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }

uint64_t Ordered64(double v) {
  const uint64_t b = std::bit_cast<uint64_t>(v);
  return (b >> 63) != 0 ? ~b : b | (uint64_t{1} << 63);
}
double FromOrdered64(uint64_t u) { return std::bit_cast<double>((u >> 63) != 0 ? u & ~(uint64_t{1} << 63) : ~u); }
uint32_t Ordered32(uint32_t b) { return (b >> 31) != 0 ? ~b : b | (uint32_t{1} << 31); }
uint32_t FromOrdered32(uint32_t u) { return (u >> 31) != 0 ? u & ~(uint32_t{1} << 31) : ~u; }

size_t VarintSize(uint64_t v) { return std::max<size_t>(1, (static_cast<size_t>(std::bit_width(v)) + 6) / 7); }
size_t PackedBytes(size_t n, int width) { return (n * static_cast<size_t>(width) + 7) / 8; }

// Appends the low `width` bits of each value, low bits first, in PackedBytes(n, width) bytes.
template <typename Value>
void PackBits(size_t n, int width, Value value, std::string& out) {
  const size_t at = out.size();
  out.resize(at + PackedBytes(n, width));
  if (width == 0) return;
  char* dst = out.data() + at;
  const uint64_t mask = width < 64 ? (uint64_t{1} << width) - 1 : ~uint64_t{0};
  uint64_t acc = 0;
  int used = 0;
  auto emit = [&dst](uint64_t word, int bytes) {
    for (int i = 0; i < bytes; ++i) *dst++ = static_cast<char>((word >> (8 * i)) & 0xff);
  };
  for (size_t i = 0; i < n; ++i) {
    const uint64_t v = value(i) & mask;
    acc |= v << used;
    const int room = 64 - used;
    if (width >= room) {
      emit(acc, 8);
      acc = room < 64 ? v >> room : 0;
      used = width - room;
    } else {
      used += width;
    }
  }
  emit(acc, (used + 7) / 8);
}

// How an integer column is written (see the header): its frame, the frame's parameters and the
// bytes it takes, computed without writing it.
struct IntsPlan {
  Frame frame = Frame::kReference;
  size_t bytes = 0;
  uint64_t base = 0;  // kReference: the minimum; else the minimum (first or second) difference
  int width = 0;
};

IntsPlan PlanInts(const uint64_t* v, size_t n) {
  IntsPlan plan;
  if (n == 0) return plan;
  // Frame of reference.
  const auto [lo, hi] = std::minmax_element(v, v + n);
  plan.base = *lo;
  plan.width = std::bit_width(*hi - *lo);
  plan.bytes = 2 + VarintSize(plan.base) + PackedBytes(n, plan.width);
  // Differences (wrapping, read as signed), and differences of differences.
  if (n >= 2) {
    int64_t d_lo = static_cast<int64_t>(v[1] - v[0]), d_hi = d_lo;
    for (size_t i = 2; i < n; ++i) {
      const auto d = static_cast<int64_t>(v[i] - v[i - 1]);
      d_lo = std::min(d_lo, d), d_hi = std::max(d_hi, d);
    }
    const int width = std::bit_width(static_cast<uint64_t>(d_hi) - static_cast<uint64_t>(d_lo));
    const size_t cost = 2 + VarintSize(v[0]) + VarintSize(Zigzag(d_lo)) + PackedBytes(n - 1, width);
    if (cost < plan.bytes) plan = {Frame::kDelta, cost, static_cast<uint64_t>(d_lo), width};
  }
  if (n >= 3) {
    auto dd_at = [v](size_t i) { return static_cast<int64_t>((v[i] - v[i - 1]) - (v[i - 1] - v[i - 2])); };
    int64_t dd_lo = dd_at(2), dd_hi = dd_lo;
    for (size_t i = 3; i < n; ++i) {
      const int64_t dd = dd_at(i);
      dd_lo = std::min(dd_lo, dd), dd_hi = std::max(dd_hi, dd);
    }
    const int width = std::bit_width(static_cast<uint64_t>(dd_hi) - static_cast<uint64_t>(dd_lo));
    const size_t cost = 2 + VarintSize(v[0]) + VarintSize(Zigzag(static_cast<int64_t>(v[1] - v[0]))) +
                        VarintSize(Zigzag(dd_lo)) + PackedBytes(n - 2, width);
    if (cost < plan.bytes) plan = {Frame::kDelta2, cost, static_cast<uint64_t>(dd_lo), width};
  }
  return plan;
}

void WriteInts(const uint64_t* v, size_t n, const IntsPlan& plan, std::string& out) {
  if (n == 0) return;
  out.push_back(static_cast<char>(plan.frame));
  switch (plan.frame) {
    case Frame::kReference:
      PutVarint(out, plan.base);
      out.push_back(static_cast<char>(plan.width));
      PackBits(
          n, plan.width, [v, &plan](size_t i) { return v[i] - plan.base; }, out);
      break;
    case Frame::kDelta:
      PutVarint(out, v[0]);
      PutVarint(out, Zigzag(static_cast<int64_t>(plan.base)));
      out.push_back(static_cast<char>(plan.width));
      PackBits(
          n - 1, plan.width, [v, &plan](size_t i) { return (v[i + 1] - v[i]) - plan.base; }, out);
      break;
    case Frame::kDelta2:
      PutVarint(out, v[0]);
      PutVarint(out, Zigzag(static_cast<int64_t>(v[1] - v[0])));
      PutVarint(out, Zigzag(static_cast<int64_t>(plan.base)));
      out.push_back(static_cast<char>(plan.width));
      PackBits(
          n - 2, plan.width, [v, &plan](size_t i) { return ((v[i + 2] - v[i + 1]) - (v[i + 1] - v[i])) - plan.base; },
          out);
      break;
  }
}

// Writes an integer column (see the header) in its shortest frame.
void EncodeInts(const std::vector<uint64_t>& v, std::string& out) {
  WriteInts(v.data(), v.size(), PlanInts(v.data(), v.size()), out);
}

// The decimal exponent p ≤ 22 with v == m / 10^p for an integer |m| < 2^53, computed as the
// decoder will; -1 when there is none.
int DecimalExponent(double v, int from) {
  for (int p = from; p <= kMaxDecimalExponent; ++p) {
    const double scaled = v * kPow10[static_cast<size_t>(p)];
    if (!(std::fabs(scaled) < kMaxExactInteger)) return -1;  // NaN too
    const double m = std::nearbyint(scaled);
    if (std::bit_cast<uint64_t>(m / kPow10[static_cast<size_t>(p)]) == std::bit_cast<uint64_t>(v)) return p;
  }
  return -1;
}

// Integer columns of one value column, one per kind, reused from column to column.
struct ValueScratch {
  std::vector<uint64_t> float32, decimal, float64;
};

// Writes one value column in the shortest kind that holds every value exactly. Each kind's size is
// planned without writing it; only the shortest (the first of equals, in kind order) is written.
void EncodeValues(const double* values, size_t n, ValueScratch& scratch, std::string& out) {
  std::vector<uint64_t>* best = nullptr;
  IntsPlan best_plan;
  size_t best_bytes = 0;
  ValueKind best_kind = ValueKind::kFloat64;
  int best_exponent = 0;
  auto consider = [&](std::vector<uint64_t>& ints, ValueKind kind, int exponent) {
    const IntsPlan plan = PlanInts(ints.data(), n);
    const size_t bytes = (kind == ValueKind::kDecimal ? 2 : 1) + plan.bytes;
    if (best == nullptr || bytes < best_bytes) {
      best = &ints, best_plan = plan, best_bytes = bytes, best_kind = kind, best_exponent = exponent;
    }
  };
  std::vector<uint64_t>& f32 = scratch.float32;
  f32.resize(n);
  bool float32 = true;
  for (size_t i = 0; i < n && float32; ++i) {
    const auto narrow = std::bit_cast<uint32_t>(static_cast<float>(values[i]));
    float32 = std::bit_cast<uint64_t>(static_cast<double>(std::bit_cast<float>(narrow))) ==
              std::bit_cast<uint64_t>(values[i]);
    f32[i] = Ordered32(narrow);
  }
  if (float32) consider(f32, ValueKind::kFloat32, 0);
  int exponent = 0;
  // The column's exponent is the largest its values need; each is checked at it below.
  for (size_t i = 0; i < n && exponent >= 0; ++i) exponent = DecimalExponent(values[i], exponent);
  if (exponent >= 0) {
    std::vector<uint64_t>& dec = scratch.decimal;
    dec.resize(n);
    const double scale = kPow10[static_cast<size_t>(exponent)];
    bool exact = true;
    for (size_t i = 0; i < n && exact; ++i) {
      const double m = std::nearbyint(values[i] * scale);
      // Converted to an integer only once it is known to fit (a larger double or a NaN would be
      // undefined behaviour).
      exact = std::fabs(m) < kMaxExactInteger && std::bit_cast<uint64_t>(static_cast<double>(static_cast<int64_t>(m)) /
                                                                         scale) == std::bit_cast<uint64_t>(values[i]);
      if (exact) dec[i] = static_cast<uint64_t>(static_cast<int64_t>(m));
    }
    if (exact) consider(dec, ValueKind::kDecimal, exponent);
  }
  std::vector<uint64_t>& f64 = scratch.float64;
  f64.resize(n);
  for (size_t i = 0; i < n; ++i) f64[i] = Ordered64(values[i]);
  consider(f64, ValueKind::kFloat64, 0);
  out.push_back(static_cast<char>(best_kind));
  if (best_kind == ValueKind::kDecimal) out.push_back(static_cast<char>(best_exponent));
  WriteInts(best->data(), n, best_plan, out);
}

// Reads a block front to back; every read is bounds-checked.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool Byte(uint8_t* v) {
    if (pos_ >= data_.size()) return false;
    *v = static_cast<uint8_t>(data_[pos_++]);
    return true;
  }
  bool Varint(uint64_t* v) {
    uint64_t out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!Byte(&b)) return false;
      out |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) {
        *v = out;
        return true;
      }
    }
    return false;
  }
  // An integer column of n values (see EncodeInts) appended to `out`.
  bool Ints(size_t n, std::vector<uint64_t>& out) {
    out.clear();
    if (n == 0) return true;
    uint8_t frame = 0;
    if (!Byte(&frame) || frame > static_cast<uint8_t>(Frame::kDelta2)) return false;
    uint64_t first = 0, base = 0, d1 = 0;
    if (frame == static_cast<uint8_t>(Frame::kReference)) {
      if (!Varint(&base)) return false;
    } else {
      if (!Varint(&first)) return false;
      if (frame == static_cast<uint8_t>(Frame::kDelta2) && !Varint(&d1)) return false;
      if (!Varint(&base)) return false;
      base = static_cast<uint64_t>(Unzigzag(base));
      d1 = static_cast<uint64_t>(Unzigzag(d1));
    }
    uint8_t width = 0;
    if (!Byte(&width) || width > 64) return false;
    const size_t fixed = frame == static_cast<uint8_t>(Frame::kReference) ? 0
                         : frame == static_cast<uint8_t>(Frame::kDelta)   ? 1
                                                                          : 2;
    if (n < fixed) return false;
    const size_t packed = n - fixed;
    const size_t bytes = PackedBytes(packed, width);
    if (bytes > data_.size() - pos_) return false;
    out.reserve(n);
    size_t bit = pos_ * 8;
    auto get = [&]() -> uint64_t {
      if (width == 0) return 0;
      uint64_t v = 0;
      const size_t byte = bit / 8;
      const int shift = static_cast<int>(bit % 8);
      const size_t avail = data_.size() - byte;
      if (avail >= 8) {
        std::memcpy(&v, data_.data() + byte, 8);
        v = LittleEndian(v);
      } else {
        for (size_t i = 0; i < avail; ++i) v |= uint64_t{static_cast<uint8_t>(data_[byte + i])} << (8 * i);
      }
      v >>= shift;
      if (shift + width > 64) v |= uint64_t{static_cast<uint8_t>(data_[byte + 8])} << (64 - shift);
      bit += width;
      return width == 64 ? v : v & ((uint64_t{1} << width) - 1);
    };
    if (frame == static_cast<uint8_t>(Frame::kReference)) {
      for (size_t i = 0; i < n; ++i) out.push_back(get() + base);
    } else if (frame == static_cast<uint8_t>(Frame::kDelta)) {
      out.push_back(first);
      for (size_t i = 1; i < n; ++i) out.push_back(out.back() + get() + base);
    } else {
      out.push_back(first);
      out.push_back(first + d1);
      uint64_t d = d1;
      for (size_t i = 2; i < n; ++i) {
        d += get() + base;
        out.push_back(out.back() + d);
      }
    }
    pos_ += bytes;
    return true;
  }
  bool AtEnd() const { return pos_ == data_.size(); }

 private:
  static uint64_t LittleEndian(uint64_t v) {
    if constexpr (std::endian::native == std::endian::little) return v;
    uint64_t out = 0;
    for (int i = 0; i < 8; ++i) out = (out << 8) | ((v >> (8 * i)) & 0xff);
    return out;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

Status Malformed(const char* what) { return Status::Internal(std::string("step block: ") + what); }

constexpr uint32_t kNoColumn = std::numeric_limits<uint32_t>::max();

}  // namespace

uint32_t StepBlockEncoder::ColumnOf(SeriesId id) {
  if (id < dense_column_.size() && dense_column_[id] != kNoColumn) return dense_column_[id];
  if (!sparse_column_.empty()) {
    if (const auto it = sparse_column_.find(id); it != sparse_column_.end()) return it->second;
  }
  const auto column = static_cast<uint32_t>(ids_.size());
  ids_.push_back(id);
  // An id far beyond the values' count (never the daemon's own) takes no array of its size.
  if (id < 2 * values_.size() + 1024) {
    if (id >= dense_column_.size()) dense_column_.resize(size_t{id} + 1, kNoColumn);
    dense_column_[id] = column;
  } else {
    sparse_column_.emplace(id, column);
  }
  return column;
}

void StepBlockEncoder::SpellOutColumns() {
  value_columns_.clear();
  value_columns_.reserve(values_.capacity());
  for (const uint64_t count : count_column_) {
    for (uint32_t j = 0; j < count; ++j) value_columns_.push_back(j);
  }
}

void StepBlockEncoder::Add(const CompletedStep& step) {
  step_column_.push_back(step.step);
  wall_column_.push_back(Ordered64(step.wall_time));
  partial_column_.push_back(uint64_t{step.partial});
  ranks_column_.push_back(uint64_t{step.ranks_reported});
  dropped_column_.push_back(step.client_dropped_steps);
  last_wall_time_ = step.wall_time;
  for (size_t j = 0; j < step.values.size(); ++j) {
    const uint32_t column = ColumnOf(step.values[j].id);
    if (in_column_order_ && column != j) {
      // The values so far, this step's included, were each at their column's index.
      count_column_.push_back(j);
      SpellOutColumns();
      count_column_.pop_back();
      in_column_order_ = false;
    }
    if (!in_column_order_) value_columns_.push_back(column);
    values_.push_back(step.values[j].value);
  }
  count_column_.push_back(step.values.size());
}

void StepBlockEncoder::Reserve(size_t steps, size_t values) {
  for (auto* column :
       {&step_column_, &wall_column_, &partial_column_, &ranks_column_, &dropped_column_, &count_column_}) {
    column->reserve(steps);
  }
  values_.reserve(values);
}

void StepBlockEncoder::Clear() {
  for (auto* column :
       {&step_column_, &wall_column_, &partial_column_, &ranks_column_, &dropped_column_, &count_column_, &ids_}) {
    column->clear();
  }
  last_wall_time_ = 0;
  dense_column_.clear();
  sparse_column_.clear();
  values_.clear();
  value_columns_.clear();
  in_column_order_ = true;
}

void StepBlockEncoder::Finish(std::string& out) {
  const size_t begin = out.size();
  EncodeBody(out);
  const uint32_t crc = Crc32c(std::string_view(out).substr(begin));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
}

void StepBlockEncoder::EncodeBody(std::string& out) {
  const size_t n = steps();
  out.push_back(static_cast<char>(kBlockVersion));
  PutVarint(out, n);
  for (const auto* column :
       {&step_column_, &wall_column_, &partial_column_, &ranks_column_, &dropped_column_, &count_column_}) {
    EncodeInts(*column, out);
  }
  PutVarint(out, ids_.size());
  EncodeInts(ids_, out);
  // Full: every step holds every series once, in column order.
  bool full = in_column_order_;
  for (const uint64_t count : count_column_) full = full && count == ids_.size();
  out.push_back(static_cast<char>(full ? 0 : 1));
  ValueScratch scratch;
  if (full) {
    // Column c's values are every ids_.size()-th value from the cth. They are gathered a tile of
    // columns at a time, each step's part of the tile read in one run.
    constexpr size_t kTile = 256;
    const size_t columns = ids_.size();
    gathered_.resize(std::min(columns, kTile) * n);
    for (size_t tile = 0; tile < columns; tile += kTile) {
      const size_t width = std::min(kTile, columns - tile);
      for (size_t i = 0; i < n; ++i) {
        const double* row = values_.data() + i * columns + tile;
        for (size_t c = 0; c < width; ++c) gathered_[c * n + i] = row[c];
      }
      for (size_t c = 0; c < width; ++c) EncodeValues(gathered_.data() + c * n, n, scratch, out);
    }
    Clear();
    return;
  }
  if (in_column_order_) SpellOutColumns();
  ints_.assign(value_columns_.begin(), value_columns_.end());
  EncodeInts(ints_, out);
  // Each column's values, gathered in step order.
  start_.assign(ids_.size() + 1, 0);
  for (const uint32_t c : value_columns_) ++start_[c + 1];
  for (size_t c = 0; c < ids_.size(); ++c) start_[c + 1] += start_[c];
  gathered_.resize(values_.size());
  next_.assign(start_.begin(), start_.end() - 1);
  for (size_t k = 0; k < values_.size(); ++k) gathered_[next_[value_columns_[k]]++] = values_[k];
  for (size_t c = 0; c < ids_.size(); ++c) {
    EncodeValues(gathered_.data() + start_[c], start_[c + 1] - start_[c], scratch, out);
  }
  Clear();
}

void EncodeStepBlock(std::span<const CompletedStep> steps, std::string& out) {
  StepBlockEncoder encoder;
  for (const CompletedStep& step : steps) encoder.Add(step);
  encoder.Finish(out);
}

namespace {

// Checks the block's version and (version 2) its checksum; *body is the block without it.
Status CheckBlock(std::string_view data, std::string_view* body) {
  if (data.empty()) return Malformed("empty");
  if (static_cast<uint8_t>(data[0]) == kBlockVersion) {
    if (data.size() < 5) return Malformed("too short for its checksum");
    *body = data.substr(0, data.size() - 4);
    uint32_t stored = 0;
    for (int i = 0; i < 4; ++i) stored |= uint32_t{static_cast<uint8_t>(data[body->size() + i])} << (8 * i);
    if (Crc32c(*body) != stored) return Malformed("checksum mismatch: the block changed on disk");
    return Status::Ok();
  }
  if (static_cast<uint8_t>(data[0]) != kBlockVersionUnchecked) return Malformed("unknown version");
  *body = data;
  return Status::Ok();
}

}  // namespace

Status VerifyStepBlock(std::string_view data) {
  std::string_view body;
  return CheckBlock(data, &body);
}

Status DecodeStepBlock(std::string_view data, std::vector<CompletedStep>& out) {
  if (Status s = CheckBlock(data, &data); !s.ok()) return s;
  Reader in(data);
  uint8_t version = 0;
  if (!in.Byte(&version)) return Malformed("empty");
  uint64_t n = 0;
  if (!in.Varint(&n) || n == 0 || n > kMaxBlockSteps) return Malformed("bad step count");
  out.resize(n);
  std::vector<uint64_t> ints;
  if (!in.Ints(n, ints)) return Malformed("bad step column");
  for (size_t i = 0; i < n; ++i) out[i].step = ints[i];
  if (!in.Ints(n, ints)) return Malformed("bad wall time column");
  for (size_t i = 0; i < n; ++i) out[i].wall_time = FromOrdered64(ints[i]);
  if (!in.Ints(n, ints)) return Malformed("bad partial column");
  for (size_t i = 0; i < n; ++i) {
    if (ints[i] > 1) return Malformed("bad partial flag");
    out[i].partial = ints[i] != 0;
  }
  if (!in.Ints(n, ints)) return Malformed("bad ranks column");
  for (size_t i = 0; i < n; ++i) {
    if (ints[i] > std::numeric_limits<uint32_t>::max()) return Malformed("bad rank count");
    out[i].ranks_reported = static_cast<uint32_t>(ints[i]);
  }
  if (!in.Ints(n, ints)) return Malformed("bad dropped column");
  for (size_t i = 0; i < n; ++i) out[i].client_dropped_steps = ints[i];
  std::vector<uint64_t> counts;
  if (!in.Ints(n, counts)) return Malformed("bad value count column");
  size_t total = 0;
  for (uint64_t c : counts) {
    if (c > kMaxBlockValues - total) return Malformed("too many values");
    total += c;
  }
  uint64_t column_count = 0;
  if (!in.Varint(&column_count) || column_count > total) return Malformed("bad series count");
  std::vector<uint64_t> ids;
  if (!in.Ints(column_count, ids)) return Malformed("bad series ids");
  for (uint64_t id : ids) {
    if (id > std::numeric_limits<SeriesId>::max()) return Malformed("bad series id");
  }
  uint8_t layout = 0;
  if (!in.Byte(&layout) || layout > 1) return Malformed("bad layout");
  std::vector<uint64_t> value_columns;
  std::vector<size_t> lengths(column_count, 0);
  if (layout == 0) {
    for (uint64_t c : counts) {
      if (c != column_count) return Malformed("a step of a full block lacks series");
    }
    for (size_t& l : lengths) l = n;
  } else {
    if (!in.Ints(total, value_columns)) return Malformed("bad layout column");
    for (uint64_t c : value_columns) {
      if (c >= column_count) return Malformed("bad column index");
      ++lengths[c];
    }
  }
  // Every column's values, decoded into one array at the column's offset.
  std::vector<size_t> start(column_count + 1, 0);
  for (size_t c = 0; c < column_count; ++c) start[c + 1] = start[c] + lengths[c];
  std::vector<double> values(total);
  for (size_t c = 0; c < column_count; ++c) {
    uint8_t kind = 0;
    if (lengths[c] == 0) continue;
    if (!in.Byte(&kind) || kind > static_cast<uint8_t>(ValueKind::kFloat64)) return Malformed("bad value kind");
    uint8_t exponent = 0;
    if (kind == static_cast<uint8_t>(ValueKind::kDecimal) && (!in.Byte(&exponent) || exponent > kMaxDecimalExponent)) {
      return Malformed("bad decimal exponent");
    }
    if (!in.Ints(lengths[c], ints)) return Malformed("bad value column");
    double* dst = values.data() + start[c];
    switch (static_cast<ValueKind>(kind)) {
      case ValueKind::kFloat32:
        for (size_t i = 0; i < lengths[c]; ++i) {
          if (ints[i] > std::numeric_limits<uint32_t>::max()) return Malformed("bad float32 value");
          dst[i] = static_cast<double>(std::bit_cast<float>(FromOrdered32(static_cast<uint32_t>(ints[i]))));
        }
        break;
      case ValueKind::kDecimal:
        for (size_t i = 0; i < lengths[c]; ++i) {
          dst[i] = static_cast<double>(static_cast<int64_t>(ints[i])) / kPow10[exponent];
        }
        break;
      case ValueKind::kFloat64:
        for (size_t i = 0; i < lengths[c]; ++i) dst[i] = FromOrdered64(ints[i]);
        break;
    }
  }
  if (!in.AtEnd()) return Malformed("trailing bytes");
  std::vector<size_t> next(start.begin(), start.end() - 1);
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    CompletedStep& s = out[i];
    s.values.resize(counts[i]);
    for (size_t j = 0; j < counts[i]; ++j, ++k) {
      const size_t c = layout == 0 ? j : static_cast<size_t>(value_columns[k]);
      s.values[j] = {static_cast<SeriesId>(ids[c]), values[next[c]++]};
    }
  }
  return Status::Ok();
}

}  // namespace gradwatch::store
