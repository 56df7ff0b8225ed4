// Sealing a run's step rows into compressed blocks (step_block.h) after commits, and rewinds,
// which move a run's steps and events from the resume step on to its abandoned branch.
#include "server/store/journal_internal.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace gradwatch::store {

Status Journal::NoteStepLocked(const std::string& run_id, uint64_t step) {
  Statements& st = *statements_;
  auto [it, first] = seal_state_.try_emplace(run_id);
  SealState& state = it->second;
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
  if (state.raw_after >= options_.block_steps && !state.due) {
    state.due = true;
    seal_due_.push_back(run_id);
  }
  return Status::Ok();
}

void Journal::SealDue() {
  MutexLock db_lock(&db_mu_);
  if (seal_due_.empty() || !db_.is_open() || !CheckFilesLocked().ok()) return;
  // Not synced by itself: the next commit's fsync of the WAL covers these frames too, and losing
  // them loses nothing (the step rows they replace are still there).
  if (Status s = db_.Exec("PRAGMA synchronous=NORMAL"); !s.ok()) {
    spdlog::warn("journal '{}': sealing blocks: {}", options_.path, s.message());
    return;
  }
  Status status;
  {
    sqlite::Transaction txn(db_, "journal");
    status = txn.Begin(sqlite::Transaction::Mode::kImmediate);
    // A run far behind (a migrated journal) is sealed a few blocks per commit, so that commits
    // wait for little.
    constexpr int kMaxBlocksPerRound = 2;
    int blocks = 0;
    std::vector<std::string> still_due;
    for (const std::string& run_id : seal_due_) {
      auto it = seal_state_.find(run_id);
      if (it == seal_state_.end()) continue;  // rewound or pruned meanwhile
      SealState& state = it->second;
      while (status.ok() && blocks < kMaxBlocksPerRound && state.raw_after >= options_.block_steps) {
        status = SealRunLocked(run_id);
        ++blocks;
      }
      state.due = status.ok() && state.raw_after >= options_.block_steps;
      if (state.due) still_due.push_back(run_id);
    }
    if (status.ok()) status = txn.Commit();
    seal_due_ = std::move(still_due);
  }
  if (!status.ok()) {
    // The rows stay as they are; the runs' counts are learnt again at their next step.
    spdlog::warn("journal '{}': sealing blocks failed, the step rows stay: {}", options_.path, status.ToString());
    seal_state_.clear();
    seal_due_.clear();
  }
  if (Status s = db_.Exec("PRAGMA synchronous=FULL"); !s.ok()) {
    spdlog::error("journal '{}': restoring synchronous=FULL: {}", options_.path, s.message());
  }
}

Status Journal::InsertBlockLocked(const std::string& run_id, StepBlockEncoder& block, const std::string& what) {
  Statements& st = *statements_;
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

Status Journal::SealRunLocked(const std::string& run_id) {
  Statements& st = *statements_;
  SealState& state = seal_state_[run_id];
  const std::string what = "journal: sealing a block of run '" + run_id + "'";
  // The rows go into the block one by one: only the block's values are held, not the rows.
  StepBlockEncoder& block = st.block;
  block.Clear();
  uint64_t rows = 0, first_row = 0, last_row = 0;  // rows read, damaged ones included
  {
    sqlite::Query use(st.raw_after);
    use.Bind(1, run_id);
    use.Bind(2, state.sealed ? static_cast<int64_t>(state.sealed_through) : int64_t{-1});
    use.Bind(3, static_cast<int64_t>(options_.block_steps));
    Status s;
    bool full = false;  // by its values, before block_steps steps
    while (!full && use.Next(&s, what)) {
      std::string why = journal_internal::ReadStepRow(use, run_id, st.row);
      if (rows == 0) first_row = st.row.step;
      last_row = st.row.step;
      ++rows;
      if (!why.empty()) {
        // Lost either way: the block leaves it out, and its row goes with the others.
        damage_.Note(journal_internal::RowDamage(run_id, st.row.step, std::move(why) + " (left out of its block)"));
        continue;
      }
      if (block.empty()) {
        // Room for the block at the first row's size: it ends at block_steps rows, or at the row
        // that takes it to journal_internal::kSealMaxValues.
        const size_t row_values = st.row.values.size();
        const size_t by_steps = row_values * options_.block_steps;
        block.Reserve(options_.block_steps, std::min(by_steps, journal_internal::kSealMaxValues - 1 + row_values));
      }
      block.Add(st.row);
      full = block.values() >= journal_internal::kSealMaxValues;
    }
    if (!s.ok()) return s;
    if (!full && rows < options_.block_steps) {
      state.raw_after = rows;  // the count was high (a rolled-back commit)
      return Status::Ok();
    }
  }
  if (!block.empty()) {
    if (Status s = InsertBlockLocked(run_id, block, what); !s.ok()) return s;
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

Status Journal::SplitBlocksLocked(const std::string& run_id, uint64_t from_step, int64_t branch) {
  Statements& st = *statements_;
  seal_state_.erase(run_id);  // learnt again at the run's next step
  const std::string what = "journal: rewinding the blocks of run '" + run_id + "'";
  struct Block {
    uint64_t first_step, last_step, steps;
    std::string data;
  };
  std::vector<Block> blocks;
  {
    sqlite::Query use(st.blocks_from);
    use.Bind(1, run_id);
    use.Bind(2, journal_internal::StepBound(from_step));
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
      journal_internal::EncodeValues(step.values, st.scratch);
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
    if (Status s = InsertBlockLocked(run_id, kept, what); !s.ok()) return s;
  }
  return Status::Ok();
}

Status Journal::ApplyRewind(const RewindRecord& r) {
  Statements& st = *statements_;
  const std::string what = "journal: rewinding run '" + r.run_id + "' to step " + std::to_string(r.from_step);
  int64_t branch = 0;  // the branch that ends here
  {
    sqlite::Query use(st.count_rewinds);
    use.Bind(1, r.run_id);
    Status s;
    if (!use.Next(&s, what)) return s.ok() ? Status::Internal(what + ": count returned no row") : s;
    branch = use.Int(0);
  }
  {
    sqlite::Query use(st.insert_rewind);
    use.Bind(1, r.run_id);
    use.Bind(2, branch);
    use.Bind(3, r.from_step);
    use.Bind(4, r.world_size);
    use.Bind(5, r.rewound_at);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  if (Status s = SplitBlocksLocked(r.run_id, r.from_step, branch); !s.ok()) return s;
  for (sqlite::Statement* move : {&st.abandon_steps, &st.abandon_events}) {
    sqlite::Query use(*move);
    use.Bind(1, r.run_id);
    use.Bind(2, branch);
    use.Bind(3, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  for (sqlite::Statement* drop : {&st.delete_steps, &st.delete_events}) {
    sqlite::Query use(*drop);
    use.Bind(1, r.run_id);
    use.Bind(2, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  if (r.from_step > 0) {
    sqlite::Query use(st.rewind_progress);
    use.Bind(1, r.run_id);
    use.Bind(2, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  {
    // After the update only a rewind to step 0 leaves progress at or above from_step: none is kept.
    sqlite::Query use(st.drop_progress);
    use.Bind(1, r.run_id);
    use.Bind(2, r.world_size);
    use.Bind(3, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  sqlite::Query use(st.set_world_size);
  use.Bind(1, r.run_id);
  use.Bind(2, r.world_size);
  return use.Run(what);
}

}  // namespace gradwatch::store
