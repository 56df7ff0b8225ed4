// The journal's compressed block of steps: K consecutive completed steps of one run, stored
// column by column, exactly lossless (every value, NaN payloads, infinities and -0.0 included,
// decodes to the same bits; the values of each step come back in the order they were given).
//
// Layout (all integers little-endian varints unless said otherwise):
//   version byte (2; blocks of version 1, written before the checksum, are read unverified),
//   step count,
//   five integer columns, one entry per step: step, wall time (the double's ordered bits),
//     partial, ranks reported, client-dropped steps;
//   an integer column of each step's value count;
//   the series columns: their count, an integer column of their series ids (first appearance);
//   the layout: a byte 0 when every step holds every series once in column order (the usual case),
//     else 1 and an integer column of the column index of each value, in step order;
//   per series column, its values in step order: a kind byte and an integer column of
//     - kFloat32: the ordered bits of the value as a float32 (a trainer's float32 norm widened to
//       double: its 29 low mantissa bits are zero, so 32 bits say everything);
//     - kDecimal: a decimal exponent p ≤ 22 byte, then m where value == m / 10^p exactly (text
//       with a few significant digits, as W&B JSONL logs: m / 10^p is one correctly rounded
//       division of two exact doubles, so it gives back the very double strtod made);
//     - kFloat64: the ordered bits of the double (any value; the fallback).
//     The encoder tries each kind that represents every value of the column exactly and keeps the
//     shortest.
//   and last, the CRC-32C of every byte before it (4 bytes, little-endian): a block changed on
//   disk is refused ("checksum mismatch"), never read as other values.
// An integer column of n values is stored as one of three frames, whichever is shortest:
// frame of reference (min, then value − min), first differences (first value, then the
// differences − their min) or second differences, each packed at the bit width of its largest
// entry. A slowly drifting or noisy series costs about the bits of its step-to-step change: a
// float32 norm with 1 % noise about 18 bits, a counter or a steady clock 0-2 bits.
// "Ordered bits" map a float's bits to an unsigned integer that grows with the value (negative
// values flipped), so that nearby values are nearby integers across zero too.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"

namespace gradwatch::store {

// Bounds of one block; the decoder refuses larger claims before allocating for them, so a damaged
// or hostile blob never makes it allocate more than about kMaxBlockValues × 16 bytes.
inline constexpr size_t kMaxBlockSteps = 1 << 16;
inline constexpr size_t kMaxBlockValues = 1 << 22;

// Builds a block from steps added one at a time (the journal's writer seals its step rows so,
// reading them one by one). It keeps each value once, 8 bytes, while every step holds the same
// series in the same order (a trainer's steps), 12 bytes otherwise, and no step: a block of
// kMaxBlockValues values built from whole CompletedSteps (16 bytes a value) and transposed took
// 28 bytes a value. Buffers are kept from block to block. Not thread-safe.
class StepBlockEncoder {
 public:
  // Adds the block's next step (its fields and values are copied).
  void Add(const CompletedStep& step);
  // Makes room for `steps` steps of `values` values in all, so that adding them allocates nothing
  // (a block grown value by value would double its buffer past what it needs).
  void Reserve(size_t steps, size_t values);

  size_t steps() const { return step_column_.size(); }
  size_t values() const { return values_.size(); }
  bool empty() const { return steps() == 0; }
  // Of the steps added; require !empty().
  uint64_t first_step() const { return step_column_.front(); }
  uint64_t last_step() const { return step_column_.back(); }
  double last_wall_time() const { return last_wall_time_; }

  // Appends the encoding of the steps added (1 ≤ steps ≤ kMaxBlockSteps, at most kMaxBlockValues
  // values in all) to `out`, then empties the encoder.
  void Finish(std::string& out);
  // Empties the encoder, keeping its buffers.
  void Clear();

 private:
  // Finish without the checksum.
  void EncodeBody(std::string& out);
  // The column of series `id`, given it a new column (first appearance order) if it has none.
  uint32_t ColumnOf(SeriesId id);
  // Writes the column of every value added so far, each step's values having been in column order.
  void SpellOutColumns();

  // One entry per step.
  std::vector<uint64_t> step_column_, wall_column_, partial_column_, ranks_column_, dropped_column_, count_column_;
  double last_wall_time_ = 0;
  // Series columns: their ids in order of first appearance; a column looked up by id in an array
  // while ids stay near the values' count (a run's ids are dense), in a map beyond it.
  std::vector<uint64_t> ids_;
  std::vector<uint32_t> dense_column_;
  std::unordered_map<SeriesId, uint32_t> sparse_column_;
  // Every value, in step order; and, once a value was not at its column's index in its step,
  // every value's column (empty until then).
  std::vector<double> values_;
  std::vector<uint32_t> value_columns_;
  bool in_column_order_ = true;
  // Scratch for Finish.
  std::vector<uint64_t> ints_;
  std::vector<double> gathered_;
  std::vector<size_t> start_, next_;
};

// Appends the encoding of `steps` (1 ≤ size ≤ kMaxBlockSteps, at most kMaxBlockValues values in
// all) to `out`: StepBlockEncoder over them.
void EncodeStepBlock(std::span<const CompletedStep> steps, std::string& out);

// Decodes a block into `out` (replaced). Internal on anything malformed (a damaged row): never reads outside `data`,
// never allocates beyond the bounds above.
Status DecodeStepBlock(std::string_view data, std::vector<CompletedStep>& out);

// Checks a block's version and checksum without decoding it (a start-up scrub reads every block
// this way). Version 1 blocks, written before the checksum, pass unverified.
Status VerifyStepBlock(std::string_view data);

}  // namespace gradwatch::store
