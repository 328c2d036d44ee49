#include "store_allgather.h"

#include <cstring>
#include <exception>
#include <vector>

namespace epcomm_torch {

int storeAllgather(void* ctx, const void* sendbuf, void* recvbuf, size_t bytes_per_rank) {
  auto* ag = static_cast<StoreAllgather*>(ctx);
  try {
    const std::string base = ag->prefix + "/ag" + std::to_string(ag->round++) + "/";
    const auto* src = static_cast<const uint8_t*>(sendbuf);
    ag->store->set(base + std::to_string(ag->rank), std::vector<uint8_t>(src, src + bytes_per_rank));
    auto* dst = static_cast<uint8_t*>(recvbuf);
    for (int r = 0; r < ag->size; ++r) {
      std::vector<uint8_t> v = ag->store->get(base + std::to_string(r));  // waits up to the Store's timeout
      if (v.size() != bytes_per_rank) {
        ag->error = "rank " + std::to_string(r) + " published " + std::to_string(v.size()) + " bytes, expected " +
                    std::to_string(bytes_per_rank);
        return 1;
      }
      std::memcpy(dst + static_cast<size_t>(r) * bytes_per_rank, v.data(), bytes_per_rank);
    }
    return 0;
  } catch (const std::exception& e) {
    ag->error = e.what();
    return 1;
  }
}

}  // namespace epcomm_torch
