// The journal's compressed block of steps: K consecutive completed steps of one run, stored
// column by column, exactly lossless (every value, NaN payloads, infinities and -0.0 included,
// decodes to the same bits; the values of each step come back in the order they were given).
//
// Layout (all integers little-endian varints unless said otherwise):
//   version byte (1), step count,
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
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"

namespace gradwatch::store {

// Bounds of one block; the decoder refuses larger claims before allocating for them, so a damaged
// or hostile blob never makes it allocate more than about kMaxBlockValues × 16 bytes.
inline constexpr size_t kMaxBlockSteps = 1 << 16;
inline constexpr size_t kMaxBlockValues = 1 << 22;

// Appends the encoding of `steps` (1 ≤ size ≤ kMaxBlockSteps, at most kMaxBlockValues values in
// all) to `out`.
void EncodeStepBlock(std::span<const CompletedStep> steps, std::string& out);

// Decodes a block into `out` (replaced). Internal on anything malformed (a damaged row): never reads outside `data`,
// never allocates beyond the bounds above.
Status DecodeStepBlock(std::string_view data, std::vector<CompletedStep>& out);

}  // namespace gradwatch::store
