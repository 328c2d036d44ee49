// The GPU proxy's device (proxy.h ProxyDevice) on CUDA: pinned mapped memory (rings, far copies) and device
// memory (the table, reservation counters), all set up before any kernel runs. The proxy's thread makes no CUDA
// call while kernels run (proxy.h says why).
#include <cuda_runtime.h>

#include <cstring>

#include "common/checks.h"
#include "common/log.h"
#include "engine/gpu/proxy.h"

namespace epcomm {

namespace {

epResult_t cudaResult(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return epSuccess;
  cudaGetLastError();
  return EP_ERROR(epCudaError, "GPU proxy: %s: %s", what, cudaGetErrorString(e));
}

class CudaProxyDevice final : public ProxyDevice {
 public:
  explicit CudaProxyDevice(int device) : device_(device) {}
  epResult_t allocMapped(size_t bytes, void** host, void** dev) override {
    EPCHECK(cudaResult(cudaHostAlloc(host, bytes, cudaHostAllocMapped), "cudaHostAlloc"));
    memset(*host, 0, bytes);
    return cudaResult(cudaHostGetDevicePointer(dev, *host, 0), "cudaHostGetDevicePointer");
  }
  void freeMapped(void* host) override { cudaFreeHost(host); }
  epResult_t allocDevice(size_t bytes, void** dev) override {
    EPCHECK(cudaResult(cudaMalloc(dev, bytes), "cudaMalloc"));
    EPCHECK(cudaResult(cudaMemset(*dev, 0, bytes), "cudaMemset"));
    return cudaResult(cudaDeviceSynchronize(), "clearing device memory");
  }
  void freeDevice(void* dev) override { cudaFree(dev); }
  epResult_t upload(void* dev, const void* src, size_t bytes) override {
    EPCHECK(cudaResult(cudaMemcpy(dev, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy"));
    return cudaResult(cudaDeviceSynchronize(), "cudaMemcpy");
  }
  epResult_t download(void* dst, const void* dev, size_t bytes) override {
    return cudaResult(cudaMemcpy(dst, dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }

 private:
  int device_;
};

}  // namespace

std::unique_ptr<ProxyDevice> cudaProxyDevice(int device) { return std::make_unique<CudaProxyDevice>(device); }

}  // namespace epcomm
