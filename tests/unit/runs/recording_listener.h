// A StepListener for tests of Run and RunRegistry: records everything runs publish, per run, in
// the order it came, and when it was delivered.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/runs/step_listener.h"

namespace gradwatch::runs::testing {

class RecordingListener final : public StepListener {
 public:
  struct Published {
    std::string run_id;
    std::string what;  // "series <id> <key>", "step <n>", "restored <n>", "rewind <n>", "end clean|unclean"
  };

  std::shared_ptr<RunChannel> Open(const RunMeta& meta, bool restored) override {
    std::lock_guard lock(mu_);
    opened.emplace_back(meta.run_id, restored);
    return std::make_shared<Channel>(this, meta.run_id);
  }
  void OnRunLeftMemory(const std::string& run_id, double) override {
    std::lock_guard lock(mu_);
    left.push_back(run_id);
  }

  // What was published (series excluded unless asked for), and how much was delivered.
  std::vector<std::string> Log(const std::string& run_id, bool with_series = false) const {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const Published& p : published) {
      if (p.run_id == run_id && (with_series || p.what.rfind("series", 0) != 0)) out.push_back(p.what);
    }
    return out;
  }
  size_t Delivered() const {
    std::lock_guard lock(mu_);
    return delivered;
  }
  size_t Undelivered() const {
    std::lock_guard lock(mu_);
    return published.size() - delivered;
  }

  std::vector<std::pair<std::string, bool>> opened;  // (run, restored)
  std::vector<std::string> left;

 private:
  class Channel final : public RunChannel {
   public:
    Channel(RecordingListener* owner, std::string run_id) : owner_(owner), run_id_(std::move(run_id)) {}
    void OnSeries(SeriesId id, const std::string& key) override { Add("series " + std::to_string(id) + " " + key); }
    void OnStep(const PublishedStep& p) override {
      Add((p.restored ? "restored " : "step ") + std::to_string(p.step.step));
    }
    void OnRewind(uint64_t from_step, double) override { Add("rewind " + std::to_string(from_step)); }
    void OnEnded(bool clean, double) override { Add(clean ? "end clean" : "end unclean"); }
    void Deliver() override {
      std::lock_guard lock(owner_->mu_);
      owner_->delivered = owner_->published.size();
    }

   private:
    void Add(std::string what) {
      std::lock_guard lock(owner_->mu_);
      owner_->published.push_back({run_id_, std::move(what)});
    }
    RecordingListener* const owner_;
    const std::string run_id_;
  };

  mutable std::mutex mu_;
  std::vector<Published> published;
  size_t delivered = 0;
};

}  // namespace gradwatch::runs::testing
