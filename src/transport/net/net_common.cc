// Logging sink, error recording and backend selection for the net transport.
#include <strings.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <mutex>

#include "common/log.h"
#include "common/param.h"
#include "transport/net/net.h"

namespace epcomm::net {

namespace {
std::atomic<NetLogSink> gSink{nullptr};
thread_local char tLastError[512];
}  // namespace

void netSetLogSink(NetLogSink sink) { gSink.store(sink); }

bool netLogEnabled(int level) {
  // NCCL's logger filters by NCCL_DEBUG itself; it is cheap to call, so hand it INFO and let it decide.
  if (gSink.load() != nullptr) return level <= kNetLogInfo || logEnabled(kLogTrace, kSubsysNet);
  return logEnabled(static_cast<LogLevel>(level), kSubsysNet);
}

static void emit(int level, const char* file, int line, const char* msg) {
  if (NetLogSink s = gSink.load()) {
    s(level, file, line, msg);
    return;
  }
  logPrint(static_cast<LogLevel>(level), kSubsysNet, file, line, "%s", msg);
}

void netLog(int level, const char* file, int line, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  emit(level, file, line, msg);
}

epResult_t netError(epResult_t code, const char* file, int line, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tLastError, sizeof(tLastError), fmt, ap);
  va_end(ap);
  emit(kNetLogWarn, file, line, tLastError);
  return code;
}

const char* netLastError() { return tLastError; }

epResult_t netQuietError(epResult_t code, const char* msg) {
  snprintf(tLastError, sizeof(tLastError), "%s", msg);
  return code;
}

NetBackend* netBackend(std::string* why) {
  const char* sel = paramString("EPCOMM_NET");
  if (sel == nullptr || strcasecmp(sel, "socket") == 0) return netSocketBackend(why);
  if (strcasecmp(sel, "ofi") == 0 || strcasecmp(sel, "libfabric") == 0) return netOfiBackend(why);
  if (why) *why = std::string("EPCOMM_NET='") + sel + "' is neither 'socket' nor 'ofi'";
  return nullptr;
}

}  // namespace epcomm::net
