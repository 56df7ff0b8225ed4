#include "gradwatch/step_buffer.h"

#include <catch2/catch.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

using gradwatch::client::StepBuffer;
namespace v1 = gradwatch::v1;

namespace {

v1::StepStats Step(uint64_t n) {
  v1::StepStats s;
  s.set_step(n);
  s.set_loss(1.0 / static_cast<double>(n + 1));
  return s;
}

v1::Event EventAt(uint64_t n, const std::string& text) {
  v1::Event e;
  e.set_step(n);
  e.set_text(text);
  return e;
}

// Writes everything that is waiting, as the sender would; returns what was written. Events wait
// for their EventAck when `events_acked` (a daemon that acks events), else leave once written.
std::vector<v1::TrainerMessage> WriteAll(StepBuffer& buffer, uint64_t& seq, bool events_acked = false) {
  std::vector<v1::TrainerMessage> written;
  while (auto claimed = buffer.NextToWrite(seq)) {
    ++seq;
    written.push_back(claimed->message);
    buffer.MarkWritten(claimed->id, events_acked);
  }
  return written;
}

std::vector<uint64_t> StepsOf(const std::vector<v1::TrainerMessage>& messages) {
  std::vector<uint64_t> steps;
  for (const auto& m : messages) {
    if (m.has_step()) steps.push_back(m.step().step());
  }
  return steps;
}

v1::Accepted MakeAccepted(std::optional<uint64_t> durable, std::optional<uint64_t> received) {
  v1::Accepted a;
  a.set_has_durable_step(durable.has_value());
  a.set_last_durable_step(durable.value_or(0));
  a.set_has_received_step(received.has_value());
  a.set_last_received_step(received.value_or(0));
  return a;
}

}  // namespace

TEST_CASE("a full buffer refuses steps, counts the drops and reports them on the next step", "[client]") {
  StepBuffer buffer(3, 10);
  CHECK(buffer.PushStep(Step(1)));
  CHECK(buffer.PushStep(Step(2)));
  CHECK(buffer.PushStep(Step(3)));
  CHECK_FALSE(buffer.PushStep(Step(4)));
  CHECK_FALSE(buffer.PushStep(Step(5)));
  CHECK(buffer.dropped() == 2);
  CHECK(buffer.steps() == 3);

  uint64_t seq = 1;
  auto written = WriteAll(buffer, seq);
  CHECK(StepsOf(written) == std::vector<uint64_t>{1, 2, 3});
  // Written but not durable still counts against the capacity.
  CHECK_FALSE(buffer.HasRoomForStep());
  CHECK_FALSE(buffer.PushStep(Step(6)));
  CHECK(buffer.dropped() == 3);

  CHECK(buffer.OnAck(2) == 2);
  CHECK(buffer.PushStep(Step(7)));
  written = WriteAll(buffer, seq);
  REQUIRE(written.size() == 1);
  CHECK(written[0].step().step() == 7);
  CHECK(written[0].step().client_dropped_steps() == 3);

  CHECK(buffer.PushStep(Step(8)));
  written = WriteAll(buffer, seq);
  CHECK(written[0].step().client_dropped_steps() == 0);
}

TEST_CASE("acks release the steps they cover and nothing newer", "[client]") {
  StepBuffer buffer(100, 10);
  for (uint64_t n = 1; n <= 10; ++n) buffer.PushStep(Step(n));
  uint64_t seq = 1;
  WriteAll(buffer, seq);
  CHECK(buffer.unacked() == 10);
  CHECK(buffer.OnAck(4) == 4);
  CHECK(buffer.steps() == 6);
  CHECK(buffer.unacked() == 6);
  CHECK(buffer.OnAck(4) == 0);
  CHECK(buffer.OnAck(10) == 6);
  CHECK(buffer.empty());
}

TEST_CASE("an ack may arrive before later steps are written", "[client]") {
  StepBuffer buffer(100, 10);
  for (uint64_t n = 1; n <= 4; ++n) buffer.PushStep(Step(n));
  uint64_t seq = 1;
  WriteAll(buffer, seq);
  for (uint64_t n = 5; n <= 8; ++n) buffer.PushStep(Step(n));
  CHECK(buffer.queued() == 4);
  CHECK(buffer.OnAck(3) == 3);
  const auto written = WriteAll(buffer, seq);
  CHECK(StepsOf(written) == std::vector<uint64_t>{5, 6, 7, 8});
  CHECK(buffer.unacked() == 5);
}

TEST_CASE("events are written in order with steps and leave once written", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  CHECK(buffer.PushEvent(EventAt(2, "switched routing")));
  buffer.PushStep(Step(2));
  uint64_t seq = 1;
  const auto written = WriteAll(buffer, seq);
  REQUIRE(written.size() == 3);
  CHECK(written[0].has_step());
  CHECK(written[1].has_event());
  CHECK(written[1].event().text() == "switched routing");
  CHECK(written[2].has_step());
  CHECK(buffer.events() == 0);
  CHECK(buffer.OnAck(2) == 2);
  CHECK(buffer.empty());
}

TEST_CASE("the event bound is separate from the step capacity", "[client]") {
  StepBuffer buffer(1, 2);
  CHECK(buffer.PushEvent(EventAt(1, "a")));
  CHECK(buffer.PushEvent(EventAt(1, "b")));
  CHECK_FALSE(buffer.PushEvent(EventAt(1, "c")));
  CHECK(buffer.PushStep(Step(1)));
  CHECK(buffer.dropped() == 0);
}

TEST_CASE("after Accepted, durable steps leave, received ones wait, the rest is resent", "[client]") {
  using Case = std::tuple<std::optional<uint64_t>, std::optional<uint64_t>, std::vector<uint64_t>, size_t>;
  // durable, received → steps resent, steps still held
  const std::vector<Case> cases = {
      {std::nullopt, std::nullopt, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 10},
      {4, 4, {5, 6, 7, 8, 9, 10}, 6},
      {4, 7, {8, 9, 10}, 6},
      {std::nullopt, 7, {8, 9, 10}, 10},
      {10, 10, {}, 0},
      {12, 12, {}, 0},
  };
  for (const auto& [durable, received, resent, held] : cases) {
    CAPTURE(durable, received);
    StepBuffer buffer(100, 10);
    for (uint64_t n = 1; n <= 10; ++n) buffer.PushStep(Step(n));
    uint64_t seq = 1;
    WriteAll(buffer, seq);
    buffer.OnAccepted(MakeAccepted(durable, received));
    CHECK(StepsOf(WriteAll(buffer, seq)) == resent);
    CHECK(buffer.steps() == held);
    CHECK(buffer.unacked() == held);
    CHECK(buffer.OnAck(10) == held);
    CHECK(buffer.empty());
  }
}

TEST_CASE("Accepted on a fresh stream holds back steps the daemon already received", "[client]") {
  // A second process replaying the same history: nothing was written on this connection yet.
  StepBuffer buffer(100, 10);
  for (uint64_t n = 1; n <= 6; ++n) buffer.PushStep(Step(n));
  buffer.OnAccepted(MakeAccepted(2, 4));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{5, 6});
  CHECK(buffer.unacked() == 4);
}

TEST_CASE("an unwritten event survives a reconnect and is written in its place", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  uint64_t seq = 1;
  WriteAll(buffer, seq);
  buffer.PushEvent(EventAt(2, "lr drop"));
  buffer.PushStep(Step(2));
  buffer.OnAccepted(MakeAccepted(std::nullopt, 1));
  const auto written = WriteAll(buffer, seq);
  REQUIRE(written.size() == 2);
  CHECK(written[0].has_event());
  CHECK(written[1].step().step() == 2);
}

TEST_CASE("a rejected step is released by seq, else by step number", "[client]") {
  StepBuffer buffer(100, 10);
  for (uint64_t n = 1; n <= 5; ++n) buffer.PushStep(Step(n));
  uint64_t seq = 100;
  WriteAll(buffer, seq);                  // steps 1..5 got seq 100..104
  CHECK(buffer.ReleaseRejected(102, 3));  // seq 102 is step 3
  CHECK(buffer.steps() == 4);
  // A seq that names no step (an event's) releases nothing, whatever its step number.
  CHECK_FALSE(buffer.ReleaseRejected(999, 4));
  CHECK(buffer.ReleaseRejected(0, 5));
  CHECK_FALSE(buffer.ReleaseRejected(0, 5));
  CHECK_FALSE(buffer.ReleaseRejected(0, 42));
  CHECK(buffer.OnAck(4) == 3);
  CHECK(buffer.empty());
}

TEST_CASE("a message refused before writing can be released by id", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  buffer.PushStep(Step(2));
  auto claimed = buffer.NextToWrite(1);
  REQUIRE(claimed);
  CHECK(claimed->message.seq() == 1);
  CHECK(buffer.Release(claimed->id));
  claimed = buffer.NextToWrite(2);
  REQUIRE(claimed);
  CHECK(claimed->message.step().step() == 2);
}

TEST_CASE("an error that overtakes its write still releases the step", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  auto claimed = buffer.NextToWrite(9);
  REQUIRE(claimed);
  CHECK(buffer.ReleaseRejected(9, 1));
  buffer.MarkWritten(claimed->id, false);
  CHECK(buffer.empty());
  CHECK(buffer.unacked() == 0);
}

TEST_CASE("marking a released entry as written is harmless", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  buffer.PushStep(Step(2));
  auto claimed = buffer.NextToWrite(1);
  REQUIRE(claimed);
  CHECK(buffer.OnAck(1) == 1);  // the daemon already had it
  buffer.MarkWritten(claimed->id, false);
  CHECK(buffer.unacked() == 0);
  CHECK(buffer.queued() == 1);
}

TEST_CASE("an event is held until its ack and written again on a new stream", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  buffer.PushEvent(EventAt(1, "switched routing"));
  buffer.PushStep(Step(2));
  uint64_t seq = 10;
  const auto first = WriteAll(buffer, seq, /*events_acked=*/true);
  REQUIRE(first.size() == 3);
  const uint64_t event_seq = first[1].seq();
  CHECK(buffer.OnAck(2) == 2);
  CHECK(buffer.events() == 1);  // the steps are durable, the event is not yet
  CHECK(buffer.unacked() == 1);
  CHECK(buffer.queued() == 0);

  // The stream breaks before the event's ack: the next stream writes it again, with a new seq.
  v1::Accepted accepted;
  accepted.set_has_durable_step(true);
  accepted.set_last_durable_step(2);
  accepted.set_has_received_step(true);
  accepted.set_last_received_step(2);
  buffer.OnAccepted(accepted);
  CHECK_FALSE(buffer.OnEventAck(event_seq));  // an ack from the old stream no longer matches
  const auto again = WriteAll(buffer, seq, true);
  REQUIRE(again.size() == 1);
  CHECK(again[0].event().text() == "switched routing");
  CHECK(buffer.OnEventAck(again[0].seq()));
  CHECK(buffer.empty());
}

TEST_CASE("an event ack that overtakes the sender's MarkWritten still releases the event", "[client]") {
  // The sender writes without the Monitor's lock; a daemon that already holds the event acks it
  // at once, so the ack can be handled before the sender marks the event written.
  StepBuffer buffer(100, 10);
  buffer.PushStep(Step(1));
  buffer.PushEvent(EventAt(1, "switched routing"));
  buffer.PushStep(Step(2));
  uint64_t seq = 20;
  auto step1 = buffer.NextToWrite(seq++);
  REQUIRE(step1);
  buffer.MarkWritten(step1->id, true);
  auto event = buffer.NextToWrite(seq++);
  REQUIRE(event);
  REQUIRE(event->message.has_event());
  CHECK(buffer.OnEventAck(event->message.seq()));  // before MarkWritten
  buffer.MarkWritten(event->id, true);             // the event is gone: nothing to mark
  CHECK(buffer.events() == 0);
  const auto rest = WriteAll(buffer, seq, true);
  CHECK(StepsOf(rest) == std::vector<uint64_t>{2});
  CHECK(buffer.OnAck(2) == 2);
  CHECK(buffer.unacked() == 0);
  CHECK(buffer.queued() == 0);
}

TEST_CASE("an event refused by the daemon is released by its seq", "[client]") {
  StepBuffer buffer(100, 10);
  buffer.PushEvent(EventAt(5, ""));
  uint64_t seq = 1;
  const auto written = WriteAll(buffer, seq, true);
  REQUIRE(written.size() == 1);
  CHECK(buffer.ReleaseRejected(written[0].seq(), 5));
  CHECK(buffer.empty());
}

TEST_CASE("the window holds back steps beyond its count until acks free it", "[client][flow]") {
  StepBuffer buffer(100, 10, {.steps = 3, .bytes = 1 << 20});
  for (uint64_t n = 1; n <= 8; ++n) REQUIRE(buffer.PushStep(Step(n)));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{1, 2, 3});
  CHECK_FALSE(buffer.CanWrite());
  CHECK(buffer.unacked() == 3);
  CHECK(buffer.queued() == 5);
  // An ack that releases one step lets one more go.
  CHECK(buffer.OnAck(1) == 1);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{4});
  CHECK(buffer.OnAck(4) == 3);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{5, 6, 7});
  CHECK(buffer.OnAck(7) == 3);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{8});
  CHECK(buffer.OnAck(8) == 1);
  CHECK(buffer.empty());
  CHECK(buffer.unacked_bytes() == 0);
}

TEST_CASE("the window bounds the bytes in flight, and a step larger than it goes alone", "[client][flow]") {
  const size_t step_bytes = [] {
    v1::TrainerMessage m;
    *m.mutable_step() = Step(1);
    return m.ByteSizeLong();
  }();
  StepBuffer buffer(100, 10, {.steps = 100, .bytes = 2 * step_bytes + step_bytes / 2});
  for (uint64_t n = 1; n <= 5; ++n) REQUIRE(buffer.PushStep(Step(n)));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{1, 2});
  CHECK(buffer.unacked_bytes() == 2 * step_bytes);
  CHECK(buffer.OnAck(2) == 2);
  CHECK(buffer.unacked_bytes() == 0);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{3, 4});

  StepBuffer tiny(100, 10, {.steps = 100, .bytes = 1});
  for (uint64_t n = 1; n <= 3; ++n) REQUIRE(tiny.PushStep(Step(n)));
  seq = 1;
  CHECK(StepsOf(WriteAll(tiny, seq)) == std::vector<uint64_t>{1});
  CHECK(tiny.OnAck(1) == 1);
  CHECK(StepsOf(WriteAll(tiny, seq)) == std::vector<uint64_t>{2});
}

TEST_CASE("events keep their place in the order when the window is full", "[client][flow]") {
  StepBuffer buffer(100, 10, {.steps = 1, .bytes = 1 << 20});
  REQUIRE(buffer.PushStep(Step(1)));
  REQUIRE(buffer.PushStep(Step(2)));
  REQUIRE(buffer.PushEvent(EventAt(2, "switched routing")));
  REQUIRE(buffer.PushStep(Step(3)));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{1});
  CHECK(buffer.OnAck(1) == 1);
  // Step 2 fills the window; the event after it waits for its turn, then goes without waiting
  // for room (events do not count), and step 3 waits for the ack of step 2.
  auto written = WriteAll(buffer, seq);
  REQUIRE(written.size() == 2);
  CHECK(written[0].step().step() == 2);
  CHECK(written[1].event().text() == "switched routing");
  CHECK(buffer.OnAck(2) == 1);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{3});
}

TEST_CASE("steps the daemon said it received occupy the window until their ack", "[client][flow]") {
  StepBuffer buffer(100, 10, {.steps = 4, .bytes = 1 << 20});
  for (uint64_t n = 1; n <= 10; ++n) REQUIRE(buffer.PushStep(Step(n)));
  uint64_t seq = 1;
  WriteAll(buffer, seq);
  // A new stream: the daemon committed through 1 and received through 3, so steps 2 and 3 are
  // owed an ack and only two more fit.
  CHECK(buffer.OnAccepted(MakeAccepted(1, 3)) == 1);
  CHECK(buffer.unacked() == 2);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{4, 5});
  CHECK(buffer.OnAck(3) == 2);
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{6, 7});
}

TEST_CASE("a rejected step frees its place in the window", "[client][flow]") {
  StepBuffer buffer(100, 10, {.steps = 2, .bytes = 1 << 20});
  for (uint64_t n = 1; n <= 3; ++n) REQUIRE(buffer.PushStep(Step(n)));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{1, 2});
  CHECK(buffer.ReleaseRejected(0, 2));
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{3});
}

TEST_CASE("a byte capacity bounds the steps held, written or not", "[client][flow]") {
  const size_t step_bytes = [] {
    v1::TrainerMessage m;
    *m.mutable_step() = Step(1);
    return m.ByteSizeLong();
  }();
  StepBuffer buffer(100, 10, {.steps = 1, .bytes = 1 << 20}, 3 * step_bytes);
  for (uint64_t n = 1; n <= 3; ++n) REQUIRE(buffer.PushStep(Step(n)));
  CHECK(buffer.held_bytes() == 3 * step_bytes);
  CHECK_FALSE(buffer.HasRoomForStep());
  CHECK_FALSE(buffer.PushStep(Step(4)));
  uint64_t seq = 1;
  CHECK(StepsOf(WriteAll(buffer, seq)) == std::vector<uint64_t>{1});
  CHECK_FALSE(buffer.HasRoomForStep());  // written is still held until acked
  CHECK(buffer.OnAck(1) == 1);
  CHECK(buffer.PushStep(Step(5)));  // it carries the drop of step 4: a few bytes more
  CHECK(buffer.steps() == 3);
  CHECK(buffer.held_bytes() > 3 * step_bytes);
  CHECK_FALSE(buffer.HasRoomForStep());
}
