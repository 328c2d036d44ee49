// Logging sink, error recording and backend selection for the net transport.
#include <dirent.h>
#include <strings.h>
#include <sys/resource.h>

#include <algorithm>
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

size_t openDescriptors() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
    if (n > 0) --n;  // the directory's own descriptor
  }
  return n;
}

epResult_t ensureDescriptors(size_t more, const char* what) {
  constexpr size_t kMargin = 64;  // for what else the process opens meanwhile (files, pipes, the bootstrap)
  const size_t open_now = openDescriptors();
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return epSuccess;  // cannot tell: let socket() say
  const size_t need = open_now + more + kMargin;
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= need) return epSuccess;
  if (lim.rlim_max == RLIM_INFINITY || lim.rlim_max >= need) {
    const rlim_t old = lim.rlim_cur;
    // Up to the hard limit at most, but not beyond what is needed twice over (a later communicator's share).
    lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? 2 * need : std::min<rlim_t>(lim.rlim_max, 2 * need);
    if (setrlimit(RLIMIT_NOFILE, &lim) == 0) {
      NET_INFO("NET/epcomm: %s need about %zu more file descriptors (%zu open): raised the soft RLIMIT_NOFILE from "
               "%llu to %llu", what, more, open_now, static_cast<unsigned long long>(old),
               static_cast<unsigned long long>(lim.rlim_cur));
      return epSuccess;
    }
    lim.rlim_cur = old;
  }
  // Not logged here: the caller reports it with its own context (the bridge's set-up error), once.
  char msg[512];
  snprintf(msg, sizeof(msg),
           "NET/epcomm: %s need about %zu more file descriptors, %zu are open, and RLIMIT_NOFILE allows %llu (hard "
           "limit %llu): raise the limit (ulimit -n) or lower EPCOMM_NET_STREAM_BUDGET (data streams per peer)",
           what, more, open_now, static_cast<unsigned long long>(lim.rlim_cur),
           lim.rlim_max == RLIM_INFINITY ? ~0ull : static_cast<unsigned long long>(lim.rlim_max));
  return netQuietError(epSystemError, msg);
}

NetBackend* netBackend(std::string* why) {
  const char* sel = paramString("EPCOMM_NET");
  if (sel == nullptr || strcasecmp(sel, "socket") == 0) return netSocketBackend(why);
  if (strcasecmp(sel, "ofi") == 0 || strcasecmp(sel, "libfabric") == 0) return netOfiBackend(why);
  if (why) *why = std::string("EPCOMM_NET='") + sel + "' is neither 'socket' nor 'ofi'";
  return nullptr;
}

}  // namespace epcomm::net
