// One of two ranks on hosts of their own, for the net bridge's unit tests: the bootstrap, this rank's region (the
// inbox from the other rank lives there) and a bridge over it, not connected yet (the caller sets it up, then
// connects).
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "multiproc.h"
#include "transport/bridge/net_bridge.h"
#include "transport/shm/shm.h"

namespace epcomm::test {

struct BridgeRank {
  std::unique_ptr<Bootstrap> bs;
  ShmRegion own;
  std::unique_ptr<NetBridge> bridge;
};

// 0, or 1 with what failed on stderr (EP_RANK_CHECK). tag names the region.
inline int openBridgeRank(int rank, const epUniqueId& id, size_t ring, size_t max_payload, const char* tag,
                          int timeout_ms, BridgeRank* out) {
  EP_RANK_CHECK(rank, bootstrapInitSocket(&id, rank, 2, timeout_ms, &out->bs) == epSuccess, "bootstrap");
  EP_RANK_CHECK(rank, out->own.create(shmRegionName(out->bs->secret(), rank) + tag, rank, 2, 1, ring) == epSuccess,
                "region");
  out->own.unlink();
  std::vector<uint8_t> remote(2, 1);
  remote[rank] = 0;
  out->bridge = std::make_unique<NetBridge>(rank, 2, 1, ring, max_payload, remote, &out->own);
  return 0;
}

}  // namespace epcomm::test
