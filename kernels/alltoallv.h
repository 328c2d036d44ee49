// Host launcher of the alltoallv kernels (kernels/alltoallv.cu): a one-block count exchange, then the copy
// through the HT dispatch queues (2 * C blocks), enqueued on a stream.
#pragma once
#include <cuda_runtime.h>

#include "common/gpu_layout.h"

namespace epcomm {

cudaError_t launchAlltoallv(const A2aParams& p, cudaStream_t s);

}  // namespace epcomm
