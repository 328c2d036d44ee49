// Names the calling thread (what top -H, /proc/<pid>/task/*/comm and debuggers show), so that a rank's threads can
// be told apart when one of them is busy or stuck. Linux keeps 15 characters; longer names are cut.
#pragma once
#include <pthread.h>

#include <cstdio>

namespace epcomm {

inline void nameThisThread(const char* name, int index = -1) {
  char buf[64];
  if (index >= 0) snprintf(buf, sizeof(buf), "%.40s%d", name, index);
  else snprintf(buf, sizeof(buf), "%.40s", name);
  buf[15] = '\0';
  pthread_setname_np(pthread_self(), buf);
}

}  // namespace epcomm
