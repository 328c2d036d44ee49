// The GPU proxy's device (proxy.h ProxyDevice) on CUDA: pinned mapped rings and staging, device counters, and the
// apply step: copy-engine copies on a stream of the proxy's own, never a kernel. A kernel would need a free SM and,
// at its first launch, a module load that waits for the running kernels: both may be the very kernels waiting for
// this batch (an LL launch with more blocks than fit, a spinning receive half), which then only end at their
// deadline.
#include <cuda_runtime.h>

#include <cstring>
#include <unordered_map>
#include <vector>

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
    return cudaResult(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating its stream");
  }
  void threadStart() override {
    cudaSetDevice(device_);
    // The application may capture a graph while this thread works on its own stream: relaxed mode keeps this
    // thread's calls from invalidating that capture, as NCCL's proxy does.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  // The payloads as one batch of copies (any order among them), then the flags as a second batch: stream order
  // puts every payload of this and earlier batches in place before any flag. Copies within a batch are unordered,
  // so a word written twice in one batch is written once, with its last value (protocol words only grow).
  epResult_t apply(const ProxyCopy* copies, int ncopies, const ProxyFlag* flags, int nflags) override {
    if (stream_ == nullptr) EP_FAIL(epCudaError, "GPU proxy: no stream");
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (int i = 0; i < ncopies; ++i) add(copies[i].dst, copies[i].src, copies[i].len);
    EPCHECK(copyBatch("the payload copies"));
    last_.clear();
    for (int i = 0; i < nflags; ++i) last_[flags[i].dst] = i;
    for (int i = 0; i < nflags; ++i)
      if (last_[flags[i].dst] == i) add(flags[i].dst, &flags[i].value, sizeof(uint64_t));
    EPCHECK(copyBatch("the flag copies"));
    return cudaResult(cudaStreamSynchronize(stream_), "the apply copies");
  }

 private:
  void add(void* dst, const void* src, size_t bytes) {
    dsts_.push_back(dst);
    srcs_.push_back(src);
    sizes_.push_back(bytes);
  }
  // The queued copies on the stream, from pinned host memory to this rank's device memory; one call per batch
  // where the driver has cudaMemcpyBatchAsync, one per copy where it refuses it.
  epResult_t copyBatch(const char* what) {
    const size_t n = dsts_.size();
    if (n == 0) return epSuccess;
    if (batch_ok_) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_idx = 0;
      const cudaError_t e = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), n, &attr, &attr_idx, 1,
                                                 stream_);
      if (e == cudaSuccess) return clear();
      cudaGetLastError();
      EP_INFO(kSubsysInit, "GPU proxy: cudaMemcpyBatchAsync refused (%s); copying one by one", cudaGetErrorString(e));
      batch_ok_ = false;
    }
    for (size_t i = 0; i < n; ++i)
      EPCHECK(cudaResult(cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], cudaMemcpyHostToDevice, stream_), what));
    return clear();
  }
  epResult_t clear() {
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    return epSuccess;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  bool batch_ok_ = true;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::unordered_map<const void*, int> last_;
};

}  // namespace

std::unique_ptr<ProxyDevice> cudaProxyDevice(int device) { return std::make_unique<CudaProxyDevice>(device); }

}  // namespace epcomm
