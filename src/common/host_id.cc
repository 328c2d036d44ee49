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

HostMap mapHosts(const std::vector<const char*>& ids) {
  HostMap m;
  const int R = static_cast<int>(ids.size());
  m.host_of.assign(R, 0);
  m.local_idx.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    int h = 0;  // the host whose lowest rank has r's identity, or a new one
    while (h < static_cast<int>(m.ranks.size()) && strcmp(ids[m.ranks[h][0]], ids[r]) != 0) ++h;
    if (h == static_cast<int>(m.ranks.size())) m.ranks.emplace_back();
    m.host_of[r] = h;
    m.local_idx[r] = static_cast<int>(m.ranks[h].size());
    m.ranks[h].push_back(r);
  }
  return m;
}

}  // namespace epcomm
