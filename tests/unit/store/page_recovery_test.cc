// RecoverRecords on databases made by SQLite: sound, cut short, with pages overwritten, with a
// WAL, and files that are not SQLite databases. Every record handed out is checked against the
// rows SQL read from the sound database.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <sqlite3.h>

#include "server/store/page_recovery.h"

using namespace gradwatch;
using namespace gradwatch::store;

namespace {

using Row = std::vector<RecoveredValue>;
using Type = RecoveredValue::Type;

// A directory of its own under the system's temporary directory, removed with its files.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("gradwatch-page-recovery-" + std::to_string(rd()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void Exec(sqlite3* db, const std::string& sql) {
  char* error = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error);
  INFO(sql << ": " << (error != nullptr ? error : ""));
  sqlite3_free(error);
  REQUIRE(rc == SQLITE_OK);
}

sqlite3* Open(const std::string& path) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  return db;
}

RecoveredValue Null() { return {}; }
RecoveredValue Int(int64_t v) {
  RecoveredValue r;
  r.type = Type::kInteger;
  r.integer = v;
  return r;
}
RecoveredValue Real(double v) {
  RecoveredValue r;
  r.type = Type::kReal;
  r.real = v;
  return r;
}
RecoveredValue Text(std::string v) {
  RecoveredValue r;
  r.type = Type::kText;
  r.bytes = std::move(v);
  return r;
}
RecoveredValue Blob(std::string v) {
  RecoveredValue r;
  r.type = Type::kBlob;
  r.bytes = std::move(v);
  return r;
}

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

void InsertRow(sqlite3* db, const std::string& sql, const Row& row) {
  sqlite3_stmt* stmt = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK);
  for (size_t i = 0; i < row.size(); ++i) {
    const int c = static_cast<int>(i) + 1;
    const RecoveredValue& v = row[i];
    switch (v.type) {
      case Type::kNull: sqlite3_bind_null(stmt, c); break;
      case Type::kInteger: sqlite3_bind_int64(stmt, c, v.integer); break;
      case Type::kReal: sqlite3_bind_double(stmt, c, v.real); break;
      case Type::kText:
        sqlite3_bind_text(stmt, c, v.bytes.data(), static_cast<int>(v.bytes.size()), SQLITE_TRANSIENT);
        break;
      case Type::kBlob:
        sqlite3_bind_blob(stmt, c, v.bytes.data(), static_cast<int>(v.bytes.size()), SQLITE_TRANSIENT);
        break;
    }
  }
  const int rc = sqlite3_step(stmt);
  sqlite3_finalize(stmt);
  REQUIRE(rc == SQLITE_DONE);
}

const int64_t kIntegers[] = {0,
                             1,
                             -1,
                             127,
                             -128,
                             128,
                             32767,
                             -32768,
                             8388607,
                             -8388608,
                             2147483647,
                             -2147483648LL,
                             int64_t{1} << 40,
                             -(int64_t{1} << 40),
                             (int64_t{1} << 47) - 1,
                             -(int64_t{1} << 47),
                             int64_t{1} << 55,
                             std::numeric_limits<int64_t>::max(),
                             std::numeric_limits<int64_t>::min()};

struct TableSpec {
  std::string name;
  bool without_rowid;
};
const std::vector<TableSpec> kTables = {{"events", false}, {"steps", true},  {"notes", false},
                                        {"kv", true},      {"pairs", false}, {"empty", false}};

// The journal-like tables: thousands of rows, 20 KB blobs and texts that overflow, small ones,
// NULLs, integers of every width, reals (some integral, which SQLite stores as integers), UTF-8,
// a table altered after some rows were written, an index (not read back) and an empty table.
void Fill(sqlite3* db) {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> real(-1e6, 1e6);
  Exec(db,
       "CREATE TABLE steps(run_id TEXT NOT NULL, step INTEGER NOT NULL, v REAL, vals BLOB NOT NULL, "
       "PRIMARY KEY(run_id, step)) WITHOUT ROWID");
  Exec(db, "CREATE TABLE events(id INTEGER PRIMARY KEY, kind TEXT, payload BLOB, n INTEGER, x REAL)");
  Exec(db, "CREATE INDEX events_kind ON events(kind)");
  Exec(db, "CREATE TABLE notes(body TEXT, score REAL)");
  Exec(db, "CREATE TABLE kv(a TEXT, b INTEGER, k TEXT PRIMARY KEY) WITHOUT ROWID");
  Exec(db, "CREATE TABLE pairs(x INTEGER, y TEXT, PRIMARY KEY(x))");
  Exec(db, "CREATE TABLE empty(a, b)");
  Exec(db, "BEGIN");
  for (int i = 0; i < 3000; ++i) {
    Row step = {Text("run-" + std::to_string(i % 5)), Int(i / 5), Null(), Blob(RandomBytes(rng, 8 + rng() % 120))};
    if (i % 10 != 0) step[2] = i % 6 == 0 ? Real(i) : Real(real(rng));
    if (i % 97 == 0) step[3] = Blob(RandomBytes(rng, 20000));
    InsertRow(db, "INSERT INTO steps VALUES(?, ?, ?, ?)", step);

    Row event = {Int(3 * int64_t{i} - 2000), Null(), Null(), Null(), Null()};
    if (i % 11 != 0) event[1] = Text("kind-" + std::to_string(i % 17) + (i % 5 == 0 ? " é ✓" : ""));
    if (i % 13 != 0) event[2] = Blob(RandomBytes(rng, i % 40 == 0 ? 20000 : rng() % 60));
    event[3] = i % 3 == 0 ? Int(kIntegers[i % std::size(kIntegers)]) : Int(static_cast<int64_t>(rng()));
    if (i % 9 != 0) event[4] = i % 7 == 0 ? Real(2.0 * i) : Real(real(rng));
    InsertRow(db, "INSERT INTO events VALUES(?, ?, ?, ?, ?)", event);
  }
  InsertRow(db, "INSERT INTO events VALUES(?, ?, ?, ?, ?)",
            {Int(std::numeric_limits<int64_t>::max()), Text("last"), Null(), Int(-7), Real(-0.5)});
  for (int i = 0; i < 300; ++i) {
    InsertRow(db, "INSERT INTO notes VALUES(?, ?)",
              {Text(std::string(i % 50 == 0 ? 5000 : 10 + i % 30, static_cast<char>('a' + i % 26))), Real(i * 0.25)});
  }
  Exec(db, "ALTER TABLE notes ADD COLUMN extra INTEGER");
  for (int i = 0; i < 300; ++i) {
    InsertRow(db, "INSERT INTO notes VALUES(?, ?, ?)",
              {Text("after " + std::to_string(i)), Real(-i * 1.5), i % 4 == 0 ? Null() : Int(i * 1000)});
  }
  for (int i = 0; i < 300; ++i) {
    InsertRow(db, "INSERT INTO kv VALUES(?, ?, ?)",
              {Text("a-" + std::to_string(i)), Int(int64_t{i} * i), Text("key-" + std::to_string(1000 + i))});
    InsertRow(db, "INSERT INTO pairs VALUES(?, ?)", {Int(7 * int64_t{i} - 5), Text("y-" + std::to_string(i))});
  }
  Exec(db, "COMMIT");
}

// A database of the tables above, in rollback-journal mode.
void Build(const std::string& path, int page_size, int reserve) {
  sqlite3* db = Open(path);
  Exec(db, "PRAGMA page_size=" + std::to_string(page_size));
  if (reserve > 0) {
    int n = reserve;
    REQUIRE(sqlite3_file_control(db, "main", SQLITE_FCNTL_RESERVE_BYTES, &n) == SQLITE_OK);
  }
  Fill(db);
  REQUIRE(sqlite3_close(db) == SQLITE_OK);
}

Row ReadRow(sqlite3_stmt* stmt, int first) {
  Row row;
  for (int c = first; c < sqlite3_column_count(stmt); ++c) {
    switch (sqlite3_column_type(stmt, c)) {
      case SQLITE_INTEGER: row.push_back(Int(sqlite3_column_int64(stmt, c))); break;
      case SQLITE_FLOAT: row.push_back(Real(sqlite3_column_double(stmt, c))); break;
      case SQLITE_TEXT: {
        const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt, c));
        row.push_back(Text(std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt, c)))));
        break;
      }
      case SQLITE_BLOB: {
        const auto* p = static_cast<const char*>(sqlite3_column_blob(stmt, c));
        const auto n = static_cast<size_t>(sqlite3_column_bytes(stmt, c));
        row.push_back(Blob(n == 0 ? std::string() : std::string(p, n)));
        break;
      }
      default: row.push_back(Null()); break;
    }
  }
  return row;
}

std::string Serialize(const Row& row) {
  std::string s;
  for (const RecoveredValue& v : row) {
    s += std::to_string(static_cast<int>(v.type)) + ":";
    switch (v.type) {
      case Type::kNull: break;
      case Type::kInteger: s += std::to_string(v.integer); break;
      case Type::kReal: {
        uint64_t bits = 0;
        std::memcpy(&bits, &v.real, sizeof bits);
        s += std::to_string(bits);
        break;
      }
      case Type::kText:
      case Type::kBlob: s += std::to_string(v.bytes.size()) + ":" + v.bytes; break;
    }
    s += ";";
  }
  return s;
}

// Per table, its rows as SQL reads them: by rowid ("#<rowid>"), or for WITHOUT ROWID tables by
// their whole serialized row.
using Expected = std::map<std::string, std::map<std::string, Row>>;

Expected ReadExpected(sqlite3* db) {
  Expected expected;
  for (const TableSpec& table : kTables) {
    auto& rows = expected[table.name];
    const std::string sql = (table.without_rowid ? "SELECT * FROM " : "SELECT rowid, * FROM ") + table.name;
    sqlite3_stmt* stmt = nullptr;
    REQUIRE(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK);
    while (sqlite3_step(stmt) == SQLITE_ROW) {
      if (table.without_rowid) {
        Row row = ReadRow(stmt, 0);
        rows[Serialize(row)] = std::move(row);
      } else {
        rows["#" + std::to_string(sqlite3_column_int64(stmt, 0))] = ReadRow(stmt, 1);
      }
    }
    sqlite3_finalize(stmt);
  }
  return expected;
}

Expected ReadExpected(const std::string& path) {
  sqlite3* db = Open(path);
  Expected expected = ReadExpected(db);
  REQUIRE(sqlite3_close(db) == SQLITE_OK);
  return expected;
}

bool SameValue(const RecoveredValue& a, const RecoveredValue& b) {
  if (a.type != b.type) return false;
  switch (a.type) {
    case Type::kNull: return true;
    case Type::kInteger: return a.integer == b.integer;
    case Type::kReal: return std::memcmp(&a.real, &b.real, sizeof a.real) == 0;
    default: return a.bytes == b.bytes;
  }
}

// Collects what RecoverRecords hands out and checks each record against the original rows: a
// record is right when it is an original row (its leading values, when it was written before
// columns were added and SQL reads NULL for them), handed out once.
struct Collector {
  explicit Collector(const Expected& e) : expected(e) {}

  void operator()(const std::string& table, const RecoveredRecord& record) {
    const auto rows = expected.find(table);
    if (rows == expected.end()) {
      Wrong("a record of unknown table " + table);
      return;
    }
    const bool without_rowid = std::any_of(kTables.begin(), kTables.end(),
                                           [&](const TableSpec& s) { return s.name == table && s.without_rowid; });
    const std::string key = without_rowid ? Serialize(record.values) : "#" + std::to_string(record.rowid);
    const auto it = rows->second.find(key);
    if (it == rows->second.end()) {
      Wrong(table + ": no original row " + (without_rowid ? "" : key));
      return;
    }
    const Row& original = it->second;
    bool same = record.values.size() <= original.size() && !record.values.empty();
    for (size_t i = 0; same && i < original.size(); ++i) {
      same = i < record.values.size() ? SameValue(record.values[i], original[i]) : original[i].type == Type::kNull;
    }
    if (!same) {
      Wrong(table + ": row " + key + " differs: " + Serialize(record.values).substr(0, 200) + " vs " +
            Serialize(original).substr(0, 200));
      return;
    }
    if (!seen[table].insert(key).second) Wrong(table + ": row " + key + " handed out twice");
  }

  void Wrong(const std::string& what) {
    if (wrong++ == 0) first_wrong = what;
  }

  size_t Total() const {
    size_t n = 0;
    for (const auto& [table, keys] : seen) n += keys.size();
    return n;
  }

  const Expected& expected;
  std::map<std::string, std::set<std::string>> seen;
  uint64_t wrong = 0;
  std::string first_wrong;
};

StatusOr<PageRecoveryReport> Recover(const std::string& path, Collector& collector) {
  return RecoverRecords(path,
                        [&](const std::string& table, const RecoveredRecord& record) { collector(table, record); });
}

size_t TotalRows(const Expected& expected) {
  size_t n = 0;
  for (const auto& [table, rows] : expected) n += rows.size();
  return n;
}

uint64_t Unreadable(const PageRecoveryReport& report) {
  uint64_t n = 0;
  for (const RecoveredTableReport& t : report.tables) n += t.unreadable_pages;
  return n;
}

uint32_t Get32(const std::string& bytes, size_t at) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data() + at);
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3];
}

int64_t RootPage(const std::string& path, const std::string& table) {
  sqlite3* db = Open(path);
  sqlite3_stmt* stmt = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, "SELECT rootpage FROM sqlite_master WHERE name = ?", -1, &stmt, nullptr) == SQLITE_OK);
  sqlite3_bind_text(stmt, 1, table.c_str(), -1, SQLITE_TRANSIENT);
  REQUIRE(sqlite3_step(stmt) == SQLITE_ROW);
  const int64_t root = sqlite3_column_int64(stmt, 0);
  sqlite3_finalize(stmt);
  REQUIRE(sqlite3_close(db) == SQLITE_OK);
  return root;
}

// The levels of a b-tree, counted down its right-most path.
int TreeLevels(const std::string& file, size_t page_size, int64_t root) {
  int levels = 1;
  auto page = static_cast<uint32_t>(root);
  while (true) {
    const size_t at = (page - 1) * page_size + (page == 1 ? 100 : 0);
    const auto type = static_cast<uint8_t>(file.at(at));
    if (type != 0x02 && type != 0x05) return levels;
    page = Get32(file, at + 8);
    ++levels;
  }
}

}  // namespace

TEST_CASE("A sound database gives back every row as SQL reads it", "[store][page_recovery]") {
  TempDir dir;
  struct Layout {
    int page_size;
    int reserve;
  };
  for (const Layout layout : {Layout{512, 0}, Layout{1024, 32}, Layout{4096, 0}, Layout{65536, 0}}) {
    INFO("page size " << layout.page_size << ", reserved " << layout.reserve);
    const std::string path = dir.File("sound-" + std::to_string(layout.page_size) + ".db");
    Build(path, layout.page_size, layout.reserve);
    const std::string file = ReadFile(path);
    REQUIRE(static_cast<int>(static_cast<uint8_t>(file[20])) == layout.reserve);
    if (layout.page_size == 512) {
      CHECK(TreeLevels(file, 512, RootPage(path, "events")) >= 3);
      CHECK(TreeLevels(file, 512, RootPage(path, "steps")) >= 3);
    }
    const Expected expected = ReadExpected(path);
    Collector collector(expected);
    const auto report = Recover(path, collector);
    REQUIRE(report.ok());
    INFO(collector.first_wrong);
    CHECK(collector.wrong == 0);
    CHECK(report->page_size == static_cast<uint32_t>(layout.page_size));
    CHECK(report->pages_in_file == file.size() / layout.page_size);
    CHECK(report->pages_in_header == report->pages_in_file);
    CHECK(report->schema_complete);
    CHECK(report->wal_frames_used == 0);
    CHECK(report->detail.empty());
    REQUIRE(report->tables.size() == kTables.size());
    for (const RecoveredTableReport& table : report->tables) {
      INFO(table.name);
      const auto spec =
          std::find_if(kTables.begin(), kTables.end(), [&](const TableSpec& s) { return s.name == table.name; });
      REQUIRE(spec != kTables.end());
      CHECK(table.without_rowid == spec->without_rowid);
      CHECK(table.root_page == RootPage(path, table.name));
      CHECK(table.sql.rfind("CREATE TABLE", 0) == 0);
      CHECK(table.unreadable_pages == 0);
      CHECK(table.lost_records == 0);
      CHECK(table.records == expected.at(table.name).size());
      CHECK(collector.seen[table.name].size() == expected.at(table.name).size());
    }
  }
}

TEST_CASE("Records come out in b-tree order with the rowid alias and column order restored", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("order.db");
  Build(path, 4096, 0);
  std::map<std::string, std::vector<RecoveredRecord>> records;
  const auto report = RecoverRecords(
      path, [&](const std::string& table, const RecoveredRecord& record) { records[table].push_back(record); });
  REQUIRE(report.ok());
  const auto& events = records["events"];
  REQUIRE(events.size() == 3001);
  for (size_t i = 1; i < events.size(); ++i) REQUIRE(events[i - 1].rowid < events[i].rowid);
  CHECK(events.front().rowid == -2000);
  CHECK(events.back().rowid == std::numeric_limits<int64_t>::max());
  CHECK(events.front().values[0].type == Type::kInteger);
  CHECK(events.front().values[0].integer == -2000);
  // kv(a, b, k PRIMARY KEY) is stored (k, a, b) and handed out (a, b, k), ordered by k.
  const auto& kv = records["kv"];
  REQUIRE(kv.size() == 300);
  CHECK(kv.front().rowid == 0);
  CHECK(kv.front().values[0].bytes == "a-0");
  CHECK(kv.front().values[2].bytes == "key-1000");
  CHECK(kv.back().values[2].bytes == "key-1299");
  // pairs(x INTEGER, y, PRIMARY KEY(x)): x is the rowid.
  const auto& pairs = records["pairs"];
  REQUIRE(pairs.size() == 300);
  CHECK(pairs[1].rowid == 2);
  CHECK(pairs[1].values[0].type == Type::kInteger);
  CHECK(pairs[1].values[0].integer == 2);
  // Rows written before ADD COLUMN have two values, those after three.
  const auto& notes = records["notes"];
  REQUIRE(notes.size() == 600);
  CHECK(notes.front().values.size() == 2);
  CHECK(notes.back().values.size() == 3);
}

TEST_CASE("A database cut short gives back original rows only, and many of them", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("whole.db");
  Build(path, 512, 0);
  const Expected expected = ReadExpected(path);
  const std::string file = ReadFile(path);
  for (const double fraction : {0.02, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99}) {
    INFO("cut at " << fraction);
    const std::string cut = dir.File("cut.db");
    // Not at a page boundary: the last page is partial.
    WriteFile(cut, file.substr(0, static_cast<size_t>(fraction * static_cast<double>(file.size())) + 123));
    Collector collector(expected);
    const auto report = Recover(cut, collector);
    REQUIRE(report.ok());
    INFO(collector.first_wrong);
    CHECK(collector.wrong == 0);
    CHECK(report->pages_in_file < report->pages_in_header);
    CHECK(Unreadable(report.value()) > 0);
    CHECK_FALSE(report->detail.empty());
    if (fraction == 0.5) {
      CHECK(report->schema_complete);
      CHECK(collector.Total() > TotalRows(expected) / 10);
    }
  }
}

TEST_CASE("Pages overwritten with junk never yield a wrong row", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("whole.db");
  Build(path, 512, 0);
  const Expected expected = ReadExpected(path);
  const std::string file = ReadFile(path);
  const size_t pages = file.size() / 512;
  std::mt19937_64 rng(7);
  for (int round = 0; round < 6; ++round) {
    INFO("round " << round);
    std::string damaged = file;
    const bool zeros = round % 2 == 1;
    const bool spare_page_one = round < 4;
    for (size_t page = spare_page_one ? 2 : 1; page <= pages; ++page) {
      if (rng() % 100 >= 8) continue;
      for (size_t i = 0; i < 512; ++i) damaged[(page - 1) * 512 + i] = zeros ? '\0' : static_cast<char>(rng());
    }
    const std::string junk = dir.File("junk.db");
    WriteFile(junk, damaged);
    Collector collector(expected);
    const auto report = Recover(junk, collector);
    if (!spare_page_one && !report.ok()) continue;  // page 1's header went too
    REQUIRE(report.ok());
    INFO(collector.first_wrong);
    CHECK(collector.wrong == 0);
    if (spare_page_one) {
      CHECK(collector.Total() > 0);
      uint64_t lost = 0;
      for (const RecoveredTableReport& t : report->tables) lost += t.lost_records;
      CHECK(Unreadable(report.value()) + lost > 0);
    }
  }
}

TEST_CASE("Random byte flips and a tree loop neither crash nor hang the reader", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("whole.db");
  Build(path, 512, 0);
  const std::string file = ReadFile(path);
  std::mt19937_64 rng(11);
  for (int round = 0; round < 12; ++round) {
    std::string damaged = file;
    for (int i = 0; i < 300; ++i) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    const std::string flipped = dir.File("flipped.db");
    WriteFile(flipped, damaged);
    uint64_t records = 0;
    const auto report = RecoverRecords(flipped, [&](const std::string&, const RecoveredRecord&) { ++records; });
    if (report.ok()) CHECK(records <= 20000);
  }

  // The root of events made its own right-most child: that subtree is cut, the rest read.
  const Expected expected = ReadExpected(path);
  const int64_t root = RootPage(path, "events");
  std::string looped = file;
  const size_t at = static_cast<size_t>(root - 1) * 512;
  REQUIRE(static_cast<uint8_t>(looped[at]) == 0x05);
  for (int i = 0; i < 4; ++i) looped[at + 8 + i] = static_cast<char>(static_cast<uint32_t>(root) >> (24 - 8 * i));
  const std::string loop = dir.File("loop.db");
  WriteFile(loop, looped);
  Collector collector(expected);
  const auto report = Recover(loop, collector);
  REQUIRE(report.ok());
  CHECK(collector.wrong == 0);
  CHECK(collector.seen["events"].size() > 0);
  CHECK(collector.seen["events"].size() < expected.at("events").size());
  CHECK(collector.seen["steps"].size() == expected.at("steps").size());
}

TEST_CASE("Rows committed only to the WAL are recovered", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("wal.db");
  sqlite3* db = Open(path);
  Exec(db, "PRAGMA page_size=1024");
  Exec(db, "PRAGMA journal_mode=WAL");
  Exec(db, "PRAGMA wal_autocheckpoint=0");
  Fill(db);
  Exec(db, "PRAGMA wal_checkpoint(TRUNCATE)");
  const Expected checkpointed = ReadExpected(db);
  // Transactions that stay in the WAL: inserts, updates and deletes.
  Exec(db, "BEGIN");
  for (int i = 0; i < 500; ++i) {
    InsertRow(db, "INSERT INTO events VALUES(?, ?, ?, ?, ?)",
              {Int(100000 + i), Text("wal"), Blob(std::string(i % 50 == 0 ? 9000 : 20, 'w')), Int(i), Real(0.5 + i)});
  }
  Exec(db, "COMMIT");
  Exec(db, "UPDATE events SET kind = 'updated', x = 1.25 WHERE id % 7 = 0");
  Exec(db, "DELETE FROM steps WHERE step % 10 = 0");
  Exec(db, "DELETE FROM notes WHERE rowid % 3 = 0");
  const Expected expected = ReadExpected(db);
  const std::string copy = dir.File("copy.db");
  std::filesystem::copy_file(path, copy);
  std::filesystem::copy_file(path + "-wal", copy + "-wal");
  REQUIRE(sqlite3_close(db) == SQLITE_OK);
  REQUIRE(std::filesystem::file_size(copy + "-wal") > 0);

  {
    Collector collector(expected);
    const auto report = Recover(copy, collector);
    REQUIRE(report.ok());
    INFO(collector.first_wrong);
    CHECK(collector.wrong == 0);
    CHECK(collector.Total() == TotalRows(expected));
    CHECK(report->wal_frames_used > 0);
    CHECK(report->pages_in_header > report->pages_in_file);
    CHECK(report->schema_complete);
  }
  {
    // Junk after the last frame (a frame that fails its checksum) changes nothing.
    std::mt19937_64 rng(3);
    std::ofstream(copy + "-wal", std::ios::binary | std::ios::app) << RandomBytes(rng, 24 + 1024);
    Collector collector(expected);
    const auto report = Recover(copy, collector);
    REQUIRE(report.ok());
    CHECK(collector.wrong == 0);
    CHECK(collector.Total() == TotalRows(expected));
  }
  {
    // Without the WAL, the file alone holds the checkpointed rows.
    std::filesystem::remove(copy + "-wal");
    Collector collector(checkpointed);
    const auto report = Recover(copy, collector);
    REQUIRE(report.ok());
    CHECK(collector.wrong == 0);
    CHECK(collector.Total() == TotalRows(checkpointed));
    CHECK(report->wal_frames_used == 0);
  }
}

TEST_CASE("Files that are not SQLite databases are errors", "[store][page_recovery]") {
  TempDir dir;
  auto nothing = [](const std::string&, const RecoveredRecord&) {};
  CHECK_FALSE(RecoverRecords(dir.File("missing.db"), nothing).ok());
  WriteFile(dir.File("empty.db"), "");
  CHECK_FALSE(RecoverRecords(dir.File("empty.db"), nothing).ok());
  WriteFile(dir.File("text.db"), std::string(4096, 'x'));
  const auto text = RecoverRecords(dir.File("text.db"), nothing);
  REQUIRE_FALSE(text.ok());
  CHECK(text.status().message().find("not a SQLite database") != std::string::npos);

  // A header alone (less than a page) is a database whose every page is missing.
  const std::string path = dir.File("small.db");
  Build(path, 4096, 0);
  WriteFile(dir.File("header.db"), ReadFile(path).substr(0, 300));
  const auto header = RecoverRecords(dir.File("header.db"), nothing);
  REQUIRE(header.ok());
  CHECK(header->pages_in_file == 0);
  CHECK_FALSE(header->schema_complete);
  CHECK(header->tables.empty());
  CHECK_FALSE(header->detail.empty());
}

TEST_CASE("A UTF-16 database is refused", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("utf16.db");
  sqlite3* db = Open(path);
  Exec(db, "PRAGMA encoding='UTF-16le'");
  Exec(db, "CREATE TABLE t(a TEXT); INSERT INTO t VALUES('hello')");
  REQUIRE(sqlite3_close(db) == SQLITE_OK);
  const auto report = RecoverRecords(path, [](const std::string&, const RecoveredRecord&) {});
  REQUIRE_FALSE(report.ok());
  CHECK(report.status().message().find("UTF-16") != std::string::npos);
}

TEST_CASE("Unusual column definitions are read as SQL reads them", "[store][page_recovery]") {
  TempDir dir;
  const std::string path = dir.File("shapes.db");
  sqlite3* db = Open(path);
  // A DESC primary key is not the rowid's alias (it may even hold NULL); generated VIRTUAL columns
  // are not stored; the REAL affinity of a multi-word type; WITHOUT ROWID after a comment.
  Exec(db,
       "CREATE TABLE shapes(a DOUBLE PRECISION, \"odd, name\" INTEGER PRIMARY KEY DESC, g AS (a * 2) VIRTUAL, "
       "s INTEGER GENERATED ALWAYS AS (a + 1) STORED, c VARCHAR(10) DEFAULT 'x,y')");
  Exec(db, "CREATE TABLE [w t](k TEXT, v FLOAT, CONSTRAINT pk PRIMARY KEY (v, k)) /* ) */ without\n rowid");
  Exec(db, "CREATE TABLE alias(-- a comment\n \"id\" integer CONSTRAINT p PRIMARY KEY ASC, t)");
  Exec(db, "BEGIN");
  for (int i = 0; i < 200; ++i) {
    InsertRow(db, "INSERT INTO shapes(a, \"odd, name\", c) VALUES(?, ?, ?)",
              {i % 5 == 0 ? Int(i) : Real(i + 0.5), i % 10 == 3 ? Null() : Int(1000 - i), Text(std::to_string(i))});
    InsertRow(db, "INSERT INTO [w t] VALUES(?, ?)",
              {Text("k" + std::to_string(i % 7)), Real(i % 3 == 0 ? i : i * 0.1)});
    InsertRow(db, "INSERT INTO alias VALUES(?, ?)", {Int(5 * i), Text("t")});
  }
  Exec(db, "COMMIT");
  const std::map<std::string, std::string> stored_columns = {
      {"shapes", "SELECT rowid, a, \"odd, name\", s, c FROM shapes"},
      {"w t", "SELECT k, v FROM [w t]"},
      {"alias", "SELECT rowid, id, t FROM alias"}};
  std::map<std::string, std::set<std::string>> expected;
  for (const auto& [table, sql] : stored_columns) {
    sqlite3_stmt* stmt = nullptr;
    REQUIRE(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK);
    while (sqlite3_step(stmt) == SQLITE_ROW) expected[table].insert(Serialize(ReadRow(stmt, 0)));
    sqlite3_finalize(stmt);
  }
  REQUIRE(sqlite3_close(db) == SQLITE_OK);

  std::map<std::string, std::set<std::string>> recovered;
  const auto report = RecoverRecords(path, [&](const std::string& table, const RecoveredRecord& record) {
    Row row = record.values;
    if (table != "w t") row.insert(row.begin(), Int(record.rowid));
    recovered[table].insert(Serialize(row));
  });
  REQUIRE(report.ok());
  REQUIRE(report->tables.size() == 3);
  CHECK_FALSE(report->tables[0].without_rowid);
  CHECK(report->tables[1].without_rowid);
  CHECK(report->detail.empty());
  for (const auto& [table, rows] : expected) {
    INFO(table);
    CHECK(rows.size() == 200);
    CHECK(recovered[table] == rows);
  }
}
