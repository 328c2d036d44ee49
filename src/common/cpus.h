// How many CPUs this process may use: defaults that trade a polling thread's latency against the cores the others
// need go by it (a 2-core VM and a 16-core GPU host want different ones).
#pragma once
#include <sched.h>
#include <unistd.h>

#include <cstdint>

namespace epcomm {

// CPUs this process may run on (its affinity mask: a container's cpuset, taskset), else the online ones.
inline int64_t usableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 ? cpus : 1;
}

}  // namespace epcomm
