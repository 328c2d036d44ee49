#include "common/time.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include "common/param.h"

namespace epcomm {

// Idle rounds a wait yields its core (sched_yield) before it starts sleeping: a diagnostic knob for many-core
// hosts, where a waiter that sleeps may come back later than the data it waits for.
EP_PARAM(BackoffYields, "BACKOFF_YIELDS", 192);

void Backoff::pause() {
  ++n_;
  static const uint32_t yields = static_cast<uint32_t>(std::clamp<int64_t>(epParamBackoffYields(), 0, 1 << 30));
  if (n_ < 64) {
    __builtin_ia32_pause();
  } else if (n_ < 64 + yields) {
    sched_yield();
  } else {
    usleep(n_ < 64 + yields + 3840 ? 20 : 200);  // 3840 short sleeps, then long ones
  }
}

}  // namespace epcomm
