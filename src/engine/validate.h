// Host-side argument validation of every operation (DESIGN.md R2). Each check decides one specific result
// code and a message naming the argument and the limit. Shared by both engines: what it reads of the
// arguments' contents (topk_idx values, layout arrays) it reads only when they are host memory.
#pragma once
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

// Bytes of each HT / LL output for the given shape (the size helpers of the API).
void htBufferSizes(const epHtDispatchArgs_t* a, int nranks, int recv_rows, epBufferSizes_t* s);
void llBufferSizes(const epLlDispatchArgs_t* a, int nranks, epBufferSizes_t* s);

}  // namespace epcomm
