#include "server/store/page_recovery.h"

#include "server/store/table_shape.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace gradwatch::store {
namespace {

// Deeper trees are not built by SQLite (a tree of 64 levels would hold far more than 2^32 pages).
constexpr int kMaxTreeDepth = 64;
// No record larger than this is assembled (SQLite's own limit is 1 GB by default).
constexpr uint64_t kMaxRecordBytes = uint64_t{1} << 30;

constexpr size_t kFileHeaderSize = 100;
constexpr uint32_t kMinUsableSize = 480;

constexpr uint8_t kIndexInterior = 0x02;
constexpr uint8_t kTableInterior = 0x05;
constexpr uint8_t kIndexLeaf = 0x0A;
constexpr uint8_t kTableLeaf = 0x0D;

constexpr uint32_t kWalMagicLittleEndian = 0x377f0682;
constexpr uint32_t kWalMagicBigEndian = 0x377f0683;
constexpr uint32_t kWalVersion = 3007000;
constexpr size_t kWalHeaderSize = 32;
constexpr size_t kWalFrameHeaderSize = 24;

uint32_t Get16(const uint8_t* p) { return uint32_t{p[0]} << 8 | p[1]; }
uint32_t Get32(const uint8_t* p) { return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3]; }
uint32_t Get32Le(const uint8_t* p) { return uint32_t{p[3]} << 24 | uint32_t{p[2]} << 16 | uint32_t{p[1]} << 8 | p[0]; }

// Reads the varint at the start of the `size` bytes at `p` into `value`; returns its length, or 0
// when it does not end within them.
size_t GetVarint(const uint8_t* p, size_t size, uint64_t& value) {
  uint64_t v = 0;
  for (size_t i = 0; i < 9; ++i) {
    if (i >= size) return 0;
    if (i == 8) {
      value = (v << 8) | p[i];
      return 9;
    }
    v = (v << 7) | (p[i] & 0x7f);
    if ((p[i] & 0x80) == 0) {
      value = v;
      return i + 1;
    }
  }
  return 0;
}

// the header or a serial type is invalid or the body's size is not exactly what the header says.
bool DecodeRecord(const std::string& payload, std::vector<RecoveredValue>& values) {
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  const size_t size = payload.size();
  uint64_t header_size = 0;
  size_t pos = GetVarint(p, size, header_size);
  if (pos == 0 || header_size < pos || header_size > size) return false;
  uint64_t body = header_size;
  while (pos < header_size) {
    uint64_t serial_type = 0;
    const size_t n = GetVarint(p + pos, header_size - pos, serial_type);
    if (n == 0) return false;
    pos += n;
    RecoveredValue v;
    uint64_t length = 0;
    switch (serial_type) {
      case 0: break;
      case 1: length = 1; break;
      case 2: length = 2; break;
      case 3: length = 3; break;
      case 4: length = 4; break;
      case 5: length = 6; break;
      case 6: length = 8; break;
      case 7: length = 8; break;
      case 8:
      case 9:
        v.type = RecoveredValue::Type::kInteger;
        v.integer = serial_type == 9 ? 1 : 0;
        break;
      case 10:
      case 11: return false;
      default: length = (serial_type - 12) / 2; break;
    }
    if (length > size - body) return false;
    const uint8_t* data = p + body;
    if (serial_type >= 1 && serial_type <= 6) {
      // Big-endian two's complement: the first byte sign-extended, the rest shifted in.
      uint64_t x = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int8_t>(data[0])));
      for (uint64_t i = 1; i < length; ++i) x = (x << 8) | data[i];
      v.type = RecoveredValue::Type::kInteger;
      v.integer = static_cast<int64_t>(x);
    } else if (serial_type == 7) {
      uint64_t x = 0;
      for (int i = 0; i < 8; ++i) x = (x << 8) | data[i];
      v.type = RecoveredValue::Type::kReal;
      v.real = std::bit_cast<double>(x);
    } else if (serial_type >= 12) {
      v.type = serial_type % 2 == 0 ? RecoveredValue::Type::kBlob : RecoveredValue::Type::kText;
      v.bytes.assign(reinterpret_cast<const char*>(data), length);
    }
    body += length;
    values.push_back(std::move(v));
  }
  return body == size;
}

// A file read with pread; closed on destruction.
class File {
 public:
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  // False, errno set, when the file cannot be opened or is not a regular file.
  bool Open(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return false;
    struct stat st;
    if (::fstat(fd_, &st) != 0) return false;
    if (!S_ISREG(st.st_mode)) {
      errno = EISDIR;
      return false;
    }
    size_ = static_cast<uint64_t>(st.st_size);
    return true;
  }

  uint64_t size() const { return size_; }

  // Reads exactly `n` bytes at `offset`; false when they are not all there.
  bool ReadAt(uint64_t offset, void* out, size_t n) const {
    if (fd_ < 0 || offset > size_ || n > size_ - offset) return false;
    auto* p = static_cast<uint8_t*>(out);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
    return true;
  }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A cell of a b-tree page, its parts located on the page.
struct Cell {
  uint32_t child = 0;           // interior pages: the left child
  int64_t rowid = 0;            // table b-trees (an interior cell's key)
  uint64_t payload_size = 0;    // leaf cells and index cells
  size_t local_offset = 0;      // where the payload's local part starts on the page
  size_t local_size = 0;        // its size
  uint32_t first_overflow = 0;  // the first overflow page when the payload does not fit locally
  bool has_overflow = false;
};

// The rowids a subtree of a table b-tree may hold: lo < rowid <= hi.
struct RowidRange {
  std::optional<int64_t> lo, hi;
  bool Contains(int64_t rowid) const { return (!lo || rowid > *lo) && (!hi || rowid <= *hi); }
};

struct TreeCounts {
  uint64_t unreadable_pages = 0;
  uint64_t lost_records = 0;
};

// Takes a cell's whole payload (and its rowid, 0 in index b-trees); false when it is not a
// readable record (counted lost).
using PayloadSink = std::function<bool(int64_t rowid, const std::string& payload)>;

using RecordCallback = std::function<void(const std::string& table, const RecoveredRecord& record)>;

class Recoverer {
 public:
  explicit Recoverer(const RecordCallback& on_record) : on_record_(on_record) {}

  StatusOr<PageRecoveryReport> Run(const std::string& path);

 private:
  // Reads the committed frames of the WAL at `path`, if it exists and is valid.
  void LoadWal(const std::string& path);
  void WalChecksum(const uint8_t* p, size_t n, uint32_t& s0, uint32_t& s1) const;

  bool Readable(uint32_t page) const;
  bool ReadPage(uint32_t page, uint8_t* out) const;
  // Marks a page as read; false when it was already (a loop, or a page shared by two trees).
  bool Visit(uint32_t page);

  uint64_t LocalPayloadSize(uint64_t payload_size, bool table_leaf) const;
  // Checks a b-tree page of the expected kind and locates its cells; false when it is malformed.
  bool ParsePage(uint32_t number, const std::vector<uint8_t>& page, bool index_tree, const RowidRange& range,
                 bool& leaf, std::vector<Cell>& cells, uint32_t& right_child) const;
  void Walk(uint32_t number, bool index_tree, int depth, const RowidRange& range, TreeCounts& counts,
            const PayloadSink& sink);
  void Emit(const std::vector<uint8_t>& page, const Cell& cell, TreeCounts& counts, const PayloadSink& sink);
  // A cell's whole payload, its overflow chain followed; nullopt when the chain is broken.
  std::optional<std::string> ReadPayload(const std::vector<uint8_t>& page, const Cell& cell);

  void ReadTables();
  void Summarize();

  const RecordCallback& on_record_;
  File db_;
  File wal_;
  uint32_t page_size_ = 0;
  uint32_t usable_size_ = 0;
  uint64_t pages_in_file_ = 0;
  bool wal_used_ = false;  // a committed transaction was read from the WAL
  bool wal_big_endian_ = false;
  uint32_t wal_database_pages_ = 0;  // the database's size after the WAL's last commit
  // The WAL's committed pages: page number → offset of its latest committed content in the WAL.
  std::unordered_map<uint32_t, uint64_t> wal_pages_;
  std::vector<bool> visited_;                         // pages up to pages_in_file_
  std::unordered_set<uint32_t> visited_beyond_file_;  // pages the WAL adds beyond it
  std::vector<uint8_t> overflow_page_;
  std::vector<std::string> problems_;
  uint64_t schema_unreadable_pages_ = 0;
  uint64_t schema_lost_records_ = 0;
  PageRecoveryReport report_;
};

StatusOr<PageRecoveryReport> Recoverer::Run(const std::string& path) {
  if (!db_.Open(path)) return Status::IoError("cannot open '" + path + "': " + std::strerror(errno));
  uint8_t header[kFileHeaderSize];
  if (!db_.ReadAt(0, header, sizeof header)) {
    return Status::IoError("'" + path + "' is not a SQLite database: shorter than the 100-byte header");
  }
  if (std::memcmp(header, "SQLite format 3", 16) != 0) {
    return Status::IoError("'" + path + "' is not a SQLite database: no SQLite header");
  }
  uint32_t page_size = Get16(header + 16);
  if (page_size == 1) page_size = 65536;
  if (page_size < 512 || page_size > 65536 || !std::has_single_bit(page_size)) {
    return Status::IoError("'" + path + "' has an invalid page size in its header: " + std::to_string(page_size));
  }
  if (page_size - header[20] < kMinUsableSize) {
    return Status::IoError("'" + path + "' has an invalid reserved space in its header: " + std::to_string(header[20]) +
                           " bytes");
  }
  page_size_ = page_size;
  usable_size_ = page_size - header[20];
  pages_in_file_ = std::min<uint64_t>(db_.size() / page_size_, UINT32_MAX);
  report_.page_size = page_size_;
  report_.pages_in_file = pages_in_file_;
  report_.pages_in_header = Get32(header + 28);
  overflow_page_.resize(page_size_);

  LoadWal(path + "-wal");
  if (wal_used_) report_.pages_in_header = wal_database_pages_;

  // The text encoding, from page 1 as the WAL has it when it has it (0 in a database with no schema yet).
  uint32_t encoding = Get32(header + 56);
  std::vector<uint8_t> page(page_size_);
  if (ReadPage(1, page.data())) encoding = Get32(page.data() + 56);
  if (encoding != 0 && encoding != 1) {
    return Status::IoError("'" + path + "' is not UTF-8 (text encoding " + std::to_string(encoding) +
                           (encoding == 2 || encoding == 3 ? ", UTF-16" : "") + "): only UTF-8 databases are read");
  }

  visited_.assign(pages_in_file_ + 1, false);
  ReadTables();
  Summarize();
  return std::move(report_);
}

void Recoverer::WalChecksum(const uint8_t* p, size_t n, uint32_t& s0, uint32_t& s1) const {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    const uint32_t a = wal_big_endian_ ? Get32(p + i) : Get32Le(p + i);
    const uint32_t b = wal_big_endian_ ? Get32(p + i + 4) : Get32Le(p + i + 4);
    s0 += a + s1;
    s1 += b + s0;
  }
}

void Recoverer::LoadWal(const std::string& path) {
  if (!wal_.Open(path)) {
    if (errno != ENOENT) problems_.push_back("cannot open the WAL '" + path + "': " + std::strerror(errno));
    return;
  }
  if (wal_.size() == 0) return;
  uint8_t header[kWalHeaderSize];
  if (!wal_.ReadAt(0, header, sizeof header)) {
    problems_.push_back("the WAL is shorter than its header (ignored)");
    return;
  }
  const uint32_t magic = Get32(header);
  if (magic != kWalMagicLittleEndian && magic != kWalMagicBigEndian) {
    problems_.push_back("the WAL has no WAL header (ignored)");
    return;
  }
  wal_big_endian_ = magic == kWalMagicBigEndian;
  if (Get32(header + 4) != kWalVersion || Get32(header + 8) != page_size_) {
    problems_.push_back("the WAL's version or page size is not the database's (ignored)");
    return;
  }
  uint32_t s0 = 0;
  uint32_t s1 = 0;
  WalChecksum(header, 24, s0, s1);
  if (s0 != Get32(header + 24) || s1 != Get32(header + 28)) {
    problems_.push_back("the WAL's header checksum is wrong (ignored)");
    return;
  }
  const uint32_t salt1 = Get32(header + 16);
  const uint32_t salt2 = Get32(header + 20);
  const uint64_t frame_size = kWalFrameHeaderSize + page_size_;
  std::vector<uint8_t> frame(frame_size);
  std::vector<std::pair<uint32_t, uint64_t>> pending;  // frames of the transaction not yet committed
  uint64_t frames = 0;
  for (uint64_t offset = kWalHeaderSize; offset + frame_size <= wal_.size(); offset += frame_size) {
    if (!wal_.ReadAt(offset, frame.data(), frame.size())) break;
    const uint32_t page = Get32(frame.data());
    const uint32_t commit_size = Get32(frame.data() + 4);
    if (page == 0 || Get32(frame.data() + 8) != salt1 || Get32(frame.data() + 12) != salt2) break;
    WalChecksum(frame.data(), 8, s0, s1);
    WalChecksum(frame.data() + kWalFrameHeaderSize, page_size_, s0, s1);
    if (s0 != Get32(frame.data() + 16) || s1 != Get32(frame.data() + 20)) break;
    ++frames;
    pending.emplace_back(page, offset + kWalFrameHeaderSize);
    if (commit_size != 0) {
      for (const auto& [number, content] : pending) wal_pages_[number] = content;
      pending.clear();
      wal_used_ = true;
      wal_database_pages_ = commit_size;
      report_.wal_frames_used = frames;
    }
  }
}

bool Recoverer::Readable(uint32_t page) const {
  if (page == 0) return false;
  if (wal_used_) {
    if (page > wal_database_pages_) return false;
    if (wal_pages_.contains(page)) return true;
  }
  return page <= pages_in_file_;
}

bool Recoverer::ReadPage(uint32_t page, uint8_t* out) const {
  if (!Readable(page)) return false;
  if (wal_used_) {
    const auto it = wal_pages_.find(page);
    if (it != wal_pages_.end()) return wal_.ReadAt(it->second, out, page_size_);
  }
  return db_.ReadAt(uint64_t{page - 1} * page_size_, out, page_size_);
}

bool Recoverer::Visit(uint32_t page) {
  if (page < visited_.size()) {
    if (visited_[page]) return false;
    visited_[page] = true;
    return true;
  }
  return visited_beyond_file_.insert(page).second;
}

uint64_t Recoverer::LocalPayloadSize(uint64_t payload_size, bool table_leaf) const {
  const uint64_t u = usable_size_;
  const uint64_t max_local = table_leaf ? u - 35 : (u - 12) * 64 / 255 - 23;
  if (payload_size <= max_local) return payload_size;
  const uint64_t min_local = (u - 12) * 32 / 255 - 23;
  const uint64_t k = min_local + (payload_size - min_local) % (u - 4);
  return k <= max_local ? k : min_local;
}

bool Recoverer::ParsePage(uint32_t number, const std::vector<uint8_t>& page, bool index_tree, const RowidRange& range,
                          bool& leaf, std::vector<Cell>& cells, uint32_t& right_child) const {
  const uint8_t* d = page.data();
  const size_t usable = usable_size_;
  const size_t header = number == 1 ? kFileHeaderSize : 0;
  const uint8_t type = d[header];
  if (index_tree ? (type != kIndexLeaf && type != kIndexInterior) : (type != kTableLeaf && type != kTableInterior)) {
    return false;
  }
  leaf = type == kIndexLeaf || type == kTableLeaf;
  const size_t header_size = leaf ? 8 : 12;
  if (header + header_size > usable) return false;
  const size_t first_freeblock = Get16(d + header + 1);
  const size_t cell_count = Get16(d + header + 3);
  size_t content_start = Get16(d + header + 5);
  if (content_start == 0) content_start = 65536;
  const size_t pointers_end = header + header_size + 2 * cell_count;
  if (pointers_end > usable || content_start < pointers_end || content_start > usable) return false;
  if (first_freeblock != 0 && (first_freeblock < pointers_end || first_freeblock + 4 > usable)) return false;
  right_child = leaf ? 0 : Get32(d + header + 8);

  cells.clear();
  cells.reserve(cell_count);
  std::optional<int64_t> previous;
  for (size_t i = 0; i < cell_count; ++i) {
    size_t pos = Get16(d + header + header_size + 2 * i);
    if (pos < content_start || pos >= usable) return false;
    Cell cell;
    if (!leaf) {
      if (usable - pos < 4) return false;
      cell.child = Get32(d + pos);
      pos += 4;
    }
    if (type == kTableInterior) {
      uint64_t key = 0;
      if (GetVarint(d + pos, usable - pos, key) == 0) return false;
      cell.rowid = static_cast<int64_t>(key);
    } else {
      size_t n = GetVarint(d + pos, usable - pos, cell.payload_size);
      if (n == 0) return false;
      pos += n;
      if (type == kTableLeaf) {
        uint64_t rowid = 0;
        n = GetVarint(d + pos, usable - pos, rowid);
        if (n == 0) return false;
        pos += n;
        cell.rowid = static_cast<int64_t>(rowid);
      }
      const uint64_t local = LocalPayloadSize(cell.payload_size, type == kTableLeaf);
      cell.has_overflow = local < cell.payload_size;
      if (local > usable - pos || (cell.has_overflow && usable - pos - local < 4)) return false;
      cell.local_offset = pos;
      cell.local_size = local;
      if (cell.has_overflow) cell.first_overflow = Get32(d + pos + local);
    }
    if (!index_tree) {
      // Rowids increase from cell to cell and stay within the bounds the parent set.
      if (!range.Contains(cell.rowid) || (previous && cell.rowid <= *previous)) return false;
      previous = cell.rowid;
    }
    cells.push_back(cell);
  }
  return true;
}

std::optional<std::string> Recoverer::ReadPayload(const std::vector<uint8_t>& page, const Cell& cell) {
  if (cell.payload_size > kMaxRecordBytes) return std::nullopt;
  std::string payload(reinterpret_cast<const char*>(page.data() + cell.local_offset), cell.local_size);
  if (!cell.has_overflow) return payload;
  uint64_t remaining = cell.payload_size - cell.local_size;
  uint32_t next = cell.first_overflow;
  while (remaining > 0) {
    if (next == 0 || !Readable(next) || !Visit(next) || !ReadPage(next, overflow_page_.data())) return std::nullopt;
    // A page of zeros (a hole left by a crash) would pass for the chain's last page.
    if (std::all_of(overflow_page_.begin(), overflow_page_.end(), [](uint8_t b) { return b == 0; })) {
      return std::nullopt;
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(remaining, usable_size_ - 4));
    payload.append(reinterpret_cast<const char*>(overflow_page_.data() + 4), n);
    remaining -= n;
    next = Get32(overflow_page_.data());
  }
  // SQLite ends a chain with a 0; anything else is a page written over (or a chain spliced).
  if (next != 0) return std::nullopt;
  return payload;
}

void Recoverer::Emit(const std::vector<uint8_t>& page, const Cell& cell, TreeCounts& counts, const PayloadSink& sink) {
  const std::optional<std::string> payload = ReadPayload(page, cell);
  if (!payload || !sink(cell.rowid, *payload)) ++counts.lost_records;
}

void Recoverer::Walk(uint32_t number, bool index_tree, int depth, const RowidRange& range, TreeCounts& counts,
                     const PayloadSink& sink) {
  std::vector<uint8_t> page(page_size_);
  std::vector<Cell> cells;
  bool leaf = false;
  uint32_t right_child = 0;
  if (depth > kMaxTreeDepth || !Readable(number) || !Visit(number) || !ReadPage(number, page.data()) ||
      !ParsePage(number, page, index_tree, range, leaf, cells, right_child)) {
    ++counts.unreadable_pages;
    return;
  }
  if (leaf) {
    for (const Cell& cell : cells) Emit(page, cell, counts, sink);
    return;
  }
  if (index_tree) {
    // Index b-trees keep each key once: an interior cell's own record comes after its left subtree.
    for (const Cell& cell : cells) {
      Walk(cell.child, index_tree, depth + 1, range, counts, sink);
      Emit(page, cell, counts, sink);
    }
    Walk(right_child, index_tree, depth + 1, range, counts, sink);
    return;
  }
  RowidRange child_range{range.lo, std::nullopt};
  for (const Cell& cell : cells) {
    child_range.hi = cell.rowid;
    Walk(cell.child, index_tree, depth + 1, child_range, counts, sink);
    child_range.lo = cell.rowid;
  }
  child_range.hi = range.hi;
  Walk(right_child, index_tree, depth + 1, child_range, counts, sink);
}

void Recoverer::ReadTables() {
  struct SchemaRow {
    std::string name;
    std::string sql;
    int64_t root_page = 0;
  };
  std::vector<SchemaRow> tables;
  TreeCounts schema;
  Walk(1, /*index_tree=*/false, 0, RowidRange{}, schema, [&](int64_t, const std::string& payload) {
    std::vector<RecoveredValue> values;
    if (!DecodeRecord(payload, values) || values.size() < 5) return false;
    const auto text = RecoveredValue::Type::kText;
    if (values[0].type != text || values[1].type != text) return false;
    if (values[0].bytes != "table" || EqualsIgnoreCase(std::string_view(values[1].bytes).substr(0, 7), "sqlite_")) {
      return true;
    }
    SchemaRow row;
    row.name = values[1].bytes;
    if (values[3].type == RecoveredValue::Type::kInteger) row.root_page = values[3].integer;
    if (values[4].type == text) row.sql = values[4].bytes;
    tables.push_back(std::move(row));
    return true;
  });
  report_.schema_complete = schema.unreadable_pages == 0 && schema.lost_records == 0;
  schema_unreadable_pages_ = schema.unreadable_pages;
  schema_lost_records_ = schema.lost_records;

  for (SchemaRow& row : tables) {
    const TableShape shape = ParseCreateTable(row.sql);
    if (shape.virtual_table) continue;
    report_.tables.emplace_back();
    RecoveredTableReport& table = report_.tables.back();
    table.name = std::move(row.name);
    table.sql = std::move(row.sql);
    table.root_page = row.root_page;
    table.without_rowid = shape.without_rowid;
    if (!shape.columns_known) {
      problems_.push_back("table '" + table.name +
                          "': its columns could not be read from its SQL; records are as stored");
    }
    if (row.root_page <= 0 || row.root_page > UINT32_MAX) {
      table.unreadable_pages = 1;
      continue;
    }
    TreeCounts counts;
    Walk(static_cast<uint32_t>(row.root_page), shape.without_rowid, 0, RowidRange{}, counts,
         [&](int64_t rowid, const std::string& payload) {
           RecoveredRecord record;
           record.rowid = shape.without_rowid ? 0 : rowid;
           if (!DecodeRecord(payload, record.values) || !ShapeRecord(shape, rowid, record)) return false;
           ++table.records;
           if (on_record_) on_record_(table.name, record);
           return true;
         });
    table.unreadable_pages = counts.unreadable_pages;
    table.lost_records = counts.lost_records;
  }
}

void Recoverer::Summarize() {
  std::vector<std::string> lines;
  if (report_.pages_in_header > report_.pages_in_file) {
    // Pages beyond the end of the file are there only if the WAL has them.
    uint64_t missing = report_.pages_in_header - report_.pages_in_file;
    for (const auto& [page, offset] : wal_pages_) {
      if (page > report_.pages_in_file && page <= report_.pages_in_header) --missing;
    }
    if (missing > 0) {
      lines.push_back(std::to_string(missing) + " of the database's " + std::to_string(report_.pages_in_header) +
                      " pages are beyond the end of the file" + (wal_used_ ? " and not in the WAL" : ""));
    }
  }
  if (db_.size() % page_size_ != 0) {
    lines.push_back("the file ends with a partial page of " + std::to_string(db_.size() % page_size_) + " bytes");
  }
  lines.insert(lines.end(), problems_.begin(), problems_.end());
  if (schema_unreadable_pages_ != 0 || schema_lost_records_ != 0) {
    lines.push_back("sqlite_master: " + std::to_string(schema_unreadable_pages_) + " unreadable pages, " +
                    std::to_string(schema_lost_records_) + " lost records (tables may be missing)");
  }
  for (const RecoveredTableReport& table : report_.tables) {
    if (table.unreadable_pages == 0 && table.lost_records == 0) continue;
    lines.push_back("table '" + table.name + "': " + std::to_string(table.unreadable_pages) + " unreadable pages, " +
                    std::to_string(table.lost_records) + " lost records, " + std::to_string(table.records) +
                    " records read");
  }
  for (const std::string& line : lines) {
    if (!report_.detail.empty()) report_.detail += "; ";
    report_.detail += line;
  }
}

}  // namespace

StatusOr<PageRecoveryReport> RecoverRecords(
    const std::string& path,
    const std::function<void(const std::string& table, const RecoveredRecord& record)>& on_record) {
  Recoverer recoverer(on_record);
  return recoverer.Run(path);
}

}  // namespace gradwatch::store
