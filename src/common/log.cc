#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace epcomm {
namespace {

struct LogConfig {
  int level = kLogWarn;
  uint32_t mask = kSubsysAll;
  char host[64] = {0};
};

uint32_t parseSubsys(const char* s) {
  static const struct { const char* name; uint32_t bit; } kNames[] = {
      {"INIT", kSubsysInit}, {"BOOTSTRAP", kSubsysBootstrap}, {"SHM", kSubsysShm}, {"NET", kSubsysNet},
      {"ENGINE", kSubsysEngine}, {"COLL", kSubsysColl}, {"GPU", kSubsysGpu}, {"ALL", kSubsysAll}};
  bool invert = s[0] == '^';
  if (invert) s++;
  uint32_t mask = 0;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", s);
  for (char* save = nullptr; char* tok = strtok_r(save ? nullptr : buf, ",", &save);) {
    for (const auto& n : kNames)
      if (strcasecmp(tok, n.name) == 0) mask |= n.bit;
  }
  return invert ? ~mask : mask;
}

const LogConfig& config() {
  static LogConfig cfg = [] {
    LogConfig c;
    if (const char* l = getenv("EPCOMM_DEBUG")) {
      if (strcasecmp(l, "NONE") == 0) c.level = kLogNone;
      else if (strcasecmp(l, "WARN") == 0) c.level = kLogWarn;
      else if (strcasecmp(l, "INFO") == 0) c.level = kLogInfo;
      else if (strcasecmp(l, "TRACE") == 0) c.level = kLogTrace;
    }
    if (const char* s = getenv("EPCOMM_DEBUG_SUBSYS")) c.mask = parseSubsys(s);
    gethostname(c.host, sizeof(c.host) - 1);
    return c;
  }();
  return cfg;
}

std::atomic<int> gRank{-1};
std::mutex gLogMutex;

}  // namespace

int logLevel() { return config().level; }

bool logEnabled(LogLevel level, uint32_t subsys) {
  const LogConfig& c = config();
  return level <= c.level && (level == kLogWarn || (c.mask & subsys) != 0);
}

void logSetRank(int rank) { gRank.store(rank); }

void logPrint(LogLevel level, uint32_t subsys, const char* file, int line, const char* fmt, ...) {
  if (!logEnabled(level, subsys)) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  static const char* kTag[] = {"", "WARN", "INFO", "TRACE"};
  std::lock_guard<std::mutex> lock(gLogMutex);
  fprintf(stderr, "%s:%d:%d [epcomm] %s %s:%d %s\n", config().host, static_cast<int>(getpid()), gRank.load(),
          kTag[level], base, line, msg);
}

}  // namespace epcomm
