// Environment parameters, each declared once next to its use:
//   EP_PARAM(TimeoutMs, "TIMEOUT_MS", 30000);   // defines int64_t epParamTimeoutMs(), reading EPCOMM_TIMEOUT_MS
// The value is read on first use and cached. A value that does not parse as an integer is reported once and
// the default is used. Every parameter is listed in README.md.
#pragma once
#include <atomic>
#include <cstdint>

namespace epcomm {
int64_t paramLoad(const char* env_name, int64_t default_value);
const char* paramString(const char* env_name);  // nullptr when unset or empty
}  // namespace epcomm

#define EP_PARAM(name, env, default_value)                                        \
  static inline int64_t epParam##name() {                                         \
    static std::atomic<int64_t> cached{INT64_MIN};                                \
    int64_t v = cached.load(std::memory_order_relaxed);                           \
    if (v == INT64_MIN) {                                                         \
      v = ::epcomm::paramLoad("EPCOMM_" env, (default_value));                    \
      cached.store(v, std::memory_order_relaxed);                                 \
    }                                                                             \
    return v;                                                                     \
  }
