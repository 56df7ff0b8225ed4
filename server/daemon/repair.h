// `gradwatchd --repair`: checks the journal in a data directory the daemon is not running on and,
// when it is damaged, replaces it with a copy of everything that can still be read.
#pragma once

#include <string>

namespace gradwatch::daemon {

// Exit codes of --repair.
constexpr int kRepairSound = 0;    // nothing damaged: the journal is left as it is
constexpr int kRepairFailed = 1;   // the check or the repair could not be made (the journal is untouched)
constexpr int kRepairDamaged = 3;  // damage found: listed, and unless dry_run the journal was replaced

// Takes the data directory's LOCK (refused while a daemon holds it), checks and repairs its
// journal (store::Journal::Repair), prints what it found and did (JSON when `json`) on stdout,
// and returns one of the exit codes above.
int RunRepair(const std::string& data_dir, bool dry_run, bool json);

}  // namespace gradwatch::daemon
