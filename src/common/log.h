// Logging in NCCL's manner: EPCOMM_DEBUG=WARN|INFO|TRACE selects the level, EPCOMM_DEBUG_SUBSYS=INIT,NET,...
// selects subsystems for INFO/TRACE. WARN always prints. Lines go to stderr prefixed by host, pid and rank.
#pragma once
#include <cstdint>

namespace epcomm {

enum LogLevel : int { kLogNone = 0, kLogWarn = 1, kLogInfo = 2, kLogTrace = 3 };
enum LogSubsys : uint32_t {
  kSubsysInit = 0x1,
  kSubsysBootstrap = 0x2,
  kSubsysShm = 0x4,
  kSubsysNet = 0x8,
  kSubsysEngine = 0x10,
  kSubsysColl = 0x20,
  kSubsysGpu = 0x40,
  kSubsysAll = 0xffffffffu,
};

int logLevel();
bool logEnabled(LogLevel level, uint32_t subsys);
void logSetRank(int rank);  // shown in every line of this process once known
void logPrint(LogLevel level, uint32_t subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

}  // namespace epcomm

#define EP_WARN(...) ::epcomm::logPrint(::epcomm::kLogWarn, ::epcomm::kSubsysAll, __FILE__, __LINE__, __VA_ARGS__)
#define EP_INFO(subsys, ...)                                                      \
  do {                                                                            \
    if (::epcomm::logEnabled(::epcomm::kLogInfo, (subsys)))                       \
      ::epcomm::logPrint(::epcomm::kLogInfo, (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define EP_TRACE(subsys, ...)                                                      \
  do {                                                                             \
    if (::epcomm::logEnabled(::epcomm::kLogTrace, (subsys)))                       \
      ::epcomm::logPrint(::epcomm::kLogTrace, (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
