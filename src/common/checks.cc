#include "common/checks.h"

#include <cstdarg>
#include <cstdio>

namespace epcomm {
namespace {
thread_local char tLastError[1024];
}

epResult_t setError(epResult_t code, const char* file, int line, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tLastError, sizeof(tLastError), fmt, ap);
  va_end(ap);
  if (logEnabled(kLogWarn, kSubsysAll))
    logPrint(kLogWarn, kSubsysAll, file, line, "%s: %s", epGetErrorString(code), tLastError);
  return code;
}

const char* threadLastError() { return tLastError; }
void clearThreadError() { tLastError[0] = '\0'; }
void setThreadErrorText(const char* text) { snprintf(tLastError, sizeof(tLastError), "%s", text); }

}  // namespace epcomm
