// Host launchers of the HT kernels (kernels/ht.cu): one per operation step, each enqueued on a stream.
#pragma once
#include <cuda_runtime.h>

#include "engine/gpu/gpu_types.h"

namespace epcomm {

cudaError_t launchHtBegin(const HtParams& p, bool combine, cudaStream_t s);
cudaError_t launchHtNotify(const HtParams& p, cudaStream_t s);
cudaError_t launchHtDispatch(const HtParams& p, int blocks, cudaStream_t s);  // send + receive
cudaError_t launchHtCombine(const HtParams& p, int blocks, cudaStream_t s);   // send + reduce
cudaError_t launchLayout(const HtParams& p, int* per_rank, int* per_expert, uint8_t* in_rank, cudaStream_t s);

}  // namespace epcomm
