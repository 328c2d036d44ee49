// NetTurnClock (src/transport/net/sockutil.h), the clock behind both backends' stall deadline: the time a
// process spent stopped itself never counts against its peer, including at the instant of the resume, when the
// heartbeat thread and the thread that judges wake together.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "transport/net/sockutil.h"

using epcomm::net::NetTurnClock;
using epcomm::net::netMissedTurnNs;

namespace {
constexpr int64_t kSec = 1000000000LL;
}

TEST(NetTurnClock, NoVerdictUntilTheFirstTurnAfterAStop) {
  NetTurnClock c;
  const int64_t t0 = 100 * kSec, heard = t0 - kSec / 10;
  c.start(t0);
  EXPECT_EQ(c.quietNs(t0 + kSec / 2, heard), kSec / 2 + kSec / 10);  // awake: the plain quiet time
  const int64_t resume = t0 + 10 * kSec;                            // stopped for 10 s, the thread missed turns
  EXPECT_EQ(c.quietNs(resume, heard), -1);                           // no verdict before its next turn
  c.turn(resume);
  EXPECT_EQ(c.quietNs(resume + kSec / 4, heard), kSec / 4);  // the resume counts as a sign of life
  c.turn(resume + kSec / 2);                                 // a regular turn moves no clock back
  EXPECT_EQ(c.quietNs(resume + kSec, heard), kSec);
  EXPECT_EQ(c.quietNs(resume + kSec, resume + kSec / 2), kSec / 2);  // a later sign of life wins
}

// The first turn after a stop races the judging thread's reads. Reading "awake" after the resume time (as the
// ofi backend once did) let a reader pair the stale resume with a fresh turn and blame its peer for the whole
// stop: in a loop like this one that happened tens of thousands of times in 300k rounds; it must never happen.
TEST(NetTurnClock, ReaderRacingTheResumeNeverSeesTheStop) {
  NetTurnClock c;
  const int64_t stop = 10 * kSec;
  ASSERT_LT(netMissedTurnNs(), stop);
  constexpr int kRounds = 100000;
  std::atomic<int> go{0}, turned{0};
  std::thread writer([&] {
    for (int k = 1; k <= kRounds; ++k) {
      while (go.load(std::memory_order_acquire) != k) {
      }
      c.turn(2 * k * stop);  // the first turn after a stop of `stop`
      turned.store(k, std::memory_order_release);
    }
  });
  long judged = 0, blamed = 0;
  for (int k = 1; k <= kRounds; ++k) {
    const int64_t before = (2 * k - 1) * stop, now = 2 * k * stop;
    c.start(before);  // last turn and last sign of life from the peer: just before the stop
    go.store(k, std::memory_order_release);
    for (int s = 0; s < 50; ++s) {
      int64_t q = c.quietNs(now, before);
      if (q >= 0) ++judged;
      if (q > netMissedTurnNs()) ++blamed;
    }
    while (turned.load(std::memory_order_acquire) != k) {
    }
  }
  writer.join();
  EXPECT_EQ(blamed, 0) << "of " << judged << " verdicts";
  EXPECT_GT(judged, 0);
}
