#include "common/host_id.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "common/param.h"

namespace epcomm {

void hostIdentity(char* out, size_t n) {
  if (const char* hid = paramString("EPCOMM_HOSTID")) {
    snprintf(out, n, "id:%s", hid);
    return;
  }
  machineIdentity(out, n);
}

void machineIdentity(char* out, size_t n) {
  char host[128] = {0}, boot[64] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) snprintf(host, sizeof(host), "localhost");
  if (FILE* f = fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (!fgets(boot, sizeof(boot), f)) boot[0] = 0;
    fclose(f);
    boot[strcspn(boot, "\n")] = 0;
  }
  snprintf(out, n, "%s/%s", host, boot);
}

}  // namespace epcomm
