// The HT buffer's shared protocol pieces, used by the HT kernels (ht.cu) and alltoallv (alltoallv.cu): the
// operation epoch, the notify mailboxes, and the bounded per-(source, channel) queues with cumulative counters.
#pragma once
#include "kernels/device_common.cuh"
#include "kernels/remote.cuh"

namespace epcomm {
namespace dev {

// Starts operation `epoch + 1` (one thread of a one-block kernel). The epoch is read and written with strong
// operations, never through a possibly stale L1 line: a stale epoch would put this rank behind its peers.
__device__ __forceinline__ uint64_t bumpEpoch(GpuCtrl* c) {
  const uint64_t e = ldAcquire(&c->epoch) + 1;
  stRelaxed(&c->epoch, e);
  __threadfence();
  return e;
}
__device__ __forceinline__ uint64_t currentEpoch(const HtParams& p) { return ldAcquire(&p.ctrl->epoch, p.gpu_scope); }

// The G warps that serve one peer in a block synchronize among themselves only (named barrier 1 + peer), so
// peers never wait for each other. With one warp per peer a warp barrier suffices.
__device__ __forceinline__ void groupSync(int G, int peer) {
  if (G == 1) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + peer), "r"(G * 32) : "memory");
  }
}

// One warp of a peer's group waits for a queue counter (lane 0 of warp 0 polls) and the others meet it at the
// group's barrier: one poller per group instead of one per warp, since many warps polling neighbouring counters
// delay the very stores they wait for. `s_ok` is a shared int per peer (read only when G > 1); false after a
// failed wait, or when the group already failed (`alive` false), for the whole group. want = 0: no wait.
// writer: the rank a timeout names, when another than `peer` writes the flag (-1: peer).
__device__ __forceinline__ bool groupWait(const HtParams& p, int G, int peer, int g, const uint64_t* flag,
                                          uint64_t want, int phase, uint64_t epoch, bool alive, volatile int* s_ok,
                                          int writer = -1) {
  const int lane = threadIdx.x & 31;
  int ok = alive;
  if (g == 0) {
    if (lane == 0 && ok && want > 0) ok = waitAtLeast(p, flag, want, writer >= 0 ? writer : peer, phase, epoch);
    ok = __shfl_sync(kFull, ok, 0);
    if (G > 1 && lane == 0) s_ok[peer] = ok;
  }
  groupSync(G, peer);
  return G > 1 ? s_ok[peer] != 0 : ok != 0;
}

__device__ __forceinline__ size_t mailboxOffset(const HtParams& p, uint64_t epoch, int src) {
  return p.lay.mailbox + ((epoch & 1) * p.nranks + src) * p.lay.mailbox_entry;
}

__device__ __forceinline__ uint64_t* qCounter(const HtParams& p, int owner, int kind, int src, int ch) {
  return reinterpret_cast<uint64_t*>(p.base[owner] + p.lay.qctrl + kind * p.lay.qctrl_stride) + src * p.C + ch;
}
// Where the words that `writer` stores into this rank's HT buffer live (remote.cuh baseOf).
__device__ __forceinline__ uint8_t* inBase(const HtParams& p, int writer) { return baseOf(p, p.rank, writer); }
// This rank's counter of `kind` that `peer` writes (a tail it publishes, a head it sends back), for channel ch.
__device__ __forceinline__ uint64_t* qCounterIn(const HtParams& p, int kind, int peer, int ch) {
  return reinterpret_cast<uint64_t*>(inBase(p, peer) + p.lay.qctrl + kind * p.lay.qctrl_stride) + peer * p.C + ch;
}
// The sending end of the queue (this rank -> owner, channel c) of one family (dispatch: kDispTail, kDispHead,
// kDispSent, kDispHeadBack; combine: the kComb* four): the tail this rank publishes, the head it waits on for room,
// and the tail it last published (base). Toward a rank of another host (kFar) the owner's counters are not
// mapped: the sender keeps its own copy of the tail and reads the head the owner sends back.
struct QueueSend {
  uint64_t* tail;
  uint64_t* sent_copy;
  const uint64_t* head;
  uint64_t base;
};
template <bool kFar>
__device__ __forceinline__ QueueSend queueSend(const HtParams& p, int owner, int c, int k_tail, int k_head, int k_sent,
                                               int k_head_back, bool active) {
  QueueSend q;
  q.tail = qCounter(p, owner, k_tail, p.rank, c);
  q.sent_copy = qCounter(p, p.rank, k_sent, owner, c);
  q.head = kFar ? qCounterIn(p, k_head_back, owner, c) : qCounter(p, owner, k_head, p.rank, c);
  // This rank is the only writer of the tail; a masked rank's memory is not touched.
  q.base = active ? ldAcquire(kFar ? q.sent_copy : q.tail, p.gpu_scope) : 0;
  return q;
}
// Publishes tail v: a release store into the owner's counters, or (kFar) a FLAG record and this rank's copy.
template <bool kFar>
__device__ __forceinline__ void publishTail(const HtParams& p, const QueueSend& q, int owner, uint64_t v, uint64_t e) {
  if constexpr (kFar) {
    remoteFlag(p, owner, kRemoteHtBuffer, remoteOff(q.tail), v, e);
    stRelaxed(q.sent_copy, v);
  } else {
    stRelease(q.tail, v, p.gpu_scope);
  }
}
// The receiving end publishes head v of the queue from src in its own counters and, for a source on another host
// (far), sends it back there (k_head_back), since that source cannot read it here.
__device__ __forceinline__ void publishHead(const HtParams& p, uint64_t* head, int src, int c, int k_head_back,
                                            uint64_t v, uint64_t e, bool far) {
  stRelease(head, v, p.gpu_scope);
  if (far) remoteFlag(p, src, kRemoteHtBuffer, remoteOff(qCounter(p, src, k_head_back, p.rank, c)), v, e);
}

__device__ __forceinline__ int chanBegin(int T, int C, int c) {
  return static_cast<int>(static_cast<int64_t>(T) * c / C);
}
// The channel of token t < T: the c with chanBegin(T, C, c) <= t < chanBegin(T, C, c + 1).
__device__ __forceinline__ int chanOf(int t, int T, int C) {
  return static_cast<int>((static_cast<int64_t>(t + 1) * C - 1) / T);
}

}  // namespace dev
}  // namespace epcomm
