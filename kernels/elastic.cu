// Elastic ranks on the GPU engine (epCommSetActiveRanks): the survivors meet on the sync entries of their HT
// buffers (GpuSyncEntry, common/gpu_layout.h), reset the protocol state a failed operation may have left
// half-done, and meet again, so that no survivor starts the next operation before every other one is clean.
#include <cuda_runtime.h>

#include "kernels/device_common.cuh"
#include "kernels/elastic.h"
#include "kernels/queues.cuh"

namespace epcomm {
namespace {

using namespace dev;

__device__ __forceinline__ GpuSyncEntry* syncEntry(const HtParams& p, int owner, int src) {
  return reinterpret_cast<GpuSyncEntry*>(p.base[owner] + p.lay.sync) + src;
}

// Thread r publishes to rank r, then waits for rank r's entry here.
__global__ void __launch_bounds__(kGpuMaxRanks) elasticSyncKernel(HtParams p, uint64_t mask, uint64_t round,
                                                                  int* disagree) {
  const int r = threadIdx.x;
  if (r >= p.nranks || !((mask >> r) & 1)) return;
  GpuSyncEntry* out = syncEntry(p, r, p.rank);
  stRelaxed(&out->mask, mask);
  __threadfence_system();
  stRelease(&out->round, round);
  const GpuSyncEntry* in = syncEntry(p, p.rank, r);
  if (!waitAtLeast(p, &in->round, round, r, epPhaseHeader, round)) return;
  if (ldAcquire(&in->mask) != mask) atomicCAS(disagree, 0, r + 1);
}

__global__ void __launch_bounds__(256) elasticResyncKernel(HtParams p, LlParams ll, int has_ll) {
  const int R = p.nranks, C = p.C;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int s = i / C, c = i % C;
    stRelaxed(qCounter(p, p.rank, kDispHead, s, c), ldAcquire(qCounter(p, p.rank, kDispTail, s, c)));
    stRelaxed(qCounter(p, p.rank, kCombHead, s, c), ldAcquire(qCounter(p, p.rank, kCombTail, s, c)));
  }
  if (!has_ll) return;
  __syncthreads();
  LlCtrl* ctrl = reinterpret_cast<LlCtrl*>(ll.base[ll.rank]);
  if (threadIdx.x < 2) {
    const int fam = threadIdx.x;
    const uint64_t sent = ctrl->send_epoch[fam];
    if (ctrl->recv_epoch[fam] < sent) {  // a receive half that never ran: its operation is discarded
      ctrl->recv_epoch[fam] = sent;
      ctrl->recv_done[fam] = sent * static_cast<uint64_t>(ll.blocks);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * R; i += blockDim.x) {
    const int fam = i / R, s = i % R;
    if (!rankActive(ll.el, s)) continue;
    uint64_t* ack = reinterpret_cast<uint64_t*>(ll.base[s] + ll.lay.ack) + fam * R + ll.rank;
    stRelease(ack, ctrl->recv_epoch[fam]);
  }
  __threadfence_system();
}

}  // namespace

cudaError_t launchElasticSync(const HtParams& p, uint64_t mask, uint64_t round, int* disagree, cudaStream_t s) {
  elasticSyncKernel<<<1, kGpuMaxRanks, 0, s>>>(p, mask, round, disagree);
  return cudaGetLastError();
}

cudaError_t launchElasticResync(const HtParams& p, const LlParams* ll, cudaStream_t s) {
  elasticResyncKernel<<<1, 256, 0, s>>>(p, ll ? *ll : LlParams{}, ll != nullptr);
  return cudaGetLastError();
}

}  // namespace epcomm
