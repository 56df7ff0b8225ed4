// Wires the daemon together: journal → run registry → gRPC services and /metrics, plus the
// ticker that drives assembly timeouts and run ending. Only this module sees everything.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/core/clock.h"
#include "server/core/status.h"
#include "server/daemon/config.h"
#include "server/daemon/tls.h"

namespace grpc {
class Server;
}

namespace gradwatch {
namespace runs {
class RunRegistry;
class MemoryBudget;
struct DaemonStats;
}  // namespace runs
namespace store {
class Journal;
class AlertStore;
class SnapshotStore;
class RemoteWriteProgress;
}  // namespace store
namespace ingest {
class Authorizer;
class IngestService;
class QueryService;
}  // namespace ingest
namespace web {
class Server;
}  // namespace web
namespace exporter {
class MetricsCollector;
class AlertMetricsCollector;
class MetricsEndpoint;
class RemoteWriter;
}  // namespace exporter

namespace daemon {

// The service name gRPC health checks ask about for ingest.
inline constexpr char kIngestServiceName[] = "gradwatch.v1.Ingest";
class Alerting;
class StepFanout;

class Daemon {
 public:
  explicit Daemon(Config config, const Clock* clock = SystemClock::Default());
  ~Daemon();

  // Opens the journal, rebuilds the runs from it, and starts serving gRPC and /metrics.
  Status Start();
  // Stops accepting, lets streams finish (up to `grace`), commits the journal and closes it.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(5));

  // Checks the TLS files again (SIGHUP) and logs what new connections get on both listeners. The
  // daemon also rereads them every second: a renewed pair, once complete and valid, needs no
  // restart; a broken one keeps the last good pair (TlsStage).
  void CheckTls() const;
  // Reads security.tokens_file again (SIGHUP): a file with an error leaves the tokens in force.
  void ReloadTokens();
  static constexpr unsigned kTlsRefreshSeconds = 1;
  // Reloads the rule files (SIGHUP, `gradwatch rules reload`); invalid files change nothing.
  StatusOr<size_t> ReloadRules();
  // SIGHUP with a configuration file: its `alerts:` section, read again (`fresh`), decides the
  // rules (default_rules, rule_files, overrides) and min_steps_before_page from now on, once its
  // rules load; otherwise nothing changes and the status says why. Other sections need a restart.
  StatusOr<size_t> ReloadAlertsConfig(const Config& fresh);

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }

 private:
  void TickLoop();
  // Snapshots runs every journal.snapshot_interval_seconds until Stop.
  void SnapshotLoop();
  // One pass of RunRegistry::SaveSnapshots, logged when it wrote or failed anything.
  void SaveSnapshots(const char* why);
  // Ingest's gRPC health follows the journal: NOT_SERVING while it cannot commit. Ticker thread.
  void UpdateIngestHealth();
  // Moves the journal's pruning cutoff (retention.journal_days) and prunes one batch of delivered
  // or given-up notifications (retention.outbox_days). On the ticker, never on the ingest path.
  void PruneOld();
  // Takes an exclusive lock on data_dir/LOCK for the daemon's life.
  Status LockDataDir();
  // The data directory (or its LOCK file) was deleted under the daemon: lock a new LOCK file, so
  // that a second daemon cannot start on the recreated directory. On the ticker thread.
  void RelockDataDirIfGone();
  // Rereads the TLS files (TlsStage::Reload) and logs a change, or the state when asked.
  void RefreshTls(bool report_unchanged) const;
  // Opens the alert store, builds the dispatcher when receivers are configured, starts alerting.
  Status StartAlerting(const std::string& journal_path);

  const Config config_;
  const Clock* const clock_;
  std::unique_ptr<runs::DaemonStats> stats_;
  std::unique_ptr<runs::MemoryBudget> budget_;  // outlives registry_: its runs release their charges
  std::unique_ptr<Alerting> alerting_;
  // remote_write receivers; with alerting_ behind fanout_, the runs' listener. They outlive
  // registry_, whose runs hold their channels.
  std::vector<std::unique_ptr<exporter::RemoteWriter>> remote_writers_;
  std::unique_ptr<StepFanout> fanout_;
  std::unique_ptr<store::RemoteWriteProgress> remote_progress_;
  std::unique_ptr<runs::RunRegistry> registry_;
  std::unique_ptr<store::Journal> journal_;
  std::unique_ptr<store::AlertStore> alert_store_;  // outlives alerting_'s writer: Stop() stops it first
  std::unique_ptr<ingest::Authorizer> authorizer_;
  std::unique_ptr<ingest::IngestService> ingest_;
  std::unique_ptr<ingest::QueryService> query_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<exporter::MetricsCollector> collector_;  // outlive metrics_endpoint_, which calls them
  std::unique_ptr<exporter::AlertMetricsCollector> alert_collector_;
  std::unique_ptr<exporter::MetricsEndpoint> metrics_endpoint_;  // outlives http_, which serves its buffers
  std::unique_ptr<web::Server> http_;
  std::unique_ptr<TlsStage> tls_stage_;  // the gRPC listener's copies of the TLS files; null without TLS
  int grpc_port_ = 0;
  int metrics_port_ = 0;

  std::mutex tick_mu_;
  // The alerts section in force: config_'s until ReloadAlertsConfig reads a fresh one, while a
  // reload (`gradwatch rules reload`) may read it.
  struct AlertsConfig {
    bool default_rules = true;
    std::vector<std::string> rule_files;
    std::vector<alerts::RuleOverride> overrides;
  };
  std::mutex alerts_config_mu_;
  AlertsConfig alerts_config_;  // guarded by alerts_config_mu_
  std::condition_variable tick_cv_;
  bool stopping_ = false;  // guarded by tick_mu_
  std::thread ticker_;
  std::unique_ptr<store::SnapshotStore> snapshots_;
  std::thread snapshotter_;     // waits on tick_cv_ too
  bool ingest_serving_ = true;  // ticker thread only, after Start
  bool stopped_ = false;
  int lock_fd_ = -1;
};

}  // namespace daemon
}  // namespace gradwatch
