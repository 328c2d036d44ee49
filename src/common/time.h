// Monotonic time and deadlines: every wait in epcomm takes a Deadline.
#pragma once
#include <time.h>

#include <algorithm>
#include <cstdint>

namespace epcomm {

inline int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Waits that must not count the time their own process spent stopped (a suspended job, a debugger) watch the
// gap between their consecutive turns. A thread that turns at least every heartbeatMs(timeout) - a heartbeat
// thread, or a wait loop that polls far more often - and finds a gap longer than missedTurnNs(timeout) did not
// run meanwhile: it could not hear its peers, which may well have been stopped with it.
inline int64_t heartbeatMs(int64_t timeout_ms) { return std::clamp<int64_t>(timeout_ms / 4, 5, 1000); }
inline int64_t missedTurnNs(int64_t timeout_ms) { return (2 * heartbeatMs(timeout_ms) + 50) * 1000000LL; }

class Deadline {
 public:
  Deadline() : end_ns_(INT64_MAX) {}
  static Deadline afterMs(int64_t ms) { return Deadline(nowNs() + ms * 1000000LL); }
  bool expired() const { return nowNs() >= end_ns_; }
  int64_t remainingMs() const {
    int64_t r = (end_ns_ - nowNs()) / 1000000LL;
    return r < 0 ? 0 : r;
  }
  int64_t endNs() const { return end_ns_; }

 private:
  explicit Deadline(int64_t end) : end_ns_(end) {}
  int64_t end_ns_;
};

// Spin politely: busy for the first iterations, then yield, then sleep briefly, so that many ranks on few
// cores still make progress.
class Backoff {
 public:
  void pause();
  void reset() { n_ = 0; }

 private:
  uint32_t n_ = 0;
};

}  // namespace epcomm
