#include "server/daemon/daemon.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <malloc.h>
#include "alerts/notify/receivers.h"
#include "server/core/thread_name.h"
#include "server/daemon/alerting.h"
#include "server/daemon/run_view.h"
#include "server/daemon/step_fanout.h"
#include "server/daemon/tls.h"
#include "server/export/alert_metrics.h"
#include "server/export/metrics_collector.h"
#include "server/export/metrics_endpoint.h"
#include "server/export/remote_write.h"
#include "server/export/text_format.h"
#include "server/ingest/authorizer.h"
#include "server/ingest/ingest_service.h"
#include "server/ingest/query_service.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/memory_budget.h"
#include "server/runs/registry.h"
#include "server/store/alert_store.h"
#include "server/store/journal.h"
#include "server/store/remote_write_progress.h"
#include "server/store/snapshots.h"
#include "server/web/server.h"

namespace gradwatch::daemon {

namespace {

// The configured forecasts, and those the forecast rules in force read (the built-in one at the
// contingency's own threshold when an override moved it): the rules find them, and the run view
// and `plot` draw them.
std::vector<std::pair<std::string, double>> ForecastsInForce(std::vector<std::pair<std::string, double>> forecasts,
                                                             const std::vector<alerts::Rule>& rules) {
  for (const alerts::Rule& r : rules) {
    if (r.kind != alerts::RuleKind::kForecast) continue;
    for (const std::string& series : r.series) {
      if (series.find_first_of("*?") != std::string::npos) continue;
      const auto same = [&](const auto& f) { return f.first == series && f.second == r.threshold; };
      if (std::none_of(forecasts.begin(), forecasts.end(), same)) forecasts.emplace_back(series, r.threshold);
    }
  }
  return forecasts;
}
constexpr auto kTickInterval = std::chrono::milliseconds(200);
// How long a snapshot waits for the alert states to be saved through its last step.
constexpr auto kSnapshotSettleTimeout = std::chrono::seconds(5);

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

ingest::AlertHistoryReader HistoryOf(store::AlertStore* store) {
  return [store](std::string_view run, size_t limit) { return store->History(run, limit); };
}

// Where queries (gRPC, the run view) read a run's diagnosis: the alerting's.
ingest::DiagnosisReader DiagnosesOf(Alerting* alerting) {
  return [alerting](const std::string& run) { return alerting->DiagnosisOf(run); };
}
}  // namespace

Daemon::Daemon(Config config, const Clock* clock) : config_(std::move(config)), clock_(clock) {
  alerts_config_ = {config_.default_rules, config_.rule_files, config_.alert_overrides};
}

Daemon::~Daemon() { Stop(); }

Status Daemon::Start() {
  std::error_code ec;
  std::filesystem::create_directories(config_.data_dir, ec);
  if (ec) return Status::IoError("cannot create data_dir " + config_.data_dir + ": " + ec.message());
  if (Status s = LockDataDir(); !s.ok()) return s;

  stats_ = std::make_unique<runs::DaemonStats>();
  auto rules = LoadConfiguredRules(config_.default_rules, config_.rule_files, config_.run_stalled_after_seconds,
                                   config_.alert_overrides);
  if (!rules.ok()) return Status(rules.status().code(), "alert rules: " + rules.status().message());
  spdlog::info("{} alert rules in force", rules->size());
  alerting_ = std::make_unique<Alerting>(std::move(rules).value(), config_.min_steps_before_page);
  runs::RunOptions run_options;
  run_options.assembly_timeout = Seconds(config_.assembly_timeout_seconds);
  run_options.series.recent_points = config_.recent_points;
  run_options.series.history_buckets = config_.history_buckets;
  run_options.param_series.recent_points = config_.param_recent_points;
  run_options.param_series.history_buckets = config_.param_history_buckets;
  run_options.max_params = config_.max_params_per_run;
  run_options.max_series = config_.max_series_per_run;
  run_options.max_events = config_.max_events_per_run;
  run_options.end_after = Seconds(config_.run_end_after_seconds);
  run_options.retention = Seconds(config_.run_retention_seconds);
  run_options.analytics.windows = config_.slope_windows;
  run_options.analytics.max_buckets = config_.slope_max_buckets;
  run_options.analytics.param_max_buckets = config_.slope_param_max_buckets;
  run_options.analytics.event_window_steps = config_.event_window_steps;
  run_options.analytics.forecast_window_steps = config_.forecast_window_steps;
  run_options.analytics.projection_steps = config_.projection_steps;
  run_options.analytics.forecasts = ForecastsInForce(config_.forecasts, alerting_->engine().Rules());
  run_options.analytics.change_points.window_steps = config_.change_point_window_steps;
  std::vector<runs::StepListener*> listeners = {alerting_.get()};
  for (const Config::RemoteWrite& r : config_.remote_write) {
    exporter::RemoteWriteOptions options;
    options.name = r.name;
    options.url = r.url;
    options.series = r.series;
    options.max_samples_per_send = r.max_samples_per_send;
    options.capacity_samples = r.capacity;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(r.remote_timeout_seconds * 1000));
    options.bearer_token = r.bearer_token;
    auto writer = exporter::RemoteWriter::Create(std::move(options));
    if (!writer.ok()) return writer.status();
    listeners.push_back(writer->get());
    remote_writers_.push_back(std::move(writer).value());
  }
  fanout_ = std::make_unique<StepFanout>(std::move(listeners));
  run_options.listener = fanout_.get();
  budget_ = std::make_unique<runs::MemoryBudget>(
      config_.memory_budget_bytes != 0 ? config_.memory_budget_bytes : runs::MemoryBudget::DefaultLimitBytes());
  run_options.budget = budget_.get();
  spdlog::info("memory budget for runs: {} bytes (limits.memory_budget_bytes)", budget_->limit());
  registry_ = std::make_unique<runs::RunRegistry>(run_options, config_.max_runs, stats_.get(), clock_);

  store::JournalOptions journal_options;
  journal_options.path = (std::filesystem::path(config_.data_dir) / "journal.db").string();
  journal_options.batch_max = config_.journal_batch_max;
  journal_options.max_delay = std::chrono::milliseconds(config_.journal_max_delay_ms);
  journal_options.block_steps = config_.journal_block_steps;
  runs::RunRegistry* registry = registry_.get();
  auto journal = store::Journal::Open(journal_options,
                                      [registry](const store::CommitReport& report) { registry->OnCommit(report); });
  if (!journal.ok()) return journal.status();
  journal_ = std::move(journal).value();
  registry_->set_journal(journal_.get());
  snapshots_ = std::make_unique<store::SnapshotStore>((std::filesystem::path(config_.data_dir) / "snapshots").string(),
                                                      runs::Run::SnapshotFingerprint());
  registry_->set_snapshots(snapshots_.get());

  if (Status s = StartAlerting(journal_options.path); !s.ok()) return s;
  if (!remote_writers_.empty()) {
    // Before the runs are read: a run the receiver is behind on publishes the steps it lacks.
    auto progress = store::RemoteWriteProgress::Open(journal_options.path);
    if (!progress.ok()) return Status(progress.status().code(), "remote_write: " + progress.status().message());
    remote_progress_ = std::move(progress).value();
    for (auto& w : remote_writers_) {
      if (Status s = w->Start(remote_progress_.get()); !s.ok()) return s;
    }
  }
  // The alert engine first: the runs evaluate the journaled steps its saved state does not cover.
  if (Status s = alerting_->RestoreState(clock_->UnixSeconds()); !s.ok()) {
    return Status(s.code(), "restoring alerts from " + journal_options.path + ": " + s.message());
  }

  const auto load_start = std::chrono::steady_clock::now();
  if (Status s = registry_->Load(); !s.ok()) {
    // Stopping here would only make a restart loop: serve with the runs that could be read.
    spdlog::error("rebuilding from the journal {}: {}; going on with the {} runs read before it", journal_options.path,
                  s.message(), registry_->run_count());
  }
  spdlog::info("rebuilt {} runs from {} in {:.2f} s", registry_->run_count(), journal_options.path,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
  alerting_->FinishRestore(*registry_, clock_->UnixSeconds());
  // The restore's transient memory (snapshots read, replaced state) goes back to the system
  // instead of staying in the allocator's free lists: 302 → 229 MB at 196,609 series.
  malloc_trim(0);

  ingest::IngestOptions ingest_options;
  ingest_options.max_message_bytes = config_.max_message_bytes;
  ingest_options.hello.max_params = config_.max_params_per_run;
  ingest_options.max_streams = config_.max_streams;
  ingest_options.max_streams_per_identity = config_.max_streams_per_identity;
  ingest_options.hello_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(config_.hello_timeout_seconds));
  authorizer_ = std::make_unique<ingest::Authorizer>();
  if (!config_.tokens_file.empty()) {
    auto policy = ingest::LoadPolicy(config_.tokens_file);
    if (!policy.ok()) return policy.status();
    spdlog::info("gRPC: callers need a token or a known certificate: {} tokens, {} identities from {}",
                 policy.value()->by_token_sha256.size(), policy.value()->by_identity.size(), config_.tokens_file);
    authorizer_->SetPolicy(std::move(policy).value());
  }
  ingest_ = std::make_unique<ingest::IngestService>(ingest_options, registry_.get(), stats_.get(), clock_);
  ingest_->set_authorizer(authorizer_.get());
  alerting_->SetTrainerSink([ingest = ingest_.get()](const alerts::Alert& alert) { ingest->SendAlert(alert); });
  query_ = std::make_unique<ingest::QueryService>(registry_.get(), clock_, &alerting_->engine(),
                                                  [this] { return ReloadRules(); });
  query_->set_max_silence_seconds(config_.max_silence_seconds);
  query_->set_authorizer(authorizer_.get());
  query_->set_alert_history(HistoryOf(alert_store_.get()));
  query_->set_diagnosis(DiagnosesOf(alerting_.get()));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // A second daemon must not share the port while this one runs or shuts down.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  TlsFiles tls{config_.tls_cert_file, config_.tls_key_file, config_.tls_client_ca_file};
  if (tls.enabled()) {
    auto pem = ReadTlsFiles(tls);
    if (!pem.ok()) return pem.status();
    auto checked = CheckTlsPem(tls, *pem);
    if (!checked.ok()) return checked.status();
    auto stage = TlsStage::Create(tls, *pem, (std::filesystem::path(config_.data_dir) / "tls").string());
    if (!stage.ok()) return stage.status();
    tls_stage_ = std::move(stage).value();
    tls = tls_stage_->staged();
    spdlog::info("gRPC: TLS with {}", checked.value());
  }
  builder.AddListeningPort(config_.listen, MakeServerCredentials(tls, kTlsRefreshSeconds), &grpc_port_);
  // Let oversized messages through to the service (up to a margin) so that they get a
  // per-message error instead of breaking the stream.
  const size_t transport_max = std::max<size_t>(64u << 20, 4 * config_.max_message_bytes);
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<size_t>(transport_max, INT32_MAX)));
  builder.RegisterService(ingest_.get());
  builder.RegisterService(query_.get());
  server_ = builder.BuildAndStart();
  if (!server_ || grpc_port_ == 0) {
    return Status::Unavailable("cannot listen for gRPC on " + config_.listen);
  }
  server_->GetHealthCheckService()->SetServingStatus(true);
  server_->GetHealthCheckService()->SetServingStatus(kIngestServiceName, journal_->healthy());

  exporter::ExportOptions export_options;
  export_options.params = config_.metrics_params;
  export_options.slope_series = config_.metrics_slope_series;
  export_options.max_series_per_run = config_.metrics_max_series_per_run;
  export_options.insecure_listener = InsecureListener(config_) || InsecureHttpListener(config_);
  collector_ = std::make_unique<exporter::MetricsCollector>(registry_.get(), stats_.get(), journal_.get(),
                                                            std::move(export_options));
  Alerting* alerting = alerting_.get();
  alert_collector_ = std::make_unique<exporter::AlertMetricsCollector>([alerting, registry] {
    exporter::AlertingView view;
    view.active = alerting->engine().Active();
    for (const alerts::Alert& a : view.active) {
      const auto run = a.labels.find("run");
      if (run == a.labels.end() || view.run_labels.count(run->second) != 0) continue;
      if (auto found = registry->Find(run->second)) view.run_labels.emplace(run->second, found->Info().labels);
    }
    view.silences = alerting->engine().Silences().size();
    view.firing_transitions = alerting->firing_transitions();
    view.resolved_transitions = alerting->resolved_transitions();
    view.store_write_failures = alerting->store_write_failures();
    view.receivers = alerting->ReceiverStats();
    view.rules = alerting->engine().Rules();
    return view;
  });
  exporter::MetricsCollector* collector = collector_.get();
  const exporter::AlertMetricsCollector* alert_collector = alert_collector_.get();
  std::vector<const exporter::RemoteWriter*> writers;
  for (const auto& w : remote_writers_) writers.push_back(w.get());
  const Clock* clock = clock_;
  metrics_endpoint_ = std::make_unique<exporter::MetricsEndpoint>(std::vector<exporter::MetricsEndpoint::Renderer>{
      [collector](exporter::Exposition& out) { collector->Render(out); },
      [alert_collector](exporter::Exposition& out) { alert_collector->Render(out); },
      [writers, clock](exporter::Exposition& out) {
        exporter::RemoteWriter::RenderMetrics(writers, out.NewChunk(), clock->UnixSeconds());
      },
      [authorizer = authorizer_.get()](exporter::Exposition& out) {
        std::string& text = out.NewChunk();
        exporter::AppendFamilyHeader(text, "gradwatch_auth_refusals_total",
                                     "Calls refused by security.tokens_file, over gRPC and HTTP: unauthenticated (no "
                                     "token or an unknown one, no known certificate) or permission_denied (a scope "
                                     "or run it lacks).",
                                     exporter::MetricType::kCounter);
        exporter::AppendSample(text, "gradwatch_auth_refusals_total", {{"reason", "unauthenticated"}},
                               static_cast<double>(authorizer->refusals(ingest::Authorizer::kUnauthenticated)));
        exporter::AppendSample(text, "gradwatch_auth_refusals_total", {{"reason", "permission_denied"}},
                               static_cast<double>(authorizer->refusals(ingest::Authorizer::kPermissionDenied)));
      }});
  web::ServerOptions http_options;
  http_options.listen = config_.metrics_listen;
  http_options.max_connections = config_.http_max_connections;
  http_options.max_connections_per_peer = config_.http_max_connections_per_peer;
  http_options.header_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(config_.http_header_timeout_seconds));
  http_options.idle_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(config_.http_idle_timeout_seconds));
  if (HttpTls(config_)) http_options.tls = {config_.tls_cert_file, config_.tls_key_file, config_.http_client_ca_file};
  // With security.metrics_require_token, every read on the HTTP listener (/metrics, the run view
  // and its API) needs a token or client certificate with the read scope.
  ReadGate gate;
  if (config_.metrics_require_token) {
    gate = [authorizer = authorizer_.get()](const web::Request& request) -> std::optional<web::Response> {
      auto [status, message] =
          authorizer->CheckHttp(request.Header("authorization"), request.client_identity, ingest::Scope::kRead,
                                request.method + " " + request.path, request.peer);
      if (status == 200) return std::nullopt;
      web::Response refusal = web::Response::Text(status, std::move(message));
      if (status == 401) refusal.headers.emplace_back("WWW-Authenticate", "Bearer realm=\"gradwatch\"");
      return refusal;
    };
  }
  std::vector<web::Route> routes = RunViewRoutes(
      {registry_.get(), clock_, &alerting_->engine(), HistoryOf(alert_store_.get()), DiagnosesOf(alerting_.get())},
      gate);
  routes.push_back(GatedRoute(
      "/metrics", false, gate,
      [endpoint = metrics_endpoint_.get()](const web::Request& request) { return endpoint->Handle(request); }));
  auto http = web::Server::Start(std::move(http_options), std::move(routes));
  if (!http.ok()) {
    return Status::Unavailable("cannot listen for /metrics on " + config_.metrics_listen + ": " +
                               http.status().message());
  }
  http_ = std::move(http).value();
  metrics_port_ = http_->port();

  ticker_ = std::thread([this] {
    NameThisThread("gw-tick");
    TickLoop();
  });
  if (config_.journal_snapshot_interval_seconds > 0) {
    snapshotter_ = std::thread([this] {
      NameThisThread("gw-snapshot");
      SnapshotLoop();
    });
  }
  spdlog::info("serving gRPC on {} (port {}{}), /metrics on {} (port {}, {}), data in {}", config_.listen, grpc_port_,
               config_.tls_cert_file.empty() ? ", plain text" : ", TLS", config_.metrics_listen, metrics_port_,
               http_->tls() ? "HTTPS" : "HTTP", config_.data_dir);
  if (InsecureListener(config_)) {
    spdlog::warn(
        "gRPC on {} is reachable beyond loopback without mutual TLS (--insecure): any host that reaches "
        "the port may stream steps into runs, silence alerts and reload rules "
        "(gradwatch_insecure_listener 1; docs/security.md)",
        config_.listen);
  }
  if (InsecureHttpListener(config_)) {
    spdlog::warn(
        "HTTP on {} is reachable beyond loopback without TLS (--insecure): /metrics, and any token a "
        "scraper sends, cross the network in clear (gradwatch_insecure_listener 1; docs/security.md)",
        config_.metrics_listen);
  }
  return Status::Ok();
}

Status Daemon::LockDataDir() {
  // Two daemons on one journal would each believe they hold the durable state: refuse.
  const std::string path = (std::filesystem::path(config_.data_dir) / "LOCK").string();
  lock_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    char holder[32] = {0};
    const ssize_t n = ::pread(lock_fd_, holder, sizeof(holder) - 1, 0);
    ::close(lock_fd_);
    lock_fd_ = -1;
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string("?");
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    return Status::FailedPrecondition("data_dir " + config_.data_dir +
                                      " is already in use by another gradwatchd (pid " + who + ")");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) < 0) {
    spdlog::warn("cannot write the pid into {}: {}", path, std::strerror(errno));
  }
  return Status::Ok();
}

void Daemon::RelockDataDirIfGone() {
  const std::string path = (std::filesystem::path(config_.data_dir) / "LOCK").string();
  struct stat held {
  }, found{};
  if (lock_fd_ < 0 || ::fstat(lock_fd_, &held) != 0) return;
  if (::stat(path.c_str(), &found) == 0 && found.st_dev == held.st_dev && found.st_ino == held.st_ino) return;
  if (!std::filesystem::is_directory(config_.data_dir)) return;  // the journal recreates it
  const int old_fd = lock_fd_;
  if (Status s = LockDataDir(); !s.ok()) {
    lock_fd_ = old_fd;
    spdlog::error("data_dir {}: its LOCK file was deleted and cannot be taken again: {}", config_.data_dir,
                  s.message());
    return;
  }
  ::close(old_fd);
  spdlog::warn("data_dir {}: its LOCK file was deleted; locked a new one", config_.data_dir);
}

void Daemon::RefreshTls(bool report_unchanged) const {
  if (tls_stage_ == nullptr) return;
  const TlsStage::Refresh r = tls_stage_->Reload();
  if (!r.changed && !report_unchanged) return;
  if (r.status.ok()) {
    spdlog::info("gRPC: TLS files {}: new connections get {}", r.changed ? "reloaded" : "checked", r.line);
  } else {
    spdlog::error("gRPC: TLS files not loaded ({}); new connections keep {}", r.status.message(), r.line);
  }
}

void Daemon::CheckTls() const {
  RefreshTls(/*report_unchanged=*/true);
  if (http_ == nullptr || !http_->tls()) return;
  auto reloaded = http_->ReloadTls();
  if (reloaded.ok()) {
    spdlog::info("HTTP: TLS files reloaded: new connections get {}", reloaded.value());
  } else {
    spdlog::error("HTTP: TLS files not reloaded ({}); new connections keep the last certificate that loaded",
                  reloaded.status().message());
  }
}

void Daemon::ReloadTokens() {
  if (config_.tokens_file.empty() || authorizer_ == nullptr) return;
  auto policy = ingest::LoadPolicy(config_.tokens_file);
  if (!policy.ok()) {
    spdlog::error("gRPC: tokens not reloaded, the ones in force stay: {}", policy.status().message());
    return;
  }
  spdlog::info("gRPC: tokens reloaded: {} tokens, {} identities", policy.value()->by_token_sha256.size(),
               policy.value()->by_identity.size());
  authorizer_->SetPolicy(std::move(policy).value());
}

StatusOr<size_t> Daemon::ReloadRules() {
  std::lock_guard lock(alerts_config_mu_);
  return alerting_->Reload(alerts_config_.default_rules, alerts_config_.rule_files, config_.run_stalled_after_seconds,
                           alerts_config_.overrides, clock_->UnixSeconds());
}

StatusOr<size_t> Daemon::ReloadAlertsConfig(const Config& fresh) {
  std::lock_guard lock(alerts_config_mu_);
  auto count = alerting_->Reload(fresh.default_rules, fresh.rule_files, config_.run_stalled_after_seconds,
                                 fresh.alert_overrides, clock_->UnixSeconds());
  if (!count.ok()) return count;
  alerts_config_ = {fresh.default_rules, fresh.rule_files, fresh.alert_overrides};
  alerting_->SetMinStepsBeforePage(fresh.min_steps_before_page);
  // Held runs forecast the thresholds the reloaded rules read, as new runs do.
  registry_->SetForecasts(ForecastsInForce(config_.forecasts, alerting_->engine().Rules()));
  spdlog::info("alerts section read again: {} override(s), alerts.min_steps_before_page {}",
               fresh.alert_overrides.size(), fresh.min_steps_before_page);
  return count;
}

Status Daemon::StartAlerting(const std::string& journal_path) {
  auto store = store::AlertStore::Open(journal_path);
  if (!store.ok()) return store.status();
  alert_store_ = std::move(store).value();
  if (config_.receivers.empty()) {
    alerting_->Start(alert_store_.get(), nullptr);
    spdlog::info("no alert receivers configured: alerts go to the trainers' streams and the Query API only");
    return Status::Ok();
  }
  std::vector<std::unique_ptr<notify::Receiver>> receivers;
  for (const Config::Receiver& r : config_.receivers) {
    notify::ReceiverConfig base;
    base.name = r.name;
    base.url = r.url;
    base.external_url = ExternalUrl(config_);
    if (r.type == "alertmanager") {
      receivers.push_back(
          std::make_unique<notify::AlertmanagerReceiver>(notify::AlertmanagerConfig{base, r.resend_interval_seconds}));
    } else if (r.type == "webhook") {
      notify::WebhookConfig c;
      c.receiver = base;
      c.bearer_token = r.bearer_token;
      receivers.push_back(std::make_unique<notify::WebhookReceiver>(c));
    } else if (r.type == "pagerduty") {
      if (base.url.empty()) base.url = "https://events.pagerduty.com/v2/enqueue";
      receivers.push_back(std::make_unique<notify::PagerDutyReceiver>(notify::PagerDutyConfig{base, r.routing_key}));
    } else {
      receivers.push_back(std::make_unique<notify::SlackReceiver>(notify::SlackConfig{base}));
    }
  }
  notify::DispatcherOptions dispatch_options;
  dispatch_options.clock = clock_;  // one clock for the whole daemon
  auto dispatcher = std::make_unique<notify::Dispatcher>(*alert_store_, std::move(receivers), dispatch_options);
  if (notify::Status s = dispatcher->Start(); !s.ok()) {
    return Status::InvalidArgument("alert receivers: " + s.message());
  }
  alerting_->Start(alert_store_.get(), std::move(dispatcher));
  spdlog::info("notifying {} receiver(s); outbox in {}", config_.receivers.size(), journal_path);
  return Status::Ok();
}

void Daemon::TickLoop() {
  constexpr int kTicksPerAlertTimer = 5;  // timer rules (stalled) once a second
  int ticks = 0;
  std::unique_lock lock(tick_mu_);
  while (!stopping_) {
    tick_cv_.wait_for(lock, kTickInterval);
    if (stopping_) break;
    lock.unlock();
    UpdateIngestHealth();
    RelockDataDirIfGone();
    if (const size_t closed = ingest_->CloseStreamsWithoutHello(std::chrono::steady_clock::now()); closed > 0) {
      spdlog::warn("closed {} stream(s) that sent no Hello within {} s of opening (limits.hello_timeout_seconds)",
                   closed, config_.hello_timeout_seconds);
    }
    registry_->Tick();
    if (++ticks % kTicksPerAlertTimer == 0) {
      alerting_->Tick(*registry_, clock_->UnixSeconds());
      PruneOld();
      RefreshTls(/*report_unchanged=*/false);
    }
    lock.lock();
  }
}

void Daemon::SnapshotLoop() {
  const auto interval = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::duration<double>(config_.journal_snapshot_interval_seconds));
  std::unique_lock lock(tick_mu_);
  while (!tick_cv_.wait_for(lock, interval, [this] { return stopping_; })) {
    lock.unlock();
    SaveSnapshots("periodic");
    lock.lock();
  }
}

void Daemon::SaveSnapshots(const char* why) {
  const auto started = std::chrono::steady_clock::now();
  // A snapshot through a step the saved alert states do not cover as evaluated would be refused
  // at the restart (AlertFeed::AcceptsRestoreThrough): have them saved first.
  const runs::RunRegistry::SnapshotReport r = registry_->SaveSnapshots([this](const std::string& run, uint64_t step) {
    return alerting_->SaveEvaluatedThrough(run, step, kSnapshotSettleTimeout);
  });
  if (r.written == 0 && r.failed == 0 && r.deferred == 0) return;
  spdlog::info(
      "snapshots ({}): {} run(s) written ({:.1f} MB), {} unchanged, {} deferred, {} failed in {:.2f} s; a "
      "run's lock held at most {:.1f} ms",
      why, r.written, r.bytes / 1e6, r.unchanged, r.deferred, r.failed,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), r.max_lock_seconds * 1e3);
}

void Daemon::UpdateIngestHealth() {
  const bool healthy = journal_->healthy();
  if (healthy == ingest_serving_) return;
  ingest_serving_ = healthy;
  server_->GetHealthCheckService()->SetServingStatus(kIngestServiceName, healthy);
  if (healthy) {
    spdlog::warn("health: {} is SERVING again: the journal commits", kIngestServiceName);
  } else {
    spdlog::error(
        "health: {} is NOT_SERVING: the journal cannot commit (storage fault); trainers are told to "
        "keep their data and retry",
        kIngestServiceName);
  }
}

void Daemon::PruneOld() {
  constexpr double kDay = 86400;
  constexpr size_t kOutboxBatch = 1000;
  const double now = clock_->UnixSeconds();
  if (config_.journal_retention_days > 0) journal_->SetPruneCutoff(now - config_.journal_retention_days * kDay);
  auto pruned = alert_store_->PruneDone(now - config_.outbox_retention_days * kDay, kOutboxBatch);
  if (pruned.ok()) {
    stats_->outbox_pruned_rows.fetch_add(pruned.value(), std::memory_order_relaxed);
  } else {
    spdlog::error("alerts: pruning the outbox: {}", pruned.status().message());
  }
  // The alert history lives as long as the journal's data it describes.
  if (config_.journal_retention_days > 0) {
    auto history = alert_store_->PruneHistory(now - config_.journal_retention_days * kDay, kOutboxBatch);
    if (!history.ok()) spdlog::error("alerts: pruning the alert history: {}", history.status().message());
  }
}

void Daemon::Stop(std::chrono::milliseconds grace) {
  if (stopped_) return;
  stopped_ = true;
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Stop accepting; streams get `grace` to finish, then are cancelled.
    server_->Shutdown(std::chrono::system_clock::now() + grace);
    server_->Wait();
  }
  {
    std::lock_guard lock(tick_mu_);
    stopping_ = true;
  }
  tick_cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  if (snapshotter_.joinable()) snapshotter_.join();
  if (alerting_) alerting_->Stop();  // saves how far the alerts were evaluated, which snapshots need
  for (auto& w : remote_writers_) {
    if (!w->Drain(grace)) {
      spdlog::warn("remote_write {}: steps left unsent at shutdown; they are sent after the restart",
                   w->options().name);
    }
    w->Stop();
  }
  http_.reset();
  // No stream is left: the runs are as the next start will find them; snapshots spare it the
  // replay.
  if (registry_ && journal_ && config_.journal_snapshot_interval_seconds > 0) SaveSnapshots("shutdown");
  if (journal_) {
    if (Status s = journal_->Flush(); !s.ok()) spdlog::error("journal flush at shutdown: {}", s.ToString());
    journal_->Stop();
  }
  if (lock_fd_ >= 0) {
    ::close(lock_fd_);  // releases the flock
    lock_fd_ = -1;
  }
  spdlog::info("stopped");
}

}  // namespace gradwatch::daemon
