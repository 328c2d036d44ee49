// The proxy's apply kernels (kernels/proxy.h): records that ranks of other hosts sent this rank, stored into its
// buffers. Launched by the proxy thread on its own stream, never captured.
#include <cuda_runtime.h>

#include "kernels/device_common.cuh"
#include "kernels/proxy.h"

namespace epcomm {
namespace {

using namespace dev;

__global__ void __launch_bounds__(256) proxyCopyKernel(const ProxyCopy* copies, int n) {
  const int lane = threadIdx.x & 31;
  for (int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); i < n; i += gridDim.x * (blockDim.x >> 5)) {
    const ProxyCopy c = copies[i];
    warpCopyAny(c.dst, c.src, c.len, lane);
  }
}

// Kernels on one stream run in order, so every copy above is complete and visible before the first flag.
__global__ void proxyFlagKernel(const ProxyFlag* flags, int n) {
  for (int i = 0; i < n; ++i) stRelease(flags[i].dst, flags[i].value);
}

}  // namespace

cudaError_t preloadProxyKernels() {  // an empty launch of each: certain to load them
  proxyCopyKernel<<<1, 32>>>(nullptr, 0);
  proxyFlagKernel<<<1, 1>>>(nullptr, 0);
  const cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

cudaError_t launchProxyApply(const ProxyCopy* copies, int ncopies, const ProxyFlag* flags, int nflags, cudaStream_t s) {
  if (ncopies > 0) {
    const int blocks = (ncopies + 7) / 8;
    proxyCopyKernel<<<blocks < 32 ? blocks : 32, 256, 0, s>>>(copies, ncopies);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (nflags > 0) proxyFlagKernel<<<1, 1, 0, s>>>(flags, nflags);
  return cudaGetLastError();
}

}  // namespace epcomm
