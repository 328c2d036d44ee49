// Error propagation. The place that decides an error records it once (message + log line, UCX's rule);
// callers above only pass the code on. The message becomes the calling thread's last error, which the API
// layer copies into the communicator (epGetLastError).
#pragma once
#include <cerrno>

#include "common/log.h"
#include "epcomm/epcomm.h"

namespace epcomm {

epResult_t setError(epResult_t code, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
const char* threadLastError();
void setThreadErrorText(const char* text);  // without logging: hands a message decided elsewhere to this thread
void clearThreadError();

}  // namespace epcomm

// Decide an error here: record and log it, evaluate to the code.
#define EP_ERROR(code, ...) ::epcomm::setError((code), __FILE__, __LINE__, __VA_ARGS__)
#define EP_FAIL(code, ...) return EP_ERROR((code), __VA_ARGS__)
#define EP_REQUIRE(cond, code, ...) \
  do {                              \
    if (!(cond)) EP_FAIL((code), __VA_ARGS__); \
  } while (0)

// Pass an error on.
#define EPCHECK(call)                                                              \
  do {                                                                             \
    epResult_t ep_res_ = (call);                                                   \
    if (ep_res_ != epSuccess) {                                                    \
      EP_TRACE(::epcomm::kSubsysAll, "-> %d (%s)", static_cast<int>(ep_res_), #call); \
      return ep_res_;                                                              \
    }                                                                              \
  } while (0)

#define EPCHECKGOTO(call, res, label) \
  do {                                \
    (res) = (call);                   \
    if ((res) != epSuccess) goto label; \
  } while (0)

// A system call that returns -1 on failure; EINTR is retried.
#define SYSCHECK_RETRY(expr, out)      \
  do {                                 \
    (out) = (expr);                    \
  } while ((out) == -1 && errno == EINTR)
