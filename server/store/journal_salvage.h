// Salvage of a damaged journal: what can still be read, copied into a fresh one. Used by
// Journal::Open (a journal SQLite calls damaged at start) and by Journal::Repair.
#pragma once

#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/store/journal.h"

namespace gradwatch::store::sqlite {
class Database;
}

namespace gradwatch::store {

// A "file:" URI of `path` that SQLite opens read-only.
std::string ReadOnlyUri(const std::string& path);

// Runs PRAGMA quick_check; false (with the first problem in *detail) when the database is damaged.
bool QuickCheck(sqlite::Database& db, std::string* detail);

// `<path>.<what>-<UTC time>`, with a counter when that name is taken.
std::string AsideName(const std::string& path, const char* what);

// Renames the database at `path` and its -wal and -shm files (those that exist) to `to` with the
// same suffixes, the database first; appends the new names to *moved.
Status RenameFiles(const std::string& path, const std::string& to, std::vector<std::string>* moved);

// Copies into the fresh journal `db` what can be read from the damaged one at `damaged_path`,
// attached read-only: each run whole (its rows in every run table, one transaction per run) or not
// at all, then every other table (the alert store's) whole or not at all.
void Salvage(sqlite::Database& db, const std::string& damaged_path, RecoveryReport& report);

}  // namespace gradwatch::store
