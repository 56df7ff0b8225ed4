// StepSealer (journal_internal.h): a journal's step rows sealed into compressed blocks, and split
// again at a rewind.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "server/store/journal_internal.h"

namespace gradwatch::store::journal_internal {

Status StepSealer::NoteStep(Statements& st, const std::string& run_id, uint64_t step) {
  auto [it, first] = state_.try_emplace(run_id);
  RunState& state = it->second;
  const std::string what = "journal: counting the step rows of run '" + run_id + "'";
  if (first) {
    // The row just written is counted by the query.
    {
      sqlite::Query use(st.last_block);
      use.Bind(1, run_id);
      Status s;
      if (use.Next(&s, what) && !use.IsNull(0)) state.sealed = true, state.sealed_through = use.Unsigned(0);
      if (!s.ok()) return s;
    }
    sqlite::Query use(st.count_raw_after);
    use.Bind(1, run_id);
    use.Bind(2, state.sealed ? static_cast<int64_t>(state.sealed_through) : int64_t{-1});
    Status s;
    if (use.Next(&s, what)) state.raw_after = use.Unsigned(0);
    if (!s.ok()) return s;
  } else if (!state.sealed || step > state.sealed_through) {
    ++state.raw_after;
  }
  if (state.raw_after >= block_steps_ && !state.due) {
    state.due = true;
    due_.push_back(run_id);
  }
  return Status::Ok();
}

Status StepSealer::SealDue(Statements& st) {
  constexpr int kMaxBlocksPerRound = 2;
  int blocks = 0;
  Status status;
  std::vector<std::string> still_due;
  for (const std::string& run_id : due_) {
    auto it = state_.find(run_id);
    if (it == state_.end()) continue;  // rewound or pruned meanwhile
    RunState& state = it->second;
    while (status.ok() && blocks < kMaxBlocksPerRound && state.raw_after >= block_steps_) {
      status = SealRun(st, run_id);
      ++blocks;
    }
    state.due = status.ok() && state.raw_after >= block_steps_;
    if (state.due) still_due.push_back(run_id);
  }
  due_ = std::move(still_due);
  return status;
}

Status StepSealer::InsertBlock(Statements& st, const std::string& run_id, StepBlockEncoder& block,
                               const std::string& what) {
  sqlite::Query use(st.insert_block);
  use.Bind(1, run_id);
  use.Bind(2, block.first_step());
  use.Bind(3, block.last_step());
  use.Bind(4, static_cast<int64_t>(block.steps()));
  use.Bind(5, block.last_wall_time());
  std::string& blob = st.scratch;
  blob.clear();
  block.Finish(blob);
  use.BindBlob(6, blob);
  return use.Run(what);
}

Status StepSealer::SealRun(Statements& st, const std::string& run_id) {
  RunState& state = state_[run_id];
  const std::string what = "journal: sealing a block of run '" + run_id + "'";
  // The rows go into the block one by one: only the block's values are held, not the rows.
  StepBlockEncoder& block = st.block;
  block.Clear();
  uint64_t rows = 0, first_row = 0, last_row = 0;  // rows read, damaged ones included
  {
    sqlite::Query use(st.raw_after);
    use.Bind(1, run_id);
    use.Bind(2, state.sealed ? static_cast<int64_t>(state.sealed_through) : int64_t{-1});
    use.Bind(3, static_cast<int64_t>(block_steps_));
    Status s;
    bool full = false;  // by its values, before block_steps steps
    while (!full && use.Next(&s, what)) {
      std::string why = ReadStepRow(use, run_id, st.row);
      if (rows == 0) first_row = st.row.step;
      last_row = st.row.step;
      ++rows;
      if (!why.empty()) {
        // Lost either way: the block leaves it out, and its row goes with the others.
        damage_.Note(RowDamage(run_id, st.row.step, std::move(why) + " (left out of its block)"));
        continue;
      }
      if (block.empty()) {
        // Room for the block at the first row's size: it ends at block_steps rows, or at the row
        // that takes it to kSealMaxValues.
        const size_t row_values = st.row.values.size();
        const size_t by_steps = row_values * block_steps_;
        block.Reserve(block_steps_, std::min(by_steps, kSealMaxValues - 1 + row_values));
      }
      block.Add(st.row);
      full = block.values() >= kSealMaxValues;
    }
    if (!s.ok()) return s;
    if (!full && rows < block_steps_) {
      state.raw_after = rows;  // the count was high (a rolled-back commit)
      return Status::Ok();
    }
  }
  if (!block.empty()) {
    if (Status s = InsertBlock(st, run_id, block, what); !s.ok()) return s;
  }
  {
    sqlite::Query use(st.delete_raw);
    use.Bind(1, run_id);
    use.Bind(2, first_row);
    use.Bind(3, last_row);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  const uint64_t last_step = last_row;
  const uint64_t steps = rows;
  state.sealed = true;
  state.sealed_through = last_step;
  state.raw_after -= std::min<uint64_t>(state.raw_after, steps);
  return Status::Ok();
}

Status StepSealer::SplitBlocks(Statements& st, const std::string& run_id, uint64_t from_step, int64_t branch) {
  state_.erase(run_id);  // learnt again at the run's next step
  const std::string what = "journal: rewinding the blocks of run '" + run_id + "'";
  struct Block {
    uint64_t first_step, last_step, steps;
    std::string data;
  };
  std::vector<Block> blocks;
  {
    sqlite::Query use(st.blocks_from);
    use.Bind(1, run_id);
    use.Bind(2, StepBound(from_step));
    Status s;
    while (use.Next(&s, what)) {
      blocks.push_back({use.Unsigned(0), use.Unsigned(2), use.Unsigned(3), std::string(use.Blob(1))});
    }
    if (!s.ok()) return s;
  }
  std::vector<CompletedStep> decoded;
  StepBlockEncoder& kept = st.block;
  for (const Block& b : blocks) {
    {
      sqlite::Query use(st.delete_block);
      use.Bind(1, run_id);
      use.Bind(2, b.first_step);
      if (Status s = use.Run(what); !s.ok()) return s;
    }
    if (Status s = DecodeStepBlock(b.data, decoded); !s.ok()) {
      // Its steps are lost either way; refusing the rewind would stop every later commit.
      damage_.Note({.run_id = run_id,
                    .first_step = b.first_step,
                    .last_step = b.last_step,
                    .steps = b.steps,
                    .block = true,
                    .why = s.message() + " (dropped by a rewind to step " + std::to_string(from_step) + ")"});
      continue;
    }
    kept.Clear();
    for (const CompletedStep& step : decoded) {
      if (step.step < from_step) {
        kept.Add(step);
        continue;
      }
      EncodeValues(step.values, st.scratch);
      sqlite::Query use(st.insert_abandoned_step);
      use.Bind(1, run_id);
      use.Bind(2, branch);
      use.Bind(3, step.step);
      use.Bind(4, step.wall_time);
      use.Bind(5, step.partial ? 1 : 0);
      use.Bind(6, step.ranks_reported);
      use.Bind(7, step.client_dropped_steps);
      use.BindBlob(8, st.scratch);
      use.Bind(9, StepRowChecksum(run_id, step.step, step.wall_time, step.partial, step.ranks_reported,
                                  step.client_dropped_steps, st.scratch));
      if (Status s = use.Run(what); !s.ok()) return s;
    }
    if (kept.empty()) continue;
    if (Status s = InsertBlock(st, run_id, kept, what); !s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace gradwatch::store::journal_internal
