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
  // peer's buffer. Collective.
  epResult_t init(Bootstrap* bs, size_t bytes, int timeout_ms);
  void* local() const { return base_[rank_]; }
  void* peer(int r) const { return base_[r]; }

 private:
  int rank_ = 0;
  std::vector<void*> base_;
  std::vector<bool> opened_;
};

}  // namespace epcomm
