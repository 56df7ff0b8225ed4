// Durability through the real gradwatchd: nothing is acked that is not committed, storage faults
// (a full disk, an immutable WAL, a deleted data directory) are reported and recovered from
// without a restart, a damaged or missing WAL is reported at start, a damaged journal is moved
// aside and salvaged rather than refused, a run with unreadable rows is skipped, events survive a
// SIGKILL exactly once, and a run fed by three ranks while the daemon is SIGKILLed over and over
// ends up exactly as an uninterrupted one.
//
// The tmpfs and chattr cases need root (or CAP_SYS_ADMIN / CAP_LINUX_IMMUTABLE); where that is not
// available they WARN and pass without checking anything (Catch2 2.13 has no SKIP).
#include <catch2/catch.hpp>

#include <sqlite3.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <google/protobuf/util/message_differencer.h>
#include <nlohmann/json.hpp>

#include "gradwatch/monitor.h"
#include "server/store/step_block.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/unit/notify/test_receiver.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kIngest = "gradwatch.v1.Ingest";

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args, int timeout_s = 60) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(timeout_s + 60));
}

// A JSONL history of steps [from, to] for `gradwatch replay`.
void WriteHistory(const std::filesystem::path& file, const std::string& run, uint64_t from, uint64_t to,
                  const std::map<uint64_t, std::string>& events = {}) {
  std::ofstream out(file);
  out << R"({"run": ")" << run << R"(", "params": [{"name": "final_norm.weight", "numel": 6144, )"
      << R"("kind": "norm_gain", "weight_decay": 0.0}]})"
      << "\n";
  for (uint64_t s = from; s <= to; ++s) {
    out << R"({"_step": )" << s << R"(, "_timestamp": )" << 1.7e9 + static_cast<double>(s) << R"(, "grad/norm/total": )"
        << 0.3 + 1e-4 * static_cast<double>(s) << R"(, "params/norm/final_norm.weight": )"
        << 78.4 + 1e-3 * static_cast<double>(s) << R"(, "train/loss": 2.0})"
        << "\n";
    if (auto e = events.find(s); e != events.end()) {
      out << R"({"_step": )" << s << R"(, "event": ")" << e->second << R"("})"
          << "\n";
    }
  }
}

std::optional<double> Metric(const DaemonProcess& daemon, const std::string& name,
                             const std::map<std::string, std::string>& labels = {}) {
  return ParseMetric(daemon.ScrapeMetrics(), name, labels);
}

v1::RunSummary GetRun(const std::string& target, const std::string& run) {
  auto stub = QueryStub(target);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(20)));
  v1::GetRunRequest req;
  req.set_run_id(run);
  v1::RunSummary summary;
  const grpc::Status s = stub->GetRun(&ctx, req, &summary);
  if (!s.ok()) throw std::runtime_error("GetRun " + run + ": " + s.error_message());
  return summary;
}

// A tmpfs mounted on `dir` for the test's life; ok() is false where mounting is not allowed.
class TmpfsMount {
 public:
  TmpfsMount(const std::filesystem::path& dir, const std::string& size) : dir_(dir) {
    std::filesystem::create_directories(dir);
    const CommandResult r = RunCommand({"mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", dir.string()});
    mounted_ = r.exit_code == 0;
    error_ = r.err;
  }
  ~TmpfsMount() {
    if (mounted_) RunCommand({"umount", "-l", dir_.string()});
  }
  bool ok() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::filesystem::path dir_;
  bool mounted_ = false;
  std::string error_;
};

// Fills the file system holding `file` until a write fails; returns the bytes written.
uintmax_t FillDisk(const std::filesystem::path& file) {
  FILE* f = std::fopen(file.c_str(), "wb");
  if (f == nullptr) return 0;
  const std::vector<char> chunk(16 * 1024, 'x');
  uintmax_t written = 0;
  while (true) {
    const size_t n = std::fwrite(chunk.data(), 1, chunk.size(), f);
    written += n;
    if (n < chunk.size() || std::fflush(f) != 0) break;
  }
  std::fclose(f);
  return written;
}

// chattr on `path`; false when the file system or the privileges do not allow it.
bool Chattr(const std::string& flag, const std::filesystem::path& path) {
  return RunCommand({"chattr", flag, path.string()}).exit_code == 0;
}

// Rows of the journal, read with SQLite directly (the daemon must be stopped).
struct JournalRows {
  std::vector<uint64_t> steps;                           // in step order
  std::vector<std::pair<uint64_t, std::string>> events;  // (step, text), in step order
};

JournalRows ReadJournal(const std::filesystem::path& db_path, const std::string& run) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    sqlite3_close(db);
    throw std::runtime_error("cannot open " + db_path.string());
  }
  JournalRows rows;
  auto query = [&](const char* sql, auto on_row) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) != SQLITE_OK) {
      throw std::runtime_error(std::string("prepare: ") + sqlite3_errmsg(db));
    }
    sqlite3_bind_text(stmt, 1, run.c_str(), -1, SQLITE_TRANSIENT);
    while (sqlite3_step(stmt) == SQLITE_ROW) on_row(stmt);
    sqlite3_finalize(stmt);
  };
  // Steps are rows of their own until their run's block of them is sealed.
  query("SELECT step FROM steps WHERE run_id = ?1",
        [&](sqlite3_stmt* s) { rows.steps.push_back(static_cast<uint64_t>(sqlite3_column_int64(s, 0))); });
  query("SELECT data FROM step_blocks WHERE run_id = ?1", [&](sqlite3_stmt* s) {
    std::vector<gradwatch::CompletedStep> block;
    const gradwatch::Status decoded =
        gradwatch::store::DecodeStepBlock(std::string_view(static_cast<const char*>(sqlite3_column_blob(s, 0)),
                                                           static_cast<size_t>(sqlite3_column_bytes(s, 0))),
                                          block);
    if (!decoded.ok()) throw std::runtime_error(decoded.ToString());
    for (const gradwatch::CompletedStep& step : block) rows.steps.push_back(step.step);
  });
  std::sort(rows.steps.begin(), rows.steps.end());
  query("SELECT step, text FROM events WHERE run_id = ?1 ORDER BY step, id", [&](sqlite3_stmt* s) {
    rows.events.emplace_back(static_cast<uint64_t>(sqlite3_column_int64(s, 0)),
                             reinterpret_cast<const char*>(sqlite3_column_text(s, 1)));
  });
  sqlite3_close(db);
  return rows;
}

// Deletes a directory the running daemon writes into on its own (its LOCK, every tick; the journal's
// files, when it rebuilds them), leaving `replacement` (a file's path, or empty for nothing) where
// it was. Removing it in place races the daemon: an entry made between remove_all's unlinks and its
// rmdir makes the rmdir fail. One rename takes it away at once, then the moved copy is removed
// (again if a file the daemon was creating as it moved still got in).
void DeleteUnderDaemon(const std::filesystem::path& dir, const std::filesystem::path& replacement = {}) {
  const std::filesystem::path aside = dir.string() + ".deleted";
  std::filesystem::remove_all(aside);
  std::filesystem::rename(dir, aside);
  if (!replacement.empty()) std::filesystem::rename(replacement, dir);
  std::error_code error;
  for (int attempt = 0; attempt < 10 && std::filesystem::exists(aside); ++attempt) {
    std::filesystem::remove_all(aside, error);
  }
  REQUIRE_FALSE(std::filesystem::exists(aside));
}

}  // namespace

TEST_CASE("a full disk: nothing is acked that is not committed, and ingest recovers without a restart",
          "[integration][durability]") {
  TempDir base("gradwatch-fulldisk");
  const std::filesystem::path data = base.path() / "data";
  TmpfsMount mount(data, "2m");
  if (!mount.ok()) {
    WARN("skipped: cannot mount a tmpfs (needs root): " << mount.error());
    return;
  }
  DaemonOptions options;
  options.data_dir = data;
  DaemonProcess daemon(options);
  const std::string file = (base.path() / "history.jsonl").string();
  WriteHistory(file, "full-disk", 1, 400, {{200, "switched routing"}});
  REQUIRE(FillDisk(data / "filler") > 0);

  // Nothing can be committed: nothing is acked, the replay says so and exits non-zero.
  const CommandResult failed = Cli(daemon, {"replay", file, "--max", "--stall-timeout", "4"}, 4);
  INFO(failed.out << failed.err);
  CHECK(failed.exit_code == 1);
  CHECK(failed.err.find("not acknowledged") != std::string::npos);
  CHECK(failed.out.find("last acked step  none") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_storage_healthy") == 0.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "NOT_SERVING");
  CHECK(Metric(daemon, "gradwatch_journal_storage_faults_total") >= 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_failed_commits_total") >= 1.0);

  // A replay that meets the full disk and outlasts it: the refused steps are sent again, and once
  // all are acknowledged it exits 0, saying the refusals were retried.
  const double refused_before =
      Metric(daemon, "gradwatch_ingest_errors_total", {{"reason", "storage_unavailable"}}).value_or(0);
  BackgroundCommand patient(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", file, "--max", "--stall-timeout", "300"});
  REQUIRE(WaitUntil(
      [&] {
        return Metric(daemon, "gradwatch_ingest_errors_total", {{"reason", "storage_unavailable"}}).value_or(0) >
               refused_before;
      },
      std::chrono::seconds(60)));

  // Space comes back: the held commit goes through, ingest serves again, the replay completes.
  std::filesystem::remove(data / "filler");
  const CommandResult outlasted = patient.Wait(std::chrono::seconds(300));
  INFO(outlasted.out << outlasted.err);
  CHECK(outlasted.exit_code == 0);
  CHECK_THAT(outlasted.out, Catch::Contains("all acknowledged") && Catch::Contains("retried"));
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 1.0; }));
  CHECK(WaitUntil([&] { return HealthStatus(daemon.grpc_target(), kIngest) == "SERVING"; }));
  const CommandResult replay = Cli(daemon, {"replay", file, "--max", "--json"});
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);
  CHECK(json::parse(replay.out)["last_acked_step"] == 400);
  CHECK(daemon.LogText().find("storage recovered") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_dropped_records_total") == 0.0);

  REQUIRE(daemon.Stop() == 0);
  const JournalRows rows = ReadJournal(data / "journal.db", "full-disk");
  CHECK(rows.steps.size() == 400);
  CHECK(std::set<uint64_t>(rows.steps.begin(), rows.steps.end()).size() == 400);
  CHECK(rows.events == std::vector<std::pair<uint64_t, std::string>>{{200, "switched routing"}});
}

TEST_CASE(
    "a full disk under the C++ Monitor: refused steps and events are kept, resent after the back-off, "
    "and a flush shorter than the back-off waits for the reconnect",
    "[integration][durability]") {
  TempDir base("gradwatch-fulldisk-monitor");
  const std::filesystem::path data = base.path() / "data";
  TmpfsMount mount(data, "2m");
  if (!mount.ok()) {
    WARN("skipped: cannot mount a tmpfs (needs root): " << mount.error());
    return;
  }
  DaemonOptions options;
  options.data_dir = data;
  DaemonProcess daemon(options);
  const auto monitor_options = [&](const std::string& run, std::chrono::milliseconds backoff) {
    client::MonitorOptions mo;
    mo.address = daemon.grpc_target();
    mo.hello.set_run_id(run);
    mo.hello.set_world_size(1);
    mo.initial_backoff = backoff;
    mo.max_backoff = backoff * 2;
    return mo;
  };
  const auto step = [](uint64_t s) {
    v1::StepStats st;
    st.set_step(s);
    st.mutable_total_grad()->set_norm(0.5 + 0.001 * static_cast<double>(s));
    return st;
  };
  REQUIRE(FillDisk(data / "filler") > 0);
  // The daemon learns the disk is full from a failed commit: a probe's steps make one.
  client::Monitor probe(monitor_options("probe", std::chrono::milliseconds(50)));
  probe.Start();
  REQUIRE(probe.WaitAccepted(std::chrono::seconds(20)));
  for (uint64_t s = 1; s <= 20; ++s) REQUIRE(probe.Log(step(s)));
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 0.0; }, std::chrono::seconds(60)));

  client::Monitor quick(monitor_options("quick-backoff", std::chrono::milliseconds(50)));
  client::Monitor slow(monitor_options("slow-backoff", std::chrono::seconds(4)));
  for (client::Monitor* m : {&quick, &slow}) {
    m->Start();
    for (uint64_t s = 1; s <= 300; ++s) REQUIRE(m->Log(step(s)));
    REQUIRE(m->Event(150, "switched routing"));
  }
  const auto refused = [](const client::Monitor& m) {
    const client::MonitorStats st = m.Stats();
    const auto it = st.errors_by_reason.find("ERROR_REASON_STORAGE_UNAVAILABLE");
    return it == st.errors_by_reason.end() ? uint64_t{0} : it->second;
  };
  REQUIRE(WaitUntil([&] { return refused(quick) > 0 && refused(slow) > 0; }, std::chrono::seconds(60)));
  CHECK_FALSE(quick.Flush(std::chrono::milliseconds(500)));  // nothing durable while the disk is full
  for (const client::Monitor* m : {&quick, &slow}) {
    const client::MonitorStats st = m->Stats();
    CHECK(st.dropped == 0);
    CHECK_FALSE(st.rejected);
    CHECK(st.queued + st.unacked == 301);  // every step and the event, held
  }

  std::filesystem::remove(data / "filler");
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 1.0; }, std::chrono::seconds(60)));
  // The slow Monitor is backing off (4 s or more): a 200 ms flush waits for its reconnect.
  CHECK(slow.Flush(std::chrono::milliseconds(200)));
  CHECK(quick.Flush(std::chrono::seconds(60)));
  CHECK(probe.Flush(std::chrono::seconds(60)));
  CHECK(slow.Finish(std::chrono::seconds(60)));
  CHECK(quick.Finish(std::chrono::seconds(60)));
  probe.Stop();

  REQUIRE(daemon.Stop() == 0);
  for (const char* run : {"quick-backoff", "slow-backoff"}) {
    INFO(run);
    const JournalRows rows = ReadJournal(data / "journal.db", run);
    CHECK(rows.steps.size() == 300);
    CHECK(std::set<uint64_t>(rows.steps.begin(), rows.steps.end()).size() == 300);
    CHECK(rows.events == std::vector<std::pair<uint64_t, std::string>>{{150, "switched routing"}});
  }
}

TEST_CASE("a replay run again sends the events at steps the daemon already holds, and each is kept once",
          "[integration][durability]") {
  // The daemon may hold a rank's steps but not an event among them: an event refused while its
  // storage failed, when the replay that sent it gave up before it could resend it.
  TempDir data("gradwatch-held-events");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  const std::string steps_only = (data.path() / "steps.jsonl").string();
  const std::string with_events = (data.path() / "events.jsonl").string();
  WriteHistory(steps_only, "held-events", 1, 300);
  WriteHistory(with_events, "held-events", 1, 300, {{200, "switched routing"}, {250, "lr decay"}});
  REQUIRE(Cli(daemon, {"replay", steps_only, "--max"}).exit_code == 0);

  for (int round = 0; round < 2; ++round) {
    const CommandResult again = Cli(daemon, {"replay", with_events, "--max", "--json"});
    INFO(again.out << again.err);
    REQUIRE(again.exit_code == 0);
    const json summary = json::parse(again.out);
    CHECK(summary["already_held_steps"] == 300);
    CHECK(summary["steps_sent"] == 0);
    CHECK(summary["events"] == 2);
  }

  REQUIRE(daemon.Stop() == 0);
  const JournalRows rows = ReadJournal(data.path() / "journal.db", "held-events");
  CHECK(rows.steps.size() == 300);
  CHECK(rows.events == std::vector<std::pair<uint64_t, std::string>>{{200, "switched routing"}, {250, "lr decay"}});
}

TEST_CASE("an immutable WAL: steps are not acked, and after it clears a replay resends them all",
          "[integration][durability]") {
  TempDir data("gradwatch-immutable");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  const std::filesystem::path wal = data.path() / "journal.db-wal";
  const std::string first = (data.path() / "first.jsonl").string();
  const std::string all = (data.path() / "all.jsonl").string();
  WriteHistory(first, "immutable", 1, 100);
  WriteHistory(all, "immutable", 1, 600);
  REQUIRE(Cli(daemon, {"replay", first, "--max"}).exit_code == 0);
  if (!Chattr("+i", wal)) {
    WARN("skipped: chattr +i is not possible here (needs root and a file system with attributes)");
    return;
  }
  struct Unlock {
    std::filesystem::path path;
    ~Unlock() { Chattr("-i", path); }
  } unlock{wal};

  const CommandResult refused = Cli(daemon, {"replay", all, "--max", "--stall-timeout", "4"}, 4);
  INFO(refused.out << refused.err);
  CHECK(refused.exit_code == 1);
  CHECK(refused.err.find("not acknowledged") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_storage_healthy") == 0.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "NOT_SERVING");
  CHECK(daemon.LogText().find("storage fault") != std::string::npos);

  REQUIRE(Chattr("-i", wal));
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 1.0; }));
  // The daemon received some of these steps while it could not commit: it holds them until they
  // are, and the replay waits for their acks before it says it is done.
  const CommandResult again = Cli(daemon, {"replay", all, "--max", "--json"});
  INFO(again.out << again.err);
  REQUIRE(again.exit_code == 0);
  CHECK(json::parse(again.out)["last_acked_step"] == 600);

  REQUIRE(daemon.Stop() == 0);
  const JournalRows rows = ReadJournal(data.path() / "journal.db", "immutable");
  CHECK(rows.steps.size() == 600);
  CHECK(rows.steps.back() == 600);
}

TEST_CASE("a data directory deleted under the running daemon is rebuilt without a restart, never a false ack",
          "[integration][durability]") {
  TempDir base("gradwatch-vanished");
  const std::filesystem::path data = base.path() / "data";
  DaemonOptions options;
  options.data_dir = data;
  DaemonProcess daemon(options);
  const std::string first = (base.path() / "first.jsonl").string();
  const std::string all = (base.path() / "all.jsonl").string();
  WriteHistory(first, "vanished", 1, 100, {{50, "lr warmup over"}});
  WriteHistory(all, "vanished", 1, 300, {{50, "lr warmup over"}, {250, "data mix changed"}});
  REQUIRE(Cli(daemon, {"replay", first, "--max"}).exit_code == 0);

  // The directory is deleted, and a file stands where it was: the journal cannot be rebuilt.
  const std::filesystem::path file = base.path() / "not-a-directory";
  { std::ofstream(file) << "not a directory\n"; }
  DeleteUnderDaemon(data, file);
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 0.0; }));
  // The health follows on the daemon's next tick.
  CHECK(WaitUntil([&] { return HealthStatus(daemon.grpc_target(), kIngest) == "NOT_SERVING"; }));
  CHECK(Metric(daemon, "gradwatch_journal_files_lost_total") == 1.0);
  // The daemon's log file went with the directory; the daemon still writes to it.
  auto log = [&] {
    std::ifstream in("/proc/" + std::to_string(daemon.pid()) + "/fd/2");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK(log().find("journal.db' vanished") != std::string::npos);
  const CommandResult refused = Cli(daemon, {"replay", all, "--max", "--stall-timeout", "3"}, 3);
  INFO(refused.out << refused.err);
  CHECK(refused.exit_code == 1);
  CHECK(refused.err.find("not acknowledged") != std::string::npos);

  // The way is clear again: the journal recreates the directory with everything it had committed.
  std::filesystem::remove(data);
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_storage_healthy") == 1.0; }));
  CHECK(WaitUntil([&] { return HealthStatus(daemon.grpc_target(), kIngest) == "SERVING"; }));
  CHECK(Metric(daemon, "gradwatch_journal_rebuilds_total") == 1.0);
  CHECK(log().find("rebuilt") != std::string::npos);
  CHECK(WaitUntil([&] { return std::filesystem::exists(data / "LOCK"); }));
  const CommandResult replay = Cli(daemon, {"replay", all, "--max", "--json"});
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);
  CHECK(json::parse(replay.out)["last_acked_step"] == 300);

  // Deleted once more while idle: rebuilt again, with no restart and nothing to resend.
  DeleteUnderDaemon(data);
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_journal_rebuilds_total") == 2.0; }));
  CHECK(Metric(daemon, "gradwatch_storage_healthy") == 1.0);

  // What a restart rebuilds is everything acked, each step and event once.
  daemon.Restart();
  const v1::RunSummary run = GetRun(daemon.grpc_target(), "vanished");
  CHECK(run.info().step_count() == 300);
  CHECK(run.events_size() == 2);
  REQUIRE(daemon.Stop() == 0);
  const JournalRows rows = ReadJournal(data / "journal.db", "vanished");
  CHECK(rows.steps.size() == 300);
  CHECK(std::set<uint64_t>(rows.steps.begin(), rows.steps.end()).size() == 300);
  CHECK(rows.events ==
        std::vector<std::pair<uint64_t, std::string>>{{50, "lr warmup over"}, {250, "data mix changed"}});
}

TEST_CASE("a journal that is not a database is moved aside at start and the daemon serves",
          "[integration][durability]") {
  TempDir data("gradwatch-garbage");
  const std::string garbage = "this is not an SQLite database, only bytes\n";
  { std::ofstream(data.path() / "journal.db") << garbage; }
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  INFO(daemon.LogText());
  CHECK(daemon.LogText().find("is damaged") != std::string::npos);
  CHECK(daemon.LogText().find("moved aside") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "moved_aside"}}) == 1.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "SERVING");
  std::vector<std::filesystem::path> aside;
  for (const auto& entry : std::filesystem::directory_iterator(data.path())) {
    if (entry.path().filename().string().rfind("journal.db.damaged-", 0) == 0) aside.push_back(entry.path());
  }
  REQUIRE(aside.size() == 1);
  std::ifstream in(aside[0]);
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == garbage);  // kept as it was

  const std::string file = (data.path() / "h.jsonl").string();
  WriteHistory(file, "after-garbage", 1, 50);
  const CommandResult replay = Cli(daemon, {"replay", file, "--max", "--json"});
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);
  CHECK(json::parse(replay.out)["last_acked_step"] == 50);
  // The next start finds a sound journal: no alarm, no loop.
  daemon.Restart();
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "moved_aside"}}) == 0.0);
  CHECK(GetRun(daemon.grpc_target(), "after-garbage").info().step_count() == 50);
}

TEST_CASE("a damaged page: the daemon starts on a fresh journal with the runs that read cleanly",
          "[integration][durability]") {
  TempDir data("gradwatch-damaged-page");
  DaemonOptions options;
  options.data_dir = data.path();
  // Steps stay rows of their own: a run's 1,500 span many pages, so one damaged page is one run's.
  // (Sealed, each run's steps of this history fit in a fraction of one page.)
  options.config_yaml += "journal: {block_steps: 4096}\n";
  DaemonProcess daemon(options);
  for (const char* run : {"a-lost", "b-kept"}) {
    const std::string file = (data.path() / (std::string(run) + ".jsonl")).string();
    WriteHistory(file, run, 1, 1500, {{700, "lr warmup over"}});
    REQUIRE(Cli(daemon, {"replay", file, "--max"}).exit_code == 0);
  }
  REQUIRE(daemon.Stop() == 0);
  const std::filesystem::path db_path = data.path() / "journal.db";
  REQUIRE_FALSE(std::filesystem::exists(data.path() / "journal.db-wal"));  // checkpointed at the clean stop
  // The steps table's leaves in key order: run a-lost's come first. Overwrite its second one.
  int64_t page = 0, page_size = 0;
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open_v2(db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
    auto one = [&](const char* sql) {
      sqlite3_stmt* stmt = nullptr;
      int64_t v = -1;
      if (sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr) == SQLITE_OK && sqlite3_step(stmt) == SQLITE_ROW) {
        v = sqlite3_column_int64(stmt, 0);
      }
      sqlite3_finalize(stmt);
      return v;
    };
    page = one("SELECT pageno FROM dbstat WHERE name = 'steps' AND pagetype = 'leaf' ORDER BY path LIMIT 1 OFFSET 1");
    page_size = one("PRAGMA page_size");
    sqlite3_close(db);
  }
  REQUIRE(page > 0);
  {
    std::fstream f(db_path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>((page - 1) * page_size));
    const std::string junk(static_cast<size_t>(page_size), '\x5a');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }

  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(daemon.LogText().find("is damaged") != std::string::npos);
  CHECK(daemon.LogText().find("lost 1 run(s) (a-lost)") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "moved_aside"}}) == 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "damaged"}}) == 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_salvaged_runs", {{"outcome", "salvaged"}}) == 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_salvaged_runs", {{"outcome", "lost"}}) == 1.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "SERVING");
  const v1::RunSummary kept = GetRun(daemon.grpc_target(), "b-kept");
  CHECK(kept.info().step_count() == 1500);
  CHECK(kept.events_size() == 1);
  CHECK_THROWS(GetRun(daemon.grpc_target(), "a-lost"));
  // The lost run's steps are sent again and kept.
  const CommandResult replay = Cli(daemon, {"replay", (data.path() / "a-lost.jsonl").string(), "--max", "--json"});
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);
  CHECK(GetRun(daemon.grpc_target(), "a-lost").info().step_count() == 1500);
}

namespace {

// One blob of the stopped journal, by its SQL.
std::string JournalBlob(const std::filesystem::path& db_path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open_v2(db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  std::string blob;
  if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK && sqlite3_step(stmt) == SQLITE_ROW) {
    blob.assign(static_cast<const char*>(sqlite3_column_blob(stmt, 0)),
                static_cast<size_t>(sqlite3_column_bytes(stmt, 0)));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return blob;
}

// Flips one bit of `blob` where it lies in the file, as a bad disk would: the file's structure
// stays sound, only the value's bytes change. Call Compact first, so that no free page holds a
// stale copy; blocks share runs of bytes, so the bit is flipped in a stretch found only once.
void FlipInFile(const std::filesystem::path& file, const std::string& blob) {
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  constexpr size_t kWindow = 24;
  REQUIRE(blob.size() >= kWindow);
  for (size_t from = 0; from + kWindow <= blob.size(); ++from) {
    const std::string_view needle(blob.data() + from, kWindow);
    const size_t at = bytes.find(needle);
    REQUIRE(at != std::string::npos);
    if (bytes.find(needle, at + 1) != std::string::npos) continue;
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at + kWindow / 2));
    const char flipped = static_cast<char>(bytes[at + kWindow / 2] ^ 0x10);
    f.write(&flipped, 1);
    return;
  }
  FAIL("no stretch of the blob is found only once in the file");
}

// Rewrites the stopped journal without free pages (VACUUM).
void Compact(const std::filesystem::path& db_path) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open_v2(db_path.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_exec(db, "VACUUM; PRAGMA wal_checkpoint(TRUNCATE)", nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(db);
}

// Runs "bad-rows" (steps 1-1000) and "good-rows" (5001-6000: other values, so that no block of
// it holds the same bytes), replayed in full; with an event at their 501st step when `events`.
void ReplayBadAndGoodRows(const DaemonProcess& daemon, const std::filesystem::path& dir, bool events) {
  for (const auto& [run, first] : {std::pair<std::string, uint64_t>{"bad-rows", 1}, {"good-rows", 5001}}) {
    const std::string file = (dir / (run + ".jsonl")).string();
    std::map<uint64_t, std::string> marks;
    if (events) marks[first + 500] = "lr decay";
    WriteHistory(file, run, first, first + 999, marks);
    REQUIRE(Cli(daemon, {"replay", file, "--max"}).exit_code == 0);
  }
}

// The stopped journal `db`, compacted, with a bit flipped in bad-rows' block of steps 129-192 and
// in its row of step 990 (blocks of 64 steps).
void DamageBadRows(const std::filesystem::path& db) {
  Compact(db);
  REQUIRE_FALSE(std::filesystem::exists(db.string() + "-wal"));
  FlipInFile(db, JournalBlob(db, "SELECT data FROM step_blocks WHERE run_id = 'bad-rows' AND first_step = 129"));
  FlipInFile(db, JournalBlob(db, "SELECT vals FROM steps WHERE run_id = 'bad-rows' AND step = 990"));
}

// The raw points of a series as the daemon serves them: step → value.
std::map<uint64_t, double> ServedSeries(const DaemonProcess& daemon, const std::string& run, const std::string& key) {
  const CommandResult r = Cli(daemon, {"series", run, key, "--max-points", "0", "--json"});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  std::map<uint64_t, double> points;
  for (const json& p : json::parse(r.out)) points[p["step"].get<uint64_t>()] = p["value"].get<double>();
  return points;
}

// The value WriteHistory writes for grad/norm/total at `step`, as the daemon parses it.
double WrittenGradNorm(uint64_t step) {
  std::ostringstream text;
  text << 0.3 + 1e-4 * static_cast<double>(step);
  return std::stod(text.str());
}

}  // namespace

TEST_CASE(
    "a bit changed on disk in a block or a row of steps: those steps are reported by run and range and never "
    "served, the rest of the run is",
    "[integration][durability][damage]") {
  TempDir data("gradwatch-bad-rows");
  DaemonOptions options;
  options.data_dir = data.path();
  // Without snapshots every step is read back from the journal; blocks of 64 steps, so 1,000 steps
  // are 15 sealed blocks and 40 rows.
  options.config_yaml += "journal: {snapshot_interval_seconds: 0, block_steps: 64}\n";
  DaemonProcess daemon(options);
  ReplayBadAndGoodRows(daemon, data.path(), false);
  // Served as acked before anything happens.
  const std::map<uint64_t, double> before = ServedSeries(daemon, "bad-rows", "grad/norm/total");
  REQUIRE(before.size() == 1000);
  for (const auto& [step, value] : before) REQUIRE(value == WrittenGradNorm(step));
  REQUIRE(daemon.Stop() == 0);
  const std::filesystem::path db = data.path() / "journal.db";
  DamageBadRows(db);

  daemon.Restart();
  INFO(daemon.LogText());
  // SQLite sees nothing wrong: the file is sound, two values are not.
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "damaged"}}) == 0.0);
  CHECK(daemon.LogText().find(
            "run 'bad-rows': steps 129-192 (a sealed block of 64 step(s)) damaged, not served: step block: "
            "checksum mismatch") != std::string::npos);
  CHECK(daemon.LogText().find("run 'bad-rows': step 990 (a step row) damaged, not served: checksum mismatch") !=
        std::string::npos);
  CHECK(daemon.LogText().find("1 block(s) and 1 row(s) of steps are damaged (65 step(s)") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_damaged_total", {{"kind", "block"}}) == 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_damaged_total", {{"kind", "row"}}) == 1.0);
  CHECK(Metric(daemon, "gradwatch_journal_damaged_steps_total") == 65.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "SERVING");

  // Every value served is the one acked; the damaged steps are missing, not changed.
  const std::map<uint64_t, double> after = ServedSeries(daemon, "bad-rows", "grad/norm/total");
  CHECK(after.size() == 1000 - 65);
  for (const auto& [step, value] : after) {
    INFO("step " << step);
    CHECK(value == WrittenGradNorm(step));
    CHECK_FALSE((step >= 129 && step <= 192));
    CHECK(step != 990);
  }
  CHECK(GetRun(daemon.grpc_target(), "bad-rows").info().step_count() == 1000 - 65);
  CHECK(GetRun(daemon.grpc_target(), "good-rows").info().step_count() == 1000);
  // The run goes on.
  const std::string more = (data.path() / "more.jsonl").string();
  WriteHistory(more, "bad-rows", 1001, 1100);
  REQUIRE(Cli(daemon, {"replay", more, "--max"}).exit_code == 0);
  CHECK(GetRun(daemon.grpc_target(), "bad-rows").info().step_count() == 1100 - 65);
}

namespace {

CommandResult Repair(const std::filesystem::path& data_dir, std::vector<std::string> args) {
  std::vector<std::string> argv = {DaemonBinaryPath(), "--data-dir", data_dir.string(), "--repair"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(120));
}

std::string FileBytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("gradwatchd --repair lists damaged steps by run and range, and replaces the journal with a sound copy",
          "[integration][durability][damage][repair]") {
  TempDir data("gradwatch-repair");
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml += "journal: {snapshot_interval_seconds: 0, block_steps: 64}\n";
  DaemonProcess daemon(options);
  ReplayBadAndGoodRows(daemon, data.path(), true);
  {
    // Refused while the daemon runs.
    const CommandResult busy = Repair(data.path(), {});
    INFO(busy.out << busy.err);
    CHECK(busy.exit_code == 1);
    CHECK(busy.err.find("in use by a running gradwatchd") != std::string::npos);
  }
  REQUIRE(daemon.Stop() == 0);
  const std::filesystem::path db = data.path() / "journal.db";
  {
    const CommandResult sound = Repair(data.path(), {"--json"});
    INFO(sound.out << sound.err);
    CHECK(sound.exit_code == 0);
    CHECK(json::parse(sound.out)["sound"] == true);
  }
  DamageBadRows(db);
  const std::string damaged_bytes = FileBytes(db);

  const CommandResult dry = Repair(data.path(), {"--dry-run", "--json"});
  INFO(dry.out << dry.err);
  REQUIRE(dry.exit_code == 3);
  const json found = json::parse(dry.out);
  CHECK(found["sound"] == false);
  CHECK(found["replaced"] == false);
  REQUIRE(found["damaged"].size() == 2);
  CHECK(found["damaged"][0]["run"] == "bad-rows");
  CHECK(found["damaged"][0]["kind"] == "block");
  CHECK(found["damaged"][0]["first_step"] == 129);
  CHECK(found["damaged"][0]["last_step"] == 192);
  CHECK(found["damaged"][1]["kind"] == "row");
  CHECK(found["damaged"][1]["first_step"] == 990);
  CHECK(found["damaged_steps"] == 65);
  CHECK(FileBytes(db) == damaged_bytes);  // a dry run changes nothing

  const CommandResult text = Repair(data.path(), {"--dry-run"});
  CHECK(text.exit_code == 3);
  CHECK(text.out.find("run 'bad-rows': steps 129-192 (a block of 64 step(s)): step block: checksum mismatch") !=
        std::string::npos);

  const CommandResult fixed = Repair(data.path(), {"--json"});
  INFO(fixed.out << fixed.err);
  REQUIRE(fixed.exit_code == 3);
  const json repaired = json::parse(fixed.out);
  CHECK(repaired["replaced"] == true);
  CHECK(repaired["runs_copied"] == 2);
  CHECK(repaired["damaged_steps"] == 65);
  REQUIRE(repaired["moved_files"].size() >= 1);
  CHECK(FileBytes(repaired["moved_files"][0].get<std::string>()) == damaged_bytes);  // kept as it was
  CHECK(Repair(data.path(), {}).exit_code == 0);                                     // sound now

  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(Metric(daemon, "gradwatch_journal_damaged_total", {{"kind", "block"}}) == 0.0);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "damaged"}}) == 0.0);
  const std::map<uint64_t, double> served = ServedSeries(daemon, "bad-rows", "grad/norm/total");
  CHECK(served.size() == 1000 - 65);
  for (const auto& [step, value] : served) CHECK(value == WrittenGradNorm(step));
  const v1::RunSummary good = GetRun(daemon.grpc_target(), "good-rows");
  CHECK(good.info().step_count() == 1000);
  CHECK(good.events_size() == 1);
  // Trainers go on writing to the repaired journal.
  const std::string more = (data.path() / "more.jsonl").string();
  WriteHistory(more, "bad-rows", 1001, 1050);
  REQUIRE(Cli(daemon, {"replay", more, "--max"}).exit_code == 0);
  CHECK(GetRun(daemon.grpc_target(), "bad-rows").info().step_count() == 1050 - 65);
}

TEST_CASE(
    "a journal cut in half is read page by page: every run and step recovered is counted truly, and the "
    "snapshots are kept aside",
    "[integration][durability][damage]") {
  TempDir data("gradwatch-cut");
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml += "journal: {snapshot_interval_seconds: 0.2}\n";
  DaemonProcess daemon(options);
  const std::vector<std::string> runs = {"r1", "r2", "r3", "r4"};
  for (const std::string& run : runs) {
    const std::string file = (data.path() / (run + ".jsonl")).string();
    WriteHistory(file, run, 1, 5000);
    REQUIRE(Cli(daemon, {"replay", file, "--max"}).exit_code == 0);
  }
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_snapshots_written_total").value_or(0) >= 4; },
                    std::chrono::seconds(60)));
  REQUIRE(daemon.Stop() == 0);
  const std::filesystem::path db = data.path() / "journal.db";
  std::filesystem::resize_file(db, std::filesystem::file_size(db) / 2);

  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "moved_aside"}}) == 1.0);
  CHECK(daemon.LogText().find("read page by page") != std::string::npos);
  // Every run is accounted for, salvaged or lost.
  const double salvaged = Metric(daemon, "gradwatch_journal_salvaged_runs", {{"outcome", "salvaged"}}).value_or(-1);
  const double lost = Metric(daemon, "gradwatch_journal_salvaged_runs", {{"outcome", "lost"}}).value_or(-1);
  CHECK(salvaged + lost == 4.0);
  uint64_t recovered = 0;
  for (const std::string& run : runs) {
    const std::string said = "run " + run + " salvaged page by page: ";
    const size_t at = daemon.LogText().find(said);
    if (at == std::string::npos) continue;
    const uint64_t count = std::stoull(daemon.LogText().substr(at + said.size()));
    // What the log says was recovered is what is served, every value as acked.
    CHECK(GetRun(daemon.grpc_target(), run).info().step_count() == count);
    const std::map<uint64_t, double> served = ServedSeries(daemon, run, "grad/norm/total");
    CHECK(served.size() == count);
    for (const auto& [step, value] : served) CHECK(value == WrittenGradNorm(step));
    recovered += count;
  }
  // How many depends on where the pages of each run lay: from a few to all of them.
  CHECK(recovered > 0);
  CHECK(recovered <= 4 * 5000);
  // No snapshot is used against a salvaged journal; all four are kept beside it.
  CHECK(Metric(daemon, "gradwatch_runs_restored_from_snapshot_total").value_or(0) == 0.0);
  size_t kept_snapshots = 0;
  for (const auto& entry : std::filesystem::directory_iterator(data.path())) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("journal.db.damaged-", 0) == 0 && name.ends_with(".snapshots")) {
      for ([[maybe_unused]] const auto& f : std::filesystem::directory_iterator(entry.path())) ++kept_snapshots;
    }
  }
  CHECK(kept_snapshots == 4);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "SERVING");
}

TEST_CASE(
    "gradwatchd --repair of a journal cut short: the runs as recovered, their snapshots set aside, the tail "
    "resent by the trainers",
    "[integration][durability][damage][repair]") {
  TempDir data("gradwatch-repair-cut");
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml += "journal: {snapshot_interval_seconds: 0.2}\n";
  DaemonProcess daemon(options);
  const std::vector<std::string> runs = {"c1", "c2"};
  for (const std::string& run : runs) {
    WriteHistory(data.path() / (run + ".jsonl"), run, 1, 5000);
    REQUIRE(Cli(daemon, {"replay", (data.path() / (run + ".jsonl")).string(), "--max"}).exit_code == 0);
  }
  REQUIRE(WaitUntil([&] { return Metric(daemon, "gradwatch_snapshots_written_total").value_or(0) >= 2; },
                    std::chrono::seconds(60)));
  REQUIRE(daemon.Stop() == 0);
  const std::filesystem::path db = data.path() / "journal.db";
  std::filesystem::resize_file(db, std::filesystem::file_size(db) * 2 / 3);

  const CommandResult fixed = Repair(data.path(), {"--json"});
  INFO(fixed.out << fixed.err);
  REQUIRE(fixed.exit_code == 3);
  const json repaired = json::parse(fixed.out);
  CHECK(repaired["replaced"] == true);
  CHECK(repaired["runs_copied"] == 2);
  CHECK_FALSE(repaired["sqlite_problem"].get<std::string>().empty());  // read page by page, as a rule
  const std::string snapshots = repaired["snapshots_moved_to"].get<std::string>();
  REQUIRE_FALSE(snapshots.empty());
  CHECK(std::distance(std::filesystem::directory_iterator(snapshots), std::filesystem::directory_iterator()) == 2);
  CHECK_FALSE(std::filesystem::exists(data.path() / "snapshots"));

  daemon.Restart();
  INFO(daemon.LogText());
  for (const std::string& run : runs) {
    const std::string said = "run " + run + " salvaged page by page: ";
    const size_t at = fixed.err.find(said);
    REQUIRE(at != std::string::npos);
    const uint64_t recovered = std::stoull(fixed.err.substr(at + said.size()));
    // Served as recovered, not as the snapshot had it.
    const v1::RunSummary summary = GetRun(daemon.grpc_target(), run);
    CHECK(summary.info().step_count() == recovered);
    const std::map<uint64_t, double> served = ServedSeries(daemon, run, "grad/norm/total");
    for (const auto& [step, value] : served) CHECK(value == WrittenGradNorm(step));
    // The trainer resends the steps after the last one recovered.
    const CommandResult again = Cli(daemon, {"replay", (data.path() / (run + ".jsonl")).string(), "--max", "--json"});
    INFO(again.out << again.err);
    CHECK(again.exit_code == 0);
    CHECK(GetRun(daemon.grpc_target(), run).info().last_step() == 5000);
  }
}

TEST_CASE("a WAL deleted while the daemon was stopped is reported at start", "[integration][durability]") {
  TempDir data("gradwatch-nowal");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  const std::string file = (data.path() / "h.jsonl").string();
  WriteHistory(file, "no-wal", 1, 50);
  REQUIRE(Cli(daemon, {"replay", file, "--max"}).exit_code == 0);
  daemon.Signal(SIGKILL);
  daemon.Stop();
  REQUIRE(std::filesystem::exists(data.path() / "journal.db-wal"));
  std::filesystem::remove(data.path() / "journal.db-wal");

  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(daemon.LogText().find("journal.db-wal) is missing after an unclean stop") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "wal_missing"}}) == 1.0);
  CHECK(HealthStatus(daemon.grpc_target(), kIngest) == "SERVING");

  // A clean restart afterwards finds nothing wrong: no loop of alarms.
  daemon.Restart();
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "wal_missing"}}) == 0.0);
}

TEST_CASE("a damaged WAL tail is cut at the last good transaction and reported", "[integration][durability]") {
  TempDir data("gradwatch-tail");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  const std::string first = (data.path() / "first.jsonl").string();
  const std::string second = (data.path() / "second.jsonl").string();
  WriteHistory(first, "tail", 1, 50);
  WriteHistory(second, "tail", 1, 100);
  REQUIRE(Cli(daemon, {"replay", first, "--max"}).exit_code == 0);

  // A crash alone loses nothing committed and reports nothing.
  daemon.Signal(SIGKILL);
  daemon.Stop();
  daemon.Restart();
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "discarded_tail"}}) == 0.0);
  REQUIRE(Cli(daemon, {"replay", second, "--max"}).exit_code == 0);
  daemon.Signal(SIGKILL);
  daemon.Stop();

  // Damage the last frame of the WAL.
  const std::filesystem::path wal = data.path() / "journal.db-wal";
  const auto size = std::filesystem::file_size(wal);
  REQUIRE(size > 4096);
  {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 100));
    const char garbage[16] = {'d', 'a', 'm', 'a', 'g', 'e', 'd', '!', 1, 2, 3, 4, 5, 6, 7, 8};
    f.write(garbage, sizeof garbage);
  }
  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(daemon.LogText().find("after the last good transaction") != std::string::npos);
  CHECK(daemon.LogText().find("the tail is damaged") != std::string::npos);
  CHECK(Metric(daemon, "gradwatch_journal_recovery_problems", {{"problem", "discarded_tail"}}) == 1.0);
  const v1::RunSummary run = GetRun(daemon.grpc_target(), "tail");
  CHECK(run.info().step_count() >= 50);
  CHECK(run.info().step_count() <= 100);
  // The daemon goes on from there: the steps lost with the tail are sent again.
  REQUIRE(Cli(daemon, {"replay", second, "--max"}).exit_code == 0);
  CHECK(GetRun(daemon.grpc_target(), "tail").info().step_count() == 100);
}

TEST_CASE("an event sent to a daemon that is stopped and then killed is resent and kept once",
          "[integration][durability]") {
  TempDir data("gradwatch-event-kill");
  DaemonOptions options;
  options.data_dir = data.path();
  options.listen = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
  DaemonProcess daemon(options);

  client::MonitorOptions mo;
  mo.address = daemon.grpc_target();
  mo.hello.set_run_id("event-kill");
  mo.hello.set_world_size(1);
  mo.initial_backoff = std::chrono::milliseconds(50);
  mo.max_backoff = std::chrono::milliseconds(500);
  client::Monitor monitor(mo);
  monitor.Start();
  REQUIRE(monitor.WaitAccepted(std::chrono::seconds(20)));
  auto step = [](uint64_t s) {
    v1::StepStats st;
    st.set_step(s);
    st.mutable_total_grad()->set_norm(0.5);
    return st;
  };
  for (uint64_t s = 1; s <= 20; ++s) REQUIRE(monitor.Log(step(s)));
  REQUIRE(monitor.Event(10, "first event"));
  REQUIRE(monitor.Flush(std::chrono::seconds(20)));

  daemon.Signal(SIGSTOP);
  for (uint64_t s = 21; s <= 30; ++s) REQUIRE(monitor.Log(step(s)));
  REQUIRE(monitor.Event(25, "switched to near-dropless EP routing"));
  // Everything is written to the stopped daemon's socket, none of it acked.
  REQUIRE(WaitUntil([&] { return monitor.Stats().queued == 0; }, std::chrono::seconds(20)));
  CHECK_FALSE(monitor.Flush(std::chrono::milliseconds(200)));
  daemon.Signal(SIGKILL);
  daemon.Stop();
  daemon.Restart();

  REQUIRE(monitor.Flush(std::chrono::seconds(30)));
  const v1::RunSummary run = GetRun(daemon.grpc_target(), "event-kill");
  CHECK(run.info().step_count() == 30);
  REQUIRE(run.events_size() == 2);
  CHECK(run.events(0).step() == 10);
  CHECK(run.events(0).text() == "first event");
  CHECK(run.events(1).step() == 25);
  CHECK(run.events(1).text() == "switched to near-dropless EP routing");
  monitor.Stop();
}

namespace {

constexpr uint32_t kRanks = 3;
constexpr uint64_t kCrashSteps = 1500;
constexpr const char* kCrashRun = "crash-run";
const std::map<uint64_t, std::string> kCrashEvents = {
    {300, "switched to near-dropless EP routing"}, {700, "lr warmup over"}, {1200, "data mix changed"}};

// The total grad norm of a step: calm, then two excursions past the contingency threshold of 5.
double TotalGradNorm(uint64_t step) {
  const bool high = (step >= 500 && step < 650) || (step >= 1000 && step < 1150);
  return (high ? 6.0 : 1.0) + 0.01 * static_cast<double>(step % 7);
}

// Rank `rank`'s report of `step`: its share of the total (as a squared partial sum) and loss;
// rank 0 also reports the final norm's gain, which grows without weight decay.
v1::StepStats RankStep(uint32_t rank, uint64_t step) {
  v1::StepStats s;
  s.set_step(step);
  s.set_wall_time(1.7e9 + static_cast<double>(step));
  const double total = TotalGradNorm(step);
  s.mutable_total_grad()->set_sq_sum(total * total / kRanks);
  s.set_loss(2.5 - 1e-4 * static_cast<double>(step));
  if (rank == 0) {
    v1::ParamStats* p = s.add_params();
    p->set_index(0);
    p->mutable_param()->set_norm(78.4 + 0.05 * static_cast<double>(step));
    p->mutable_grad()->set_norm(0.01 * total);
  }
  return s;
}

// Feeds the run from kRanks Monitors on `address`. Each rank logs steps up to *allowed (raised by
// the caller, under mu) and then waits; returns once every Monitor flushed (false if one did not).
class RankFeeders {
 public:
  explicit RankFeeders(const std::string& address) {
    for (uint32_t r = 0; r < kRanks; ++r) {
      client::MonitorOptions mo;
      mo.address = address;
      mo.hello.set_run_id(kCrashRun);
      mo.hello.set_rank(r);
      mo.hello.set_world_size(kRanks);
      v1::ParamInfo* p = mo.hello.add_params();
      p->set_name("final_norm.weight");
      p->set_numel(6144);
      p->set_kind(v1::PARAM_KIND_NORM_GAIN);
      mo.initial_backoff = std::chrono::milliseconds(50);
      mo.max_backoff = std::chrono::milliseconds(400);
      monitors_.push_back(std::make_unique<client::Monitor>(mo));
    }
    for (auto& m : monitors_) m->Start();
    for (uint32_t r = 0; r < kRanks; ++r) threads_.emplace_back([this, r] { Feed(r); });
  }
  ~RankFeeders() {
    Allow(kCrashSteps);
    for (std::thread& t : threads_) t.join();
    for (auto& m : monitors_) m->Stop();
  }

  void Allow(uint64_t through) {
    std::lock_guard lock(mu_);
    allowed_ = std::max(allowed_, through);
    cv_.notify_all();
  }
  // Lets the ranks log through `through` and waits until all of it is acked, so that no rank runs
  // ahead of another by more than the steps allowed at once (the daemon holds at most 1,024
  // incomplete steps; a rank further behind would find its steps completed without it).
  bool AllowAndFlush(uint64_t through, std::chrono::seconds limit) {
    Allow(through);
    const auto deadline = Clock::now() + Scaled(limit);
    std::unique_lock lock(mu_);
    if (!logged_cv_.wait_until(lock, deadline, [&] {
          return std::all_of(logged_.begin(), logged_.end(), [&](uint64_t l) { return l >= through; });
        })) {
      return false;
    }
    lock.unlock();
    bool ok = true;
    for (auto& m : monitors_) ok = m->Flush(limit) && ok;
    return ok;
  }
  // Waits for the feeding threads, then for every Monitor to have everything acked.
  bool FinishAndFlush(std::chrono::seconds limit) {
    Allow(kCrashSteps);
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    bool ok = failures_ == 0;
    for (auto& m : monitors_) ok = m->Flush(Scaled(limit)) && ok;
    return ok;
  }
  // What each rank's Monitor holds, for a failure message.
  std::string Describe() const {
    std::string out = "feeding failures " + std::to_string(failures_.load()) + "\n";
    for (size_t r = 0; r < monitors_.size(); ++r) {
      const client::MonitorStats s = monitors_[r]->Stats();
      out += "rank " + std::to_string(r) + ": queued " + std::to_string(s.queued) + ", unacked " +
             std::to_string(s.unacked) + ", sent " + std::to_string(s.sent) + ", acked through " +
             std::to_string(s.acked_through_step) + ", dropped " + std::to_string(s.dropped) + ", errors " +
             std::to_string(s.errors) + " (" + s.last_error + "), connected " + std::to_string(s.connected) + "\n";
    }
    return out;
  }

 private:
  void Feed(uint32_t rank) {
    // The events come first, so that the analytics know them before any step, live as after a
    // restart (when the journal gives them back before the steps).
    if (rank == 0) {
      for (const auto& [step, text] : kCrashEvents) {
        if (!monitors_[0]->Event(step, text)) ++failures_;
      }
    }
    for (uint64_t s = 1; s <= kCrashSteps; ++s) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return s <= allowed_; });
      }
      if (!monitors_[rank]->LogBlocking(RankStep(rank, s), std::chrono::seconds(60))) ++failures_;
      std::lock_guard lock(mu_);
      logged_[rank] = s;
      logged_cv_.notify_all();
    }
  }

  std::vector<std::unique_ptr<client::Monitor>> monitors_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable logged_cv_;
  uint64_t allowed_ = 0;
  std::array<uint64_t, kRanks> logged_{};  // last step each rank logged
  std::atomic<int> failures_{0};
};

// One alert of a notification: which, which change, and its summary (which says the step and
// the value that decided the change).
struct Notice {
  std::string status, alertname, fingerprint, summary;
  bool operator==(const Notice&) const = default;
};

size_t CountOf(const std::vector<Notice>& notices, const std::string& alertname) {
  return static_cast<size_t>(
      std::count_if(notices.begin(), notices.end(), [&](const Notice& n) { return n.alertname == alertname; }));
}

// Each change once: every alert's notifications alternate firing, resolved, firing...
bool EachChangeOnce(const std::vector<Notice>& notices) {
  std::map<std::string, std::string> last;  // by fingerprint
  for (const Notice& n : notices) {
    const std::string expected = last.count(n.fingerprint) && last[n.fingerprint] == "firing" ? "resolved" : "firing";
    if (n.status != expected) return false;
    last[n.fingerprint] = n.status;
  }
  return true;
}

std::string Describe(const std::vector<Notice>& notices) {
  std::string out;
  for (const Notice& n : notices) out += n.alertname + " " + n.status + " " + n.fingerprint + ": " + n.summary + "\n";
  return out;
}

// Every notification the receiver got, in order. Delivery is at least once: a request the daemon
// was killed before recording as delivered is sent again after the restart, with the same
// Idempotency-Key; such a repeat (with the same body) is dropped, as a receiver should.
std::vector<Notice> Delivered(const notify::testing::TestReceiver& receiver, size_t* repeats = nullptr) {
  std::vector<Notice> out;
  std::map<std::string, std::string> seen;  // body by idempotency key
  for (const auto& r : receiver.Delivered()) {
    if (auto key = r.headers.find("idempotency-key"); key != r.headers.end()) {
      auto [it, first] = seen.emplace(key->second, r.body);
      if (!first && it->second == r.body) {
        if (repeats != nullptr) ++*repeats;
        continue;
      }
    }
    const json body = json::parse(r.body);
    for (const json& a : body.at("alerts")) {
      out.push_back({a.at("status").get<std::string>(), a.at("labels").at("alertname").get<std::string>(),
                     a.at("fingerprint").get<std::string>(), a.at("annotations").value("summary", "")});
    }
  }
  return out;
}

DaemonOptions CrashDaemonOptions(const TempDir& data, const notify::testing::TestReceiver& receiver) {
  DaemonOptions options;
  options.data_dir = data.path();
  options.listen = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
  options.config_yaml =
      "log: {format: text, level: info}\nalerts:\n  receivers:\n"
      "    - {type: webhook, name: hook, url: " +
      receiver.url("/hook") + "}\n";
  return options;
}

// Alert state changes this daemon process made that are notified (to firing or resolved).
size_t Transitions(const DaemonProcess& daemon) {
  const std::string metrics = daemon.ScrapeMetrics();
  return static_cast<size_t>(
      ParseMetric(metrics, "gradwatch_alert_transitions_total", {{"to", "firing"}}).value_or(0) +
      ParseMetric(metrics, "gradwatch_alert_transitions_total", {{"to", "resolved"}}).value_or(0));
}

// Waits until the receiver got `count` alerts and the daemon's outbox is empty.
bool DeliveredAll(const DaemonProcess& daemon, const notify::testing::TestReceiver& receiver, size_t count) {
  return WaitUntil([&] {
    return Delivered(receiver).size() >= count &&
           ParseMetric(daemon.ScrapeMetrics(), "gradwatch_notification_queue_depth", {{"receiver", "hook"}}) == 0.0;
  });
}

}  // namespace

TEST_CASE("three ranks replaying while the daemon is SIGKILLed 20 times end up as an uninterrupted run",
          "[integration][durability][crash]") {
  const auto started = Clock::now();
  constexpr int kKills = 20;

  // The reference: the same reports, never interrupted.
  notify::testing::TestReceiver reference_receiver;
  TempDir reference_data("gradwatch-crash-ref");
  DaemonProcess reference(CrashDaemonOptions(reference_data, reference_receiver));
  {
    RankFeeders feeders(reference.grpc_target());
    for (int k = 0; k < kKills; ++k) {
      REQUIRE(
          feeders.AllowAndFlush(kCrashSteps * static_cast<uint64_t>(k + 1) / (kKills + 1), std::chrono::seconds(60)));
    }
    REQUIRE(feeders.FinishAndFlush(std::chrono::seconds(60)));
  }
  REQUIRE(DeliveredAll(reference, reference_receiver, Transitions(reference)));
  const std::vector<Notice> expected_notices = Delivered(reference_receiver);
  const v1::RunSummary live = GetRun(reference.grpc_target(), kCrashRun);
  // The analysis as the daemon rebuilds it from the journal equals the live one.
  reference.Restart();
  const v1::RunSummary expected = GetRun(reference.grpc_target(), kCrashRun);
  REQUIRE(reference.Stop() == 0);
  REQUIRE(expected.info().step_count() == kCrashSteps);
  REQUIRE(expected.info().partial_steps() == 0);
  {
    std::string diff;
    google::protobuf::util::MessageDifferencer differ;
    differ.ReportDifferencesToString(&diff);
    CHECK(differ.Compare(live.analysis(), expected.analysis()));
    INFO(diff);
    CHECK(diff.empty());
  }
  INFO("reference notifications:\n" << Describe(expected_notices));
  REQUIRE(CountOf(expected_notices, "GradNormContingency") == 4);  // fires and resolves twice
  // Estimate rules are compared too: at least one of them notified.
  REQUIRE(expected_notices.size() > 4);
  REQUIRE(EachChangeOnce(expected_notices));

  notify::testing::TestReceiver receiver;
  TempDir data("gradwatch-crash");
  DaemonProcess daemon(CrashDaemonOptions(data, receiver));
  std::mt19937 rng(20261130);
  std::uniform_int_distribution<int> delay_ms(0, 300);
  {
    RankFeeders feeders(daemon.grpc_target());
    for (int k = 0; k < kKills; ++k) {
      feeders.Allow(kCrashSteps * static_cast<uint64_t>(k + 1) / (kKills + 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));  // a random moment
      daemon.Signal(SIGKILL);
      daemon.Stop();
      daemon.Restart();  // returns once the new daemon is ready
    }
    const bool flushed = feeders.FinishAndFlush(std::chrono::seconds(60));
    if (!flushed) FAIL(feeders.Describe() << daemon.LogText());
  }
  INFO(daemon.LogText());
  CHECK(DeliveredAll(daemon, receiver, expected_notices.size()));
  std::this_thread::sleep_for(std::chrono::seconds(1));  // nothing more may follow
  size_t repeats = 0;
  const std::vector<Notice> notices = Delivered(receiver, &repeats);
  CHECK(ParseMetric(daemon.ScrapeMetrics(), "gradwatch_journal_dropped_records_total") == 0.0);
  daemon.Restart();
  const v1::RunSummary got = GetRun(daemon.grpc_target(), kCrashRun);

  CHECK(got.info().step_count() == kCrashSteps);
  CHECK(got.info().partial_steps() == 0);
  CHECK(got.info().last_step() == kCrashSteps);
  REQUIRE(got.events_size() == static_cast<int>(kCrashEvents.size()));
  size_t i = 0;
  for (const auto& [step, text] : kCrashEvents) {
    CHECK(got.events(static_cast<int>(i)).step() == step);
    CHECK(got.events(static_cast<int>(i)).text() == text);
    ++i;
  }
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  CHECK(differ.Compare(expected.analysis(), got.analysis()));
  INFO(diff);
  CHECK(diff.empty());
  // Same notifications of every rule, same order, each change once (fingerprints are of the same
  // label sets).
  INFO("notifications:\n" << Describe(notices));
  CHECK(EachChangeOnce(notices));
  CHECK(notices == expected_notices);

  REQUIRE(daemon.Stop() == 0);
  const JournalRows rows = ReadJournal(data.path() / "journal.db", kCrashRun);
  REQUIRE(rows.steps.size() == kCrashSteps);
  for (uint64_t s = 1; s <= kCrashSteps; ++s) CHECK(rows.steps[s - 1] == s);
  std::vector<std::pair<uint64_t, std::string>> events(kCrashEvents.begin(), kCrashEvents.end());
  CHECK(rows.events == events);

  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  WARN("crash test: " << kKills << " SIGKILLs, " << kCrashSteps << " steps x " << kRanks << " ranks in " << seconds
                      << " s; " << repeats << " notification(s) delivered again after a kill");
  CHECK(seconds < Scaled(std::chrono::seconds(90)).count());
}
