#include "server/runs/step_assembler.h"

#include <algorithm>

namespace gradwatch::runs {

void PendingStep::Reset(uint64_t new_step, SteadyTime now, uint32_t world_size, size_t param_count) {
  step = new_step;
  first_seen = now;
  wall_time = 0;
  ranks_reported = 0;
  partial = false;
  world = world_size;
  rank_bits.clear();
  contributors.clear();
  total_grad = {};
  loss_sum = z_loss_sum = lr_sum = 0;
  loss_n = z_loss_n = lr_n = 0;
  tokens_sum = 0;
  tokens_present = false;
  param_sq.assign(param_count * kNormFields, 0.0L);
  param_present.assign(param_count * kNormFields, 0);
  radial_any = false;
  extra_used = 0;
  client_dropped_steps = 0;
}

void PendingStep::Accumulate(uint32_t rank, const RankStep& r) {
  ++ranks_reported;
  contributors.emplace_back(rank, r.seq);
  if (rank_bits.empty() && contributors.size() > kSparseRanks) {
    rank_bits.assign((static_cast<size_t>(world) + 63) / 64, 0);
    for (const auto& [seen, seq] : contributors) rank_bits[seen / 64] |= uint64_t{1} << (seen % 64);
  } else if (!rank_bits.empty()) {
    rank_bits[rank / 64] |= uint64_t{1} << (rank % 64);
  }
  wall_time = std::max(wall_time, r.wall_time);
  if (r.total_grad.present) {
    total_grad.present = true;
    total_grad.sq += r.total_grad.sq;
  }
  if (r.loss) loss_sum += *r.loss, ++loss_n;
  if (r.z_loss) z_loss_sum += *r.z_loss, ++z_loss_n;
  if (r.learning_rate) lr_sum += *r.learning_rate, ++lr_n;
  if (r.tokens) tokens_sum += *r.tokens, tokens_present = true;
  for (const ParamContribution& pc : r.params) {
    const size_t base = static_cast<size_t>(pc.index) * kNormFields;
    if (base + kNormFields > param_sq.size()) {  // the catalog grew after this step started
      param_sq.resize(base + kNormFields, 0.0L);
      param_present.resize(base + kNormFields, 0);
    }
    for (int f = 0; f < kNormFields; ++f) {
      if (!pc.norms[f].present) continue;
      param_sq[base + f] += pc.norms[f].sq;
      param_present[base + f] = 1;
    }
    if (!pc.radial.present()) continue;
    if (!radial_any) {
      radial.assign(param_sq.size() / kNormFields, Radial{});
      radial_any = true;
    }
    if (pc.index >= radial.size()) radial.resize(pc.index + 1);
    Radial& r = radial[pc.index];
    r.present = true;
    if (pc.radial.form == RadialContribution::Form::kDot) {
      r.dot += pc.radial.value;
      r.has_dot = true;
    } else {
      r.radial += pc.radial.value;
    }
  }
  for (const auto& [key, value] : r.extra) {
    auto it = std::find_if(extra.begin(), extra.begin() + extra_used,
                           [&key = key](const Extra& e) { return e.key == key; });  // clang 14: no bare binding
    if (it == extra.begin() + extra_used) {
      if (extra_used == extra.size()) extra.emplace_back();
      it = extra.begin() + extra_used++;
      it->key = key;
      it->sum = 0;
      it->n = 0;
    }
    it->sum += value;
    ++it->n;
  }
  client_dropped_steps += r.client_dropped_steps;
}

StepAssembler::StepAssembler(uint32_t world_size, std::chrono::nanoseconds timeout, size_t max_pending)
    : world_size_(world_size), timeout_(timeout), max_pending_(std::max<size_t>(1, max_pending)) {}

void StepAssembler::RestoreLastCompleted(uint64_t step) {
  if (!has_completed_ || step > last_completed_step_) last_completed_step_ = step;
  has_completed_ = true;
}

bool StepAssembler::FullFor(uint64_t step) const {
  if (pending_.size() < max_pending_) return false;
  if (has_completed_ && step <= last_completed_step_) return false;
  for (auto it = pending_.rbegin(); it != pending_.rend() && (*it)->step >= step; ++it) {
    if ((*it)->step == step) return false;
  }
  return true;
}

PendingStep* StepAssembler::FindOrInsert(uint64_t step, SteadyTime now) {
  // Reports arrive nearly in order: search from the newest pending step.
  auto it = pending_.end();
  while (it != pending_.begin()) {
    auto prev = std::prev(it);
    if ((*prev)->step == step) return prev->get();
    if ((*prev)->step < step) break;
    it = prev;
  }
  std::unique_ptr<PendingStep> p;
  if (!free_.empty()) {
    p = std::move(free_.back());
    free_.pop_back();
  } else {
    p = std::make_unique<PendingStep>();
  }
  p->Reset(step, now, world_size_, param_count_);
  return pending_.insert(it, std::move(p))->get();
}

}  // namespace gradwatch::runs
