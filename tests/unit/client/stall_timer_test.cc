#include "client/lib/stall_timer.h"

#include <catch2/catch.hpp>

#include "server/core/clock.h"

using gradwatch::FakeClock;
using gradwatch::client::StallTimer;
using namespace std::chrono_literals;

TEST_CASE("a wait with no progress stalls exactly the stall timeout after it began", "[client]") {
  FakeClock clock;
  clock.Advance(1h);
  const StallTimer timer(10s, clock.Now(), 7);
  CHECK(timer.GiveUpAt() == clock.Now() + 10s);
  clock.Advance(10s - 1ns);
  CHECK_FALSE(timer.Stalled(clock.Now()));
  clock.Advance(1ns);
  CHECK(timer.Stalled(clock.Now()));
  CHECK(timer.Quiet(clock.Now()) == 10s);
}

TEST_CASE("a daemon that keeps making progress is waited for far beyond the stall timeout", "[client]") {
  FakeClock clock;
  StallTimer timer(10s, clock.Now(), 0);
  uint64_t progress = 0;
  // An hour of a slow daemon: one ack every 9 s.
  for (int i = 0; i < 400; ++i) {
    clock.Advance(9s);
    REQUIRE_FALSE(timer.Stalled(clock.Now()));
    timer.Observe(++progress, clock.Now());
    CHECK(timer.GiveUpAt() == clock.Now() + 10s);
  }
  // Then it stops: the wait gives up 10 s after the last ack, not after the hour.
  clock.Advance(9s);
  timer.Observe(progress, clock.Now());
  CHECK_FALSE(timer.Stalled(clock.Now()));
  clock.Advance(1s);
  timer.Observe(progress, clock.Now());
  CHECK(timer.Stalled(clock.Now()));
}

TEST_CASE("observing an unchanged progress count does not extend the wait", "[client]") {
  FakeClock clock;
  StallTimer timer(5s, clock.Now(), 3);
  const auto give_up = timer.GiveUpAt();
  for (int i = 0; i < 4; ++i) {
    clock.Advance(1s);
    timer.Observe(3, clock.Now());
    CHECK(timer.GiveUpAt() == give_up);
  }
  clock.Advance(1s);
  CHECK(timer.Stalled(clock.Now()));
}

TEST_CASE("progress counted before the wait began does not shorten it", "[client]") {
  // The owner's counter may have moved long before this wait: the wait still gets its full
  // stall timeout from its own start.
  FakeClock clock;
  StallTimer timer(5s, clock.Now(), 1000);
  clock.Advance(4s);
  CHECK_FALSE(timer.Stalled(clock.Now()));
  timer.Observe(1001, clock.Now());
  clock.Advance(4s);
  CHECK_FALSE(timer.Stalled(clock.Now()));
  CHECK(timer.Quiet(clock.Now()) == 4s);
}
