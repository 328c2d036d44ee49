// ipc transport: GPU memory shared by the ranks of one host. Each rank allocates its buffer once and exports
// a CUDA IPC handle; peers map it. Works when several ranks share one GPU (processes under MPS).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "epcomm/epcomm.h"

namespace epcomm {

class IpcBuffers {
 public:
  ~IpcBuffers();
  // Allocates `bytes` on the current device (zeroed), exchanges handles through the bootstrap and maps every
  // peer's buffer but those of ranks with remote[r] != 0 (other hosts: peer(r) is nullptr). Collective.
  epResult_t init(Bootstrap* bs, size_t bytes, int timeout_ms, const std::vector<uint8_t>& remote = {});
  void* local() const { return base_.empty() ? nullptr : base_[rank_]; }  // nullptr before init
  void* peer(int r) const { return base_[r]; }

 private:
  int rank_ = 0;
  std::vector<void*> base_;
  std::vector<bool> opened_;
};

// Caller memory shared on demand (epCommRegister, and implicitly by the HT combine): the handle of the cudaMalloc
// allocation that holds [ptr, ptr + bytes), ptr's offset in it, its start and (alloc_bytes) its length.
// epInvalidArgument when the range leaves the allocation; epNotSupported for memory CUDA IPC cannot export
// (cuMemCreate / expandable segments, cudaMallocAsync). quiet: a refusal sets no message (the caller falls back on
// its own).
epResult_t ipcExport(const void* ptr, size_t bytes, int device, cudaIpcMemHandle_t* handle, size_t* offset,
                     void** alloc_base, size_t* alloc_bytes = nullptr, bool quiet = false);

// Peer allocations opened in this process, counted: CUDA maps an allocation once per process, and several
// registered regions may lie in one allocation. Every mapping still open is closed on destruction.
class IpcMappings {
 public:
  ~IpcMappings();
  // quiet: a refusal sets no message (the caller falls back on its own).
  epResult_t open(const cudaIpcMemHandle_t& h, int peer, void** base, bool quiet = false);
  void close(void* base);

 private:
  struct Mapping {
    cudaIpcMemHandle_t handle;
    void* base;
    int refs;
  };
  std::vector<Mapping> maps_;
};

}  // namespace epcomm
