// Routing rules shared by the host engine and the GPU kernels (__host__ __device__): which rank hosts an
// expert, its local id, and how a (count, begin) pair is packed into a layout-range word.
#pragma once
#include <cstdint>

#include "common/hd.h"

namespace epcomm {

struct ExpertMap {
  int num_experts;
  int nranks;
  int local_experts;  // num_experts / nranks
  EP_HD int rankOf(int64_t expert) const { return static_cast<int>(expert / local_experts); }
  EP_HD int localOf(int64_t expert) const { return static_cast<int>(expert % local_experts); }
};

EP_HD int64_t packLayoutRange(int64_t count, int64_t begin) { return (count << 32) | (begin & 0xffffffffLL); }
EP_HD int layoutRangeCount(int64_t v) { return static_cast<int>(v >> 32); }
EP_HD int layoutRangeBegin(int64_t v) { return static_cast<int>(v & 0xffffffffLL); }

// True when topk_idx[t, k] repeats an earlier entry of the same token (such a pair is sent once).
EP_HD bool isRepeatedExpert(const int64_t* row, int k) {
  for (int j = 0; j < k; ++j)
    if (row[j] == row[k]) return true;
  return false;
}

}  // namespace epcomm
