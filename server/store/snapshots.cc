#include "server/store/snapshots.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <system_error>

#include <spdlog/spdlog.h>

#include "server/core/state_io.h"

namespace gradwatch::store {

namespace {

constexpr std::array<char, 8> kMagic = {'G', 'W', 'S', 'N', 'A', 'P', '\0', '\1'};
constexpr uint32_t kFormatVersion = 1;
constexpr const char* kSuffix = ".snap";
constexpr const char* kTempSuffix = ".snap.tmp";
// Run ids are bounded well below this by ingest; a larger length is damage.
constexpr uint64_t kMaxRunIdBytes = 1 << 16;

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The CRC-32 of `data` following bytes whose CRC-32 is `crc_before` (zlib's, 0 for none).
uint32_t Crc32(std::string_view data, uint32_t crc_before = 0) {
  uLong crc = crc_before;
  // zlib takes lengths as uInt: feed large payloads in pieces.
  constexpr size_t kPiece = size_t{1} << 30;
  for (size_t at = 0; at < data.size(); at += kPiece) {
    const size_t n = std::min(kPiece, data.size() - at);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data() + at), static_cast<uInt>(n));
  }
  return static_cast<uint32_t>(crc);
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

Status WriteAll(int fd, std::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IoError(Errno("writing " + path));
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IoError(Errno("opening " + dir));
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return rc == 0 ? Status::Ok() : Status::IoError(Errno("syncing " + dir));
}

struct Header {
  uint64_t fingerprint = 0;
  uint64_t payload_bytes = 0;
  uint32_t crc = 0;
  std::string run_id;
};

// Reads the header at the start of `bytes`; false when it is not a snapshot of this format.
bool ParseHeader(StateReader& in, Header& h, std::string* why) {
  std::array<char, 8> magic{};
  uint32_t version = 0;
  if (!in.Get(magic) || magic != kMagic) return *why = "not a snapshot file", false;
  if (!in.Get(version) || version != kFormatVersion) return *why = "another snapshot format version", false;
  uint64_t id_bytes = 0;
  if (!in.Get(h.fingerprint) || !in.Get(h.payload_bytes) || !in.Get(h.crc) ||
      !in.GetCount(id_bytes, 1, kMaxRunIdBytes)) {
    return *why = "its header is truncated", false;
  }
  h.run_id.clear();
  for (uint64_t i = 0; i < id_bytes; ++i) {
    char c = 0;
    if (!in.Get(c)) return *why = "its header is truncated", false;
    h.run_id.push_back(c);
  }
  return true;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) {
    if (errno == ENOENT) return Status::NotFound("no snapshot at " + path);
    return Status::IoError(Errno("opening " + path));
  }
  // Sized once: a snapshot can be hundreds of megabytes, and a string grown as it is read would
  // briefly take twice that.
  const std::streamoff size = f.tellg();
  if (size < 0) return Status::IoError(Errno("sizing " + path));
  std::string bytes(static_cast<size_t>(size), '\0');
  f.seekg(0);
  if (!f.read(bytes.data(), size)) return Status::IoError(Errno("reading " + path));
  return bytes;
}

}  // namespace

SnapshotStore::SnapshotStore(std::string dir, uint64_t fingerprint) : dir_(std::move(dir)), fingerprint_(fingerprint) {}

std::string SnapshotStore::PathFor(const std::string& run_id) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx", static_cast<unsigned long long>(Fnv1a(run_id)));
  return (std::filesystem::path(dir_) / (std::string(name) + kSuffix)).string();
}

Status SnapshotStore::Write(const std::string& run_id, std::string_view payload) const {
  return WritePieces(run_id, {payload});
}

Status SnapshotStore::Write(const std::string& run_id, const ByteChunks& payload) const {
  std::vector<std::string_view> pieces;
  payload.ForEachPiece([&](std::string_view piece) { pieces.push_back(piece); });
  return WritePieces(run_id, pieces);
}

Status SnapshotStore::WritePieces(const std::string& run_id, const std::vector<std::string_view>& pieces) const {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return Status::IoError("creating " + dir_ + ": " + ec.message());
  uint64_t size = 0;
  uint32_t crc = 0;
  for (std::string_view piece : pieces) {
    size += piece.size();
    crc = Crc32(piece, crc);
  }
  std::string header;
  StateWriter out(header);
  out.Put(kMagic);
  out.Put(kFormatVersion);
  out.Put(fingerprint_);
  out.Put<uint64_t>(size);
  out.Put(crc);
  out.Put<uint64_t>(run_id.size());
  header.append(run_id);

  const std::string path = PathFor(run_id);
  const std::string temp = path.substr(0, path.size() - std::strlen(kSuffix)) + kTempSuffix;
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IoError(Errno("creating " + temp));
  Status s = WriteAll(fd, header, temp);
  for (size_t i = 0; s.ok() && i < pieces.size(); ++i) s = WriteAll(fd, pieces[i], temp);
  if (s.ok() && ::fsync(fd) != 0) s = Status::IoError(Errno("syncing " + temp));
  if (::close(fd) != 0 && s.ok()) s = Status::IoError(Errno("closing " + temp));
  if (s.ok() && std::rename(temp.c_str(), path.c_str()) != 0) s = Status::IoError(Errno("renaming " + temp));
  if (!s.ok()) {
    ::unlink(temp.c_str());
    return s;
  }
  return SyncDir(dir_);
}

StatusOr<std::string> SnapshotStore::Read(const std::string& run_id) const {
  const std::string path = PathFor(run_id);
  auto bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  StateReader in(*bytes);
  Header h;
  std::string why;
  if (!ParseHeader(in, h, &why)) return Status::Internal(path + ": " + why);
  if (h.run_id != run_id) return Status::NotFound(path + " holds the snapshot of another run");
  if (h.fingerprint != fingerprint_) {
    return Status::FailedPrecondition(path + " was written by a build with another layout");
  }
  const size_t at = in.position();
  if (bytes->size() - at != h.payload_bytes) {
    return Status::Internal(path + ": " + std::to_string(bytes->size() - at) + " payload bytes where the header says " +
                            std::to_string(h.payload_bytes));
  }
  std::string payload = std::move(*bytes);
  payload.erase(0, at);  // in place: no second copy of the payload
  if (Crc32(payload) != h.crc) return Status::Internal(path + ": its checksum does not match (damaged)");
  return payload;
}

void SnapshotStore::Remove(const std::string& run_id) const {
  std::error_code ec;
  std::filesystem::remove(PathFor(run_id), ec);
}

std::optional<std::string> SnapshotStore::RunOfFile(const std::string& path) const {
  std::ifstream f(path, std::ios::binary);
  std::string head(256 + kMaxRunIdBytes, '\0');
  f.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(f.gcount()));
  StateReader in(head);
  Header h;
  std::string why;
  if (!ParseHeader(in, h, &why) || path != PathFor(h.run_id)) return std::nullopt;
  return h.run_id;
}

size_t SnapshotStore::RemoveAllBut(const std::vector<std::string>& keep) const {
  const std::set<std::string> kept(keep.begin(), keep.end());
  std::error_code ec;
  if (!std::filesystem::is_directory(dir_, ec)) return 0;
  size_t removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temp = name.ends_with(kTempSuffix);
    if (!temp && !name.ends_with(kSuffix)) continue;
    bool drop = temp;
    if (!drop) {
      const std::optional<std::string> run = RunOfFile(entry.path().string());
      drop = !run || kept.count(*run) == 0;
    }
    if (drop && std::filesystem::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

std::vector<std::string> SnapshotStore::SetAsideAllBut(const std::vector<std::string>& keep,
                                                       const std::string& to_dir) const {
  const std::set<std::string> kept(keep.begin(), keep.end());
  std::vector<std::string> moved;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir_, ec)) return moved;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.ends_with(kSuffix)) continue;
    const std::optional<std::string> run = RunOfFile(entry.path().string());
    if (!run || kept.count(*run) != 0) continue;
    std::filesystem::create_directories(to_dir, ec);
    std::filesystem::rename(entry.path(), std::filesystem::path(to_dir) / name, ec);
    if (!ec) moved.push_back(*run);
  }
  std::sort(moved.begin(), moved.end());
  return moved;
}

uint64_t SnapshotStore::DiskBytes() const {
  std::error_code ec;
  uint64_t bytes = 0;
  if (!std::filesystem::is_directory(dir_, ec)) return 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const uint64_t n = entry.file_size(ec);
    if (!ec) bytes += n;
  }
  return bytes;
}

}  // namespace gradwatch::store
