// A StreamSink for tests of Run and RunRegistry: records everything a run sends to a stream.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "server/runs/run.h"

namespace gradwatch::runs::testing {

class RecordingSink final : public StreamSink {
 public:
  void SendAck(uint64_t durable_step, uint64_t seq) override { acks.emplace_back(durable_step, seq); }
  void SendError(const IngestError& error) override { errors.push_back(error); }
  void Supersede() override { superseded = true; }
  void SendFinished(const std::string&, uint64_t seq) override { finished.push_back(seq); }
  void SendEventAck(uint64_t seq, uint64_t step) override { event_acks.emplace_back(seq, step); }

  std::vector<std::pair<uint64_t, uint64_t>> acks;  // (durable step, seq)
  std::vector<IngestError> errors;
  bool superseded = false;
  std::vector<uint64_t> finished;                         // seqs of the Goodbyes made durable
  std::vector<std::pair<uint64_t, uint64_t>> event_acks;  // (seq, step)
};

}  // namespace gradwatch::runs::testing
