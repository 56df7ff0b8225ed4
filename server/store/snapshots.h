// Snapshots of runs' in-memory state (series, analytics, counters), one file per run in a
// directory beside the journal. A snapshot is a cache of the journal, never the only copy of
// anything: a restart loads a run's snapshot and replays only the journal's steps after it, and a
// snapshot that is missing, damaged, from another build or no longer true to the journal (the run
// rewound past it) is ignored, and the journal is replayed whole.
//
// File: the magic "GWSNAP\0\1", the format version, the writer's layout fingerprint, the payload's
// length and CRC-32, the run id, then the payload. Named by a 64-bit hash of the run id (ids may
// be long and hold any character); the id inside is checked on read, so a collision only costs a
// snapshot. Written to a temporary file, synced, renamed over the old one and the directory
// synced: a crash leaves the old snapshot or the new one, never a mix.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/byte_chunks.h"
#include "server/core/status.h"

namespace gradwatch::store {

class SnapshotStore {
 public:
  // `dir` is created when the first snapshot is written. `fingerprint` identifies the layout of
  // what the payloads hold (see state_io.h): a file written with another one is not read.
  SnapshotStore(std::string dir, uint64_t fingerprint);

  // Writes the run's snapshot, replacing the previous one. The payload's bytes are all synced
  // before the call returns OK.
  Status Write(const std::string& run_id, std::string_view payload) const;
  Status Write(const std::string& run_id, const ByteChunks& payload) const;
  // The run's payload; NotFound when there is none, another error when the file cannot be read,
  // is damaged (CRC), is truncated, or was written by another layout or for another run.
  StatusOr<std::string> Read(const std::string& run_id) const;
  // Deletes the run's snapshot, if any.
  void Remove(const std::string& run_id) const;
  // Deletes every snapshot (and leftover temporary file) whose run is not in `keep`, or whose
  // header cannot be read; returns how many files it deleted.
  size_t RemoveAllBut(const std::vector<std::string>& keep) const;
  // Moves the snapshot of every run not in `keep` into `to_dir` (created when needed), under its
  // own name, and returns those runs' ids, sorted: after a damaged journal was set aside, the
  // snapshots of the runs it lost go with it, as their last record.
  std::vector<std::string> SetAsideAllBut(const std::vector<std::string>& keep, const std::string& to_dir) const;
  // Bytes of the snapshot files.
  uint64_t DiskBytes() const;

  const std::string& dir() const { return dir_; }
  std::string PathFor(const std::string& run_id) const;

 private:
  // The run whose snapshot the file at `path` is: its header reads and it sits at the run's own path.
  std::optional<std::string> RunOfFile(const std::string& path) const;
  Status WritePieces(const std::string& run_id, const std::vector<std::string_view>& pieces) const;
  const std::string dir_;
  const uint64_t fingerprint_;
};

}  // namespace gradwatch::store
