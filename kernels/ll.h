// Host launchers of the LL kernels (kernels/ll.cu): the send and receive halves of dispatch and combine, each one
// kernel on a fixed grid of LlParams::blocks blocks, or both halves in one kernel, enqueued on a stream.
#pragma once
#include <cuda_runtime.h>

#include "common/gpu_layout.h"

namespace epcomm {

// Shared memory the dispatch send kernel stages its routing in (zero_copy: a zero-copy dispatch's, a little more);
// the engine rejects calls above kLlMaxSmem.
constexpr size_t kLlMaxSmem = 200 * 1024;
size_t llSendSmemBytes(int T, int K, int E, bool zero_copy = false);
// Shared memory of the fused combine (the receive half's staging and the send half's prefix), the most any
// combine kernel takes.
size_t llCombineSmemBytes(int T, int K, int E, int L);

cudaError_t launchLlDispatchSend(const LlParams& p, cudaStream_t s);
// Both halves in one cooperative launch: p.blocks must not exceed the device's SMs.
cudaError_t launchLlDispatch(const LlParams& p, cudaStream_t s);
cudaError_t launchLlCombine(const LlParams& p, cudaStream_t s);
cudaError_t launchLlDispatchRecv(const LlParams& p, cudaStream_t s);
cudaError_t launchLlCombineSend(const LlParams& p, cudaStream_t s);
cudaError_t launchLlCombineRecv(const LlParams& p, cudaStream_t s);

}  // namespace epcomm
