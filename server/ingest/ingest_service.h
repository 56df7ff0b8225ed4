// The Ingest service: one callback reactor per trainer stream. Handlers only convert and hand on
// to the run registry; answers (accepted, acks, errors) are queued and written one at a time.
//
// Locking: a stream's mutex guards its run, run id, rank and answer queue. Lock order: the run
// registry's locks, then a run's mutex, then a stream's (a run answers through its StreamSink with
// its own mutex held); a stream calls into its run only with its own mutex released.
#pragma once

#include <chrono>
#include <cstddef>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "alerts/alert.h"
#include "gradwatch/v1/gradwatch.grpc.pb.h"
#include "server/core/clock.h"
#include "server/core/thread_annotations.h"
#include "server/ingest/convert.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"

namespace gradwatch::ingest {

class Authorizer;

struct IngestOptions {
  // Largest TrainerMessage accepted (bytes); larger ones get an OVERSIZED error. gRPC itself is
  // configured to let messages up to a margin above this through, so the stream survives them.
  size_t max_message_bytes = 4 << 20;
  // Answers waiting to be written on one stream before errors are dropped (acks coalesce).
  size_t max_queued_answers = 1024;
  HelloLimits hello;
  // Streams open at once, and of one caller (its token's or certificate's name in the policy;
  // without a policy, every caller is one). Only authenticated streams count: one refused by the
  // policy is answered and closed without taking a slot.
  size_t max_streams = 4096;
  size_t max_streams_per_identity = 4096;
  // A stream that sends no Hello this long after it opens is closed (CloseStreamsWithoutHello).
  std::chrono::milliseconds hello_timeout{30'000};
};

// A stream waiting for its Hello (IngestService::CloseStreamsWithoutHello).
class HelloWaiter {
 public:
  virtual ~HelloWaiter() = default;
  // Cancels the call: it sent no Hello in time.
  virtual void CloseForNoHello() = 0;
};

// A stream that hears its run's alerts (IngestService::SendAlert).
class AlertReceiver {
 public:
  virtual ~AlertReceiver() = default;
  virtual void SendAlert(const alerts::Alert& alert) = 0;
};

class IngestService final : public v1::Ingest::CallbackService {
 public:
  IngestService(const IngestOptions& options, runs::RunRegistry* registry, runs::DaemonStats* stats,
                const Clock* clock);

  grpc::ServerBidiReactor<v1::TrainerMessage, v1::DaemonMessage>* Stream(grpc::CallbackServerContext* context) override;

  const IngestOptions& options() const { return options_; }
  runs::RunRegistry* registry() const { return registry_; }
  runs::DaemonStats* stats() const { return stats_; }
  const Clock* clock() const { return clock_; }
  // Who may stream which runs (null: everyone). Set before the service is registered.
  void set_authorizer(const Authorizer* authorizer) { authorizer_ = authorizer; }
  const Authorizer* authorizer() const { return authorizer_; }

  // Sends a firing or resolved alert to every stream carrying its run (the alert's "run" label):
  // each stream from just before its Hello is attached until it detaches or is superseded.
  // Thread-safe; it only queues. Lock order: a run's mutex, then the receivers', then a stream's.
  void SendAlert(const alerts::Alert& alert);
  void Subscribe(const std::string& run_id, AlertReceiver* receiver);
  void Unsubscribe(const std::string& run_id, AlertReceiver* receiver);

  // Counts a new authenticated stream of `identity` against max_streams and
  // max_streams_per_identity: OK, or RESOURCE_EXHAUSTED saying which limit. ReleaseSlot undoes an
  // OK.
  grpc::Status TakeSlot(const std::string& identity, const std::string& peer);
  void ReleaseSlot(const std::string& identity);

  // Streams wait for their Hello in the order they opened; a stream whose Hello came (or that
  // ended) leaves the list. Thread-safe.
  void AwaitHello(HelloWaiter* stream);
  void HelloDone(HelloWaiter* stream);
  // Closes the streams that opened more than hello_timeout before `now` without a Hello (the
  // daemon's tick calls it); returns how many.
  size_t CloseStreamsWithoutHello(std::chrono::steady_clock::time_point now);

 private:
  const IngestOptions options_;
  runs::RunRegistry* const registry_;
  runs::DaemonStats* const stats_;
  const Clock* const clock_;
  const Authorizer* authorizer_ = nullptr;
  std::mutex receivers_mu_;
  std::unordered_map<std::string, std::vector<AlertReceiver*>> receivers_;  // guarded by receivers_mu_

  Mutex slots_mu_;
  size_t open_ GUARDED_BY(slots_mu_) = 0;
  std::unordered_map<std::string, size_t> open_by_identity_ GUARDED_BY(slots_mu_);

  struct Waiting {
    std::chrono::steady_clock::time_point opened;
    HelloWaiter* stream;
  };
  Mutex hello_mu_;
  std::list<Waiting> awaiting_hello_ GUARDED_BY(hello_mu_);  // in order of opening
  std::unordered_map<HelloWaiter*, std::list<Waiting>::iterator> awaiting_index_ GUARDED_BY(hello_mu_);
};

}  // namespace gradwatch::ingest
