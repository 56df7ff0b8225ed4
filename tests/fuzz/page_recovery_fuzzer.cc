// Fuzzes the page-by-page reader of SQLite files (page_recovery.h), which reads a journal SQLite
// refuses: damaged, cut short or foreign bytes. Any input is read or refused without a crash, an
// out-of-bounds read or an allocation from a size field; every record handed out has no more
// values than a table may have columns.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "server/store/page_recovery.h"

using namespace gradwatch::store;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A file of its own per process (the reader takes a path), rewritten for every input and
  // removed at exit.
  static const struct Scratch {
    std::string path = "/tmp/gradwatch-fuzz-page-recovery-" + std::to_string(::getpid()) + ".db";
    ~Scratch() { std::remove(path.c_str()); }
  } scratch;
  const std::string& path = scratch.path;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  size_t records = 0;
  const auto report = RecoverRecords(path, [&](const std::string&, const RecoveredRecord& record) {
    if (record.values.size() > 32767) std::abort();  // SQLite's most columns
    ++records;
  });
  if (report.ok()) {
    uint64_t counted = 0;
    for (const RecoveredTableReport& t : report->tables) counted += t.records;
    if (counted != records) std::abort();
  }
  return 0;
}
