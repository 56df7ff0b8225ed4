// Restarts from snapshots, against the real gradwatchd and `gradwatch replay`: a daemon restarted on
// a run's snapshot plus the journal's steps after it serves exactly what a daemon that replays the
// whole journal serves (analytics, latest values, points, alerts), after a clean stop and after a
// SIGKILL; a snapshot the run rewound past, or a damaged one, is not used and the journal is
// replayed instead.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/support/temp_dir.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;

namespace {

constexpr const char* kRun = "snapshot-job";
constexpr uint64_t kEvent = 10000;  // the routing switch: the final norm's slope bends there

// Deterministic noise in [-1, 1).
double Noise(uint64_t step, uint64_t salt) {
  uint64_t x = (step + 1) * 0x9E3779B97F4A7C15ull ^ salt * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<double>(x >> 11) / static_cast<double>(uint64_t{1} << 52) - 1.0;
}

// Steps [from, to] of a run with a norm gain that grows faster after kEvent, an output layer and a
// decayed matrix; the total grad norm rises through 5 near step 24,000 (the contingency pages),
// with a one-step spike now and then. `header` is the file's first line (the run, its catalog, a
// resume).
void WriteHistory(const std::filesystem::path& file, const std::string& header, uint64_t from, uint64_t to) {
  std::ofstream out(file);
  out << header << "\n";
  for (uint64_t s = from; s <= to; ++s) {
    const double x = static_cast<double>(s);
    const double gain = 78.4 + 1e-3 * x + (s > kEvent ? 1.5e-3 * (x - kEvent) : 0.0) + 0.05 * Noise(s, 1);
    const double total = 0.3 + 1.95e-4 * x + 0.05 * Noise(s, 2) + (s % 997 == 0 ? 3.0 : 0.0);
    out << R"({"_step": )" << s << R"(, "_timestamp": )" << json(1.7e9 + x).dump() << R"(, "grad/norm/total": )"
        << json(total).dump() << R"(, "grad/norm/final_norm.weight": )" << json(0.2 * total + 0.01 * Noise(s, 3)).dump()
        << R"(, "params/norm/final_norm.weight": )" << json(gain).dump() << R"(, "grad/norm/lm_head.weight": )"
        << json(0.7 * total + 0.01 * Noise(s, 4)).dump() << R"(, "params/norm/lm_head.weight": )"
        << json(310.0 + 2e-4 * x).dump() << R"(, "grad/norm/layers.0.mlp.weight": )" << json(0.1 * total).dump()
        << R"(, "params/norm/layers.0.mlp.weight": )" << json(120.0 - 1e-4 * x).dump() << R"(, "train/loss": )"
        << json(2.0 + 1.0 / (1.0 + x / 1000.0) + 0.01 * Noise(s, 5)).dump() << "}\n";
    if (s == kEvent)
      out << R"({"_step": )" << s << R"(, "event": "routing switch"})"
          << "\n";
    if (s == 22000)
      out << R"({"_step": )" << s << R"(, "event": "lr warmup restarted"})"
          << "\n";
  }
}

std::string Header(const std::string& extra = "") {
  return std::string(R"({"run": ")") + kRun + R"(", "params": [)" +
         R"({"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain", "weight_decay": 0.0}, )" +
         R"({"name": "lm_head.weight", "numel": 1000000, "kind": "output", "weight_decay": 0.1}, )" +
         R"({"name": "layers.0.mlp.weight", "numel": 500000, "kind": "mlp", "weight_decay": 0.1}])" + extra + "}";
}

// Replays `file` into the daemon, which must take all of it.
void Replay(const DaemonProcess& daemon, const std::filesystem::path& file) {
  const CommandResult r = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "--timeout", "60", "replay", file.string(), "--json"},
      std::nullopt, std::chrono::seconds(600));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
}

DaemonOptions Options(const std::filesystem::path& dir, double snapshot_interval) {
  DaemonOptions o;
  o.data_dir = dir;
  o.config_yaml =
      "log: {format: text, level: debug}\njournal: {snapshot_interval_seconds: " + json(snapshot_interval).dump() +
      "}\n";
  return o;
}

double Metric(const DaemonProcess& daemon, const std::string& name) {
  return ParseMetric(daemon.ScrapeMetrics(), name).value_or(-1);
}

// Everything a client can read of the run, in a form two daemons can be compared by: the summary
// (but the fields of the process's own life: open streams, the state and its times), the points
// of its key series, and its alerts.
struct View {
  std::string summary;
  std::vector<std::string> series;
  std::vector<std::string> alerts;
  std::string debug;
};

View Read(const DaemonProcess& daemon) {
  View v;
  auto stub = QueryStub(daemon.grpc_target());
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(30)));
    v1::GetRunRequest req;
    req.set_run_id(kRun);
    v1::RunSummary summary;
    const grpc::Status s = stub->GetRun(&ctx, req, &summary);
    REQUIRE(s.ok());
    summary.mutable_info()->clear_open_streams();
    summary.mutable_info()->clear_state();
    summary.mutable_info()->clear_ended_at();
    // The diagnosis is the alerting's view at the latest step it evaluated: a restart evaluates
    // no step it already judged (snapshot or journal), so the diagnosis comes back with the next
    // step, whichever way the run was restored. The alerts below are compared.
    summary.clear_diagnosis();
    v.summary = summary.SerializeAsString();
    v.debug += summary.DebugString();
  }
  for (const char* key :
       {"grad/norm/total", "params/norm/final_norm.weight", "grad/norm/layers.0.mlp.weight", "train/loss"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(30)));
    v1::GetSeriesRequest req;
    req.set_run_id(kRun);
    req.set_key(key);
    v1::GetSeriesResponse resp;
    const grpc::Status s = stub->GetSeries(&ctx, req, &resp);
    REQUIRE(s.ok());
    REQUIRE(resp.points_size() > 0);
    v.series.push_back(resp.SerializeAsString());
  }
  for (v1::Alert a : ListAlerts(daemon.grpc_target(), kRun)) {
    v.alerts.push_back(a.name() + " " + a.fingerprint() + " " + std::to_string(a.state()) + " step " +
                       std::to_string(a.step()) + " value " + json(a.value()).dump() + " since " +
                       json(a.starts_at()).dump());
  }
  std::sort(v.alerts.begin(), v.alerts.end());
  return v;
}

void RequireSame(const View& a, const View& b) {
  INFO("first:\n" << a.debug << "\nsecond:\n" << b.debug);
  CHECK(a.summary == b.summary);
  CHECK(a.series == b.series);
  CHECK(a.alerts == b.alerts);
}

// A copy of a stopped daemon's data directory without its snapshots: a daemon started on it
// replays the whole journal.
std::filesystem::path CopyWithoutSnapshots(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(to / "snapshots");
  std::filesystem::remove(to / "LOCK");
  return to;
}

// A daemon on the data directory and one on a copy of it without snapshots, which replays the
// whole journal: `RequireSame` checks they serve the same, the first having restored `restored`
// runs from their snapshots and the second none.
struct SnapshotAndReplay {
  SnapshotAndReplay(const std::filesystem::path& data, const std::filesystem::path& copy)
      : full(CopyWithoutSnapshots(data, copy)), from_snapshot(Options(data, 3600)), replayed(Options(full, 0)) {}

  View RequireSame(double restored) {
    CHECK(Metric(from_snapshot, "gradwatch_runs_restored_from_snapshot_total") == restored);
    CHECK(Metric(replayed, "gradwatch_runs_restored_from_snapshot_total") == 0);
    View a = Read(from_snapshot);
    ::RequireSame(a, Read(replayed));
    return a;
  }

  std::filesystem::path full;
  DaemonProcess from_snapshot;
  DaemonProcess replayed;
};

}  // namespace

TEST_CASE("a restart from a snapshot and the journal's tail serves what a full replay serves",
          "[integration][snapshot]") {
  TempDir dir("gradwatch-snapshot");
  const auto data = dir.path() / "data";
  std::filesystem::create_directories(data);
  WriteHistory(dir.path() / "first.jsonl", Header(), 0, 19999);
  WriteHistory(dir.path() / "second.jsonl", Header(), 20000, 25999);

  View before_stop;
  {
    // No periodic snapshot: the one written at the clean stop covers the run through 19,999.
    DaemonProcess daemon(Options(data, 3600));
    Replay(daemon, dir.path() / "first.jsonl");
    before_stop = Read(daemon);
    REQUIRE(daemon.Stop() == 0);
    CHECK(daemon.LogText().find("snapshots (shutdown): 1 run(s) written") != std::string::npos);
  }
  REQUIRE(std::filesystem::exists(data / "snapshots"));

  {
    DaemonProcess daemon(Options(data, 3600));
    CHECK(Metric(daemon, "gradwatch_runs_restored_from_snapshot_total") == 1);
    CHECK(daemon.LogText().find("1 of 1 runs restored from their snapshots") != std::string::npos);
    // The same analytics, points and alerts as before the stop.
    RequireSame(before_stop, Read(daemon));

    // The tail: steps after the snapshot, then a crash before any other snapshot.
    Replay(daemon, dir.path() / "second.jsonl");
    daemon.Stop(SIGKILL);
  }

  SnapshotAndReplay daemons(data, dir.path() / "full");
  const View a = daemons.RequireSame(1);
  // The run did page on the tail's steps (the contingency), and both hold it the same.
  CHECK(std::any_of(a.alerts.begin(), a.alerts.end(),
                    [](const std::string& s) { return s.rfind("GradNormContingency", 0) == 0; }));
}

TEST_CASE("a snapshot the run rewound past, or a damaged one, is not used: the journal is replayed",
          "[integration][snapshot]") {
  TempDir dir("gradwatch-snapshot");
  const auto data = dir.path() / "data";
  std::filesystem::create_directories(data);
  WriteHistory(dir.path() / "first.jsonl", Header(), 0, 14999);
  WriteHistory(dir.path() / "resumed.jsonl", Header(R"(, "resume_from_step": 12000)"), 12000, 16999);

  {
    DaemonProcess daemon(Options(data, 3600));
    Replay(daemon, dir.path() / "first.jsonl");
    REQUIRE(daemon.Stop() == 0);  // a snapshot through 14,999 on the first branch
  }
  {
    DaemonProcess daemon(Options(data, 3600));
    CHECK(Metric(daemon, "gradwatch_runs_restored_from_snapshot_total") == 1);
    // The job resumes from its checkpoint at 12,000, below the snapshot; the daemon dies before
    // any other snapshot.
    Replay(daemon, dir.path() / "resumed.jsonl");
    daemon.Stop(SIGKILL);
  }
  {
    SnapshotAndReplay daemons(data, dir.path() / "full");
    daemons.RequireSame(0);
    CHECK(daemons.from_snapshot.LogText().find("the run rewound since") != std::string::npos);
    REQUIRE(daemons.from_snapshot.Stop() == 0);  // a snapshot on the new branch
  }

  // A damaged snapshot: one byte changed.
  std::filesystem::path file;
  for (const auto& entry : std::filesystem::directory_iterator(data / "snapshots")) file = entry.path();
  REQUIRE(!file.empty());
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(file) / 2));
    f.put('\x5a');
  }
  SnapshotAndReplay daemons(data, dir.path() / "full-again");
  daemons.RequireSame(0);
  CHECK(daemons.from_snapshot.LogText().find("checksum does not match") != std::string::npos);
}

TEST_CASE("snapshots are taken periodically while a run streams, and a crash restarts from the latest",
          "[integration][snapshot]") {
  TempDir dir("gradwatch-snapshot");
  const auto data = dir.path() / "data";
  std::filesystem::create_directories(data);
  WriteHistory(dir.path() / "first.jsonl", Header(), 0, 9999);
  WriteHistory(dir.path() / "second.jsonl", Header(), 10000, 11999);
  {
    DaemonProcess daemon(Options(data, 0.5));
    Replay(daemon, dir.path() / "first.jsonl");
    // A pass after the replay covers it all (it may have run before the replay's last ack reached
    // the test: the run's snapshot step says when); then more steps, and a kill.
    const auto deadline = std::chrono::steady_clock::now() + Scaled(std::chrono::seconds(60));
    while (ParseMetric(daemon.ScrapeMetrics(), "gradwatch_run_snapshot_step", {{"run", kRun}}).value_or(-1) != 9999) {
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(Metric(daemon, "gradwatch_snapshots_written_total") >= 1);
    CHECK(daemon.LogText().find("snapshots (periodic): 1 run(s) written") != std::string::npos);
    Replay(daemon, dir.path() / "second.jsonl");
    daemon.Stop(SIGKILL);
  }
  SnapshotAndReplay(data, dir.path() / "full").RequireSame(1);
}
