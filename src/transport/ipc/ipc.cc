#include "transport/ipc/ipc.h"

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

epResult_t IpcBuffers::init(Bootstrap* bs, size_t bytes, int timeout_ms) {
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
  for (int r = 0; r < R; ++r) {
    if (r == rank_) continue;
    e = cudaIpcOpenMemHandle(&base_[r], handles[r], cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      EP_FAIL(epCudaError, "cannot map rank %d's GPU buffer (cudaIpcOpenMemHandle: %s); ranks of one host must "
              "see each other's GPUs (peer access, or one GPU under MPS)", r, cudaGetErrorString(e));
    opened_[r] = true;
  }
  EP_INFO(kSubsysGpu, "ipc: mapped %d peer buffers of %zu bytes", R - 1, bytes);
  return bs->barrier(timeout_ms);
}

}  // namespace epcomm
