// Where a rank runs: the identity of its host (DESIGN.md "host"). Ranks with the same identity share memory;
// ranks with different ones reach each other over the net transport only.
#pragma once
#include <cstddef>
#include <vector>

namespace epcomm {

// "id:" + EPCOMM_HOSTID when set (virtual hosts on one machine, as epcomm-run --hosts sets it), else hostname +
// "/" + boot id. Written NUL-terminated into out (n bytes), truncated if longer.
void hostIdentity(char* out, size_t n);
// The machine itself, whatever EPCOMM_HOSTID says: hostname + "/" + boot id (ranks of virtual hosts that share a
// GPU still share its SMs).
void machineIdentity(char* out, size_t n);

// The ranks grouped by host, from each rank's host identity (ids[r], as hostIdentity gives it): hosts numbered in
// the order of their lowest rank, a rank's local index its place among its host's ranks, ascending. Both engines
// number hosts with it, so the forwarder a rule picks from these numbers is the same rank in each.
struct HostMap {
  std::vector<int> host_of;             // [R]
  std::vector<int> local_idx;           // [R]
  std::vector<std::vector<int>> ranks;  // [hosts]: each host's ranks, ascending
};
HostMap mapHosts(const std::vector<const char*>& ids);

}  // namespace epcomm
