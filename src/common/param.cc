#include "common/param.h"

#include <cerrno>
#include <cstdlib>

#include "common/log.h"

namespace epcomm {

int64_t paramLoad(const char* env_name, int64_t default_value) {
  const char* s = getenv(env_name);
  if (s == nullptr || s[0] == '\0') return default_value;
  errno = 0;
  char* end = nullptr;
  long long v = strtoll(s, &end, 0);
  if (errno != 0 || end == s || *end != '\0') {
    EP_WARN("%s='%s' is not an integer; using the default %lld", env_name, s,
            static_cast<long long>(default_value));
    return default_value;
  }
  EP_INFO(kSubsysInit, "%s set by environment to %lld", env_name, v);
  return v;
}

const char* paramString(const char* env_name) {
  const char* s = getenv(env_name);
  return (s == nullptr || s[0] == '\0') ? nullptr : s;
}

}  // namespace epcomm
