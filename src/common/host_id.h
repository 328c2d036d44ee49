// Where a rank runs: the identity of its host (DESIGN.md "host"). Ranks with the same identity share memory;
// ranks with different ones reach each other over the net transport only.
#pragma once
#include <cstddef>

namespace epcomm {

// "id:" + EPCOMM_HOSTID when set (virtual hosts on one machine, as epcomm-run --hosts sets it), else hostname +
// "/" + boot id. Written NUL-terminated into out (n bytes), truncated if longer.
void hostIdentity(char* out, size_t n);
// The machine itself, whatever EPCOMM_HOSTID says: hostname + "/" + boot id (ranks of virtual hosts that share a
// GPU still share its SMs).
void machineIdentity(char* out, size_t n);

}  // namespace epcomm
