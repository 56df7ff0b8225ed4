#include "server/daemon/logging.h"

#include <chrono>
#include <memory>

#include <spdlog/formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

namespace gradwatch::daemon {

namespace {

// {"ts":"2026-11-29T12:00:00.123456Z","level":"info","msg":"..."}; the message is escaped.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(msg.time.time_since_epoch()).count();
    const std::time_t secs = static_cast<std::time_t>(micros / 1000000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char ts[40];
    const size_t n = std::strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
    std::snprintf(ts + n, sizeof(ts) - n, ".%06lldZ", static_cast<long long>(micros % 1000000));
    nlohmann::json line = {
        {"ts", ts},
        {"level",
         std::string(spdlog::level::to_string_view(msg.level).data(), spdlog::level::to_string_view(msg.level).size())},
        {"msg", std::string(msg.payload.data(), msg.payload.size())},
    };
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    dest.append(text.data(), text.data() + text.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }
};

}  // namespace

Status SetUpLogging(const std::string& format, const std::string& level) {
  auto logger = std::make_shared<spdlog::logger>("gradwatchd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  if (format == "json") {
    logger->set_formatter(std::make_unique<JsonFormatter>());
  } else if (format == "text") {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ %v");
  } else {
    return Status::InvalidArgument("log format must be text or json, not '" + format + "'");
  }
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("unknown log level '" + level + "'");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  return Status::Ok();
}

}  // namespace gradwatch::daemon
