// MonitorSet: one rank's steps to several daemons (replicas watching one run), a Monitor per
// address. Every step and event goes to each; each daemon has its own stream, buffer and acks, so
// one that is down holds up neither the training loop (Log never blocks) nor the others.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gradwatch/monitor.h"

namespace gradwatch::client {

// "a:1,b:2" → {"a:1", "b:2"}; empty entries are dropped.
std::vector<std::string> SplitAddresses(const std::string& list);

class MonitorSet {
 public:
  // One Monitor per address, each with `options` (its address replaced). The callbacks are shared:
  // with several daemons each calls them with its own copy of an alert or error.
  MonitorSet(const std::vector<std::string>& addresses, const MonitorOptions& options);
  ~MonitorSet();  // calls Stop()
  MonitorSet(const MonitorSet&) = delete;
  MonitorSet& operator=(const MonitorSet&) = delete;

  void Start();
  // True when at least one daemon's buffer took the step (the others count a drop).
  bool Log(const v1::StepStats& step);
  bool Event(uint64_t step, const std::string& text);
  // Every daemon has every step and event durable within `timeout` (one deadline for all).
  bool Flush(std::chrono::milliseconds timeout);
  // Ends the run cleanly on every daemon, together (one that is down costs `timeout` once); true
  // when every daemon confirmed.
  bool Finish(std::chrono::milliseconds timeout, v1::GoodbyeReason reason = v1::GOODBYE_REASON_FINISHED,
              const std::string& message = {});
  void Stop();

  size_t size() const { return monitors_.size(); }
  const std::string& address(size_t i) const { return addresses_[i]; }
  MonitorStats Stats(size_t i) const { return monitors_[i]->Stats(); }

 private:
  const std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<Monitor>> monitors_;
};

}  // namespace gradwatch::client
