// Salvage of a SQLite database that SQLite itself refuses: reads every record that is still
// readable from the file, without SQLite. A journal cut short (cut in half by a full disk or a bad
// copy) is "malformed" to SQLite as soon as it loads the schema, since sqlite_master names root
// pages beyond the end of the file, and Debian's SQLite has no `.recover`.
//
// What it reads: the file format itself (https://www.sqlite.org/fileformat2.html), one page at a
// time on demand (pread; memory holds a few pages, never the file): the 100-byte header, the
// b-tree of sqlite_master from page 1, then the b-tree of every table sqlite_master names (rowid
// tables, and the index b-trees of WITHOUT ROWID tables), overflow chains included, and the
// committed frames of a "-wal" file beside the database, whose pages override the file's.
//
// What it does not read: anything no readable b-tree page points to. It is a tree walk only, so
// freelist pages, orphan pages whose parent was lost, and the free space of pages are never read:
// deleted rows never come back, and neither do the rows of a subtree whose interior page is gone.
// Indexes are skipped (their content is in their tables). A page that is missing (beyond the end of
// the file) or malformed (a page type foreign to its tree, cells outside the page's cell area,
// rowids out of order or outside the range its parent gives) is skipped with its whole subtree; a
// record whose overflow chain is broken (a page missing, reached twice, all zeros, or a last page
// not ending the chain) or whose header is invalid is counted lost, never handed out in part.
// SQLite keeps no checksums, so bytes changed within a record's data cannot be told and come out as
// they are. Every offset, cell count, varint, serial type and page number is bounds-checked, so
// that hostile bytes make it skip, never crash, read out of bounds or allocate from a size field.
//
// Records are handed out as stored, but for what SQL would read differently: the NULL that stands
// for an INTEGER PRIMARY KEY becomes the rowid, an integer in a column of REAL affinity becomes a
// real, and the values of a WITHOUT ROWID table (stored primary key first) come in column order.
// Only UTF-8 databases are read.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "server/core/status.h"

namespace gradwatch::store {

// One column value of a recovered record (the serial types of SQLite's record format).
struct RecoveredValue {
  enum class Type { kNull, kInteger, kReal, kText, kBlob };
  Type type = Type::kNull;
  int64_t integer = 0;
  double real = 0;
  std::string bytes;  // text or blob
};

struct RecoveredRecord {
  int64_t rowid = 0;  // table b-trees; 0 for WITHOUT ROWID (index b-tree) tables
  // In column order, as stored: rows written before an ALTER TABLE ADD COLUMN have fewer values.
  std::vector<RecoveredValue> values;
};

// What was found about one table of sqlite_master (type 'table', not sqlite_*, not virtual).
struct RecoveredTableReport {
  std::string name;
  std::string sql;  // its CREATE TABLE text
  int64_t root_page = 0;
  bool without_rowid = false;
  uint64_t records = 0;  // handed to on_record
  // Pages of its tree that are beyond the end of the file, malformed, or reached twice (a loop);
  // their subtrees are skipped.
  uint64_t unreadable_pages = 0;
  // Cells seen but unreadable (overflow chain broken or missing, bad record header).
  uint64_t lost_records = 0;
};

struct PageRecoveryReport {
  uint32_t page_size = 0;
  uint64_t pages_in_file = 0;    // file size / page size
  uint64_t pages_in_header = 0;  // the header's database size (the last WAL commit's, when one is used)
  // sqlite_master's tree was read without skipping a page or losing a record.
  bool schema_complete = false;
  uint64_t wal_frames_used = 0;  // frames of committed transactions read from the "-wal" file
  std::vector<RecoveredTableReport> tables;
  std::string detail;  // human-readable summary of the problems found (empty when none)
};

// Reads, without SQLite, every record of every table of the database file at `path` that can still
// be read, by walking each table's b-tree from its root page (found in sqlite_master on page 1) and
// skipping pages that are missing (beyond the end of the file) or malformed. Calls
// on_record(table_name, record) for each record, in b-tree order per table. Only a file whose first
// page (the 100-byte header) cannot be read or is not a SQLite database is an error (IoError), and
// a database whose text encoding is not UTF-8.
StatusOr<PageRecoveryReport> RecoverRecords(
    const std::string& path,
    const std::function<void(const std::string& table, const RecoveredRecord& record)>& on_record);

}  // namespace gradwatch::store
