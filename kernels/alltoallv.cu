// alltoallv kernels of the GPU engine: a notify step exchanges the byte counts through the HT mailboxes, then
// the bytes stream through the HT dispatch queues (kernels/queues.cuh), whose slots serve as byte chunks (a
// rank's bytes to itself are copied directly). The queue counters are cumulative and shared with HT dispatch:
// each operation drains what it queued, so the counters stay consistent across the two.
#include <cuda_runtime.h>

#include "kernels/alltoallv.h"
#include "kernels/preload.h"
#include "kernels/queues.cuh"
#include "kernels/remote.cuh"

namespace epcomm {
namespace {

using namespace dev;

// Mailbox entry of an alltoallv, written by `src` into the owner's buffer: the bytes src sends the owner, and
// (host counts) the bytes src expects from the owner, -1 with device counts.
__device__ __forceinline__ int64_t* a2aEntry(const A2aParams& p, int owner, uint64_t e, int src) {
  return reinterpret_cast<int64_t*>(baseOf(p.ht, owner, src) + mailboxOffset(p.ht, e, src) + sizeof(MailboxHead));
}

// Bytes of the caller's send range for r (where the next range begins), and what is sent to r: nothing to a
// masked rank.
__device__ __forceinline__ int64_t sendRangeBytes(const A2aParams& p, int r) {
  if (p.dev_send_counts == nullptr) return static_cast<int64_t>(p.send_bytes[r]);
  const int64_t n = p.dev_send_counts[r];
  return n > 0 ? n * static_cast<int64_t>(p.elem) : 0;
}
__device__ __forceinline__ int64_t sendBytesTo(const A2aParams& p, int r) {
  return rankActive(p.ht.el, r) ? sendRangeBytes(p, r) : 0;
}

// Bytes source s sends this rank, from its mailbox entry (nothing from a masked rank: its entry is stale).
__device__ __forceinline__ uint64_t recvBytesFrom(const A2aParams& p, uint64_t e, int s) {
  return rankActive(p.ht.el, s) ? static_cast<uint64_t>(a2aEntry(p, p.ht.rank, e, s)[0]) : 0;
}

// One block: bumps the epoch, publishes this rank's counts to every peer, waits for theirs and checks them.
template <bool kX>
__global__ void __launch_bounds__(1024, 1) a2aNotifyKernel(A2aParams p) {
  __shared__ uint64_t s_e;
  const int R = p.ht.nranks, me = p.ht.rank;
  if (threadIdx.x == 0) s_e = bumpEpoch(p.ht.ctrl);
  __syncthreads();
  const uint64_t e = s_e;
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    if (p.dev_send_counts && p.dev_send_counts[r] < 0) recordViolation(p.ht, epInvalidArgument);
    if (!rankActive(p.ht.el, r)) {  // masked: nothing sent, counted as dropped
      const uint64_t n = static_cast<uint64_t>(sendRangeBytes(p, r)) / p.elem;
      if (n > 0) atomicAdd(&p.ht.el->drops[kDropA2aElements][r], static_cast<unsigned long long>(n));
      continue;
    }
    int64_t* ent = a2aEntry(p, r, e, me);
    RemoteSlot rs{nullptr, 0};
    if (isRemote(farMask<kX>(p.ht), r)) {  // a rank of another host: the entry as a record
      rs = remoteReserve(p.ht, r, kRemoteData, kRemoteHtBuffer, remoteOff(ent), 16, e);
      if (rs.hdr == nullptr) continue;
      ent = reinterpret_cast<int64_t*>(rs.payload());
    }
    ent[0] = sendBytesTo(p, r);
    ent[1] = p.dev_send_counts ? -1 : static_cast<int64_t>(p.recv_bytes[r]);
    if (rs.hdr != nullptr) stampRecord(rs.hdr, rs.pos);
    fenceForPeers(p.ht.gpu_scope);
    MailboxHead* mh = reinterpret_cast<MailboxHead*>(p.ht.base[r] + mailboxOffset(p.ht, e, me));
    publish<kX>(p.ht, r, kRemoteHtBuffer, &mh->tag, mailboxTag(e, kMailboxA2a), e, p.ht.gpu_scope);
  }
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    const MailboxHead* head = reinterpret_cast<const MailboxHead*>(inBase(p.ht, s) + mailboxOffset(p.ht, e, s));
    if (!rankActive(p.ht.el, s)) continue;
    if (!waitAtLeast(p.ht, &head->tag, mailboxTag(e, 0), s, epPhaseHeader, e)) {
      s_ok = 0;
    } else if (ldAcquire(&head->tag, p.ht.gpu_scope) != mailboxTag(e, kMailboxA2a)) {
      recordError(p.ht, epInvalidUsage, s, epPhaseHeader, e);  // rank s issued another operation (HT notify)
      s_ok = 0;
    }
  }
  __syncthreads();
  if (!s_ok || threadIdx.x != 0) return;
  if (p.dev_send_counts == nullptr) {
    // Host counts: a count one side disagrees with is a violation on both sides; each moves the smaller.
    for (int s = 0; s < R; ++s) {
      if (!rankActive(p.ht.el, s)) continue;
      const int64_t* ent = a2aEntry(p, me, e, s);
      if (ent[0] != static_cast<int64_t>(p.recv_bytes[s]) || ent[1] != static_cast<int64_t>(p.send_bytes[s]))
        recordViolation(p.ht, epInvalidUsage);
    }
    return;
  }
  // Device counts: packed by source up to the capacity; recv_counts holds what each source sent.
  uint64_t pos = 0, dropped = 0;
  for (int s = 0; s < R; ++s) {
    const uint64_t n = recvBytesFrom(p, e, s);
    const uint64_t fit = pos < p.capacity_bytes ? min(n, p.capacity_bytes - pos) : 0;
    pos += fit;
    dropped += n - fit;
    if (p.dev_recv_counts) p.dev_recv_counts[s] = static_cast<int64_t>(n / p.elem);
  }
  if (p.dev_dropped) *p.dev_dropped = static_cast<int64_t>(dropped / p.elem);
  if (dropped > 0) recordViolation(p.ht, epCapacityExceeded);
}

// Where this rank's bytes from source s go: the offset in recvbuf, the bytes s sends and the part of them kept.
struct A2aRecvRange {
  uint64_t off, bytes, keep;
};
__device__ __forceinline__ A2aRecvRange recvRange(const A2aParams& p, uint64_t e, int s) {
  A2aRecvRange r{0, 0, 0};
  if (p.dev_send_counts == nullptr) {
    r.bytes = min(recvBytesFrom(p, e, s), p.recv_bytes[s]);
    r.off = p.recv_off[s];
    r.keep = r.bytes;
    return r;
  }
  r.bytes = recvBytesFrom(p, e, s);
  for (int q = 0; q < s; ++q) {
    const uint64_t nq = recvBytesFrom(p, e, q);
    r.off += r.off < p.capacity_bytes ? min(nq, p.capacity_bytes - r.off) : 0;
  }
  r.keep = r.off < p.capacity_bytes ? min(r.bytes, p.capacity_bytes - r.off) : 0;
  return r;
}

// Block 2c sends channel c's chunks to every peer (G warps per peer), block 2c + 1 receives channel c's chunks
// from every source and copies the bytes that fit to their place in recvbuf. The bytes a rank sends itself skip
// the queues: the sending warps copy them straight to their place in recvbuf.
template <bool kX>
__global__ void __launch_bounds__(1024) a2aKernel(A2aParams p) {
  const HtParams& h = p.ht;
  const uint64_t e = currentEpoch(h);
  const int c = blockIdx.x >> 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Q = h.Q, C = h.C, G = h.G, me = h.rank;
  const int peer = warp / G, g = warp % G;
  const uint64_t CH = h.lay.disp_slot;
  const int RC = h.round;
  __shared__ int s_ok[32];  // per peer group: its last wait succeeded (groupWait)
  if ((blockIdx.x & 1) == 0) {
    const int r = peer;
    uint64_t bytes, off = 0;
    if (!rankActive(h.el, r)) {
      bytes = 0;
    } else if (p.dev_send_counts == nullptr) {
      const int64_t expected = a2aEntry(p, me, e, r)[1];
      bytes = min(p.send_bytes[r], static_cast<uint64_t>(expected > 0 ? expected : 0));
      off = p.send_off[r];
    } else {
      bytes = static_cast<uint64_t>(sendBytesTo(p, r));
      for (int q = 0; q < r; ++q) off += static_cast<uint64_t>(sendRangeBytes(p, q));
    }
    const int n = static_cast<int>((bytes + CH - 1) / CH);
    const int cb = chanBegin(n, C, c), ce = chanBegin(n, C, c + 1);
    if (r == me) {  // to itself: straight into recvbuf, what fits; nothing after a failure (as a receiver)
      if (!noFailure(h)) return;
      const A2aRecvRange to = recvRange(p, e, me);
      for (int i = cb + g; i < ce; i += G) {
        const uint64_t from = static_cast<uint64_t>(i) * CH;
        if (from < to.keep) warpCopyAny(p.recvbuf + to.off + from, p.sendbuf + off + from, min(CH, to.keep - from), lane);
      }
      return;
    }
    // The queues and counters of the HT dispatch, with its rule for a rank of another host (kernels/ht.cu): two
    // instances of the loop, mapped and across hosts.
    auto rounds = [&](auto far_c) {
      constexpr bool kFar = decltype(far_c)::value;
      const QueueSend qs =
          queueSend<kFar>(h, r, c, kDispTail, kDispHead, kDispSent, kDispHeadBack, rankActive(h.el, r));
      const uint64_t base = qs.base;
      uint8_t* q = h.base[r] + h.lay.disp_q + (static_cast<size_t>(me) * C + c) * Q * h.lay.disp_slot;
      bool alive = true;
      for (int k = cb; k < ce; k += RC) {
        const int kend = min(k + RC, ce);
        const uint64_t end = base + (kend - cb);  // room for the round's chunks
        const uint64_t want = end > static_cast<uint64_t>(Q) ? end - Q : 0;
        alive = groupWait(h, G, r, g, qs.head, want, epPhaseData, e, alive, s_ok);
        for (int i = k + g; alive && i < kend; i += G) {
          const uint64_t idx = base + (i - cb), from = static_cast<uint64_t>(i) * CH;
          uint8_t* slot = q + (idx % Q) * h.lay.disp_slot;
          if constexpr (kFar) {
            const uint64_t n = min(CH, bytes - from);
            const RemoteSlot rs = remoteDataWarp(h, r, kRemoteHtBuffer, remoteOff(slot), static_cast<uint32_t>(n), e);
            if (rs.hdr == nullptr) continue;
            warpCopyAny(rs.payload(), p.sendbuf + off + from, n, lane);
            remoteCommitWarp(rs);
          } else {
            warpCopyAny(slot, p.sendbuf + off + from, min(CH, bytes - from), lane);
          }
        }
        fenceForPeers(h.gpu_scope);
        groupSync(G, r);
        if (g == 0 && lane == 0 && noFailure(h)) publishTail<kFar>(h, qs, r, end, e);
      }
    };
    if (isRemote(farMask<kX>(h), r)) rounds(FarTag<kX>{});
    else rounds(FarTag<false>{});
    return;
  }
  const int s = peer;
  if (s == me) return;  // its own bytes were copied by the sending block
  const A2aRecvRange from_s = recvRange(p, e, s);
  const int n = static_cast<int>((from_s.bytes + CH - 1) / CH);
  const int cb = chanBegin(n, C, c), ce = chanBegin(n, C, c + 1);
  uint64_t* tail = qCounterIn(h, kDispTail, s, c);
  uint64_t* head = qCounter(h, me, kDispHead, s, c);
  const uint64_t base = ldAcquire(head, h.gpu_scope);
  const uint8_t* q = inBase(h, s) + h.lay.disp_q + (static_cast<size_t>(s) * C + c) * Q * h.lay.disp_slot;
  bool alive = true;
  for (int k = cb; k < ce; k += RC) {
    const int kend = min(k + RC, ce);
    alive = groupWait(h, G, s, g, tail, base + (kend - cb), epPhaseData, e, alive, s_ok);  // the round is in
    for (int i = k + g; alive && i < kend; i += G) {
      const uint64_t idx = base + (i - cb);
      const uint64_t from = static_cast<uint64_t>(i) * CH;
      if (from < from_s.keep)
        warpCopyAny(p.recvbuf + from_s.off + from, q + (idx % Q) * h.lay.disp_slot, min(CH, from_s.keep - from), lane);
    }
    groupSync(G, s);
    if (g == 0 && lane == 0)
      publishHead(h, head, s, c, kDispHeadBack, base + kend - cb, e, isRemote(farMask<kX>(h), s));
  }
}

}  // namespace

cudaError_t launchAlltoallv(const A2aParams& p, cudaStream_t s) {
  // Two instances of each (kernels/remote.cuh): with ranks of other hosts or without.
  if (p.ht.remote) a2aNotifyKernel<true><<<1, 1024, 0, s>>>(p);
  else a2aNotifyKernel<false><<<1, 1024, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (p.ht.remote) a2aKernel<true><<<2 * p.ht.C, p.ht.nranks * p.ht.G * 32, 0, s>>>(p);
  else a2aKernel<false><<<2 * p.ht.C, p.ht.nranks * p.ht.G * 32, 0, s>>>(p);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (kernels/preload.h says why).
cudaError_t preloadAlltoallvKernels() {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(a2aNotifyKernel<false>),
      reinterpret_cast<const void*>(a2aNotifyKernel<true>),
      reinterpret_cast<const void*>(a2aKernel<false>),
      reinterpret_cast<const void*>(a2aKernel<true>),
  };
  return preloadKernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

}  // namespace epcomm
