// Reading a configuration-like file (the config, rule files, the tokens file, TLS PEM files)
// whole, safely: only a regular file is read, so a FIFO, a device or a directory named by mistake
// is an error at once rather than a reader blocked for ever, and a file larger than a bound is an
// error rather than all of memory.
#pragma once

#include <cstddef>
#include <string>

#include "server/core/status.h"

namespace gradwatch {

// The whole of the regular file at `path`. Errors (IoError) name `what` and `path`: missing,
// unreadable, not a regular file (a FIFO, a directory, ...), or larger than `max_bytes`.
StatusOr<std::string> ReadRegularFile(const std::string& what, const std::string& path,
                                      size_t max_bytes = size_t{64} << 20);

}  // namespace gradwatch
