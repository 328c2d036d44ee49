// Elastic ranks on the GPU engine (epCommSetActiveRanks): the survivors meet on the sync entries of their HT
// buffers (GpuSyncEntry, common/gpu_layout.h), reset the protocol state a failed operation may have left
// half-done — continuing from the largest epochs, since a rank that failed earlier than another issued fewer
// launches — and meet again, so that no survivor starts the next operation before every other one is clean.
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/device_common.cuh"
#include "kernels/elastic.h"
#include "kernels/preload.h"
#include "kernels/queues.cuh"
#include "kernels/remote.cuh"

namespace epcomm {
namespace {

using namespace dev;

// Sync entry of `src` in `owner`'s buffer.
__device__ __forceinline__ GpuSyncEntry* syncEntry(const HtParams& p, int owner, int kind, uint64_t round, int src) {
  const int slot = kind * kGpuSyncSlots + static_cast<int>(round % kGpuSyncSlots);
  return reinterpret_cast<GpuSyncEntry*>(baseOf(p, owner, src) + p.lay.sync) + slot * p.nranks + src;
}

// Thread r publishes to rank r, then (with wait) waits for rank r's entry here. Only plain stores reach the
// host-mapped `disagree` (a GPU need not perform atomics on host memory).
__global__ void __launch_bounds__(kGpuMaxRanks) elasticSyncKernel(HtParams p, const LlCtrl* ll_ctrl, int kind,
                                                                  uint64_t mask, uint64_t publish_to, uint64_t round,
                                                                  int wait, int* disagree) {
  const int r = threadIdx.x;
  if (r >= p.nranks) return;
  if ((publish_to >> r) & 1) {
    GpuSyncEntry* out = syncEntry(p, r, kind, round, p.rank);
    GpuSyncEntry mine{};
    mine.mask = mask;
    mine.ht_epoch = ldAcquire(&p.ctrl->epoch);
    for (int f = 0; f < 2; ++f) mine.ll_epoch[f] = ll_ctrl ? max(ll_ctrl->send_epoch[f], ll_ctrl->recv_epoch[f]) : 0;
    if (isRemote(p.remote, r)) {
      // A rank of another host: the payload as records (the mask, then the epochs after the round), then the round.
      const uint64_t at = remoteOff(out);
      RemoteSlot a = remoteReserve(p, r, kRemoteData, kRemoteHtBuffer, at, 8, round);
      if (a.hdr == nullptr) return;
      *reinterpret_cast<uint64_t*>(a.payload()) = mine.mask;
      stampRecord(a.hdr, a.pos);
      RemoteSlot b = remoteReserve(p, r, kRemoteData, kRemoteHtBuffer, at + offsetof(GpuSyncEntry, ht_epoch), 24, round);
      if (b.hdr == nullptr) return;
      uint64_t* v = reinterpret_cast<uint64_t*>(b.payload());
      v[0] = mine.ht_epoch;
      v[1] = mine.ll_epoch[0];
      v[2] = mine.ll_epoch[1];
      stampRecord(b.hdr, b.pos);
      remoteFlag(p, r, kRemoteHtBuffer, at + offsetof(GpuSyncEntry, round), round, round);
    } else {
      stRelaxed(&out->mask, mine.mask);
      stRelaxed(&out->ht_epoch, mine.ht_epoch);
      for (int f = 0; f < 2; ++f) stRelaxed(&out->ll_epoch[f], mine.ll_epoch[f]);
      __threadfence_system();
      stRelease(&out->round, round);
    }
  }
  if (!wait || !((mask >> r) & 1)) return;
  const GpuSyncEntry* in = syncEntry(p, p.rank, kind, round, r);
  if (!waitAtLeast(p, &in->round, round, r, epPhaseHeader, round)) return;
  if (ldAcquire(&in->mask) != mask) *reinterpret_cast<volatile int*>(disagree) = r + 1;
}

__global__ void __launch_bounds__(256) elasticResyncKernel(HtParams p, LlParams ll, int has_ll, uint64_t mask,
                                                           uint64_t round, GpuResyncOut* out) {
  const int R = p.nranks, C = p.C;
  __shared__ uint64_t s_max[3];  // HT epoch, LL epoch per family: the largest any survivor published
  if (threadIdx.x == 0) {
    uint64_t m[3] = {0, 0, 0};
    for (int r = 0; r < R; ++r) {
      if (!((mask >> r) & 1)) continue;
      const GpuSyncEntry* e = syncEntry(p, p.rank, kSyncElastic, round, r);
      m[0] = max(m[0], ldAcquire(&e->ht_epoch));
      m[1] = max(m[1], ldAcquire(&e->ll_epoch[0]));
      m[2] = max(m[2], ldAcquire(&e->ll_epoch[1]));
    }
    for (int i = 0; i < 3; ++i) s_max[i] = m[i];
    stRelaxed(&p.ctrl->epoch, m[0]);
  }
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int s = i / C, c = i % C;
    const uint64_t dt = ldAcquire(qCounterIn(p, kDispTail, s, c)), ct = ldAcquire(qCounterIn(p, kCombTail, s, c));
    stRelaxed(qCounter(p, p.rank, kDispHead, s, c), dt);
    stRelaxed(qCounter(p, p.rank, kCombHead, s, c), ct);
    // Hierarchical dispatch: the rows forwarders wrote here for s (the next forwarder of s starts from this tail).
    stRelaxed(qCounter(p, p.rank, kDispFwdHead, s, c), ldAcquire(qCounter(p, p.rank, kDispFwdTail, s, c)));
    // Hierarchical combine: rows this rank staged for a combiner that never read them are free again.
    stRelaxed(qCounter(p, p.rank, kCombOutAck, s, c), ldAcquire(qCounter(p, p.rank, kCombOutReady, s, c)));
    // A source on another host reads these heads in its own buffer. Everything it sent before its entry of the
    // first meeting is in (its records arrive in order), so the tails here are all it published.
    if (isRemote(p.remote, s) && ((mask >> s) & 1)) {
      remoteFlag(p, s, kRemoteHtBuffer, remoteOff(qCounter(p, s, kDispHeadBack, p.rank, c)), dt, round);
      remoteFlag(p, s, kRemoteHtBuffer, remoteOff(qCounter(p, s, kCombHeadBack, p.rank, c)), ct, round);
    }
  }
  __syncthreads();
  // Pull combine and dispatch: whatever a failed operation left unread, every active copier may overwrite its
  // rows for this rank again (it waits for an acknowledgement no older than what it last published, which is <= s_max[0]).
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int s = i / C, c = i % C;
    if (!((mask >> s) & 1) || isRemote(p.remote, s)) continue;  // no pull protocol across hosts (push only)
    stRelease(qCounter(p, s, kPullAck, p.rank, c), s_max[0]);
    stRelease(qCounter(p, s, kPullAck1, p.rank, c), s_max[0]);
    stRelease(qCounter(p, s, kPullDAck, p.rank, c), s_max[0]);  // and pull dispatch's
    stRelease(qCounter(p, s, kPullDAck1, p.rank, c), s_max[0]);
  }
  if (has_ll) {
    LlCtrl* ctrl = reinterpret_cast<LlCtrl*>(ll.base[ll.rank]);
    if (threadIdx.x < 2) {
      const int f = threadIdx.x;
      const uint64_t e = s_max[1 + f];
      ctrl->send_epoch[f] = ctrl->recv_epoch[f] = e;
      ctrl->send_done[f] = ctrl->recv_done[f] = e * static_cast<uint64_t>(ll.blocks);
    }
    for (int i = threadIdx.x; i < 2 * R; i += blockDim.x) {
      const int f = i / R, s = i % R;
      if (!((mask >> s) & 1)) continue;
      publish<true>(ll, s, kRemoteLlBuffer, reinterpret_cast<uint64_t*>(ll.base[s] + ll.lay.ack) + f * R + ll.rank,
              s_max[1 + f], round, false);
    }
  }
  __threadfence_system();
  if (threadIdx.x == 0) {
    volatile GpuResyncOut* o = out;
    o->ht_epoch = s_max[0];
    o->ll_epoch[0] = s_max[1];
    o->ll_epoch[1] = s_max[2];
  }
}

}  // namespace

cudaError_t launchElasticSync(const HtParams& p, const LlCtrl* ll_ctrl, int kind, uint64_t mask, uint64_t publish_to,
                              uint64_t round, bool wait, int* disagree, cudaStream_t s) {
  elasticSyncKernel<<<1, kGpuMaxRanks, 0, s>>>(p, ll_ctrl, kind, mask, publish_to, round, wait ? 1 : 0, disagree);
  return cudaGetLastError();
}

cudaError_t launchElasticResync(const HtParams& p, const LlParams* ll, uint64_t mask, uint64_t round,
                                GpuResyncOut* out, cudaStream_t s) {
  elasticResyncKernel<<<1, 256, 0, s>>>(p, ll ? *ll : LlParams{}, ll != nullptr, mask, round, out);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (kernels/preload.h says why).
cudaError_t preloadElasticKernels() {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(elasticSyncKernel),
      reinterpret_cast<const void*>(elasticResyncKernel),
  };
  return preloadKernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

}  // namespace epcomm
