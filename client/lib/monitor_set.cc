#include "gradwatch/monitor_set.h"

#include <algorithm>
#include <thread>

namespace gradwatch::client {

std::vector<std::string> SplitAddresses(const std::string& list) {
  std::vector<std::string> out;
  size_t from = 0;
  while (from <= list.size()) {
    const size_t comma = std::min(list.find(',', from), list.size());
    if (comma > from) out.push_back(list.substr(from, comma - from));
    from = comma + 1;
  }
  return out;
}

MonitorSet::MonitorSet(const std::vector<std::string>& addresses, const MonitorOptions& options)
    : addresses_(addresses) {
  for (const std::string& address : addresses_) {
    MonitorOptions o = options;
    o.address = address;
    monitors_.push_back(std::make_unique<Monitor>(std::move(o)));
  }
}

MonitorSet::~MonitorSet() { Stop(); }

void MonitorSet::Start() {
  for (auto& m : monitors_) m->Start();
}

bool MonitorSet::Log(const v1::StepStats& step) {
  bool taken = false;
  for (auto& m : monitors_) taken = m->Log(step) || taken;
  return taken;
}

bool MonitorSet::Event(uint64_t step, const std::string& text) {
  bool taken = false;
  for (auto& m : monitors_) taken = m->Event(step, text) || taken;
  return taken;
}

bool MonitorSet::Flush(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool all = true;
  for (auto& m : monitors_) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    all = m->Flush(std::max(left, std::chrono::milliseconds(0))) && all;
  }
  return all;
}

bool MonitorSet::Finish(std::chrono::milliseconds timeout, v1::GoodbyeReason reason, const std::string& message) {
  std::vector<char> confirmed(monitors_.size(), 0);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < monitors_.size(); ++i) {
    threads.emplace_back([&, i] { confirmed[i] = monitors_[i]->Finish(timeout, reason, message) ? 1 : 0; });
  }
  for (auto& t : threads) t.join();
  return std::all_of(confirmed.begin(), confirmed.end(), [](char c) { return c != 0; });
}

void MonitorSet::Stop() {
  for (auto& m : monitors_) m->Stop();
}

}  // namespace gradwatch::client
