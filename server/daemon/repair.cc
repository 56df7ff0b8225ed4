#include "server/daemon/repair.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "server/store/journal.h"

namespace gradwatch::daemon {

namespace {

std::string Steps(const store::DamagedSteps& d) {
  return d.first_step == d.last_step ? "step " + std::to_string(d.first_step)
                                     : "steps " + std::to_string(d.first_step) + "-" + std::to_string(d.last_step);
}

void PrintText(const store::RepairReport& r, bool dry_run) {
  std::cout << "journal " << r.journal << ": " << (r.sound() ? "sound" : "damaged") << "\n";
  if (!r.sqlite_problem.empty()) std::cout << "  SQLite: " << r.sqlite_problem << "\n";
  for (const store::DamagedSteps& d : r.damaged) {
    std::cout << "  run '" << d.run_id << "': " << Steps(d) << " ("
              << (d.block ? "a block of " + std::to_string(d.steps) + " step(s)" : "a step row") << "): " << d.why
              << "\n";
  }
  for (const std::string& id : r.lost_run_ids) std::cout << "  run '" << id << "': cannot be read, lost\n";
  for (const std::string& t : r.lost_tables) std::cout << "  table " << t << ": cannot be read, lost\n";
  if (r.sound()) {
    std::cout << "nothing to repair; the journal is unchanged\n";
  } else if (dry_run) {
    std::cout << "dry run: nothing changed; without --dry-run the damaged steps are left out of a fresh copy\n";
  } else if (r.replaced) {
    std::cout << "repaired: " << r.runs_copied << " run(s) copied into a fresh journal, " << r.damaged_steps
              << " damaged step(s) and " << r.lost_run_ids.size()
              << " unreadable run(s) left out; the old files are kept as";
    for (const std::string& f : r.moved_files) std::cout << " " << f;
    std::cout << "\n";
  }
}

nlohmann::json Json(const store::RepairReport& r, bool dry_run) {
  nlohmann::json damaged = nlohmann::json::array();
  for (const store::DamagedSteps& d : r.damaged) {
    damaged.push_back({{"run", d.run_id},
                       {"first_step", d.first_step},
                       {"last_step", d.last_step},
                       {"steps", d.steps},
                       {"kind", d.block ? "block" : "row"},
                       {"why", d.why}});
  }
  return {{"journal", r.journal},         {"sound", r.sound()},
          {"dry_run", dry_run},           {"sqlite_problem", r.sqlite_problem},
          {"damaged", damaged},           {"damaged_steps", r.damaged_steps},
          {"lost_runs", r.lost_run_ids},  {"lost_tables", r.lost_tables},
          {"runs_copied", r.runs_copied}, {"replaced", r.replaced},
          {"moved_files", r.moved_files}};
}

}  // namespace

int RunRepair(const std::string& data_dir, bool dry_run, bool json) {
  const std::string lock_path = (std::filesystem::path(data_dir) / "LOCK").string();
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) {
    std::cerr << "gradwatchd: cannot open " << lock_path << ": " << std::strerror(errno) << "\n";
    return kRepairFailed;
  }
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    std::cerr << "gradwatchd: data_dir " << data_dir << " is in use by a running gradwatchd: stop it before --repair\n";
    ::close(lock_fd);
    return kRepairFailed;
  }
  store::RepairReport report;
  const Status s = store::Journal::Repair((std::filesystem::path(data_dir) / "journal.db").string(), dry_run, report);
  std::string snapshots_moved;
  if (s.ok() && report.replaced && !report.moved_files.empty()) {
    // The snapshots cache the old journal's runs, steps it may no longer hold: they go with it, and
    // the daemon rebuilds the runs from the repaired journal.
    const std::filesystem::path snapshots = std::filesystem::path(data_dir) / "snapshots";
    std::error_code ec;
    if (std::filesystem::exists(snapshots, ec)) {
      snapshots_moved = report.moved_files.front() + ".snapshots";
      std::filesystem::rename(snapshots, snapshots_moved, ec);
      if (ec) {
        std::cerr << "gradwatchd: --repair: cannot move " << snapshots.string() << " aside (" << ec.message()
                  << "): delete it before starting the daemon\n";
        ::close(lock_fd);
        return kRepairFailed;
      }
    }
  }
  ::close(lock_fd);
  if (!s.ok()) {
    std::cerr << "gradwatchd: --repair: " << s.message() << "\n";
    return kRepairFailed;
  }
  if (json) {
    nlohmann::json out = Json(report, dry_run);
    out["snapshots_moved_to"] = snapshots_moved;
    std::cout << out.dump(2) << "\n";
  } else {
    PrintText(report, dry_run);
    if (!snapshots_moved.empty()) std::cout << "the runs' snapshots are kept in " << snapshots_moved << "\n";
  }
  return report.sound() ? kRepairSound : kRepairDamaged;
}

}  // namespace gradwatch::daemon
