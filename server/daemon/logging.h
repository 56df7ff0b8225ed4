// spdlog set-up for the daemon: human text, or one JSON object per line for log shippers.
#pragma once

#include <string>

#include "server/core/status.h"

namespace gradwatch::daemon {

// format: "text" or "json"; level: an spdlog level name. Logs go to stderr.
Status SetUpLogging(const std::string& format, const std::string& level);

}  // namespace gradwatch::daemon
