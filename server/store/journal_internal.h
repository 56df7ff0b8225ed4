// What the journal's rooms share, and no one else: the on-disk format's codecs and the reading of
// step rows and blocks (journal_format.cc), the prepared statements, the StepSealer
// (journal_sealer.cc) and the connection. The rooms: journal.cc, the commit queue, its writer
// thread and what a commit applies (rewinds included); journal_open.cc, opening, salvage, repair
// and the rebuild of lost files; journal_load.cc, reading runs back; journal_prune.cc, pruning
// ended runs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"
#include "server/store/journal.h"
#include "server/store/journal_check.h"
#include "server/store/sqlite.h"
#include "server/store/step_block.h"

namespace gradwatch::store {
namespace journal_internal {

// A block holds at most this many values, whatever block_steps says (the decoder's bound is 4×).
inline constexpr size_t kSealMaxValues = size_t{1} << 20;
// A larger catalog index can only come from corruption; refuse it rather than allocate for it.
inline constexpr int64_t kMaxParamIndex = 1 << 24;

// The journal's schema, with the migrations of older versions (sqlite::ApplySchema sets
// user_version).
const sqlite::Schema& JournalSchema();

// A step's value blob: (uint32 series id, float64 value) pairs, little-endian. Bit copies, never
// arithmetic, so NaN payloads and infinities survive exactly. Decode fails on a torn blob.
void EncodeValues(const std::vector<SeriesValue>& values, std::string& out);
bool DecodeValues(std::string_view blob, std::vector<SeriesValue>& out);

// A run's labels and config as the runs table holds them (JSON). Encoding never fails (invalid
// UTF-8 is replaced, an error logged and "{}" written); parsing says which run's row is bad.
std::string LabelsJson(const std::map<std::string, std::string>& labels);
std::string ConfigJson(const RunConfig& config);
Status ParseLabels(const std::string& text, const std::string& run_id, std::map<std::string, std::string>& out);
Status ParseConfig(const std::string& text, const std::string& run_id, RunConfig& out);

// One row of `SELECT step, wall_time, partial, ranks_reported, client_dropped, vals, crc FROM
// steps`. Returns why the row is damaged (StepRowDamage), empty when `step` holds it.
std::string ReadStepRow(sqlite::Query& row, const std::string& run_id, CompletedStep& step);
DamagedSteps RowDamage(const std::string& run_id, uint64_t step, std::string why);
// A step as the signed 64-bit column holds it (clamped to 2^63 - 1).
int64_t StepBound(uint64_t step);
// The last step below `before_step`, for a `step <= ?` bound: the column is a signed 64-bit
// integer, so "below 2^64 - 1" must read as "at most 2^63 - 1", the largest step kept, not as a
// `step < 2^63 - 1` that would leave that step out. -1 (nothing) below 0.
int64_t LastStepBefore(uint64_t before_step);

// Hands on_step the run's steps below before_step in step order: its blocks (`blocks`: SELECT
// first_step, last_step, steps, data ... WHERE run_id = ?1 AND first_step <= ?2 ORDER BY
// first_step) merged with its step rows (`rows`: as ReadStepRow reads them, WHERE run_id = ?1 AND
// step <= ?2 ORDER BY step), ?2 being LastStepBefore(before_step). A step in both (a row rewritten
// after its block was sealed, which only a late out-of-order step does) is taken from its row, the
// later write. A damaged block or row is noted in `damage` and skipped: the rest is read.
Status VisitSteps(sqlite::Statement& blocks, sqlite::Statement& rows, const std::string& run_id, uint64_t from_step,
                  uint64_t before_step, DamageLog& damage, const std::function<void(const CompletedStep&)>& on_step);

// The journal's prepared statements: made once at open, reused by every commit.
struct Statements {
  sqlite::Statement insert_run, insert_param, insert_series, insert_step, upsert_progress, insert_event, end_run;
  sqlite::Statement count_rewinds, insert_rewind, abandon_steps, delete_steps, abandon_events, delete_events,
      rewind_progress, drop_progress, set_world_size;
  sqlite::Statement prune_candidates, prune_steps, prune_events, prune_series, prune_params, prune_progress, prune_run,
      prune_rewinds, prune_abandoned_steps, prune_abandoned_events, prune_blocks, prune_old_branch_steps,
      prune_old_branch_events;
  sqlite::Statement last_block, count_raw_after, raw_after, insert_block, delete_raw, blocks_from, delete_block,
      insert_abandoned_step;
  std::string scratch;  // the value blob being written; reused to spare allocations
  // A block being sealed, and the step row read into it: reused from block to block.
  StepBlockEncoder block;
  CompletedStep row;

  Status PrepareAll(sqlite::Database& db);  // journal_format.cc
};

// Sealing one journal's step rows into compressed blocks (step_block.h): which runs have
// block_steps rows past their last block (learnt from the database at a run's first step since
// open, then counted as rows are written; an over-count, from a rolled-back commit, only costs a
// seal that finds too few) and the sealing itself, and the split of a run's blocks at a rewind.
// Every call runs inside the caller's transaction. Not thread-safe: the Journal holds it under
// its connection's lock.
class StepSealer {
 public:
  StepSealer(size_t block_steps, DamageLog& damage) : block_steps_(block_steps), damage_(damage) {}

  // Counts a step row just written toward its run's next block.
  Status NoteStep(Statements& st, const std::string& run_id, uint64_t step);
  bool any_due() const { return !due_.empty(); }
  // Seals the runs due a block, a few blocks per call, so that commits wait for little (a run far
  // behind, from a migrated journal, takes several calls). The runs still due stay due.
  Status SealDue(Statements& st);
  // The run's blocks from `from_step` on, at a rewind: their steps before it become a smaller
  // block, the others rows of the abandoned `branch`.
  Status SplitBlocks(Statements& st, const std::string& run_id, uint64_t from_step, int64_t branch);
  // Forgets a run's counts (pruned, rewound), or every run's (a failed seal): learnt again from the
  // database at the run's next step.
  void Forget(const std::string& run_id) { state_.erase(run_id); }
  void ForgetAll() {
    state_.clear();
    due_.clear();
  }

 private:
  struct RunState {
    bool sealed = false;          // steps at or below sealed_through are in blocks
    uint64_t sealed_through = 0;  // valid when sealed
    uint64_t raw_after = 0;       // step rows above it
    bool due = false;             // listed in due_
  };
  // One block of the run's oldest rows past its last block.
  Status SealRun(Statements& st, const std::string& run_id);
  // Encodes the steps added to `block` (one run's, in step order, at least one) into a block row;
  // `block` is emptied.
  Status InsertBlock(Statements& st, const std::string& run_id, StepBlockEncoder& block, const std::string& what);

  const size_t block_steps_;
  DamageLog& damage_;
  std::map<std::string, RunState> state_;
  std::vector<std::string> due_;
};

// Pruning one journal, a transaction at a time: the abandoned branches rewound before the cutoff
// first (of any run), then, run by run, the rows of runs that ended before it and are not held,
// table by table and at most max_rows per transaction (a block counts as block_steps rows), the
// runs row last, so that a run half pruned stays listed (and LoadRun finishes it) rather than
// leaving orphans. Not thread-safe: the Journal holds it under its connection's lock.
class RunPruner {
 public:
  explicit RunPruner(size_t block_steps) : block_rows_(std::max<size_t>(block_steps, 1)) {}

  struct Batch {
    uint64_t rows = 0;          // rows deleted (blocks counted as block_steps rows)
    std::string pruned_run;     // a run whose last rows went in this batch
    bool nothing_left = false;  // no branch nor run left to prune before this cutoff
  };
  // One transaction of at most max_rows rows; is_held(run) says which runs must stay.
  Status PruneBatch(sqlite::Database& db, Statements& st, double cutoff, size_t max_rows,
                    const std::function<bool(const std::string&)>& is_held, Batch& out);
  // The run being pruned, empty between runs.
  const std::string& pruning_run() const { return pruning_run_; }

 private:
  const size_t block_rows_;
  std::string pruning_run_;
};

}  // namespace journal_internal

// An open connection with its statements, and the identity (device, inode) of the files it
// opened. Closes on destruction; one whose files must stay as they are (damaged, or lost) is
// closed without the checkpoint SQLite makes at close, which would also delete the WAL by name.
struct Journal::Connection {
  sqlite::Database db;
  std::unique_ptr<journal_internal::Statements> statements;
  uint64_t db_dev = 0, db_ino = 0, wal_dev = 0, wal_ino = 0;
  bool keep_files = true;  // until it opened cleanly

  Connection() = default;
  Connection(Connection&& o) noexcept { *this = std::move(o); }
  Connection& operator=(Connection&& o) noexcept {
    Close();
    db = std::move(o.db);
    statements = std::move(o.statements);
    db_dev = o.db_dev, db_ino = o.db_ino, wal_dev = o.wal_dev, wal_ino = o.wal_ino;
    keep_files = o.keep_files;
    return *this;
  }
  ~Connection() { Close(); }

  void Close() {
    statements.reset();  // a connection with live statements cannot close
    if (keep_files) db.SkipCheckpointOnClose();
    db.Close();
  }
};

}  // namespace gradwatch::store
