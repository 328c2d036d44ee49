// Host launchers of the HT kernels (kernels/ht.cu): one per operation step, each enqueued on a stream.
#pragma once
#include <cuda_runtime.h>

#include "common/gpu_layout.h"

namespace epcomm {

cudaError_t launchHtBegin(const HtParams& p, cudaStream_t s);     // bumps the epoch
cudaError_t launchHtNotify(const HtParams& p, cudaStream_t s);    // bumps the epoch, exchanges counts
cudaError_t launchHtDispatch(const HtParams& p, cudaStream_t s);  // 2 * C blocks: send and receive
cudaError_t launchHtCombine(const HtParams& p, cudaStream_t s);   // 2 * C blocks: send and reduce
cudaError_t launchHtEnd(const HtParams& p, cudaStream_t s);       // waits until the owners read x (registered)
cudaError_t launchLayout(const HtParams& p, int* per_rank, int* per_expert, uint8_t* in_rank, cudaStream_t s);

}  // namespace epcomm
