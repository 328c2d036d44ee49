#include "transport/ipc/ipc.h"

#include <cudaTypedefs.h>

#include <cstring>

#include "common/checks.h"
#include "common/log.h"

namespace epcomm {

IpcBuffers::~IpcBuffers() {
  for (size_t r = 0; r < base_.size(); ++r) {
    if (base_[r] == nullptr) continue;
    if (static_cast<int>(r) == rank_) cudaFree(base_[r]);
    else if (opened_[r]) cudaIpcCloseMemHandle(base_[r]);
  }
}

epResult_t IpcBuffers::init(Bootstrap* bs, size_t bytes, int timeout_ms, const std::vector<uint8_t>& remote) {
  rank_ = bs->rank();
  const int R = bs->nranks();
  base_.assign(R, nullptr);
  opened_.assign(R, false);
  cudaError_t e = cudaMalloc(&base_[rank_], bytes);
  if (e != cudaSuccess)
    EP_FAIL(epCudaError, "cudaMalloc of the %zu-byte communication buffer failed: %s", bytes, cudaGetErrorString(e));
  // Finished before the barrier below: peers start writing here as soon as they pass it.
  e = cudaMemset(base_[rank_], 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaMemset of the communication buffer failed: %s", cudaGetErrorString(e));
  std::vector<cudaIpcMemHandle_t> handles(R);
  e = cudaIpcGetMemHandle(&handles[rank_], base_[rank_]);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaIpcGetMemHandle failed: %s", cudaGetErrorString(e));
  EPCHECK(bs->allgather(handles.data(), sizeof(cudaIpcMemHandle_t), timeout_ms));
  int mapped = 0;
  for (int r = 0; r < R; ++r) {
    if (r == rank_ || (r < static_cast<int>(remote.size()) && remote[r])) continue;
    e = cudaIpcOpenMemHandle(&base_[r], handles[r], cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      EP_FAIL(epCudaError, "cannot map rank %d's GPU buffer (cudaIpcOpenMemHandle: %s); ranks of one host must "
              "see each other's GPUs (peer access, or one GPU under MPS)", r, cudaGetErrorString(e));
    opened_[r] = true;
    ++mapped;
  }
  EP_INFO(kSubsysGpu, "ipc: mapped %d peer buffers of %zu bytes", mapped, bytes);
  return bs->barrier(timeout_ms);
}

// The driver's cuMemGetAddressRange, found through the runtime (the library links cudart only).
static PFN_cuMemGetAddressRange_v3020 addressRangeFn() {
  static PFN_cuMemGetAddressRange_v3020 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(f);
  }();
  return fn;
}

// quiet: a refusal returns its code without a message (EP_ERROR sets the thread's error text and logs it).
#define IPC_FAIL(code, ...) return quiet ? (code) : EP_ERROR((code), __VA_ARGS__)
epResult_t ipcExport(const void* ptr, size_t bytes, int device, cudaIpcMemHandle_t* handle, size_t* offset,
                     void** alloc_base, size_t* alloc_bytes, bool quiet) {
  cudaPointerAttributes at{};
  cudaError_t e = cudaPointerGetAttributes(&at, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    IPC_FAIL(epInvalidArgument, "ptr = %p is not memory CUDA knows (cudaPointerGetAttributes: %s)", ptr,
             cudaGetErrorString(e));
  }
  if (at.type != cudaMemoryTypeDevice)
    IPC_FAIL(epInvalidArgument, "ptr = %p is not device memory (CUDA memory type %d); register cudaMalloc memory",
             ptr, static_cast<int>(at.type));
  if (at.device != device)
    IPC_FAIL(epInvalidArgument, "ptr = %p is memory of device %d, the communicator's is %d", ptr, at.device,
             device);
  PFN_cuMemGetAddressRange_v3020 range = addressRangeFn();
  if (range == nullptr) IPC_FAIL(epCudaError, "the driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
    IPC_FAIL(epInvalidArgument, "ptr = %p lies in no device allocation (cuMemGetAddressRange failed)", ptr);
  const size_t off = reinterpret_cast<uintptr_t>(ptr) - base;
  if (bytes > size - off)
    IPC_FAIL(epInvalidArgument, "bytes = %zu from ptr = %p run past the end of its allocation (%zu bytes from "
             "there)", bytes, ptr, size - off);
  e = cudaIpcGetMemHandle(handle, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();
    IPC_FAIL(epNotSupported, "the allocation that holds ptr = %p cannot be shared over CUDA IPC "
             "(cudaIpcGetMemHandle: %s); cuMemCreate memory, e.g. PyTorch's expandable segments, cannot be "
             "registered", ptr, cudaGetErrorString(e));
  }
  *offset = off;
  *alloc_base = reinterpret_cast<void*>(base);
  if (alloc_bytes != nullptr) *alloc_bytes = size;
  return epSuccess;
}
#undef IPC_FAIL

IpcMappings::~IpcMappings() {
  for (Mapping& m : maps_) cudaIpcCloseMemHandle(m.base);
}

epResult_t IpcMappings::open(const cudaIpcMemHandle_t& h, int peer, void** base, bool quiet) {
  for (Mapping& m : maps_)
    if (memcmp(&m.handle, &h, sizeof(h)) == 0) {
      ++m.refs;
      *base = m.base;
      return epSuccess;
    }
  void* b = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&b, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (quiet) return epCudaError;
    EP_FAIL(epCudaError, "cannot map rank %d's registered memory (cudaIpcOpenMemHandle: %s)", peer,
            cudaGetErrorString(e));
  }
  maps_.push_back(Mapping{h, b, 1});
  *base = b;
  return epSuccess;
}

void IpcMappings::close(void* base) {
  for (size_t i = 0; i < maps_.size(); ++i)
    if (maps_[i].base == base && --maps_[i].refs == 0) {
      cudaIpcCloseMemHandle(base);
      maps_.erase(maps_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
}

}  // namespace epcomm
