#include <catch2/catch.hpp>

#include <filesystem>
#include <random>

#include "server/store/outbox.h"

using namespace gradwatch;

namespace {

std::filesystem::path TempPath() {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / ("gradwatch-outbox-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

notify::OutboxEntry Entry(const std::string& receiver, const std::string& fingerprint, alerts::AlertState state) {
  notify::OutboxEntry e;
  e.receiver = receiver;
  e.fingerprint = fingerprint;
  e.state = state;
  e.payload = R"({"name":"GradNormContingency"})";
  e.created_at = 1.7e9;
  return e;
}

}  // namespace

TEST_CASE("the SQLite outbox keeps pending entries in order across a reopen until delivered", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  {
    auto outbox = store::SqliteOutbox::Open(path);
    REQUIRE(outbox.ok());
    auto ids = (*outbox)->Add({Entry("am", "f1", alerts::AlertState::kFiring), Entry("pd", "f1", alerts::AlertState::kFiring),
                               Entry("am", "f1", alerts::AlertState::kResolved)});
    REQUIRE(ids.ok());
    REQUIRE(ids->size() == 3);
    CHECK(ids.value()[0] < ids.value()[2]);
    REQUIRE((*outbox)->MarkRetry(ids.value()[0], 1.7e9 + 5, 1, "connection refused").ok());
    REQUIRE((*outbox)->MarkDelivered(ids.value()[1]).ok());
  }
  auto outbox = store::SqliteOutbox::Open(path);  // a restart
  REQUIRE(outbox.ok());
  auto am = (*outbox)->Pending("am", 10);
  REQUIRE(am.ok());
  REQUIRE(am->size() == 2);
  CHECK(am.value()[0].state == alerts::AlertState::kFiring);
  CHECK(am.value()[0].attempts == 1);
  CHECK(am.value()[0].next_attempt_at == Approx(1.7e9 + 5));
  CHECK(am.value()[1].state == alerts::AlertState::kResolved);
  CHECK(am.value()[1].payload == R"({"name":"GradNormContingency"})");
  CHECK((*outbox)->PendingCount("pd").value() == 0);
  REQUIRE((*outbox)->MarkFailed(am.value()[0].id, "400 bad request").ok());
  CHECK((*outbox)->PendingCount("am").value() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("opening the outbox in a missing directory fails with a clear message", "[store]") {
  auto outbox = store::SqliteOutbox::Open("/nonexistent-gradwatch-dir/journal.db");
  REQUIRE_FALSE(outbox.ok());
  CHECK(outbox.status().message().find("/nonexistent-gradwatch-dir/journal.db") != std::string::npos);
}
