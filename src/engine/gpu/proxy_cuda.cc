// The GPU proxy's device (proxy.h ProxyDevice) on CUDA: pinned mapped rings and staging, device counters, and the
// apply kernels (kernels/proxy.cu) on a stream of the proxy's own.
#include <cuda_runtime.h>

#include <cstring>

#include "common/checks.h"
#include "common/log.h"
#include "engine/gpu/proxy.h"
#include "kernels/proxy.h"

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
  ~CudaProxyDevice() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
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
  epResult_t prepare() override {
    int lo = 0, hi = 0;
    cudaDeviceGetStreamPriorityRange(&lo, &hi);
    EPCHECK(cudaResult(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, hi), "creating its stream"));
    // Loaded now, while no kernel of this communicator runs (kernels/proxy.h says why).
    return cudaResult(preloadProxyKernels(), "loading the apply kernels");
  }
  void threadStart() override {
    cudaSetDevice(device_);
    // The application may capture a graph while this thread works on its own stream: relaxed mode keeps this
    // thread's calls from invalidating that capture, as NCCL's proxy does.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  epResult_t apply(const ProxyCopy* copies, int ncopies, const ProxyFlag* flags, int nflags) override {
    if (stream_ == nullptr) EP_FAIL(epCudaError, "GPU proxy: no stream");
    EPCHECK(cudaResult(launchProxyApply(copies, ncopies, flags, nflags, stream_), "launching the apply kernels"));
    return cudaResult(cudaStreamSynchronize(stream_), "the apply kernels");
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<ProxyDevice> cudaProxyDevice(int device) { return std::make_unique<CudaProxyDevice>(device); }

}  // namespace epcomm
