// Values of a step set aside to be applied later, a slice of ids at a time: runs::Run's points
// (to the store's series) and runs::RunAnalytics' slope samples (to the trackers). A large run's
// per-series state outgrows the caches; applied step by step, every value misses on its series'
// state. Set aside in kSetAsideSlices slices by id, with one slice applied at each step, in turn,
// every id takes kSetAsideSlices values at once while its state is cached, and each step does the
// same share of the work.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradwatch {

inline constexpr size_t kSetAsideSlices = 8;

struct SetAsideValue {
  uint32_t id;    // whose value (a series id, a catalog index)
  uint32_t slot;  // the step's slot in the owner's ring of kSetAsideSlices step numbers
  double value;
};

// One slice: the values of the ids i with i % kSetAsideSlices == the slice's index, in step order.
struct SetAsideSlice {
  std::vector<SetAsideValue> values;
  size_t steps = 0;  // steps since the slice was last applied (some may have set nothing aside here)

  // How to visit `values` so that each id takes its values in step order: `runs` runs of `each`
  // values, run i being values[i], values[i + stride], ... Id by id when every step set aside the
  // same ids in the same order (a trainer's steps do: its catalog's order); otherwise step by
  // step (a partial step, a key that comes and goes), each value a run of its own.
  struct Order {
    size_t runs = 0;
    size_t stride = 0;
    size_t each = 0;
  };
  Order ApplyOrder() const {
    if (values.empty() || steps == 0) return {values.size(), 0, 1};
    const size_t per_step = values.size() / steps;
    bool aligned = per_step * steps == values.size();
    for (size_t p = 0; aligned && p < per_step; ++p) {
      for (size_t k = 1; k < steps && aligned; ++k) aligned = values[k * per_step + p].id == values[p].id;
    }
    if (!aligned) return {values.size(), 0, 1};
    return {per_step, per_step, steps};
  }
  const SetAsideValue& At(const Order& order, size_t run, size_t k) const { return values[run + k * order.stride]; }
  void Clear() {
    values.clear();
    steps = 0;
  }
};

// The slices and the ring of the steps they hold. A value set aside at the step of slot s is
// applied no later than the step of sequence number seq + kSetAsideSlices - 1 (when its slice
// comes round), before slot s is reused.
struct SetAsideSlices {
  std::array<SetAsideSlice, kSetAsideSlices> slices;
  std::array<uint64_t, kSetAsideSlices> step_of_slot{};
  uint64_t seq = 0;  // steps begun

  // A step begins: its slot.
  uint32_t Begin(uint64_t step) {
    const auto slot = static_cast<uint32_t>(seq % kSetAsideSlices);
    step_of_slot[slot] = step;
    return slot;
  }
  void Add(uint32_t id, uint32_t slot, double value) {
    slices[id % kSetAsideSlices].values.push_back({id, slot, value});
  }
  // The step ends: the index of the slice to apply now.
  size_t End() {
    const size_t slot = seq % kSetAsideSlices;
    for (SetAsideSlice& s : slices) ++s.steps;
    ++seq;
    return slot;
  }

  // Feeds slice `slice`'s values to add(id, step, value), id by id in step order where the slice
  // allows (SetAsideSlice::ApplyOrder), and clears it. An owner whose per-id state is a chain of
  // cold lines fetches it in stages: prefetch(id, stage) is called for the id stage × lookahead
  // runs ahead, for each stage from `stages` down to 1, so that the misses of several ids overlap.
  template <typename Prefetch, typename Add>
  void Apply(size_t slice, size_t lookahead, size_t stages, Prefetch&& prefetch, Add&& add) {
    SetAsideSlice& s = slices[slice];
    const SetAsideSlice::Order order = s.ApplyOrder();
    for (size_t i = 0; i < order.runs; ++i) {
      for (size_t stage = stages; stage >= 1; --stage) {
        if (i + stage * lookahead < order.runs) prefetch(s.values[i + stage * lookahead].id, stage);
      }
      for (size_t k = 0; k < order.each; ++k) {
        const SetAsideValue& v = s.At(order, i, k);
        add(v.id, step_of_slot[v.slot], v.value);
      }
    }
    s.Clear();
  }
};

}  // namespace gradwatch
