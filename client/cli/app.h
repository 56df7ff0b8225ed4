// The `gradwatch` command line: argument parsing and dispatch to the subcommands.
#pragma once

#include <ostream>

namespace gradwatch::cli {

// Parses `argv` and runs the chosen subcommand, writing results to `out` and diagnostics to
// `err`. Returns the exit code: kExitOk, kExitFailure, kExitUsage or kExitPartial.
int Run(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

// Run() on std::cout / std::cerr, with logging sent to stderr.
int Main(int argc, const char* const* argv);

}  // namespace gradwatch::cli
