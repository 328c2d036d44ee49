// Loading the GPU engine's kernels at communicator creation. With CUDA's lazy module loading (the default since
// CUDA 12.2) a kernel is loaded at its first launch, and that load can wait for the kernels already running in the
// process. Kernels that spin until another launch of the process makes progress then stall until their deadline:
// the GPU proxy's apply kernels behind a notify kernel that waits for them (seen on an H200, s11 run03: the
// proxy's first batch waited 20 s for the notify that waited for it), or a kernel launched while an earlier one
// spins. The CUDA programming guide's lazy-loading hazards name the remedy: load every kernel that may run
// concurrently beforehand (cudaFuncGetAttributes loads it).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace epcomm {

// Each of kernels[0..n) (a __global__ function), through cudaFuncGetAttributes.
inline cudaError_t preloadKernels(const void* const* kernels, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    cudaFuncAttributes a;
    const cudaError_t e = cudaFuncGetAttributes(&a, kernels[i]);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// One per kernel file (ll.cu, ht.cu, alltoallv.cu, elastic.cu): every kernel and instance it defines.
cudaError_t preloadLlKernels();
cudaError_t preloadHtKernels();
cudaError_t preloadAlltoallvKernels();
cudaError_t preloadElasticKernels();

}  // namespace epcomm
