#include "common/time.h"

#include <sched.h>
#include <unistd.h>

namespace epcomm {

void Backoff::pause() {
  ++n_;
  if (n_ < 64) {
    __builtin_ia32_pause();
  } else if (n_ < 256) {
    sched_yield();
  } else {
    usleep(n_ < 4096 ? 20 : 200);
  }
}

}  // namespace epcomm
