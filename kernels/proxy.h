// Host launchers of the proxy's apply kernels (kernels/proxy.cu): what the proxy of this rank received from ranks
// of other hosts (src/engine/gpu/proxy.h), stored into this rank's buffers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/gpu_remote.h"

namespace epcomm {

// The copies of a batch (a warp per copy, in any order), then its flags, one thread in order, each a release
// store: a flag is seen only after every copy before it in the batch, and after every earlier batch.
// Loads the apply kernels now. With CUDA's lazy module loading (the default) a kernel is loaded at its first launch,
// and that load waits for the kernels running on the device: the proxy's first batch would wait for the very
// kernels that wait for it.
cudaError_t preloadProxyKernels();
cudaError_t launchProxyApply(const ProxyCopy* copies, int ncopies, const ProxyFlag* flags, int nflags, cudaStream_t s);

}  // namespace epcomm
