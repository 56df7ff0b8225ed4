#include "server/store/table_shape.h"

#include <algorithm>
#include <cctype>
#include <utility>

namespace gradwatch::store {
namespace {

std::string Upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// A token of SQL text, as far as reading a CREATE TABLE statement needs.
struct Token {
  enum class Kind { kWord, kQuoted, kString, kPunct };
  Kind kind = Kind::kPunct;
  std::string text;  // a quoted identifier or string without its quotes
};

bool IsWordByte(char c) {
  const auto u = static_cast<unsigned char>(c);
  return std::isalnum(u) || c == '_' || c == '$' || u >= 0x80;
}

std::vector<Token> Tokenize(std::string_view sql) {
  std::vector<Token> tokens;
  size_t i = 0;
  const size_t n = sql.size();
  while (i < n) {
    const char c = sql[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (c == '-' && i + 1 < n && sql[i + 1] == '-') {
      while (i < n && sql[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < n && sql[i + 1] == '*') {
      const size_t end = sql.find("*/", i + 2);
      i = end == std::string_view::npos ? n : end + 2;
    } else if (c == '\'' || c == '"' || c == '`' || c == '[') {
      const char close = c == '[' ? ']' : c;
      Token t;
      t.kind = c == '\'' ? Token::Kind::kString : Token::Kind::kQuoted;
      ++i;
      while (i < n) {
        if (sql[i] == close) {
          // A doubled quote stands for itself (not within brackets).
          if (close != ']' && i + 1 < n && sql[i + 1] == close) {
            t.text += close;
            i += 2;
            continue;
          }
          ++i;
          break;
        }
        t.text += sql[i++];
      }
      tokens.push_back(std::move(t));
    } else if (IsWordByte(c)) {
      Token t;
      t.kind = Token::Kind::kWord;
      while (i < n && IsWordByte(sql[i])) t.text += sql[i++];
      tokens.push_back(std::move(t));
    } else {
      tokens.push_back(Token{Token::Kind::kPunct, std::string(1, c)});
      ++i;
    }
  }
  return tokens;
}

bool IsWord(const std::vector<Token>& tokens, size_t i, std::string_view word) {
  return i < tokens.size() && tokens[i].kind == Token::Kind::kWord && EqualsIgnoreCase(tokens[i].text, word);
}

bool IsPunct(const std::vector<Token>& tokens, size_t i, char c) {
  return i < tokens.size() && tokens[i].kind == Token::Kind::kPunct && tokens[i].text[0] == c;
}

// The index of the parenthesis closing the one at `open`, or tokens.size().
size_t ClosingParenthesis(const std::vector<Token>& tokens, size_t open) {
  int depth = 0;
  for (size_t i = open; i < tokens.size(); ++i) {
    if (IsPunct(tokens, i, '(')) ++depth;
    if (IsPunct(tokens, i, ')') && --depth == 0) return i;
  }
  return tokens.size();
}

bool IsColumnConstraintKeyword(const Token& t) {
  static constexpr std::string_view kKeywords[] = {
      "CONSTRAINT", "PRIMARY", "NOT", "NULL", "UNIQUE", "CHECK", "DEFAULT", "COLLATE", "REFERENCES", "GENERATED", "AS"};
  if (t.kind != Token::Kind::kWord) return false;
  for (std::string_view k : kKeywords) {
    if (EqualsIgnoreCase(t.text, k)) return true;
  }
  return false;
}

// SQLite's rule for a declared type's affinity (https://www.sqlite.org/datatype3.html): REAL only
// when the type has no INT, CHAR, CLOB, TEXT or BLOB and has REAL, FLOA or DOUB.
bool HasRealAffinity(const std::string& type) {
  const std::string t = Upper(type);
  auto has = [&](const char* s) { return t.find(s) != std::string::npos; };
  if (has("INT") || has("CHAR") || has("CLOB") || has("TEXT") || has("BLOB") || t.empty()) return false;
  return has("REAL") || has("FLOA") || has("DOUB");
}

}  // namespace

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

TableShape ParseCreateTable(const std::string& sql) {
  TableShape shape;
  const std::vector<Token> tokens = Tokenize(sql);
  if (IsWord(tokens, 0, "CREATE") && IsWord(tokens, 1, "VIRTUAL")) {
    shape.virtual_table = true;
    return shape;
  }
  size_t open = 0;
  while (open < tokens.size() && !IsPunct(tokens, open, '(')) ++open;
  const size_t close = ClosingParenthesis(tokens, open);
  if (close >= tokens.size()) return shape;
  for (size_t i = close + 1; i + 1 < tokens.size(); ++i) {
    if (IsWord(tokens, i, "WITHOUT") && IsWord(tokens, i + 1, "ROWID")) shape.without_rowid = true;
  }

  // The definitions between the parentheses, split at their top-level commas.
  std::vector<std::vector<Token>> definitions(1);
  int depth = 0;
  for (size_t i = open + 1; i < close; ++i) {
    if (IsPunct(tokens, i, '(')) ++depth;
    if (IsPunct(tokens, i, ')')) --depth;
    if (depth == 0 && IsPunct(tokens, i, ',')) {
      definitions.emplace_back();
    } else {
      definitions.back().push_back(tokens[i]);
    }
  }

  struct Column {
    std::string name;
    bool stored = true;
    bool integer_type = false;  // declared type exactly INTEGER
    bool real_affinity = false;
    bool primary_key = false;
    bool primary_key_desc = false;
  };
  std::vector<Column> columns;
  std::vector<std::string> table_primary_key;  // a PRIMARY KEY(...) table constraint's columns
  int primary_keys = 0;
  for (const std::vector<Token>& def : definitions) {
    if (def.empty()) continue;
    static constexpr std::string_view kTableConstraints[] = {"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN"};
    if (std::any_of(std::begin(kTableConstraints), std::end(kTableConstraints),
                    [&](std::string_view k) { return IsWord(def, 0, k); })) {
      const size_t k = IsWord(def, 0, "CONSTRAINT") ? 2 : 0;
      if (IsWord(def, k, "PRIMARY") && IsWord(def, k + 1, "KEY") && IsPunct(def, k + 2, '(')) {
        ++primary_keys;
        const size_t end = ClosingParenthesis(def, k + 2);
        bool at_item_start = true;
        int item_depth = 0;
        for (size_t i = k + 3; i < end; ++i) {
          if (IsPunct(def, i, '(')) ++item_depth;
          if (IsPunct(def, i, ')')) --item_depth;
          if (item_depth == 0 && IsPunct(def, i, ',')) {
            at_item_start = true;
          } else if (at_item_start) {
            table_primary_key.push_back(def[i].text);
            at_item_start = false;
          }
        }
      }
      continue;
    }
    Column column;
    column.name = def[0].text;
    size_t i = 1;
    std::string type;
    bool type_has_arguments = false;
    int type_words = 0;
    while (i < def.size() && def[i].kind == Token::Kind::kWord && !IsColumnConstraintKeyword(def[i])) {
      type += (type.empty() ? "" : " ") + def[i++].text;
      ++type_words;
    }
    if (IsPunct(def, i, '(')) {
      type_has_arguments = true;
      i = ClosingParenthesis(def, i) + 1;
    }
    column.integer_type = type_words == 1 && !type_has_arguments && EqualsIgnoreCase(type, "INTEGER");
    column.real_affinity = HasRealAffinity(type);
    for (int level = 0; i < def.size(); ++i) {
      if (IsPunct(def, i, '(')) ++level;
      if (IsPunct(def, i, ')')) --level;
      if (level != 0) continue;
      if (IsWord(def, i, "PRIMARY") && IsWord(def, i + 1, "KEY")) {
        ++primary_keys;
        column.primary_key = true;
        column.primary_key_desc = IsWord(def, i + 2, "DESC");
      } else if (IsWord(def, i, "AS") && IsPunct(def, i + 1, '(')) {
        // A generated column: VIRTUAL (the default) ones are not stored in records.
        const size_t end = ClosingParenthesis(def, i + 1);
        column.stored = IsWord(def, end + 1, "STORED");
        i = end;
      }
    }
    columns.push_back(std::move(column));
  }
  if (columns.empty()) return shape;

  std::vector<size_t> stored;  // indices into columns
  for (size_t c = 0; c < columns.size(); ++c) {
    if (columns[c].stored) stored.push_back(c);
  }
  auto stored_index_of = [&](std::string_view name) -> std::optional<size_t> {
    for (size_t s = 0; s < stored.size(); ++s) {
      if (EqualsIgnoreCase(columns[stored[s]].name, name)) return s;
    }
    return std::nullopt;
  };
  shape.columns_known = true;
  shape.stored_columns = stored.size();

  if (!shape.without_rowid) {
    // The rowid alias (https://www.sqlite.org/lang_createtable.html#rowid): the one primary key
    // column, declared type exactly INTEGER, not "PRIMARY KEY DESC" in its column definition.
    if (primary_keys == 1) {
      for (size_t s = 0; s < stored.size(); ++s) {
        const Column& c = columns[stored[s]];
        if (c.primary_key && c.integer_type && !c.primary_key_desc) shape.rowid_alias_slot = s;
      }
      if (table_primary_key.size() == 1) {
        const std::optional<size_t> s = stored_index_of(table_primary_key[0]);
        if (s && columns[stored[*s]].integer_type) shape.rowid_alias_slot = s;
      }
    }
    for (size_t c : stored) shape.real_affinity.push_back(columns[c].real_affinity);
    return shape;
  }

  // WITHOUT ROWID: records hold the primary key's columns first (each once), then the others in
  // column order.
  std::vector<size_t> key;
  for (size_t s = 0; s < stored.size(); ++s) {
    if (columns[stored[s]].primary_key) key.push_back(s);
  }
  for (const std::string& name : table_primary_key) {
    const std::optional<size_t> s = stored_index_of(name);
    if (!s) {
      shape.columns_known = false;  // a key column we cannot place: hand records out as stored
      return shape;
    }
    if (std::find(key.begin(), key.end(), *s) == key.end()) key.push_back(*s);
  }
  shape.column_of_slot = key;
  for (size_t s = 0; s < stored.size(); ++s) {
    if (std::find(key.begin(), key.end(), s) == key.end()) shape.column_of_slot.push_back(s);
  }
  for (size_t s : shape.column_of_slot) shape.real_affinity.push_back(columns[stored[s]].real_affinity);
  return shape;
}

bool ShapeRecord(const TableShape& shape, int64_t rowid, RecoveredRecord& record) {
  std::vector<RecoveredValue>& values = record.values;
  if (!shape.columns_known) return true;
  if (values.size() > shape.stored_columns) return false;
  for (size_t s = 0; s < values.size(); ++s) {
    if (shape.real_affinity[s] && values[s].type == RecoveredValue::Type::kInteger) {
      values[s].type = RecoveredValue::Type::kReal;
      values[s].real = static_cast<double>(values[s].integer);
      values[s].integer = 0;
    }
  }
  if (shape.rowid_alias_slot && *shape.rowid_alias_slot < values.size() &&
      values[*shape.rowid_alias_slot].type == RecoveredValue::Type::kNull) {
    values[*shape.rowid_alias_slot].type = RecoveredValue::Type::kInteger;
    values[*shape.rowid_alias_slot].integer = rowid;
  }
  if (!shape.column_of_slot.empty()) {
    // A record missing trailing columns (added since) holds the first values.size() columns.
    std::vector<RecoveredValue> ordered(values.size());
    for (size_t s = 0; s < values.size(); ++s) {
      const size_t c = shape.column_of_slot[s];
      if (c >= values.size()) return false;
      ordered[c] = std::move(values[s]);
    }
    values = std::move(ordered);
  }
  return true;
}

}  // namespace gradwatch::store
