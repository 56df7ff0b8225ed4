// Options shared by every subcommand.
#pragma once

#include <chrono>
#include <string>

#include "gradwatch/channel_security.h"

namespace gradwatch::cli {

struct GlobalOptions {
  std::string address;
  client::ChannelSecurity tls;
  double timeout_seconds = 10;
  bool json = false;
  bool verbose = false;

  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  }
};

// Exit codes of the `gradwatch` command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitPartial = 3;

}  // namespace gradwatch::cli
