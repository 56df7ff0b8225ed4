#include "server/daemon/step_fanout.h"

namespace gradwatch::daemon {

namespace {

class FanoutChannel final : public runs::RunChannel {
 public:
  explicit FanoutChannel(std::vector<std::shared_ptr<runs::RunChannel>> channels) : channels_(std::move(channels)) {}

  void OnSeries(SeriesId id, const std::string& key) override {
    for (const auto& c : channels_) c->OnSeries(id, key);
  }
  void OnStep(const runs::PublishedStep& step) override {
    for (const auto& c : channels_) c->OnStep(step);
  }
  void OnRewind(uint64_t from_step, double now) override {
    for (const auto& c : channels_) c->OnRewind(from_step, now);
  }
  void OnEnded(bool clean, double now) override {
    for (const auto& c : channels_) c->OnEnded(clean, now);
  }
  void Deliver() override {
    for (const auto& c : channels_) c->Deliver();
  }
  bool AcceptsRestoreThrough(uint64_t step) override {
    bool all = true;
    for (const auto& c : channels_) all = c->AcceptsRestoreThrough(step) && all;
    return all;
  }

 private:
  const std::vector<std::shared_ptr<runs::RunChannel>> channels_;
};

}  // namespace

std::shared_ptr<runs::RunChannel> StepFanout::Open(const RunMeta& meta, bool restored) {
  std::vector<std::shared_ptr<runs::RunChannel>> channels;
  for (runs::StepListener* l : listeners_) {
    if (auto c = l->Open(meta, restored)) channels.push_back(std::move(c));
  }
  if (channels.size() == 1) return channels.front();
  return std::make_shared<FanoutChannel>(std::move(channels));
}

void StepFanout::OnRunLeftMemory(const std::string& run_id, double now) {
  for (runs::StepListener* l : listeners_) l->OnRunLeftMemory(run_id, now);
}

}  // namespace gradwatch::daemon
