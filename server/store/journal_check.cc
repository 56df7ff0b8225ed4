#include "server/store/journal_check.h"

#include <bit>
#include <cstring>

#include <spdlog/spdlog.h>

#include "server/store/crc32c.h"
#include "server/store/sqlite.h"
#include "server/store/step_block.h"

namespace gradwatch::store {

namespace {

constexpr size_t kRowEntryBytes = 4 + 8;  // as the journal writes them

void AppendLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string StepRange(const DamagedSteps& d) {
  return d.first_step == d.last_step ? "step " + std::to_string(d.first_step)
                                     : "steps " + std::to_string(d.first_step) + "-" + std::to_string(d.last_step);
}

}  // namespace

uint32_t StepRowChecksum(std::string_view run_id, uint64_t step, double wall_time, bool partial,
                         uint32_t ranks_reported, uint64_t client_dropped, std::string_view vals) {
  std::string head;
  head.reserve(run_id.size() + 1 + 8 + 8 + 1 + 4 + 8);
  head.append(run_id);
  head.push_back('\0');
  AppendLe(head, step, 8);
  AppendLe(head, std::bit_cast<uint64_t>(wall_time), 8);
  head.push_back(partial ? 1 : 0);
  AppendLe(head, ranks_reported, 4);
  AppendLe(head, client_dropped, 8);
  return Crc32c(vals, Crc32c(head));
}

std::string StepRowDamage(std::string_view run_id, uint64_t step, double wall_time, bool partial,
                          uint32_t ranks_reported, uint64_t client_dropped, std::string_view vals,
                          const std::optional<int64_t>& crc) {
  if (crc && static_cast<uint64_t>(*crc) !=
                 StepRowChecksum(run_id, step, wall_time, partial, ranks_reported, client_dropped, vals)) {
    return "checksum mismatch: the row changed on disk";
  }
  if (vals.size() % kRowEntryBytes != 0) {
    return "its value blob of " + std::to_string(vals.size()) + " bytes is not a whole number of " +
           std::to_string(kRowEntryBytes) + "-byte entries";
  }
  return {};
}

bool DamageLog::Note(DamagedSteps damage) {
  MutexLock lock(&mu_);
  if (!seen_.emplace(damage.run_id, damage.first_step, damage.block).second) return false;
  (damage.block ? blocks_ : rows_) += 1;
  steps_ += damage.steps;
  spdlog::error("journal: run '{}': {} ({}) damaged, not served: {}", damage.run_id, StepRange(damage),
                damage.block ? "a sealed block of " + std::to_string(damage.steps) + " step(s)" : "a step row",
                damage.why);
  if (found_.size() < kMaxKept) found_.push_back(std::move(damage));
  return true;
}

std::vector<DamagedSteps> DamageLog::Found() const {
  MutexLock lock(&mu_);
  return found_;
}

uint64_t DamageLog::blocks() const {
  MutexLock lock(&mu_);
  return blocks_;
}

uint64_t DamageLog::rows() const {
  MutexLock lock(&mu_);
  return rows_;
}

uint64_t DamageLog::steps() const {
  MutexLock lock(&mu_);
  return steps_;
}

Status ScrubSteps(sqlite::Database& db, const std::string& schema, DamageLog& log) {
  const std::string what = "journal: checking the step blocks and rows of '" + db.path() + "'";
  {
    auto blocks = db.Prepare("SELECT run_id, first_step, last_step, steps, data FROM " + schema + ".step_blocks");
    if (!blocks.ok()) return blocks.status();
    sqlite::Query q(*blocks);
    Status s;
    while (q.Next(&s, what)) {
      if (Status v = VerifyStepBlock(q.Blob(4)); !v.ok()) {
        log.Note({.run_id = q.Text(0),
                  .first_step = q.Unsigned(1),
                  .last_step = q.Unsigned(2),
                  .steps = q.Unsigned(3),
                  .block = true,
                  .why = v.message()});
      }
    }
    if (!s.ok()) return s;
  }
  // A journal of version 4 or older (read by --repair before it is migrated) has no crc column.
  bool has_crc = false;
  {
    auto columns = db.Prepare("PRAGMA " + schema + ".table_info(steps)");
    if (!columns.ok()) return columns.status();
    sqlite::Query q(*columns);
    Status s;
    while (q.Next(&s, what)) has_crc = has_crc || q.Text(1) == "crc";
    if (!s.ok()) return s;
  }
  auto rows =
      db.Prepare(std::string("SELECT run_id, step, wall_time, partial, ranks_reported, client_dropped, vals, ") +
                 (has_crc ? "crc" : "NULL") + " FROM " + schema + ".steps");
  if (!rows.ok()) return rows.status();
  sqlite::Query q(*rows);
  Status s;
  while (q.Next(&s, what)) {
    const std::string run_id = q.Text(0);
    const uint64_t step = q.Unsigned(1);
    std::string why =
        StepRowDamage(run_id, step, q.Real(2), q.Int(3) != 0, static_cast<uint32_t>(q.Int(4)), q.Unsigned(5), q.Blob(6),
                      q.IsNull(7) ? std::nullopt : std::optional<int64_t>(q.Int(7)));
    if (!why.empty()) {
      log.Note({.run_id = run_id, .first_step = step, .last_step = step, .steps = 1, .why = std::move(why)});
    }
  }
  return s;
}

}  // namespace gradwatch::store
