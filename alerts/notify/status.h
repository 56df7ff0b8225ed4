// The notifier library reports failures with the project's Status and StatusOr.
#pragma once

#include <string>
#include <utility>

#include "server/core/status.h"

namespace gradwatch::notify {

using Status = gradwatch::Status;
template <typename T>
using Result = gradwatch::StatusOr<T>;

// A notifier failure: the receiver, the network or the outbox is unavailable for now.
inline Status NotifyError(std::string message) { return Status::Unavailable(std::move(message)); }

}  // namespace gradwatch::notify
