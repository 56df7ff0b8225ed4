// Damage to the journal's step data that SQLite cannot see: PRAGMA quick_check checks the file's
// structure, not what the rows hold, so a flipped byte inside a value is served as another value.
// Every step row carries a CRC-32C of its fields (StepRowChecksum) and every sealed block one of
// its bytes (step_block.h); this checks them and keeps the account of what failed: which run,
// which steps, a block or a row, and why. A damaged block or row is never served: its steps are
// reported and skipped, and the rest of the run is read.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace gradwatch::store::sqlite {
class Database;
}

namespace gradwatch::store {

// The CRC-32C of a step row's fields (the run, the step, its time, flags and value blob), stored
// in the row's crc column. Rows written before the column (journal version 4 and older) have
// NULL there and are read unverified.
uint32_t StepRowChecksum(std::string_view run_id, uint64_t step, double wall_time, bool partial,
                         uint32_t ranks_reported, uint64_t client_dropped, std::string_view vals);

// Why a step row is damaged, or empty when it is intact: its checksum (`crc`, when not NULL)
// does not match its fields, or its value blob is not a whole number of 12-byte entries.
std::string StepRowDamage(std::string_view run_id, uint64_t step, double wall_time, bool partial,
                          uint32_t ranks_reported, uint64_t client_dropped, std::string_view vals,
                          const std::optional<int64_t>& crc);

// Steps of a run that the journal holds but cannot serve.
struct DamagedSteps {
  std::string run_id;
  uint64_t first_step = 0, last_step = 0;
  uint64_t steps = 0;  // how many steps the block or row held (as its own columns say)
  bool block = false;  // a sealed block; else one step row
  std::string why;
};

// The damage found since the journal opened, each block or row once however often it is read.
// Thread-safe.
class DamageLog {
 public:
  // Records damage and logs it (an error naming the run and steps); false, and nothing logged,
  // when it was recorded already.
  bool Note(DamagedSteps damage) EXCLUDES(mu_);
  // What was found, in the order found; at most kMaxKept entries (the counts go on).
  std::vector<DamagedSteps> Found() const EXCLUDES(mu_);
  uint64_t blocks() const EXCLUDES(mu_);
  uint64_t rows() const EXCLUDES(mu_);
  uint64_t steps() const EXCLUDES(mu_);  // steps the damaged blocks and rows held

  static constexpr size_t kMaxKept = 10000;

 private:
  mutable Mutex mu_;
  std::set<std::tuple<std::string, uint64_t, bool>> seen_ GUARDED_BY(mu_);  // (run, first step, block)
  std::vector<DamagedSteps> found_ GUARDED_BY(mu_);
  uint64_t blocks_ GUARDED_BY(mu_) = 0, rows_ GUARDED_BY(mu_) = 0, steps_ GUARDED_BY(mu_) = 0;
};

// Reads every step block and step row of the journal `db` (the `schema` database of the
// connection: "main", or an attached one) and checks their checksums without decoding them,
// noting the damage in `log`. Error only when the tables cannot be read (then SQLite's own
// damage: a page it calls corrupt).
Status ScrubSteps(sqlite::Database& db, const std::string& schema, DamageLog& log);

}  // namespace gradwatch::store
