// Host-side argument validation of every operation (DESIGN.md R2). Each check decides one specific result
// code and a message naming the argument and the limit. Shared by both engines: what it reads of the
// arguments' contents (topk_idx values, layout arrays) it reads only when they are host memory.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/comm.h"
#include "epcomm/epcomm.h"

namespace epcomm {

struct ValidateCtx {
  const epComm* comm;
  bool host_memory;     // arrays may be read on the host
  size_t max_row_bytes; // largest row the engine's queues take
};

epResult_t validateHtDispatch(const ValidateCtx& v, const epHtDispatchArgs_t* a, const epHtHandle* h, bool notify);
epResult_t validateHtCombine(const ValidateCtx& v, const epHtCombineArgs_t* a, const epHtHandle* h);
epResult_t validateLlDispatch(const ValidateCtx& v, const epLlDispatchArgs_t* a);
epResult_t validateLlCombine(const ValidateCtx& v, const epLlCombineArgs_t* a);
epResult_t validateRouting(int num_tokens, int topk, int num_experts, int nranks);
epResult_t validateTopkIdx(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, const char* name);

epResult_t validateAlltoallv(const ValidateCtx& v, const void* sendbuf, const size_t* send_counts,
                             const size_t* send_displs, const void* recvbuf, const size_t* recv_counts,
                             const size_t* recv_displs, int dtype);
epResult_t validateAlltoallvDevice(const ValidateCtx& v, const void* sendbuf, const int64_t* send_counts,
                                   const void* recvbuf, size_t recv_capacity, const int64_t* recv_counts, int dtype);

// epCommSetActiveRanks: active (nranks int32, nonzero = keep) must keep the calling rank and may not re-add a
// rank masked earlier (comm->active). On success *mask holds the mask as 0/1 bytes.
epResult_t validateActiveRanks(const epComm* comm, const int32_t* active, std::vector<uint8_t>* mask);

// The size helpers of the API: the shape fields are checked as the operations check them, and *sizes is
// written only on success.
epResult_t htDispatchSizes(const ValidateCtx& v, const epHtDispatchArgs_t* a, int recv_rows, epBufferSizes_t* sizes);
epResult_t llDispatchSizes(const ValidateCtx& v, const epLlDispatchArgs_t* a, epBufferSizes_t* sizes);

// The phases of an LL call when its args can be read and name a valid set, else 0 (a rejected call whose
// halves the engine derives from its own state).
template <typename Args>
unsigned llCallPhases(const Args* a) {
  if (a == nullptr || a->magic != EP_STRUCT_MAGIC || a->size < sizeof(Args)) return 0;
  return a->phases >= 1 && a->phases <= 3 ? a->phases : 0;
}

}  // namespace epcomm
