// The GPU engine: HT dispatch/combine and layout between the GPUs of one host (kernels/ht.cu), over
// communication buffers shared with CUDA IPC. Launch planning and host bookkeeping only; per-operation state
// lives in device memory (gpu_types.h), so nothing here runs between the kernels of captured operations.
#pragma once
#include <memory>

#include "engine/comm.h"
#include "engine/engine.h"
#include "engine/gpu/gpu_types.h"
#include "transport/ipc/ipc.h"

namespace epcomm {

int gpuDeviceCount();  // CUDA devices visible to this process (0 without a driver)
std::unique_ptr<Engine> makeGpuEngine(epComm* comm);

class GpuEngine final : public Engine {
 public:
  explicit GpuEngine(epComm* comm) : comm_(comm) {}
  ~GpuEngine() override;
  epResult_t init() override;
  bool hostMemory() const override { return false; }
  size_t maxRowBytes() const override { return lay_.x_stride; }

  epResult_t handleInit(epHtHandle* h) override;
  void handleFree(epHtHandle* h) override;
  epResult_t layout(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* per_rank,
                    int* per_expert, uint8_t* in_rank, epStream_t stream) override;
  epResult_t htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                      int* per_expert_host, epStream_t stream) override;
  epResult_t htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t alltoallv(const void*, const size_t*, const size_t*, void*, const size_t*, const size_t*, size_t,
                       epResult_t local, epStream_t) override;
  epResult_t alltoallvDevice(const void*, const int64_t*, void*, size_t, int64_t*, int64_t*, size_t,
                             epResult_t local, epStream_t) override;
  epResult_t barrier(epStream_t stream) override;
  void abort() override;
  void pollAsyncError() override;

 private:
  HtParams baseParams(int op) const;
  HtParams dispatchParams(int op, const epHtDispatchArgs_t* a, const GpuHandleDev& h) const;
  epResult_t checkLaunch(cudaError_t e, const char* what);

  epComm* comm_;
  int device_ = 0;
  int blocks_ = 24;
  GpuBufferLayout lay_{};
  IpcBuffers bufs_;
  GpuErrorRecord* err_host_ = nullptr;  // host-mapped
  GpuErrorRecord* err_dev_ = nullptr;
  uint64_t violations_seen_ = 0;
};

}  // namespace epcomm
