// Opening the journal and keeping its files: Open (with the WAL scan, quick_check, salvage of a
// damaged journal), Repair, the writer's check that its files are still the ones it opened and the
// rebuild when they are not, and the files' size.
#include "server/store/journal_internal.h"

#include "server/store/journal_salvage.h"

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

namespace {

using Clock = std::chrono::steady_clock;

// Big-endian 32-bit field of a WAL header or frame header.
uint32_t GetBe32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// SQLite's WAL checksum (https://www.sqlite.org/fileformat2.html#walformat): over 32-bit words
// in the byte order the header's magic names, continuing from (s0, s1).
void WalChecksum(const unsigned char* p, size_t bytes, bool big_endian, uint32_t& s0, uint32_t& s1) {
  auto word = [big_endian](const unsigned char* w) {
    return big_endian ? GetBe32(w)
                      : (uint32_t{w[3]} << 24) | (uint32_t{w[2]} << 16) | (uint32_t{w[1]} << 8) | uint32_t{w[0]};
  };
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    s0 += word(p + i) + s1;
    s1 += word(p + i + 4) + s0;
  }
}

// Reads the WAL as SQLite's recovery will, before SQLite opens it, to count what recovery drops:
// frames of the current WAL (matching salts) after the last valid commit frame.
void ScanWal(const std::string& wal_path, RecoveryReport& report) {
  FILE* f = std::fopen(wal_path.c_str(), "rb");
  if (f == nullptr) return;
  std::unique_ptr<FILE, int (*)(FILE*)> owned(f, std::fclose);
  unsigned char header[32];
  if (std::fread(header, 1, sizeof header, f) != sizeof header) return;
  const uint32_t magic = GetBe32(header);
  if ((magic & ~1u) != 0x377f0682u) return;  // not a WAL SQLite would recover from
  const bool big_endian = (magic & 1u) != 0;
  const uint32_t page_size = GetBe32(header + 8);
  if (page_size < 512 || page_size > 65536 || (page_size & (page_size - 1)) != 0) return;
  uint32_t s0 = 0, s1 = 0;
  WalChecksum(header, 24, big_endian, s0, s1);
  if (s0 != GetBe32(header + 24) || s1 != GetBe32(header + 28)) return;  // SQLite ignores the file
  std::vector<unsigned char> frame(24 + page_size);
  uint64_t valid = 0, committed = 0, after_commit = 0;
  bool broken = false;
  while (true) {
    const size_t got = std::fread(frame.data(), 1, frame.size(), f);
    if (got == 0) break;
    const bool same_salt = got >= 24 && std::memcmp(frame.data() + 8, header + 16, 8) == 0;
    if (!same_salt) break;  // a frame of an earlier WAL generation: stale, not lost
    if (got < frame.size()) {
      ++after_commit, report.corrupt_tail = true;  // torn frame
      break;
    }
    if (!broken) {
      uint32_t c0 = s0, c1 = s1;
      WalChecksum(frame.data(), 8, big_endian, c0, c1);
      WalChecksum(frame.data() + 24, page_size, big_endian, c0, c1);
      if (c0 == GetBe32(frame.data() + 16) && c1 == GetBe32(frame.data() + 20)) {
        s0 = c0, s1 = c1;
        ++valid;
        if (GetBe32(frame.data() + 4) != 0)
          committed = valid, after_commit = 0;
        else
          ++after_commit;
        continue;
      }
      broken = true;
      report.corrupt_tail = true;
    }
    ++after_commit;
  }
  report.discarded_frames = after_commit;
  if (after_commit > 0) {
    report.detail += std::to_string(after_commit) + " WAL frame(s) after the last good transaction (frame " +
                     std::to_string(committed) + ") are discarded" +
                     (report.corrupt_tail ? ": the tail is damaged (bad checksum or torn frame)"
                                          : ": a transaction that never committed") +
                     ". ";
  }
}

bool FileId(const std::string& path, uint64_t& dev, uint64_t& ino) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  dev = st.st_dev;
  ino = st.st_ino;
  return true;
}

void RemoveDatabaseFiles(const std::string& path) {
  std::error_code ec;
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix, ec);
}

}  // namespace

Status Journal::OpenConnection(const std::string& path, bool check, RecoveryReport& recovery, bool* damaged,
                               Connection& out) {
  *damaged = false;
  Connection conn;
  auto opened = sqlite::Database::Open(path, {.create = true, .uri = true});
  if (!opened.ok()) return Status(opened.status().code(), "journal: " + opened.status().message());
  conn.db = std::move(opened).value();
  sqlite::Database& db = conn.db;
  // Whether a failure was caused by the file's contents rather than the storage: asked at once.
  auto failed = [&](Status s) {
    *damaged = db.last_error_is_damage();
    return Status(s.code(), "journal: " + s.message());
  };
  // A new journal's pages are 16 KiB (SQLite's default is 4): a step row of 1,000 parameters
  // (24 KB) then takes two pages instead of seven, and a sealed block a quarter of the pages, so
  // that the writer makes a quarter of the page writes, WAL frames and syscalls (the writer's CPU
  // at 1 x 1 x 1,000: about a fifth less, docs/performance.md). It applies only before the file's
  // first page is written: an existing journal keeps its page size.
  if (Status s = db.Exec("PRAGMA page_size=16384"); !s.ok()) return failed(s);
  if (Status s = db.UseWal(); !s.ok()) return failed(s);
  // WAL with FULL fsyncs the log at every commit: an acked step survives a power cut.
  if (Status s = db.Exec("PRAGMA synchronous=FULL"); !s.ok()) return failed(s);
  // Pruning frees pages that later writes reuse; the WAL shrinks back to this after checkpoints.
  if (Status s = db.Exec("PRAGMA journal_size_limit=67108864"); !s.ok()) return failed(s);
  if (check && !QuickCheck(db, &recovery.detail)) {
    *damaged = true;
    return Status::IoError("journal '" + path + "' is damaged (PRAGMA quick_check)");
  }
  if (Status s = sqlite::ApplySchema(db, journal_internal::JournalSchema()); !s.ok()) {
    *damaged = db.last_error_is_damage();
    return s;  // names the journal already
  }
  conn.statements = std::make_unique<journal_internal::Statements>();
  if (Status s = conn.statements->PrepareAll(db); !s.ok()) return failed(s);
  if (!FileId(path, conn.db_dev, conn.db_ino)) {
    return Status::IoError("journal '" + path + "': stat after open: " + std::strerror(errno));
  }
  FileId(path + "-wal", conn.wal_dev, conn.wal_ino);  // adopted at the first check if not there yet
  conn.keep_files = false;
  out = std::move(conn);
  return Status::Ok();
}

Status Journal::MoveAsideAndSalvage(const std::string& path, RecoveryReport& recovery, Connection& out) {
  const std::string aside = AsideName(path, "damaged");
  if (Status s = RenameFiles(path, aside, &recovery.moved_files); !s.ok()) return s;
  recovery.moved_aside = true;
  RecoveryReport fresh;
  bool damaged = false;
  if (Status s = OpenConnection(path, false, fresh, &damaged, out); !s.ok()) {
    return Status(s.code(), "opening a fresh journal after moving the damaged one aside: " + s.message());
  }
  Salvage(out.db, aside, recovery);
  return Status::Ok();
}

Status Journal::Repair(const std::string& path, bool dry_run, RepairReport& report) {
  report.journal = path;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return Status::NotFound("no journal at " + path);
  // The check, on a read-only connection.
  DamageLog found;
  {
    auto opened = sqlite::Database::Open(ReadOnlyUri(path), {.create = false, .uri = true});
    if (!opened.ok()) {
      report.sqlite_problem = opened.status().message();
    } else if (std::string detail; !QuickCheck(*opened, &detail)) {
      report.sqlite_problem = detail;
    } else if (Status s = ScrubSteps(*opened, "main", found); !s.ok()) {
      report.sqlite_problem = s.message();
    }
  }
  report.damaged = found.Found();
  report.damaged_steps = found.steps();
  if (dry_run || report.sound()) return Status::Ok();

  // The copy: every run SQLite reads, then the damaged blocks and rows taken out of it.
  const std::string fresh_path = path + ".repair-tmp";
  RemoveDatabaseFiles(fresh_path);
  {
    Connection fresh;
    RecoveryReport copied;
    bool damaged = false;
    if (Status s = OpenConnection(fresh_path, false, copied, &damaged, fresh); !s.ok()) {
      RemoveDatabaseFiles(fresh_path);
      return Status(s.code(), "creating the repaired journal " + fresh_path + ": " + s.message());
    }
    Salvage(fresh.db, path, copied);
    report.runs_copied = copied.salvaged_runs;
    report.lost_run_ids = copied.lost_run_ids;
    report.lost_tables = copied.lost_tables;
    if (!copied.detail.empty()) report.sqlite_problem += copied.detail;
    DamageLog copied_damage;
    Status s = ScrubSteps(fresh.db, "main", copied_damage);
    if (s.ok()) {
      report.damaged = copied_damage.Found();
      report.damaged_steps = copied_damage.steps();
      sqlite::Transaction txn(fresh.db, "repair");
      s = txn.Begin(sqlite::Transaction::Mode::kImmediate);
      auto drop_block = fresh.db.Prepare("DELETE FROM step_blocks WHERE run_id = ?1 AND first_step = ?2");
      auto drop_row = fresh.db.Prepare("DELETE FROM steps WHERE run_id = ?1 AND step = ?2");
      if (s.ok()) s = drop_block.status();
      if (s.ok()) s = drop_row.status();
      for (size_t i = 0; s.ok() && i < report.damaged.size(); ++i) {
        const DamagedSteps& d = report.damaged[i];
        sqlite::Query use(d.block ? *drop_block : *drop_row);
        use.Bind(1, d.run_id);
        use.Bind(2, d.first_step);
        s = use.Run("repair: leaving out damaged steps");
      }
      if (s.ok()) s = txn.Commit();
    }
    if (s.ok()) s = fresh.db.Exec("PRAGMA wal_checkpoint(TRUNCATE)");
    fresh.Close();
    if (!s.ok()) {
      RemoveDatabaseFiles(fresh_path);
      return Status(s.code(), "repair: " + s.message());
    }
  }
  if (Status s = RenameFiles(path, AsideName(path, "before-repair"), &report.moved_files); !s.ok()) {
    RemoveDatabaseFiles(fresh_path);
    return s;
  }
  std::filesystem::rename(fresh_path, path, ec);
  if (ec) return Status::IoError("repair: cannot rename " + fresh_path + " to " + path + ": " + ec.message());
  std::filesystem::remove(fresh_path + "-wal", ec);
  std::filesystem::remove(fresh_path + "-shm", ec);
  report.replaced = true;
  return Status::Ok();
}

StatusOr<std::unique_ptr<Journal>> Journal::Open(const JournalOptions& options, CommitCallback on_commit) {
  // SQLite's own message for a missing directory is only "unable to open database file".
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options.path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    return Status::IoError("cannot open journal '" + options.path + "': directory '" + dir.string() +
                           "' does not exist");
  }

  // Before SQLite opens the files: its recovery rewrites the WAL index and forgets what it dropped.
  RecoveryReport recovery;
  const bool had_db = std::filesystem::exists(options.path, ec);
  if (had_db && std::filesystem::exists(options.path + "-shm", ec) &&
      !std::filesystem::exists(options.path + "-wal", ec)) {
    recovery.wal_missing = true;
    recovery.detail += "the WAL (" + options.path +
                       "-wal) is missing after an unclean stop: transactions "
                       "since the last checkpoint are lost. ";
  }
  ScanWal(options.path + "-wal", recovery);

  // quick_check reads every page: bounded to small journals and to starts whose WAL recovery lost
  // something; SQLite's WAL keeps a crash from tearing pages, so a larger journal after a clean
  // recovery starts without it (damage is then found when its rows are read).
  const bool check =
      had_db && (!recovery.ok() || std::filesystem::file_size(options.path, ec) <= options.quick_check_max_bytes);
  Connection conn;
  bool damaged = false;
  if (Status s = OpenConnection(options.path, check, recovery, &damaged, conn); !s.ok()) {
    if (!damaged) {
      if (recovery.detail.empty()) return s;
      return Status(s.code(), s.message() + " (" + recovery.detail + ")");
    }
    // Refusing to start would only make a restart loop: keep the damaged files, start afresh.
    recovery.damaged = true;
    recovery.detail += s.message() + ". ";
    conn.Close();
    if (Status m = MoveAsideAndSalvage(options.path, recovery, conn); !m.ok()) {
      return Status(m.code(), m.message() + " (" + recovery.detail + ")");
    }
  }
  if (recovery.moved_aside) {
    std::string files, lost;
    for (const std::string& f : recovery.moved_files) files += (files.empty() ? "" : ", ") + f;
    for (size_t i = 0; i < recovery.lost_run_ids.size() && i < 20; ++i) {
      lost += (lost.empty() ? "" : ", ") + recovery.lost_run_ids[i];
    }
    if (recovery.lost_run_ids.size() > 20) lost += ", ...";
    std::string tables;
    for (const std::string& t : recovery.lost_tables) tables += (tables.empty() ? "" : ", ") + t;
    spdlog::error(
        "journal '{}' is damaged: {}its files were moved aside to {} (kept for inspection) and a fresh "
        "journal started; salvaged {} run(s), lost {} run(s){}{}; trainers resend what they did not "
        "see acknowledged",
        options.path, recovery.detail, files, recovery.salvaged_runs, recovery.lost_runs,
        lost.empty() ? "" : " (" + lost + ")", tables.empty() ? "" : "; tables not salvaged: " + tables);
  } else if (recovery.wal_missing || recovery.corrupt_tail || recovery.damaged) {
    spdlog::error("journal '{}': recovered with losses: {}", options.path, recovery.detail);
  } else if (!recovery.ok()) {
    spdlog::warn("journal '{}': {}", options.path, recovery.detail);
  }

  JournalOptions normalized = options;
  normalized.batch_max = std::max<size_t>(normalized.batch_max, 1);
  std::unique_ptr<Journal> journal(new Journal(std::move(normalized), std::move(on_commit), std::move(conn)));
  journal->recovery_ = std::move(recovery);
  if (check || journal->recovery_.moved_aside) {
    // Contents quick_check cannot see: the checksums of every block and step row.
    MutexLock db_lock(&journal->db_mu_);
    if (Status s = ScrubSteps(journal->db_, "main", journal->damage_); !s.ok()) {
      spdlog::error("journal '{}': checking the steps' checksums stopped: {}", options.path, s.message());
    } else if (const DamageLog& d = journal->damage_; d.blocks() + d.rows() > 0) {
      spdlog::error(
          "journal '{}': {} block(s) and {} row(s) of steps are damaged ({} step(s), listed above); the rest of "
          "their runs is served. `gradwatchd --repair` copies what is sound into a fresh journal",
          options.path, d.blocks(), d.rows(), d.steps());
    }
  }
  MutexLock stop_lock(&journal->stop_mu_);
  try {
    journal->thread_ = std::thread(&Journal::Run, journal.get());
  } catch (const std::exception& e) {
    return Status::ResourceExhausted(std::string("journal: cannot start writer thread: ") + e.what());
  }
  return journal;
}

void Journal::CheckFilesWhileIdle() {
  mu_.Unlock();
  Status status;
  {
    MutexLock db_lock(&db_mu_);
    if (db_.is_open()) status = EnsureFilesLocked();
  }
  mu_.Lock();
  if (status.ok()) {
    NoteSuccessLocked();
  } else {
    NoteFailureLocked(status, queue_.size());
  }
}

Status Journal::CheckFilesLocked() {
  // SQLite goes on writing to files that were deleted or replaced under it, and those writes
  // would be acked and then lost: a commit only counts while the files are the ones it opened.
  uint64_t dev = 0, ino = 0;
  if (!FileId(options_.path, dev, ino)) {
    return Status::IoError("journal '" + options_.path + "' vanished: " + std::strerror(errno));
  }
  if (dev != db_dev_ || ino != db_ino_) {
    return Status::IoError("journal '" + options_.path + "' was replaced by another file");
  }
  const std::string wal = options_.path + "-wal";
  if (wal_ino_ == 0) {
    FileId(wal, wal_dev_, wal_ino_);  // SQLite creates the WAL at the first transaction
    return Status::Ok();
  }
  if (!FileId(wal, dev, ino)) {
    return Status::IoError("the WAL of journal '" + options_.path + "' vanished: " + std::strerror(errno));
  }
  if (dev != wal_dev_ || ino != wal_ino_) {
    return Status::IoError("the WAL of journal '" + options_.path + "' was replaced by another file");
  }
  return Status::Ok();
}

Status Journal::EnsureFilesLocked() {
  Status lost = CheckFilesLocked();
  if (lost.ok()) return lost;
  if (!files_lost_reported_) {
    files_lost_reported_ = true;
    files_lost_.fetch_add(1, std::memory_order_relaxed);
    spdlog::error("{}; nothing is acked until the journal is rebuilt from the open connection", lost.message());
  }
  if (Status s = RebuildLocked(lost.message()); !s.ok()) {
    return Status::IoError(lost.message() + "; rebuilding the journal failed, retried: " + s.message());
  }
  files_lost_reported_ = false;
  return Status::Ok();
}

Status Journal::RebuildLocked(const std::string& why) {
  const auto start = Clock::now();
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options_.path).parent_path();
  if (!dir.empty()) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IoError("cannot create '" + dir.string() + "': " + ec.message());
  }
  // Whatever sits at the journal's paths is not what it wrote to: keep it, out of the way.
  std::vector<std::string> moved;
  if (Status s = RenameFiles(options_.path, AsideName(options_.path, "detached"), &moved); !s.ok()) return s;
  const std::string temp = options_.path + ".rebuild";
  for (const char* suffix : {"", "-journal"}) std::filesystem::remove(temp + suffix, ec);
  {
    auto dest = sqlite::Database::Open(temp);
    if (!dest.ok()) return dest.status();
    // The open connection still reads the unlinked files: copy everything committed to them.
    sqlite3_backup* backup = sqlite3_backup_init(dest->get(), "main", db_.get(), "main");
    if (backup == nullptr) return dest->Error("copying the journal into '" + temp + "'");
    const int step = sqlite3_backup_step(backup, -1);
    sqlite3_backup_finish(backup);
    if (step != SQLITE_DONE) return dest->Error("copying the journal into '" + temp + "'");
    if (Status s = dest->Close(); !s.ok()) return s;
  }
  std::filesystem::rename(temp, options_.path, ec);
  if (ec) return Status::IoError("renaming '" + temp + "' to '" + options_.path + "': " + ec.message());
  if (const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);  // the rename itself survives a power cut
    ::close(fd);
  }
  Connection fresh;
  RecoveryReport ignored;
  bool damaged = false;
  if (Status s = OpenConnection(options_.path, false, ignored, &damaged, fresh); !s.ok()) return s;
  Connection old;
  old.db = std::exchange(db_, std::move(fresh.db));
  old.statements = std::exchange(statements_, std::move(fresh.statements));
  old.keep_files = true;  // its files are gone or someone else's: no checkpoint, no WAL deletion
  db_dev_ = fresh.db_dev, db_ino_ = fresh.db_ino, wal_dev_ = fresh.wal_dev, wal_ino_ = fresh.wal_ino;
  old.Close();
  rebuilds_.fetch_add(1, std::memory_order_relaxed);
  std::string aside;
  for (const std::string& f : moved) aside += (aside.empty() ? "" : ", ") + f;
  spdlog::error(
      "journal '{}' rebuilt in {:.2f} s from the open connection after: {}; every committed record is "
      "kept{}",
      options_.path, std::chrono::duration<double>(Clock::now() - start).count(), why,
      aside.empty() ? "" : "; the files found at its paths were moved to " + aside);
  return Status::Ok();
}

uint64_t Journal::DiskBytes() const {
  uint64_t total = 0;
  for (const std::string& file : {options_.path, options_.path + "-wal", options_.path + "-shm"}) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(file, ec);
    if (!ec) total += size;
  }
  return total;
}

}  // namespace gradwatch::store
