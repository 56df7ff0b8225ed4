// Status and Result for the notifier library. Expected failures travel as values; nothing here
// throws. Kept local so that alerts/notify depends on nothing of the daemon's.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace gradwatch::notify {

class Status {
 public:
  Status() = default;
  static Status Ok() { return {}; }
  static Status Error(std::string message) { return Status(std::move(message)); }

  bool ok() const { return !failed_; }
  // Empty when ok().
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

// Either a value or a failed Status.
template <typename T>
class Result {
 public:
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }
  // Only when ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace gradwatch::notify
