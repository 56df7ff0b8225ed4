// What reading a table's records needs to know of its CREATE TABLE statement, read from SQLite's
// own schema text without SQLite: used by the page-level reader of a damaged journal
// (page_recovery.h), which finds each table's statement in sqlite_master.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/store/page_recovery.h"

namespace gradwatch::store {

// What reading a table's records needs to know of its CREATE TABLE statement.
struct TableShape {
  bool without_rowid = false;
  bool virtual_table = false;
  bool columns_known = false;  // the column list was read
  size_t stored_columns = 0;   // columns held in a record (generated VIRTUAL columns are not)
  // The record slot of the INTEGER PRIMARY KEY column (the rowid's alias), if any.
  std::optional<size_t> rowid_alias_slot;
  // Per record slot: the column has REAL affinity (SQL reads an integer stored there as a real).
  std::vector<bool> real_affinity;
  // WITHOUT ROWID tables: per record slot, the column's place among the stored columns (records
  // hold the primary key first); empty when records are in column order.
  std::vector<size_t> column_of_slot;
};

// The shape a CREATE TABLE (or CREATE VIRTUAL TABLE) statement gives; columns_known is false when
// its column list could not be read, and records are then taken as they are.
TableShape ParseCreateTable(const std::string& sql);

// Turns a decoded record into what SQL would read (see page_recovery.h). False when the record
// cannot be one of the table's: more values than the table has columns, or a WITHOUT ROWID record
// that lacks part of its primary key.
bool ShapeRecord(const TableShape& shape, int64_t rowid, RecoveredRecord& record);

// SQL's comparison of names: ASCII letters in either case.
bool EqualsIgnoreCase(std::string_view a, std::string_view b);

}  // namespace gradwatch::store
