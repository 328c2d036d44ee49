// High-throughput (HT) dispatch and combine kernels of the GPU engine, for the ranks of one host.
// Buffer layout and protocol: src/common/gpu_layout.h. Element rules: src/common/dtype.h (shared with the
// host engine, so both produce the same bits).
#include <cuda_runtime.h>

#include "common/dtype.h"
#include "common/routing.h"
#include "kernels/device_common.cuh"
#include "kernels/ht.h"
#include "kernels/preload.h"
#include "kernels/queues.cuh"
#include "kernels/remote.cuh"

namespace epcomm {
namespace {

using namespace dev;

// Pull combine and dispatch: before any block of the operation overwrites this rank's staging, every active
// reader has acknowledged what this rank last published there, on every (reader, channel): with another layout a
// block's rows were another channel's. Done here, before the main kernel, because inside it a late block would
// read the counters its own launch already advanced and wait for the operation it is part of (rule G2). A failed
// wait is recorded, and every block of the main kernel then skips its copy phase.
// ack_kind2: a second acknowledgement to wait for (the pull combine's two halves), or -1.
__device__ void waitPullAcks(const HtParams& p, int sent_kind, int ack_kind, int ack_kind2, uint64_t e) {
  for (int i = threadIdx.x; i < p.nranks * p.C; i += blockDim.x) {
    const int r = i / p.C, c = i % p.C;
    if (!rankActive(p.el, r)) continue;
    const uint64_t last = ldAcquire(qCounter(p, p.rank, sent_kind, r, c), p.gpu_scope);
    if (!waitAtLeast(p, qCounter(p, p.rank, ack_kind, r, c), last, r, epPhaseData, e)) return;
    if (ack_kind2 >= 0 && !waitAtLeast(p, qCounter(p, p.rank, ack_kind2, r, c), last, r, epPhaseData, e)) return;
  }
}

// This rank's first receive row of source s's channel c: s's rows start at prefix[s], channel by channel.
__device__ __forceinline__ int recvChanStart(const HtParams& p, int s, int c) {
  int row = p.h.prefix[s];
  for (int cc = 0; cc < c; ++cc) row += p.h.recv_chan[s * p.C + cc];
  return row;
}

// Hierarchical dispatch and combine: source s's first forwarded row of channel c at its forwarder (this rank), in
// the order of GpuHandleDev::fwd_place (s's rows, channel by channel).
__device__ __forceinline__ int fwdChanStart(const HtParams& p, int s, int c) {
  int row = 0;
  for (int cc = 0; cc < c; ++cc) row += p.h.fwd_chan[s * p.C + cc];
  return row;
}

// Hierarchical combine: where this rank's rows for owner s (of another host) on channel c start in its comb_out
// region: their receive row less the rows of the sources of this host before s (comb_out holds rows from the ranks of
// other hosts only, so far_ranks * max_tokens rows suffice).
__device__ __forceinline__ int farRowStart(const HtParams& p, int s, int c) {
  int row = recvChanStart(p, s, c);
  for (int r = 0; r < s; ++r)
    if (!isRemote(p.remote, r)) row -= p.h.prefix[r + 1] - p.h.prefix[r];
  return row;
}

// Hierarchical dispatch: the rank of host h that forwards source s's channel c there (common/gpu_layout.h
// hierForwarder), the channel moving the choice along the host's ranks when p.fwd_spread is set, so that s streams
// to several ranks of h (to every one where the channels are at least h's active ranks).
__device__ __forceinline__ int forwarderOf(const HtParams& p, int s, int h, int c, uint64_t active) {
  return hierForwarder(p.host_ranks[h], active, p.local_of[s] + (p.fwd_spread ? c : 0));
}

// Hierarchical combine: before this rank overwrites its comb_out region, the combiner of every (owner, channel) it
// last staged rows for has acknowledged them (the acknowledgement names the epoch of the staging). A failed wait is
// recorded, and the combine kernel then does nothing.
__device__ void waitCombOutAcks(const HtParams& p, uint64_t e) {
  for (int i = threadIdx.x; i < p.nranks * p.C; i += blockDim.x) {
    const int s = i / p.C, c = i % p.C;
    if (!isRemote(p.remote, s)) continue;
    const uint64_t last = ldAcquire(qCounter(p, p.rank, kCombOutReady, s, c), p.gpu_scope);
    const int f = forwarderOf(p, s, p.my_host, c, p.el->active);
    if (!waitAtLeast(p, qCounter(p, p.rank, kCombOutAck, s, c), last, f, epPhaseData, e)) return;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Begin: bumps the epoch (one block, so no other block of this launch reads it).
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(32, 1) htBeginKernel(HtParams p) {
  __shared__ uint64_t s_epoch;
  if (threadIdx.x == 0) s_epoch = bumpEpoch(p.ctrl);
  __syncwarp();
  // A combine overwrites its staging; after a dispatch (zc_guard) the caller may write the next zero-copy combine's
  // x there: both need the owners done with the last combine's rows.
  if (p.pull || p.zc_guard) waitPullAcks(p, kPullSent, kPullAck, kPullAck1, s_epoch);
  if (p.pull_dispatch) waitPullAcks(p, kPullDSent, kPullDAck, kPullDAck1, s_epoch);
  // Hierarchical combine: the combiners of this host have read what this rank last staged for them (comb_out).
  if (p.op == epOpHtCombine && p.hier) waitCombOutAcks(p, s_epoch);
  // A pull combine tells the owners where its rows are; they read it once they see its ready counter. After the
  // waits above: an owner still reading the last combine reads the last source.
  __syncwarp();
  if (p.op == epOpHtCombine && p.pull && threadIdx.x == 0 && noFailure(p)) {
    GpuCombineSource* cs = &p.ctrl->comb_src;
    cs->region = p.x_region;
    cs->have = min(*p.h.num_recv, p.recv_rows);
    cs->off = p.x_off;
  }
  // Implicit registration: the peers' latest published slots and, while this rank waits for some, their
  // acknowledgements of its own, for the host's next call (monotone words; a stale one only delays a slot).
  if (p.op == epOpHtCombine && p.auto_mirror != nullptr)
    for (int i = threadIdx.x; i < p.nranks * (p.auto_acks ? 1 + kGpuAutoRegions : 1); i += blockDim.x) {
      const int r = i % p.nranks, j = i / p.nranks - 1;
      if (r == p.rank || !rankActive(p.el, r)) continue;
      const uint8_t* b = p.base[r];
      if (j < 0)
        p.auto_mirror->latest[r] =
            *reinterpret_cast<const volatile uint64_t*>(b + p.lay.auto_exp + offsetof(GpuAutoTable, latest));
      else
        p.auto_mirror->ack[r][j] = *reinterpret_cast<const volatile uint64_t*>(
            b + p.lay.auto_ack + (static_cast<size_t>(p.rank) * kGpuAutoRegions + j) * sizeof(uint64_t));
    }
}

// ---------------------------------------------------------------------------------------------------------
// End of a pull combine that read x in registered memory (epCommRegister): the combine completes only once every
// active owner has read this rank's rows, so the caller may reuse x as after a copying combine.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(32, 1) htEndKernel(HtParams p) {
  waitPullAcks(p, kPullSent, kPullAck, kPullAck1, currentEpoch(p));
}

// ---------------------------------------------------------------------------------------------------------
// Notify (one block): layout of this rank's tokens (in_rank, per-destination positions, per-expert and
// per-channel counts), the exchange of counts through the peers' mailboxes, and the receive-side prefixes.
// ---------------------------------------------------------------------------------------------------------
template <bool kX>
__global__ void __launch_bounds__(1024, 1) htNotifyKernel(HtParams p) {
  extern __shared__ int s_expert[];  // [E]
  __shared__ uint64_t s_epoch;
  __shared__ int s_count[kGpuMaxRanks];
  __shared__ int s_masked[kGpuMaxRanks];  // tokens not sent to r because r is masked
  __shared__ int s_warp[32];
  __shared__ int s_total;
  __shared__ int s_chan[kGpuMaxRanks * kGpuMaxChannels];  // tokens to r in channel c (r * C + c)
  // Hierarchical dispatch: the same per host h (tokens this rank forwards there), after the ranks' in s_count
  // (s_count[R + h]) and in s_hchan (h * C + c).
  __shared__ int s_hchan[kX ? kGpuMaxRanks * kGpuMaxChannels : 1];
  __shared__ int s_hcount[kX ? kGpuMaxRanks : 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int R = p.nranks, L = p.L, K = p.K, C = p.C;
  const int NH = kX && p.hier ? p.nhosts : 0;  // hosts this rank may forward to
  if (tid == 0) s_epoch = bumpEpoch(p.ctrl);
  for (int i = tid; i < p.E; i += blockDim.x) s_expert[i] = 0;
  for (int r = tid; r < R; r += blockDim.x) s_count[r] = s_masked[r] = 0;
  for (int i = tid; i < R * C; i += blockDim.x) s_chan[i] = 0;
  for (int i = tid; i < NH * C; i += blockDim.x) s_hchan[i] = 0;
  for (int h = tid; h < NH; h += blockDim.x) s_hcount[h] = 0;
  __syncthreads();
  const uint64_t e = s_epoch;
  const uint64_t act = p.el->active;  // masked ranks: no rows, no mailbox entries, no waits
  if (p.pull_dispatch) waitPullAcks(p, kPullDSent, kPullDAck, kPullDAck1, e);
  if (p.zc_guard) waitPullAcks(p, kPullSent, kPullAck, kPullAck1, e);  // as in htBeginKernel

  for (int base = 0; base < p.T; base += blockDim.x) {
    const int t = base + tid;
    uint64_t mask = 0;
    if (t < p.T) {
      const int64_t* row = p.topk_idx + static_cast<size_t>(t) * K;
      for (int k = 0; k < K; ++k) {
        int64_t x = row[k];
        if (x < -1 || x >= p.E) {
          recordViolation(p, epExpertOutOfRange);
          continue;
        }
        if (x < 0 || isRepeatedExpert(row, k)) continue;
        mask |= 1ull << (x / L);
        if ((act >> (x / L)) & 1) atomicAdd(&s_expert[x], 1);
      }
      for (uint64_t m = mask & ~act; m; m &= m - 1) atomicAdd(&s_masked[__ffsll(static_cast<long long>(m)) - 1], 1);
      mask &= act;
      for (int r = 0; r < R; ++r) p.h.in_rank[static_cast<size_t>(t) * R + r] = (mask >> r) & 1;
    }
    // Position of t among this chunk's tokens that go to r: warp ballots, then a scan of the warp totals. With
    // hierarchical dispatch also among those this rank forwards to host h (j = R + h), for every other host.
    for (int j = 0; j < R + NH; ++j) {
      const int r = j, h = j - R;
      const int bit = j < R ? static_cast<int>((mask >> r) & 1)
                            : static_cast<int>(h != p.my_host && (mask & p.host_ranks[h]) != 0);
      const unsigned ballot = __ballot_sync(kFull, bit);
      const int in_warp = __popc(ballot & ((1u << lane) - 1));
      if (lane == 0) s_warp[warp] = __popc(ballot);
      __syncthreads();
      if (warp == 0) {
        int v = lane < nwarps ? s_warp[lane] : 0, incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          int n = __shfl_up_sync(kFull, incl, o);
          if (lane >= o) incl += n;
        }
        if (lane < nwarps) s_warp[lane] = incl - v;
        if (lane == 31) s_total = incl;
      }
      __syncthreads();
      if (bit && j < R) {
        p.h.pos[static_cast<size_t>(t) * R + r] = s_count[r] + s_warp[warp] + in_warp;
        atomicAdd(&s_chan[r * C + chanOf(t, p.T, C)], 1);
      } else if (bit) {
        p.h.fpos[static_cast<size_t>(t) * R + h] = s_hcount[h] + s_warp[warp] + in_warp;
        atomicAdd(&s_hchan[h * C + chanOf(t, p.T, C)], 1);
      }
      __syncthreads();
      if (tid == 0) (j < R ? s_count[r] : s_hcount[h]) += s_total;
      __syncthreads();
    }
  }
  // Tokens sent to r before channel c's first token: the per-channel counts above, scanned over the channels
  // (the last __syncthreads of the token loop ordered every count before this).
  for (int r = tid; r < R; r += blockDim.x) {
    int acc = 0;
    for (int c = 0; c < C; ++c) {
      p.h.send_chan_base[r * C + c] = acc;
      acc += s_chan[r * C + c];
    }
  }
  for (int h = tid; h < NH; h += blockDim.x) {
    int acc = 0;
    for (int c = 0; c < C; ++c) {
      p.h.fchan_base[h * C + c] = acc;
      acc += s_hchan[h * C + c];
    }
  }
  __syncthreads();

  for (int r = tid; r < R; r += blockDim.x) p.h.masked[r] = s_masked[r];
  // Mailbox entry for every active peer r: counts to every rank, per local expert of r, per channel (to r). A rank
  // of another host gets the entry as one record, which the whole block fills.
  __shared__ RemoteSlot s_rec;
  for (int r = 0; r < R; ++r) {
    if (!((act >> r) & 1)) continue;
    int32_t* ent = reinterpret_cast<int32_t*>(p.base[r] + mailboxOffset(p, e, p.rank) + sizeof(MailboxHead));
    const bool far = isRemote(farMask<kX>(p), r);
    RemoteSlot rec{nullptr, 0};
    if (far) {
      if (tid == 0)
        s_rec = remoteReserve(p, r, kRemoteData, kRemoteHtBuffer, remoteOff(ent),
                              4 * static_cast<uint32_t>(R + L + 2 * C), e);
      __syncthreads();
      rec = s_rec;
      __syncthreads();  // every thread has read s_rec before thread 0 reserves the next
      if (rec.hdr == nullptr) continue;  // a failed wait (recorded): the ring toward r is stuck for good
      ent = reinterpret_cast<int32_t*>(rec.payload());
    }
    for (int j = tid; j < R; j += blockDim.x) ent[j] = s_count[j];
    for (int l = tid; l < L; l += blockDim.x) ent[R + l] = s_expert[r * L + l];
    for (int c = tid; c < C; c += blockDim.x) {
      const int next = c + 1 < C ? p.h.send_chan_base[r * C + c + 1] : s_count[r];
      ent[R + L + c] = next - p.h.send_chan_base[r * C + c];
      // What r forwards if it is this rank's forwarder on its host (hierarchical dispatch): the channel's tokens
      // bound for that host.
      ent[R + L + C + c] = NH > 0 && p.host_of[r] != p.my_host ? s_hchan[p.host_of[r] * C + c] : 0;
    }
    if (far) {
      __threadfence_system();
      __syncthreads();
      if (tid == 0) stampRecord(rec.hdr, rec.pos);
    }
  }
  fenceForPeers(p.gpu_scope);
  __syncthreads();
  for (int r = tid; r < R; r += blockDim.x) {
    if (!((act >> r) & 1)) continue;
    MailboxHead* head = reinterpret_cast<MailboxHead*>(p.base[r] + mailboxOffset(p, e, p.rank));
    publish<kX>(p, r, kRemoteHtBuffer, &head->tag, mailboxTag(e, kMailboxHtNotify), e, p.gpu_scope);
  }
  __shared__ int s_ok;
  if (tid == 0) s_ok = 1;
  __syncthreads();
  for (int s = tid; s < R; s += blockDim.x) {
    MailboxHead* head = reinterpret_cast<MailboxHead*>(inBase(p, s) + mailboxOffset(p, e, s));
    if (!((act >> s) & 1)) continue;
    if (!waitAtLeast(p, &head->tag, mailboxTag(e, 0), s, epPhaseHeader, e)) {
      s_ok = 0;
    } else if (ldAcquire(&head->tag, p.gpu_scope) != mailboxTag(e, kMailboxHtNotify)) {
      recordError(p, epInvalidUsage, s, epPhaseHeader, e);  // rank s issued another operation (alltoallv)
      s_ok = 0;
    }
  }
  __syncthreads();
  if (!s_ok) return;
  auto countsOf = [&](int s) {
    return reinterpret_cast<const int32_t*>(inBase(p, s) + mailboxOffset(p, e, s) + sizeof(MailboxHead));
  };
  for (int l = tid; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s)
      if ((act >> s) & 1) sum += countsOf(s)[R + l];
    p.h.per_expert[l] = sum;
    if (p.recv_per_expert_out) p.recv_per_expert_out[l] = sum;
  }
  for (int i = tid; i < R * C; i += blockDim.x)
    p.h.recv_chan[i] = ((act >> (i / C)) & 1) ? countsOf(i / C)[R + L + i % C] : 0;
  if (kX && p.hier)  // rows this rank forwards for each source of another host it is the forwarder of
    for (int i = tid; i < R * C; i += blockDim.x) {
      const int s = i / C;
      const bool fwd = ((act >> s) & 1) && isRemote(p.remote, s) &&
                       forwarderOf(p, s, p.my_host, i % C, act) == p.rank;
      p.h.fwd_chan[i] = fwd ? countsOf(s)[R + L + C + i % C] : 0;
    }
  // Where this rank's rows start in r's receive order: the rows of the active sources before it (pull combine).
  for (int r = tid; r < R; r += blockDim.x) {
    int b = 0;
    for (int s = 0; s < p.rank; ++s)
      if ((act >> s) & 1) b += countsOf(s)[r];
    p.h.peer_base[r] = b;
  }
  if (tid == 0) {
    int acc = 0;
    p.h.prefix[0] = 0;
    for (int s = 0; s < R; ++s) {
      if ((act >> s) & 1) acc += countsOf(s)[p.rank];
      p.h.prefix[s + 1] = acc;
    }
    *p.h.num_recv = acc;
    if (p.num_recv_out) *p.num_recv_out = acc;
    if (p.worst > 0 && acc > p.worst) recordViolation(p, epCapacityExceeded);
  }
}

// Block 1 of a dispatch, after its rows: worst-token padding of the metadata and the counts.
__device__ void dispatchTail(const HtParams& p, int num_recv, int rows) {
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, K = p.K;
  for (int i = rows + warp; i < p.worst; i += nwarps)
    if (lane < K) {
      if (p.recv_topk_idx) p.recv_topk_idx[static_cast<size_t>(i) * K + lane] = -1;
      if (p.recv_topk_weights) p.recv_topk_weights[static_cast<size_t>(i) * K + lane] = 0.0f;
    }
  for (int l = threadIdx.x; l < p.L; l += blockDim.x)
    if (p.recv_per_expert_out) p.recv_per_expert_out[l] = p.h.per_expert[l];
  if (threadIdx.x == 0 && p.num_recv_out) *p.num_recv_out = num_recv;
}

// The receiver's view of global expert id x: its local id on rank r, or -1 for another rank's expert.
__device__ __forceinline__ int64_t localExpert(const HtParams& p, int64_t x, int r) {
  return x >= 0 && x < p.E && x / p.L == r ? x % p.L : -1;
}
// A token's top-k metadata as the receiver keeps it: expert ids local to rank r (-1 for the other ranks' experts)
// and their weights (0 there). Lane l < K handles column l.
__device__ __forceinline__ void tokenMeta(const HtParams& p, int t, int r, int lane, int64_t* idx, float* w) {
  *idx = localExpert(p, p.topk_idx[static_cast<size_t>(t) * p.K + lane], r);
  *w = *idx >= 0 && p.topk_weights != nullptr ? p.topk_weights[static_cast<size_t>(t) * p.K + lane] : 0.0f;
}

// ---------------------------------------------------------------------------------------------------------
// Pull dispatch (src/common/gpu_layout.h). Blocks 2c and 2c+1 share channel c, each with its half of the work
// (as in the pull combine: every block stages, then every block reads). Stage: the block's half of channel c's
// tokens, copied once into this rank's dispatch staging (x, scales, global expert ids, weights), with the
// per-destination token lists; then it publishes its half to every active receiver. Read: for every active
// source s (G warps per source), once s published both halves of channel c, the block's half of s's channel-c
// rows for this rank, straight from s's staging into their final receive rows (source rank order, then token
// order: the same rows as the push path); then it acknowledges its half to s.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(1024) htDispatchPullKernel(HtParams p) {
  const uint64_t e = currentEpoch(p);
  const int c = blockIdx.x >> 1, half = blockIdx.x & 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int R = p.nranks, K = p.K, C = p.C, G = p.G;
  if (blockIdx.x == 0 && threadIdx.x < R && p.h.masked[threadIdx.x] > 0)
    atomicAdd(&p.el->drops[kDropTokenRows][threadIdx.x], static_cast<unsigned long long>(p.h.masked[threadIdx.x]));
  uint8_t* const me = p.base[p.rank];
  // The readers of what this rank last published have acknowledged it (the notify or begin kernel waited);
  // after any failure nothing is written: a slow reader may still be reading. One answer for the whole block
  // (each thread reading the failure flag could get its own): the barriers below must be reached by all.
  const bool stage = __syncthreads_and(noFailure(p));
  if (stage) {
    const int tb = chanBegin(p.T, C, c), te = chanBegin(p.T, C, c + 1);
    int32_t* const list = reinterpret_cast<int32_t*>(me + p.lay.disp_list);
    for (int t = tb + half * nwarps + warp; t < te; t += 2 * nwarps) {
      bool any = false;  // a token no active rank receives is not staged
      for (int r = lane; r < R; r += 32) any |= p.h.in_rank[static_cast<size_t>(t) * R + r] != 0;
      if (!__any_sync(kFull, any)) continue;
      uint8_t* slot = me + p.lay.disp_stage + static_cast<size_t>(t) * p.lay.disp_slot;
      warpCopy16(slot, static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * p.xrow, p.xrow, lane);
      if (p.srow)
        warpCopy4(slot + p.lay.x_stride, reinterpret_cast<const uint8_t*>(p.x_scales) + t * p.srow, p.srow, lane);
      uint8_t* meta = slot + p.lay.x_stride + p.lay.scale_stride;
      if (p.topk_idx != nullptr && lane < K) {
        reinterpret_cast<int64_t*>(meta)[lane] = p.topk_idx[static_cast<size_t>(t) * K + lane];
        if (p.topk_weights != nullptr)
          reinterpret_cast<float*>(meta + kGpuMaxTopk * 8)[lane] = p.topk_weights[static_cast<size_t>(t) * K + lane];
      }
      for (int r = lane; r < R; r += 32) {
        const size_t tr = static_cast<size_t>(t) * R + r;
        if (p.h.in_rank[tr]) list[static_cast<size_t>(r) * p.lay.max_tokens + p.h.pos[tr]] = t;
      }
    }
  }
  fenceForPeers(p.gpu_scope);
  __syncthreads();
  if (stage && noFailure(p))
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      if (!rankActive(p.el, r)) continue;
      stRelease(qCounter(p, r, half ? kPullDReady1 : kPullDReady, p.rank, c), e, p.gpu_scope);
      stRelaxed(qCounter(p, p.rank, kPullDSent, r, c), e);
    }
  const int num_recv = *p.h.num_recv;
  const int rows = p.worst > 0 ? min(num_recv, p.worst) : num_recv;
  {
    const int s = warp / G, g = warp % G;
    const int n = rankActive(p.el, s) ? p.h.recv_chan[s * C + c] : 0;
    int before = 0;  // s's earlier channels' rows for this rank: where channel c starts in s's list for it
    for (int cc = 0; cc < c; ++cc) before += p.h.recv_chan[s * C + cc];
    const int dst = p.h.prefix[s] + before;
    bool ok = true;
    if (rankActive(p.el, s) && lane < 2)
      ok = waitAtLeast(p, qCounter(p, p.rank, lane ? kPullDReady1 : kPullDReady, s, c), e, s, epPhaseData, e);
    ok = __all_sync(kFull, ok);
    __syncwarp();  // lanes 0 and 1's acquires order the whole warp's reads of s's staging below
    const uint8_t* src_base = p.base[s];
    const int32_t* list = reinterpret_cast<const int32_t*>(src_base + p.lay.disp_list) +
                          static_cast<size_t>(p.rank) * p.lay.max_tokens + before;
    for (int i = half * G + g; ok && i < n; i += 2 * G) {
      const int row = dst + i;
      if (row >= rows) break;  // worst-token overflow: never written past the capacity (recorded by notify)
      const int t = list[i];
      const uint8_t* slot = src_base + p.lay.disp_stage + static_cast<size_t>(t) * p.lay.disp_slot;
      warpCopy16(static_cast<uint8_t*>(p.recv_x) + static_cast<size_t>(row) * p.xrow, slot, p.xrow, lane);
      if (p.srow)
        warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + row * p.srow, slot + p.lay.x_stride, p.srow, lane);
      const uint8_t* meta = slot + p.lay.x_stride + p.lay.scale_stride;
      if (lane < K && p.topk_idx != nullptr) {
        const int64_t l = localExpert(p, reinterpret_cast<const int64_t*>(meta)[lane], p.rank);
        if (p.recv_topk_idx) p.recv_topk_idx[static_cast<size_t>(row) * K + lane] = l;
        if (p.recv_topk_weights && p.topk_weights)
          p.recv_topk_weights[static_cast<size_t>(row) * K + lane] =
              l >= 0 ? reinterpret_cast<const float*>(meta + kGpuMaxTopk * 8)[lane] : 0.0f;
      }
    }
    groupSync(G, s);
    if (ok && g == 0 && lane == 0 && rankActive(p.el, s))
      stRelease(qCounter(p, s, half ? kPullDAck1 : kPullDAck, p.rank, c), e, p.gpu_scope);
  }
  if (blockIdx.x == 1) dispatchTail(p, num_recv, rows);
}

// ---------------------------------------------------------------------------------------------------------
// Hierarchical dispatch, the forwarder's side (HtParams::hier; the G warps of source s's group in block 2c+1):
// source s of another host sends this rank, its forwarder on this host, one slot per channel-c token that any rank
// here receives, in token order, with global expert ids and the token's place j_d among s's channel-c rows for each
// rank d here (-1: none). Per round of RT slots, warp g takes slots k + g, k + g + G, ...: it reads each once and
// writes it to this rank's receive row (as the direct path would) and into the queue for s of every other rank d
// that receives it, at d's slot j_d (the slot s would have sent d: x, scales, d's local expert ids and weights),
// after d has room; then the group publishes to each d how many of its rows are in (kDispFwdTail) and the head of
// its own queue back to s. Lane j of every warp keeps the state of the host's j-th rank.
// ---------------------------------------------------------------------------------------------------------
__device__ void forwardFrom(const HtParams& p, int s, int c, int g, int rows, uint64_t e, volatile int* s_ok) {
  const int lane = threadIdx.x & 31, K = p.K, C = p.C, Q = p.Q, G = p.G, RT = p.round;
  __shared__ int s_fcnt[32][kGpuHierMaxLocal];  // [group][j]: rows of the host's j-th rank forwarded so far
  __shared__ uint8_t* s_dst[32][kGpuHierMaxLocal];  // [warp][...]: where the warp's current slot goes
  __shared__ volatile int s_ffail[32];  // [group]: a warp's wait for room failed; the group then publishes nothing more
  const int warp = threadIdx.x >> 5;
  const int n = p.h.fwd_chan[s * C + c];
  const int dst = recvChanStart(p, s, c);
  const uint64_t* tail = qCounterIn(p, kDispTail, s, c);
  uint64_t* head = qCounter(p, p.rank, kDispHead, s, c);
  const uint64_t base = ldAcquire(head, p.gpu_scope);
  const uint8_t* q = inBase(p, s) + p.lay.disp_q + (static_cast<size_t>(s) * C + c) * Q * p.lay.disp_slot;
  // Lane j: the host's j-th rank dj (-1 past them; this rank or a masked one: no queue) and the tail of its queue
  // for s when the operation started (only forwarders of s write it, and a finished operation leaves it drained).
  const int dj = lane < p.lay.fwd_idx ? kthRank(p.host_ranks[p.my_host], lane) : -1;
  const bool other = dj >= 0 && dj != p.rank && rankActive(p.el, dj);
  const uint64_t fbase = other ? ldAcquire(qCounter(p, dj, kDispFwdTail, s, c), p.gpu_scope) : 0;
  uint8_t* const dq = other ? p.base[dj] + p.lay.disp_q + (static_cast<size_t>(s) * C + c) * Q * p.lay.disp_slot
                            : nullptr;
  // What each slot names, kept for the combine (combineFor): s's forwarded rows, channel by channel.
  int32_t* const place = p.h.fwd_place + (static_cast<size_t>(s) * p.lay.max_tokens + fwdChanStart(p, s, c)) *
                                             p.lay.fwd_idx;
  if (g == 0 && lane < kGpuHierMaxLocal) s_fcnt[s][lane] = 0;  // read after the group's first barrier
  if (g == 0 && lane == 0) s_ffail[s] = 0;
  int published = 0;  // warp 0, lane j: the count dj last saw
  uint64_t room = 0;   // lane j: the largest head of dj's queue this warp read (its rows below room + Q are free)
  bool alive = true;
  for (int k = 0; k < n; k += RT) {
    const int kend = min(k + RT, n);
    alive = groupWait(p, G, s, g, tail, base + kend, epPhaseData, e, alive, s_ok) && s_ffail[s] == 0;
    int most = 0;  // lane j: rows of dj among the slots this warp forwarded
    for (int i = k + g; alive && i < kend; i += G) {
      const uint8_t* slot = q + ((base + i) % Q) * p.lay.disp_slot;
      const int jd = dj >= 0 ? reinterpret_cast<const int32_t*>(slot + p.lay.disp_fwd)[lane] : -1;
      if (p.hier_combine && lane < p.lay.fwd_idx) place[static_cast<size_t>(i) * p.lay.fwd_idx + lane] = jd;
      // Room at dj for its row jd; this rank's own row where it receives the token.
      // The head is read again only when the last value read leaves no room (the receiver drains far ahead of
      // need mostly), so most slots cost no load across the link.
      bool ok = true;
      if (other && jd >= 0 && fbase + jd + 1 > room + Q) {
        const uint64_t* dh = qCounter(p, dj, kDispFwdHead, s, c);
        ok = waitAtLeast(p, dh, fbase + jd + 1 - Q, dj, epPhaseData, e);
        if (ok) room = ldAcquire(dh, p.gpu_scope);
      }
      if (!__all_sync(kFull, ok)) {  // rows this warp leaves unwritten: no count may cover them
        alive = false;
        if (lane == 0) s_ffail[s] = 1;
        break;
      }
      uint8_t* to = nullptr;
      if (other && jd >= 0) {
        to = dq + ((fbase + jd) % Q) * p.lay.disp_slot;
        most = max(most, jd + 1);
      }
      const bool mine = dj == p.rank && jd >= 0 && dst + jd < rows;  // past rows: worst-token overflow
      if (mine) to = static_cast<uint8_t*>(p.recv_x) + static_cast<size_t>(dst + jd) * p.xrow;
      const unsigned targets = __ballot_sync(kFull, to != nullptr);
      const int own = __ffs(__ballot_sync(kFull, mine)) - 1;  // the lane of this rank's own row, or -1
      const int own_row = __shfl_sync(kFull, dst + jd, own < 0 ? 0 : own);
      if (lane < kGpuHierMaxLocal) s_dst[warp][lane] = to;
      __syncwarp();
      // x: each 16-byte piece read once (the slot may be in host memory), stored to every target.
      const int4* src = reinterpret_cast<const int4*>(slot);
      for (int x = lane; x < static_cast<int>(p.xrow / 16); x += 32) {
        const int4 v = src[x];
        for (unsigned t = targets; t; t &= t - 1) reinterpret_cast<int4*>(s_dst[warp][__ffs(t) - 1])[x] = v;
      }
      if (p.srow)
        for (int x = lane; x < static_cast<int>(p.srow / 4); x += 32) {
          const uint32_t v = reinterpret_cast<const uint32_t*>(slot + p.lay.x_stride)[x];
          for (unsigned t = targets; t; t &= t - 1) {
            const int j = __ffs(t) - 1;
            uint8_t* sc = j == own ? reinterpret_cast<uint8_t*>(p.recv_x_scales) + static_cast<size_t>(own_row) * p.srow
                                   : s_dst[warp][j] + p.lay.x_stride;
            reinterpret_cast<uint32_t*>(sc)[x] = v;
          }
        }
      // Expert ids and weights, localized for each target rank as the source would have for it (tokenMeta).
      if (p.topk_idx != nullptr) {
        const uint8_t* meta = slot + p.lay.x_stride + p.lay.scale_stride;
        const int64_t xg = lane < K ? reinterpret_cast<const int64_t*>(meta)[lane] : -1;
        const float wg = lane < K ? reinterpret_cast<const float*>(meta + kGpuMaxTopk * 8)[lane] : 0.0f;
        for (unsigned t = targets; t; t &= t - 1) {
          const int j = __ffs(t) - 1;
          const int d = __shfl_sync(kFull, dj, j);
          if (lane < K) {
            const int64_t l = localExpert(p, xg, d);
            const float w = l >= 0 ? wg : 0.0f;
            if (j == own) {
              if (p.recv_topk_idx) p.recv_topk_idx[static_cast<size_t>(own_row) * K + lane] = l;
              if (p.recv_topk_weights && p.topk_weights)
                p.recv_topk_weights[static_cast<size_t>(own_row) * K + lane] = w;
            } else {
              uint8_t* dm = s_dst[warp][j] + p.lay.x_stride + p.lay.scale_stride;
              reinterpret_cast<int64_t*>(dm)[lane] = l;
              reinterpret_cast<float*>(dm + kGpuMaxTopk * 8)[lane] = w;
            }
          }
        }
      }
      __syncwarp();  // s_dst is rewritten for the next slot
    }
    // The round's rows are in: count them per rank (the largest place + 1: the stream is in token order, so the
    // rows of dj among slots [0, kend) are its first ones), order them before the counts, publish.
    if (lane < kGpuHierMaxLocal && most > 0) atomicMax(&s_fcnt[s][lane], most);
    fenceForPeers(p.gpu_scope);
    groupSync(G, s);
    if (g == 0) {
      const int cnt = lane < kGpuHierMaxLocal ? s_fcnt[s][lane] : 0;
      if (other && alive && s_ffail[s] == 0 && cnt > published && noFailure(p)) {
        stRelease(qCounter(p, dj, kDispFwdTail, s, c), fbase + cnt, p.gpu_scope);
        published = cnt;
      }
      if (lane == 0) publishHead(p, head, s, c, kDispHeadBack, base + kend, e, true);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch: block 2c sends channel c's tokens (G warps per destination, in token order, into the
// destination's queue for this rank and channel; its own rows straight to their final receive rows); block
// 2c+1 receives channel c (G warps per source) and copies each row to its final receive row: source rank
// order, then token order.
// ---------------------------------------------------------------------------------------------------------
// kH: hierarchical across hosts (p.hier; kX only), an instance of its own so that the flat one keeps its registers.
template <bool kX, bool kH>
__global__ void __launch_bounds__(1024) htDispatchKernel(HtParams p) {
  const uint64_t e = currentEpoch(p);
  const int c = blockIdx.x >> 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = p.nranks, K = p.K, Q = p.Q, C = p.C, G = p.G;
  const int peer = warp / G, g = warp % G;  // G warps serve each peer
  const int RT = p.round;
  __shared__ int s_ok[32];  // per peer group: its last wait succeeded (groupWait)
  // Rows the layout did not send because their rank is masked: counted once per dispatch.
  if (blockIdx.x == 0 && threadIdx.x < R && p.h.masked[threadIdx.x] > 0)
    atomicAdd(&p.el->drops[kDropTokenRows][threadIdx.x], static_cast<unsigned long long>(p.h.masked[threadIdx.x]));
  const int num_recv = *p.h.num_recv;
  const int rows = p.worst > 0 ? min(num_recv, p.worst) : num_recv;
  if ((blockIdx.x & 1) == 0) {
    const int r = peer;
    const int tb = chanBegin(p.T, C, c), te = rankActive(p.el, r) ? chanBegin(p.T, C, c + 1) : tb;
    const int chan_base = p.h.send_chan_base[r * C + c];
    if (r == p.rank) {
      // To itself: straight to the final receive row (the receiving block's rule: source prefix, the channels
      // before this one, the token's position in the channel), no queue. After a failure nothing is written, as
      // a receiver writes nothing the sender did not publish.
      if (!noFailure(p)) return;
      const int dst = recvChanStart(p, r, c);
      for (int t = tb + g; t < te; t += G) {
        if (!p.h.in_rank[static_cast<size_t>(t) * R + r]) continue;
        const int row = dst + (p.h.pos[static_cast<size_t>(t) * R + r] - chan_base);
        if (row >= rows) continue;  // worst-token overflow, recorded by notify
        warpCopy16(static_cast<uint8_t*>(p.recv_x) + row * p.xrow, static_cast<const uint8_t*>(p.x) + t * p.xrow,
                   p.xrow, lane);
        if (p.srow)
          warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + row * p.srow,
                    reinterpret_cast<const uint8_t*>(p.x_scales) + t * p.srow, p.srow, lane);
        if (p.topk_idx != nullptr && lane < K) {
          int64_t idx;
          float w;
          tokenMeta(p, t, r, lane, &idx, &w);
          if (p.recv_topk_idx) p.recv_topk_idx[static_cast<size_t>(row) * K + lane] = idx;
          if (p.recv_topk_weights && p.topk_weights) p.recv_topk_weights[static_cast<size_t>(row) * K + lane] = w;
        }
      }
      return;
    }
    // To a peer: rounds of RT tokens; once the queue has room for the round's rows, warp g writes tokens k + g,
    // k + g + G, ... into their slots (their positions among this channel's tokens to the peer), then the group
    // publishes the tail.
    // A rank of another host: this rank's own copy of the tail, the head the receiver sends back, and the slots as
    // records. The two cases are two instances of the loop, so that the mapped one keeps its registers.
    // Hierarchical dispatch (kH): toward the host of r only r = this rank's forwarder there gets slots, one per
    // token any rank of that host receives, with global expert ids and the token's place at each of its ranks (the
    // forwarder hands each its slot); the other ranks of that host get nothing from here.
    auto rounds = [&](auto far_c) {
      constexpr bool kFar = decltype(far_c)::value;
      const QueueSend qs =
          queueSend<kFar>(p, r, c, kDispTail, kDispHead, kDispSent, kDispHeadBack, rankActive(p.el, r));
      const uint64_t base = qs.base;
      uint8_t* q = p.base[r] + p.lay.disp_q + (static_cast<size_t>(p.rank) * C + c) * Q * p.lay.disp_slot;
      // Forwarding (kFar only): host hh of r; lane j < fwd_idx names the host's j-th rank (dj; -1 past its ranks).
      constexpr bool fwd = kFar && kH;
      const int hh = fwd ? p.host_of[r] : 0;
      const int dj = fwd && lane < p.lay.fwd_idx ? kthRank(p.host_ranks[hh], lane) : -1;
      const int fchan = fwd ? p.h.fchan_base[hh * C + c] : 0;
      // Token t goes through this queue: to r, or (forwarding) to any rank of r's host.
      auto goes = [&](int t) {
        if (!fwd) return p.h.in_rank[static_cast<size_t>(t) * R + r] != 0;
        return __any_sync(kFull, dj >= 0 && p.h.in_rank[static_cast<size_t>(t) * R + dj] != 0) != 0;
      };
      uint64_t sent = 0;  // rows published so far (kept by lane 0 of warp 0, the group's publisher)
      bool alive = true;  // after a failed wait the group keeps meeting its barriers, doing nothing
      for (int k = tb; k < te; k += RT) {
        const int kend = min(k + RT, te);
        uint64_t want = 0;  // room for the round's rows
        if (g == 0) {
          for (int u = k; u < kend; ++u) sent += goes(u);
          want = base + sent > static_cast<uint64_t>(Q) ? base + sent - Q : 0;
        }
        alive = groupWait(p, G, r, g, qs.head, want, epPhaseData, e, alive, s_ok);
        for (int t = k + g; alive && t < kend; t += G) {
          if (!goes(t)) continue;
          const uint64_t idx = base + (fwd ? p.h.fpos[static_cast<size_t>(t) * R + hh] - fchan
                                           : p.h.pos[static_cast<size_t>(t) * R + r] - chan_base);
          uint8_t* slot = q + (idx % Q) * p.lay.disp_slot;
          RemoteSlot rs{nullptr, 0};
          if constexpr (kFar) {  // the whole slot as one record
            rs = remoteDataWarp(p, r, kRemoteHtBuffer, remoteOff(slot), static_cast<uint32_t>(p.lay.disp_slot), e);
            if (rs.hdr == nullptr) continue;
            slot = rs.payload();
          }
          warpCopy16(slot, static_cast<const uint8_t*>(p.x) + t * p.xrow, p.xrow, lane);
          if (p.srow)
            warpCopy4(slot + p.lay.x_stride, reinterpret_cast<const uint8_t*>(p.x_scales) + t * p.srow, p.srow, lane);
          if (p.topk_idx != nullptr && lane < K) {
            int64_t idx_l;
            float w;
            if (fwd) {  // as given: the forwarder localizes them for each rank
              idx_l = p.topk_idx[static_cast<size_t>(t) * K + lane];
              w = p.topk_weights != nullptr ? p.topk_weights[static_cast<size_t>(t) * K + lane] : 0.0f;
            } else {
              tokenMeta(p, t, r, lane, &idx_l, &w);
            }
            uint8_t* meta = slot + p.lay.x_stride + p.lay.scale_stride;
            reinterpret_cast<int64_t*>(meta)[lane] = idx_l;
            if (p.topk_weights != nullptr) reinterpret_cast<float*>(meta + kGpuMaxTopk * 8)[lane] = w;
          }
          if constexpr (fwd) {
            if (lane < p.lay.fwd_idx) {
              const size_t td = static_cast<size_t>(t) * R + dj;
              reinterpret_cast<int32_t*>(slot + p.lay.disp_fwd)[lane] =
                  dj >= 0 && p.h.in_rank[td] ? p.h.pos[td] - p.h.send_chan_base[dj * C + c] : -1;
            }
          }
          if constexpr (kFar) remoteCommitWarp(rs);
        }
        fenceForPeers(p.gpu_scope);
        groupSync(G, r);
        if (g == 0 && lane == 0 && noFailure(p)) publishTail<kFar>(p, qs, r, base + sent, e);
      }
    };
    if (isRemote(farMask<kX>(p), r)) {
      // Hierarchical: only this rank's forwarder on r's host; the other ranks there get nothing from here.
      if (kH && forwarderOf(p, p.rank, p.host_of[r], c, p.el->active) != r) return;
      rounds(FarTag<kX>{});
    } else {
      rounds(FarTag<false>{});
    }
    return;
  }
  // Receive: rows of source s in rounds of RT; warp g copies rows k + g, k + g + G, ... to their final receive
  // rows, then the group publishes the head (room for the sender). This rank's own rows were written directly.
  // Hierarchical dispatch, s of another host: this rank's forwarder there writes s's rows into this rank's own
  // queue for s (counters kDispFwdTail / kDispFwdHead), or this rank is that forwarder (forwardFrom).
  if (peer != p.rank) {
    const int s = peer;
    const bool far = isRemote(farMask<kX>(p), s);
    const bool hier = kX && kH && far;
    const int fwd = hier ? forwarderOf(p, s, p.my_host, c, p.el->active) : -1;  // s's forwarder on this host
    if (hier && fwd == p.rank) {  // hier first: the flat instances compile no forwarder
      forwardFrom(p, s, c, g, rows, e, s_ok);
    } else {
      const int n = rankActive(p.el, s) ? p.h.recv_chan[s * C + c] : 0;
      const int dst = recvChanStart(p, s, c);
      uint64_t* tail = hier ? qCounter(p, p.rank, kDispFwdTail, s, c) : qCounterIn(p, kDispTail, s, c);
      uint64_t* head = qCounter(p, p.rank, hier ? kDispFwdHead : kDispHead, s, c);
      const uint64_t base = ldAcquire(head, p.gpu_scope);
      const uint8_t* q = (hier ? p.base[p.rank] : inBase(p, s)) + p.lay.disp_q +
                         (static_cast<size_t>(s) * C + c) * Q * p.lay.disp_slot;
      bool alive = true;
      for (int k = 0; k < n; k += RT) {
        const int kend = min(k + RT, n);
        // the round's rows are in (hierarchical: a timeout names the forwarder, who writes the tail)
        alive = groupWait(p, G, s, g, tail, base + kend, epPhaseData, e, alive, s_ok, fwd);
        for (int i = k + g; alive && i < kend; i += G) {
          const uint64_t idx = base + i;
          const uint8_t* slot = q + (idx % Q) * p.lay.disp_slot;
          const int row = dst + i;
          if (row < rows) {  // worst-token overflow: never written past the capacity (recorded by notify)
            warpCopy16(static_cast<uint8_t*>(p.recv_x) + row * p.xrow, slot, p.xrow, lane);
            if (p.srow)
              warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + row * p.srow, slot + p.lay.x_stride, p.srow,
                        lane);
            const uint8_t* meta = slot + p.lay.x_stride + p.lay.scale_stride;
            if (lane < K && p.topk_idx != nullptr) {
              if (p.recv_topk_idx)
                p.recv_topk_idx[static_cast<size_t>(row) * K + lane] = reinterpret_cast<const int64_t*>(meta)[lane];
              if (p.recv_topk_weights && p.topk_weights)
                p.recv_topk_weights[static_cast<size_t>(row) * K + lane] =
                    reinterpret_cast<const float*>(meta + kGpuMaxTopk * 8)[lane];
            }
          }
        }
        groupSync(G, s);
        if (g == 0 && lane == 0) publishHead(p, head, s, c, kDispHeadBack, base + kend, e, far && !hier);
      }
    }
  }
  if (blockIdx.x == 1) dispatchTail(p, num_recv, rows);
}

// ---------------------------------------------------------------------------------------------------------
// Hierarchical combine across hosts (HtParams::hier, the push combine): the expert outputs for a token of owner s
// cross to s's host once, as one partial sum P_h per host h (epcomm.h states the order: P_h = +0 + the rows of h's
// ranks in ascending rank order, in fp32; where one rank holds the token, P_h is that row in its dtype). The rank
// of h that forwarded s's channel c in the dispatch (forwarderOf) combines it: it knows, for each row it forwarded,
// the token's place at each rank of h (GpuHandleDev::fwd_place).
// ---------------------------------------------------------------------------------------------------------
// Bytes of a partial sum in fp32 (4 per element) and where its byte o lies in a partial's two queue slots: fp32
// partials of 2-byte types span two slots (o < xrow in the first, the rest from the second's start).
__device__ __forceinline__ size_t partialBytes(const HtParams& p) { return 4 * static_cast<size_t>(p.H); }
__device__ __forceinline__ size_t partialOff(const HtParams& p, size_t o) {
  return o < p.xrow ? o : p.lay.x_stride + (o - p.xrow);
}

// The partial stream of one (combiner's host h, owner, channel c) runs through the owner's combine queues for every
// rank of h on channel c in turn (in this mode only the combiner sends that owner anything from h), so it has
// hosts' ranks x Q slots: a partial is two slots, and one rank carries what each rank of its host sent before; a
// shallow queue bounds the bytes in flight, which set the speed across hosts. Offset in comb_q of pair k's first slot.
__device__ __forceinline__ size_t partialSlot(const HtParams& p, uint64_t hm, int c, uint64_t k) {
  const uint64_t per = static_cast<uint64_t>(p.Q / 2);  // pairs per queue
  const uint64_t at = k % (per * __popcll(hm));
  const int rr = kthRank(hm, static_cast<int>(at / per));
  return ((static_cast<size_t>(rr) * p.C + c) * p.Q + 2 * (at % per)) * p.lay.x_stride;
}
__device__ __forceinline__ uint64_t partialPairs(const HtParams& p, uint64_t hm) {
  return static_cast<uint64_t>(p.Q / 2) * __popcll(hm);
}
// How many ranks of a host (its ranks: mask hm) received this rank's token t (in_rank: active ranks only): 0, its
// partial is one row (1), or an fp32 sum.
__device__ __forceinline__ int hostHolders(const HtParams& p, int t, uint64_t hm) {
  int n = 0;
  for (uint64_t m = hm; m; m &= m - 1)
    n += p.h.in_rank[static_cast<size_t>(t) * p.nranks + __ffsll(static_cast<long long>(m)) - 1];
  return n;
}

// The warps that serve the peers of one other host h work as one team in the hierarchical combine: a rank combines
// for only some of h's ranks and receives one partial stream from h per channel, so per-peer groups would leave most
// of those warps idle. W warps (this warp is number w), named barrier 1 + lead (h's first rank, never a rank of this
// host), owners: the ranks of h the team serves. Named barriers stop at 15: from 16 ranks on, each peer's G warps
// stay a team of their own.
struct FarTeam {
  int W, w, lead;
  uint64_t owners;
};
__device__ __forceinline__ FarTeam farTeam(const HtParams& p, int peer, int g) {
  const uint64_t hm = p.host_ranks[p.host_of[peer]];
  if (p.nranks >= 16) return FarTeam{p.G, g, peer, 1ull << peer};
  return FarTeam{__popcll(hm) * p.G, p.local_of[peer] * p.G + g, __ffsll(static_cast<long long>(hm)) - 1, hm};
}

// Owner s of another host, channel c, a rank of this host that is not s's combiner there: copies its rows for s's
// channel-c tokens into its comb_out region, where the combiner reads them (warp w of W copies rows w, w + W, ...).
// The team then publishes where they start and that they are in (stageDone).
__device__ void stageForCombiner(const HtParams& p, int s, int c, const FarTeam& tm) {
  const int lane = threadIdx.x & 31;
  const int n = p.h.recv_chan[s * p.C + c], src = recvChanStart(p, s, c), start = farRowStart(p, s, c);
  const int have = min(*p.h.num_recv, p.recv_rows);
  uint8_t* out = p.base[p.rank] + p.lay.comb_out + static_cast<size_t>(start) * p.lay.x_stride;
  for (int i = tm.w; i < n; i += tm.W) {
    if (src + i < have)
      warpCopy16(out + i * p.lay.x_stride, static_cast<const uint8_t*>(p.x) + (src + i) * p.xrow, p.xrow, lane);
    else  // worst-token overflow (recorded by notify): x has no such row; the combiner adds zeros
      warpZero16(out + i * p.lay.x_stride, p.xrow, lane);
  }
}
// One thread, after the team's rows are in and fenced: kCombOutStart, then kCombOutReady = epoch (own buffer).
__device__ void stageDone(const HtParams& p, int s, int c, uint64_t e) {
  stRelaxed(qCounter(p, p.rank, kCombOutStart, s, c), static_cast<uint64_t>(farRowStart(p, s, c)));
  stRelease(qCounter(p, p.rank, kCombOutReady, s, c), e, p.gpu_scope);
}

// s's combiner on this host for channel c: for each row it forwarded to this host in the dispatch, in order, the
// token's partial sum over the ranks here that hold it (its own rows from x, the others' from their comb_out once
// they published them), written as one record into s's combine queues of this host's ranks (partialSlot: two slots
// per partial, so that an fp32 partial of a 2-byte type fits), in rounds; then it acknowledges the other ranks' rows.
// Lane j of every warp keeps the state of the host's j-th rank. False after a failed wait.
template <int kDtype>
__device__ bool combineFor(const HtParams& p, int s, int c, const FarTeam& tm, uint64_t e, volatile int* s_ok) {
  using V = Vec8<kDtype>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, C = p.C;
  __shared__ const uint8_t* s_src[32][kGpuHierMaxLocal];  // [warp][j]: the host's j-th rank's row of the slot
  const int n = p.h.fwd_chan[s * C + c];
  const int32_t* place =
      p.h.fwd_place + (static_cast<size_t>(s) * p.lay.max_tokens + fwdChanStart(p, s, c)) * p.lay.fwd_idx;
  const int dj = lane < p.lay.fwd_idx ? kthRank(p.host_ranks[p.my_host], lane) : -1;
  const bool other = dj >= 0 && dj != p.rank && rankActive(p.el, dj);
  const int mine = recvChanStart(p, s, c), have = min(*p.h.num_recv, p.recv_rows);
  // The other ranks' rows are in: warp 0's lanes wait for one rank each.
  bool ok = true;
  if (tm.w == 0 && other) ok = waitAtLeast(p, qCounter(p, dj, kCombOutReady, s, c), e, dj, epPhaseData, e);
  bool alive = groupWait(p, tm.W, tm.lead, tm.w, nullptr, 0, epPhaseData, e, __all_sync(kFull, ok), s_ok);
  const uint8_t* rows =
      other && alive ? p.base[dj] + p.lay.comb_out +
                           ldAcquire(qCounter(p, dj, kCombOutStart, s, c), p.gpu_scope) * p.lay.x_stride
                     : nullptr;
  const QueueSend qs = queueSend<true>(p, s, c, kCombTail, kCombHead, kCombSent, kCombHeadBack, true);
  const uint64_t hm = p.host_ranks[p.my_host], base = qs.base, pairs = partialPairs(p, hm);
  // Rounds of one partial per warp, at most a quarter of the stream's pairs (several rounds in flight; with the
  // owner's rounds of at most a quarter as well, neither end waits for the other for good).
  const int RT = max(1, min(tm.W, static_cast<int>(pairs / 4)));
  uint8_t* q = p.base[s] + p.lay.comb_q;
  const size_t pbytes = partialBytes(p);
  const uint32_t sum_len = static_cast<uint32_t>(pbytes > p.xrow ? p.lay.x_stride + pbytes - p.xrow : pbytes);
  const int chunks = static_cast<int>(p.xrow / 16);
  for (int k = 0; k < n; k += RT) {
    const int kend = min(k + RT, n);
    const uint64_t end = base + 2 * static_cast<uint64_t>(kend);
    alive = groupWait(p, tm.W, tm.lead, tm.w, qs.head, end > 2 * pairs ? end - 2 * pairs : 0, epPhaseData, e, alive,
                      s_ok);
    for (int i = k + tm.w; alive && i < kend; i += tm.W) {
      const int jd = lane < p.lay.fwd_idx ? place[static_cast<size_t>(i) * p.lay.fwd_idx + lane] : -1;
      const bool holds = jd >= 0 && (dj == p.rank || other);
      const unsigned holders = __ballot_sync(kFull, holds);
      const uint8_t* row = nullptr;  // nullptr: a worst-token overflow row of this rank, zeros
      if (holds && dj != p.rank) row = rows + static_cast<size_t>(jd) * p.lay.x_stride;
      else if (holds && mine + jd < have) row = static_cast<const uint8_t*>(p.x) + (mine + jd) * p.xrow;
      if (lane < kGpuHierMaxLocal) s_src[warp][lane] = row;
      __syncwarp();
      const bool single = __popc(holders) == 1;
      uint8_t* slot = q + partialSlot(p, hm, c, base / 2 + i);
      const RemoteSlot rs = remoteDataWarp(p, s, kRemoteHtBuffer, remoteOff(slot),
                                           single ? static_cast<uint32_t>(p.xrow) : sum_len, e);
      if (rs.hdr != nullptr) {
        uint8_t* out = rs.payload();
        if (single) {  // the row itself, in its dtype
          const uint8_t* r0 = s_src[warp][__ffs(holders) - 1];
          if (r0 != nullptr) warpCopy16(out, r0, p.xrow, lane);
          else warpZero16(out, p.xrow, lane);
        } else {
          for (int ch = lane; ch < chunks; ch += 32) {
            float acc[V::kN];
#pragma unroll
            for (int x = 0; x < V::kN; ++x) acc[x] = 0.0f;
            for (unsigned t = holders; t; t &= t - 1) {
              const uint8_t* r = s_src[warp][__ffs(t) - 1];
              V::add(acc, r != nullptr ? reinterpret_cast<const int4*>(r)[ch] : make_int4(0, 0, 0, 0));
            }
#pragma unroll
            for (int x = 0; x < V::kN / 4; ++x)
              *reinterpret_cast<float4*>(out + partialOff(p, 16 * (static_cast<size_t>(ch) * (V::kN / 4) + x))) =
                  make_float4(acc[4 * x], acc[4 * x + 1], acc[4 * x + 2], acc[4 * x + 3]);
          }
        }
      }
      __syncwarp();  // s_src is rewritten for the next slot
      remoteCommitWarp(rs);
    }
    fenceForPeers(p.gpu_scope);
    groupSync(tm.W, tm.lead);
    if (tm.w == 0 && lane == 0 && noFailure(p)) publishTail<true>(p, qs, s, end, e);
  }
  // Every row read (ordered before this by the team's last barrier): the other ranks may reuse comb_out.
  groupSync(tm.W, tm.lead);
  if (tm.w == 0 && other && alive && noFailure(p)) stRelease(qCounter(p, dj, kCombOutAck, s, c), e, p.gpu_scope);
  return alive;
}

// Send side of the hierarchical combine toward the owners of another host (one team, farTeam): first this rank's
// rows for the owners it does not combine for, staged for their combiners (so those start early), then the owners it
// combines for, one after another.
template <int kDtype>
__device__ void combineToHost(const HtParams& p, int c, const FarTeam& tm, uint64_t e, volatile int* s_ok) {
  const uint64_t act = p.el->active;
  const uint64_t owners = tm.owners & act;
  uint64_t combined = 0;
  for (uint64_t m = owners; m; m &= m - 1) {
    const int s = __ffsll(static_cast<long long>(m)) - 1;
    if (forwarderOf(p, s, p.my_host, c, act) == p.rank) combined |= 1ull << s;
    else if (noFailure(p)) stageForCombiner(p, s, c, tm);
  }
  fenceForPeers(p.gpu_scope);
  groupSync(tm.W, tm.lead);
  if (tm.w == 0 && (threadIdx.x & 31) == 0 && noFailure(p))
    for (uint64_t m = owners & ~combined; m; m &= m - 1) stageDone(p, __ffsll(static_cast<long long>(m)) - 1, c, e);
  bool alive = true;
  for (uint64_t m = combined; m && alive; m &= m - 1)
    alive = combineFor<kDtype>(p, __ffsll(static_cast<long long>(m)) - 1, c, tm, e, s_ok);
}

// The owner's side (block 2c+1, the team of host h): this rank's combiner on h for channel c streams one partial per
// channel-c token that a rank of h holds, in token order. The team walks the channel's tokens W at a time (warp w
// takes the w-th), moving the partial of each token that h holds into the combine staging rows of h's first two
// ranks (unused otherwise: h's ranks send nothing else here) at the token's place among those forwarded there
// (fpos); the fp32 partial's second slot (two or more holders, a 2-byte type) into the second rank's row. False after
// a failed wait.
__device__ bool drainPartials(const HtParams& p, int c, const FarTeam& tm, uint64_t e, uint8_t* stage) {
  const int lane = threadIdx.x & 31, R = p.nranks, C = p.C;
  const int h = p.host_of[tm.lead];
  const uint64_t hm = p.host_ranks[h];
  const int r = forwarderOf(p, p.rank, h, c, p.el->active);
  // No stream (no active rank on h), or another team's.
  if (r < 0 || !rankActive(p.el, r) || ((tm.owners >> r) & 1) == 0) return true;
  const int tb = chanBegin(p.T, C, c), te = chanBegin(p.T, C, c + 1);
  const int fb = p.h.fchan_base[h * C + c], ra = kthRank(hm, 0), rb = kthRank(hm, 1);
  const bool split = partialBytes(p) > p.xrow && rb >= 0;
  const size_t plane = static_cast<size_t>(p.lay.max_tokens) * p.lay.x_stride;
  uint8_t* A = stage + ra * plane + static_cast<size_t>(fb) * p.lay.x_stride;
  uint8_t* B = split ? stage + rb * plane + static_cast<size_t>(fb) * p.lay.x_stride : nullptr;
  const uint64_t* tail = qCounterIn(p, kCombTail, r, c);
  uint64_t* head = qCounter(p, p.rank, kCombHead, r, c);
  const uint64_t base = ldAcquire(head, p.gpu_scope), pairs = partialPairs(p, hm);
  const uint8_t* q = inBase(p, r) + p.lay.comb_q;
  bool alive = true;
  int done = 0;  // warp 0: partials drained (the round's largest index + 1)
  // Rounds of at most W tokens and at most a quarter of the stream's pairs (as the combiner's rounds: combineFor).
  const int step = max(1, min(tm.W, static_cast<int>(pairs / 4)));
  for (int t0 = tb; t0 < te; t0 += step) {
    const int t = t0 + tm.w;
    const int holders = tm.w < step && t < te ? hostHolders(p, t, hm) : 0;
    const int i = holders > 0 ? p.h.fpos[static_cast<size_t>(t) * R + h] - fb : -1;
    if (alive && i >= 0) {
      bool ok = true;
      if (lane == 0) ok = waitAtLeast(p, tail, base + 2 * static_cast<uint64_t>(i) + 2, r, epPhaseData, e);
      alive = __shfl_sync(kFull, ok, 0);
      if (alive) {
        const uint8_t* slot = q + partialSlot(p, hm, c, base / 2 + i);
        warpCopy16(A + i * p.lay.x_stride, slot, p.xrow, lane);
        if (split && holders > 1)
          warpCopy16(B + i * p.lay.x_stride, slot + p.lay.x_stride, partialBytes(p) - p.xrow, lane);
      }
    }
    if (tm.w == 0) {  // the round's last partial: lane l looks at the round's l-th token (step <= W <= 32)
      const int tl = t0 + lane;
      const int hl = lane < step && tl < te ? hostHolders(p, tl, hm) : 0;
      const int il = hl > 0 ? p.h.fpos[static_cast<size_t>(tl) * R + h] - fb + 1 : 0;
      done = max(done, static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(il))));
    }
    groupSync(tm.W, tm.lead);
    if (tm.w == 0 && lane == 0)
      publishHead(p, head, r, c, kCombHeadBack, base + 2 * static_cast<uint64_t>(done), e, true);
  }
  return alive;
}

// ---------------------------------------------------------------------------------------------------------
// Combine: block 2c returns, for every source s, the rows of s's channel-c tokens (contiguous in this rank's
// receive order) into s's combine queue for this rank and channel; block 2c+1 reduces this rank's channel-c
// tokens, a warp per token: rows of the ranks that received it, in ascending rank order, in fp32, rounded once.
// kH: hierarchical across hosts (p.hier; kX only): toward an owner of another host this rank either combines for it
// (combineFor) or stages its rows for the rank that does; from there it receives one partial per host.
// ---------------------------------------------------------------------------------------------------------
template <int kDtype, bool kX, bool kH>
__global__ void __launch_bounds__(1024) htCombineKernel(HtParams p) {
  using V = Vec8<kDtype>;
  const uint64_t e = currentEpoch(p);
  const int c = blockIdx.x >> 1, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int R = p.nranks, Q = p.Q, C = p.C, G = p.G;
  if ((blockIdx.x & 1) == 0) {
    // Send: the G warps of source s copy its rows in rounds of G, then publish the tail.
    const int s = warp / G, g = warp % G;
    if constexpr (kH) {
      __shared__ int s_okc[32];  // per team (groupWait)
      if (isRemote(p.remote, s)) {
        combineToHost<kDtype>(p, c, farTeam(p, s, g), e, s_okc);
        return;
      }
    }
    const int n = rankActive(p.el, s) ? p.h.recv_chan[s * C + c] : 0;
    const int src = recvChanStart(p, s, c);
    auto rounds = [&](auto far_c) {  // as in the push dispatch: two instances, mapped and across hosts
      constexpr bool kFar = decltype(far_c)::value;
      const QueueSend qs =
          queueSend<kFar>(p, s, c, kCombTail, kCombHead, kCombSent, kCombHeadBack, rankActive(p.el, s));
      const uint64_t base = qs.base;
      uint8_t* q = p.base[s] + p.lay.comb_q + (static_cast<size_t>(p.rank) * C + c) * Q * p.lay.x_stride;
      bool alive = true;
      for (int k = 0; k < n; k += G) {
        const int i = k + g;
        if (alive && i < n) {
          bool ok = true;
          if (lane == 0 && base + i + 1 > static_cast<uint64_t>(Q))
            ok = waitAtLeast(p, qs.head, base + i + 1 - Q, s, epPhaseData, e);
          alive = __shfl_sync(kFull, ok, 0);
        }
        if (alive && i < n) {
          const uint64_t idx = base + i;
          uint8_t* slot = q + (idx % Q) * p.lay.x_stride;
          RemoteSlot rs{nullptr, 0};
          if constexpr (kFar) {
            rs = remoteDataWarp(p, s, kRemoteHtBuffer, remoteOff(slot), static_cast<uint32_t>(p.xrow), e);
            slot = rs.payload();
          }
          if (!kFar || rs.hdr != nullptr) {
            if (src + i < min(*p.h.num_recv, p.recv_rows)) {
              warpCopy16(slot, static_cast<const uint8_t*>(p.x) + (src + i) * p.xrow, p.xrow, lane);
            } else {  // worst-token overflow (recorded by notify): x has no such row; the owner adds zeros
              warpZero16(slot, p.xrow, lane);
            }
          }
          if constexpr (kFar) remoteCommitWarp(rs);
        }
        fenceForPeers(p.gpu_scope);
        groupSync(G, s);
        if (g == 0 && lane == 0 && noFailure(p)) publishTail<kFar>(p, qs, s, base + min(k + G, n), e);
      }
    };
    if (isRemote(farMask<kX>(p), s)) rounds(FarTag<kX>{});
    else rounds(FarTag<false>{});
    return;
  }
  // Receive side, in two phases so that the sources never wait for each other: (1) the G warps of source r
  // move its rows out of the queue, in rounds of G, into this rank's combine staging at the row's position
  // among the tokens this rank sent to r, publishing the head after each round; (2) once the block's rows are
  // all in, a warp per token sums them in ascending rank order, in fp32, and rounds once.
  uint8_t* stage = p.base[p.rank] + p.lay.comb_stage;
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  const int r = warp / G, g = warp % G;
  if (kH && isRemote(p.remote, r)) {
    if (!drainPartials(p, c, farTeam(p, r, g), e, stage) && lane == 0) s_ok = 0;
  } else {
    const int tb = chanBegin(p.T, C, c), te = chanBegin(p.T, C, c + 1);
    // Rows from r on this channel: its tokens in [tb, te) that went to r.
    int n = 0;
    for (int t = tb + lane; t < te; t += 32) n += p.h.in_rank[static_cast<size_t>(t) * R + r];
    n = rankActive(p.el, r) ? warpSum(n) : 0;
    uint64_t* tail = qCounterIn(p, kCombTail, r, c);
    uint64_t* head = qCounter(p, p.rank, kCombHead, r, c);
    const uint64_t base = ldAcquire(head, p.gpu_scope);
    const int first = p.h.send_chan_base[r * C + c];
    const uint8_t* q = inBase(p, r) + p.lay.comb_q + (static_cast<size_t>(r) * C + c) * Q * p.lay.x_stride;
    bool alive = true;
    for (int k = 0; k < n; k += G) {
      const int i = k + g;
      if (alive && i < n) {
        bool ok = true;
        if (lane == 0) ok = waitAtLeast(p, tail, base + i + 1, r, epPhaseData, e);
        alive = __shfl_sync(kFull, ok, 0);
        if (!alive && lane == 0) s_ok = 0;
      }
      if (alive && i < n)
        warpCopy16(stage + (static_cast<size_t>(r) * p.lay.max_tokens + first + i) * p.lay.x_stride,
                   q + ((base + i) % Q) * p.lay.x_stride, p.xrow, lane);
      groupSync(G, r);
      if (g == 0 && lane == 0)
        publishHead(p, head, r, c, kCombHeadBack, base + min(k + G, n), e, isRemote(farMask<kX>(p), r));
    }
  }
  __syncthreads();
  if (!s_ok) return;
  const int tb = chanBegin(p.T, C, c), te = chanBegin(p.T, C, c + 1), chunks = static_cast<int>(p.xrow / 16);
  const size_t plane = static_cast<size_t>(p.lay.max_tokens) * p.lay.x_stride;  // staging rows of one source
  for (int t = tb + warp; t < te; t += nwarps) {
    for (int ch = lane; ch < chunks; ch += 32) {
      float acc[V::kN];
#pragma unroll
      for (int i = 0; i < V::kN; ++i) acc[i] = 0.0f;
      if constexpr (kH) {
        // Hierarchical: acc = +0 + P_h over the hosts h that hold t, ascending (epcomm.h): this host's P_h from the
        // staged rows of its ranks, another's from the partial its combiner sent.
        for (int h = 0; h < p.nhosts; ++h) {
          const uint64_t hm = p.host_ranks[h];
          if (h == p.my_host) {
            float part[V::kN];
#pragma unroll
            for (int i = 0; i < V::kN; ++i) part[i] = 0.0f;
            bool any = false;
            for (uint64_t m = hm; m; m &= m - 1) {
              const int r = __ffsll(m) - 1;
              const size_t tr = static_cast<size_t>(t) * R + r;
              if (!p.h.in_rank[tr] || !rankActive(p.el, r)) continue;
              V::add(part, reinterpret_cast<const int4*>(stage + r * plane + p.h.pos[tr] * p.lay.x_stride)[ch]);
              any = true;
            }
            if (any)
#pragma unroll
              for (int i = 0; i < V::kN; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
            continue;
          }
          const int holders = hostHolders(p, t, hm);
          if (holders == 0) continue;
          const size_t row = static_cast<size_t>(p.h.fpos[static_cast<size_t>(t) * R + h]) * p.lay.x_stride;
          const uint8_t* a = stage + kthRank(hm, 0) * plane + row;
          if (holders == 1 || partialBytes(p) <= p.xrow) {  // the row itself, or an fp32 partial of an fp32 row
            V::add(acc, reinterpret_cast<const int4*>(a)[ch]);
          } else {  // fp32 partial: its bytes from xrow on (its second slot) in the host's second rank's row
            const uint8_t* b = stage + kthRank(hm, 1) * plane + row;
#pragma unroll
            for (int x = 0; x < V::kN / 4; ++x) {
              const size_t o = 16 * (static_cast<size_t>(ch) * (V::kN / 4) + x);
              const float4 v = *reinterpret_cast<const float4*>(o < p.xrow ? a + o : b + (o - p.xrow));
              acc[4 * x] = __fadd_rn(acc[4 * x], v.x);
              acc[4 * x + 1] = __fadd_rn(acc[4 * x + 1], v.y);
              acc[4 * x + 2] = __fadd_rn(acc[4 * x + 2], v.z);
              acc[4 * x + 3] = __fadd_rn(acc[4 * x + 3], v.w);
            }
          }
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const size_t tr = static_cast<size_t>(t) * R + r;
          if (!p.h.in_rank[tr] || !rankActive(p.el, r)) continue;
          V::add(acc, reinterpret_cast<const int4*>(stage + r * plane + p.h.pos[tr] * p.lay.x_stride)[ch]);
        }
      }
      reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.xrow)[ch] = V::pack(acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Pull combine (src/common/gpu_layout.h). Blocks 2c and 2c+1 share channel c, each with its half of the work, so that
// every block copies and then every block reduces (with one role per block, half the SMs sat idle in each phase). Copy:
// the block's half of the rows of every owner's channel-c tokens, all its warps sharing one list over the owners, from
// x into this rank's staging (same row index as in x, rows of xrow bytes; nothing to copy when x is the staging:
// zero-copy, epHtCombineBuffer, or for this rank's own tokens), then it publishes its half to every owner. Reduce: once
// every active rank published both halves of this rank's channel c, the block's half of the channel's tokens, a token
// per warp, straight from the peers' staging (its own rows from x) in ascending rank order, in fp32, rounded once (the
// same arithmetic as the push path); then it acknowledges its half to every copier.
// ---------------------------------------------------------------------------------------------------------
template <int kDtype>
__global__ void __launch_bounds__(1024) htCombinePullKernel(HtParams p) {
  using V = Vec8<kDtype>;
  constexpr int kBatch = 4;  // rows loaded before they are added, for memory-level parallelism
  const uint64_t e = currentEpoch(p);
  const int c = blockIdx.x >> 1, half = blockIdx.x & 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int R = p.nranks, C = p.C;
  uint8_t* const stage = p.base[p.rank] + p.lay.comb_stage;
  {
    // The owners have read what this rank last published (the begin kernel waited); after any failure
    // nothing is written: a slow owner may still be reading. A masked owner gets nothing. The block's rows of
    // every owner form one list that all its warps share, so no warp idles while another owner still has rows
    // (this rank's own rows need no copy: it reads them in x).
    __shared__ int s_first[kGpuMaxRanks], s_at[kGpuMaxRanks + 1];  // per owner: first row; the list's prefix
    const bool ok = __syncthreads_and(noFailure(p));  // one answer for the block, as in the pull dispatch
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
      const int n = rankActive(p.el, s) ? p.h.recv_chan[s * C + c] : 0;
      int first = p.h.prefix[s];
      for (int cc = 0; cc < c; ++cc) first += p.h.recv_chan[s * C + cc];
      s_first[s] = first;
      s_at[s + 1] = n > half ? (n - half + 1) / 2 : 0;  // this half's rows of the owner: i = half, half + 2, ...
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      s_at[0] = 0;
      for (int s = 0; s < R; ++s) s_at[s + 1] += s_at[s];
    }
    __syncthreads();
    // Rows past x's rows (worst-token overflow, recorded by notify) were never received: zeros, so that the
    // owner adds nothing for them.
    const int have = min(*p.h.num_recv, p.recv_rows);
    for (int j = warp; ok && j < s_at[R]; j += nwarps) {
      int s = 0;
      while (s_at[s + 1] <= j) ++s;
      const int row = s_first[s] + half + 2 * (j - s_at[s]);
      uint8_t* dst = stage + static_cast<size_t>(row) * p.xrow;
      if (row >= have)
        warpZero16(dst, p.xrow, lane);
      else if (!p.zero_copy && p.x_region < 0 && s != p.rank)
        warpCopy16(dst, static_cast<const uint8_t*>(p.x) + static_cast<size_t>(row) * p.xrow, p.xrow, lane);
    }
    fenceForPeers(p.gpu_scope);
    __syncthreads();
    if (ok && noFailure(p))
      for (int s = threadIdx.x; s < R; s += blockDim.x) {
        if (!rankActive(p.el, s)) continue;
        stRelease(qCounter(p, s, half ? kPullReady1 : kPullReady, p.rank, c), e, p.gpu_scope);
        stRelaxed(qCounter(p, p.rank, kPullSent, s, c), e);
      }
  }
  // Reduce: every active rank's rows of this channel's tokens are in (both halves).
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * R; i += blockDim.x) {
    const int r = i >> 1;
    if (rankActive(p.el, r) &&
        !waitAtLeast(p, qCounter(p, p.rank, (i & 1) ? kPullReady1 : kPullReady, r, c), e, r, epPhaseData, e))
      s_ok = 0;
  }
  __syncthreads();
  if (!s_ok) return;
  // Where each rank's rows are: rows [0, s_have[r]) at s_rows[r] (this rank's x, or a peer's registered memory
  // as it published, bound-checked against the region it registered), the rest in r's staging.
  __shared__ const uint8_t* s_rows[kGpuMaxRanks];
  __shared__ int s_have[kGpuMaxRanks];
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    const uint8_t* rows = nullptr;
    int have_r = 0;
    if (r == p.rank) {
      rows = static_cast<const uint8_t*>(p.x);
      have_r = min(*p.h.num_recv, p.recv_rows);
    } else if (rankActive(p.el, r)) {
      const volatile GpuCombineSource* cs = &reinterpret_cast<const GpuCtrl*>(p.base[r])->comb_src;
      const int k = cs->region, n = cs->have;
      const uint64_t off = cs->off;
      if (k >= 0) {
        const uint8_t* b = k < kGpuRegionSlots ? p.regions[k].base[r] : nullptr;
        const uint64_t len = k < kGpuRegionSlots ? p.regions[k].bytes[r] : 0;
        if (b == nullptr || n < 0 || off > len || static_cast<uint64_t>(n) * p.xrow > len - off) {
          recordViolation(p, epInternalError);  // what the peer published does not fit what it registered
        } else {
          rows = b + off;
          have_r = n;
        }
      }
    }
    s_rows[r] = rows;
    s_have[r] = have_r;
  }
  __syncthreads();
  // Per warp: the rows of its token, in ascending rank order.
  __shared__ const int4* s_src[32][kGpuMaxRanks];
  const int4** src = s_src[warp];
  const int tb = chanBegin(p.T, C, c), te = chanBegin(p.T, C, c + 1), chunks = static_cast<int>(p.xrow / 16);
  for (int t = tb + half * nwarps + warp; t < te; t += 2 * nwarps) {
    int n = 0;
    for (int r0 = 0; r0 < R; r0 += 32) {
      const int r = r0 + lane;
      const size_t tr = static_cast<size_t>(t) * R + r;
      const bool has = r < R && p.h.in_rank[tr] && rankActive(p.el, r);
      const unsigned b = __ballot_sync(kFull, has);
      if (has) {
        const int row = p.h.peer_base[r] + p.h.pos[tr];
        const uint8_t* at = row < s_have[r] ? s_rows[r] : p.base[r] + p.lay.comb_stage;
        src[n + __popc(b & ((1u << lane) - 1))] = reinterpret_cast<const int4*>(at + static_cast<size_t>(row) * p.xrow);
      }
      n += __popc(b);
    }
    __syncwarp();
    // Two 16-byte chunks per lane at a time (ch and ch + 32): kBatch x 2 loads in flight, each chunk's rows still
    // added in rank order.
    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.xrow);
    for (int ch = lane; ch < chunks; ch += 64) {
      const bool in1 = ch + 32 < chunks;
      float acc[2][V::kN];
#pragma unroll
      for (int i = 0; i < V::kN; ++i) acc[0][i] = acc[1][i] = 0.0f;
      for (int i = 0; i < n; i += kBatch) {
        int4 v[kBatch][2];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (i + u < n) v[u][0] = src[i + u][ch];
          if (i + u < n && in1) v[u][1] = src[i + u][ch + 32];
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (i + u < n) V::add(acc[0], v[u][0]);
          if (i + u < n && in1) V::add(acc[1], v[u][1]);
        }
      }
      out[ch] = V::pack(acc[0]);
      if (in1) out[ch + 32] = V::pack(acc[1]);
    }
    __syncwarp();
  }
  // Every row of this block's half is read: the copiers may overwrite them once both halves say so.
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    if (rankActive(p.el, r)) stRelease(qCounter(p, r, half ? kPullAck1 : kPullAck, p.rank, c), e, p.gpu_scope);
}

// ---------------------------------------------------------------------------------------------------------
// Layout (epGetDispatchLayout), local: outputs zeroed by the launcher, then counted with atomics.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(256) layoutKernel(HtParams p, int* per_rank, int* per_expert, uint8_t* in_rank) {
  const int R = p.nranks, K = p.K;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < p.T; t += gridDim.x * blockDim.x) {
    const int64_t* row = p.topk_idx + static_cast<size_t>(t) * K;
    uint64_t mask = 0;
    for (int k = 0; k < K; ++k) {
      int64_t x = row[k];
      if (x < -1 || x >= p.E) {
        recordViolation(p, epExpertOutOfRange);
        continue;
      }
      if (x < 0 || isRepeatedExpert(row, k) || !rankActive(p.el, static_cast<int>(x / p.L))) continue;
      mask |= 1ull << (x / p.L);
      if (per_expert) atomicAdd(per_expert + x, 1);
    }
    for (int r = 0; r < R; ++r) {
      const int bit = static_cast<int>((mask >> r) & 1);
      if (in_rank) in_rank[static_cast<size_t>(t) * R + r] = bit;
      if (bit && per_rank) atomicAdd(per_rank + r, 1);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------
cudaError_t launchHtBegin(const HtParams& p, cudaStream_t s) {
  htBeginKernel<<<1, 32, 0, s>>>(p);
  return cudaGetLastError();
}

// Kernels that write to peers in two instances (kernels/remote.cuh): with ranks of other hosts or without.
cudaError_t launchHtNotify(const HtParams& p, cudaStream_t s) {
  const size_t smem = sizeof(int) * static_cast<size_t>(p.E);
  if (p.remote) htNotifyKernel<true><<<1, 1024, smem, s>>>(p);
  else htNotifyKernel<false><<<1, 1024, smem, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launchHtDispatch(const HtParams& p, cudaStream_t s) {
  if (p.pull_dispatch)
    htDispatchPullKernel<<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p);
  else if (p.remote && p.hier)
    htDispatchKernel<true, true><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p);
  else if (p.remote)
    htDispatchKernel<true, false><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p);
  else
    htDispatchKernel<false, false><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launchHtEnd(const HtParams& p, cudaStream_t s) {
  htEndKernel<<<1, 32, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launchHtCombine(const HtParams& p, cudaStream_t s) {
  if (p.pull) {
    switch (p.dtype) {
      case epBfloat16: htCombinePullKernel<epBfloat16><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p); break;
      case epFloat16: htCombinePullKernel<epFloat16><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p); break;
      default: htCombinePullKernel<epFloat32><<<2 * p.C, p.nranks * p.G * 32, 0, s>>>(p); break;
    }
    return cudaGetLastError();
  }
  const dim3 grid(2 * p.C), block(p.nranks * p.G * 32);
  // Instances: one host; across hosts flat; across hosts hierarchical.
  auto launch = [&](auto kernel_one, auto kernel_flat, auto kernel_hier) {
    if (!p.remote) kernel_one<<<grid, block, 0, s>>>(p);
    else if (p.hier) kernel_hier<<<grid, block, 0, s>>>(p);
    else kernel_flat<<<grid, block, 0, s>>>(p);
  };
  switch (p.dtype) {
    case epBfloat16:
      launch(htCombineKernel<epBfloat16, false, false>, htCombineKernel<epBfloat16, true, false>,
             htCombineKernel<epBfloat16, true, true>);
      break;
    case epFloat16:
      launch(htCombineKernel<epFloat16, false, false>, htCombineKernel<epFloat16, true, false>,
             htCombineKernel<epFloat16, true, true>);
      break;
    default:
      launch(htCombineKernel<epFloat32, false, false>, htCombineKernel<epFloat32, true, false>,
             htCombineKernel<epFloat32, true, true>);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launchLayout(const HtParams& p, int* per_rank, int* per_expert, uint8_t* in_rank, cudaStream_t s) {
  if (per_rank) cudaMemsetAsync(per_rank, 0, sizeof(int) * p.nranks, s);
  if (per_expert) cudaMemsetAsync(per_expert, 0, sizeof(int) * p.E, s);
  const int blocks = p.T > 0 ? (p.T + 255) / 256 : 1;
  layoutKernel<<<blocks < 132 ? blocks : 132, 256, 0, s>>>(p, per_rank, per_expert, in_rank);
  return cudaGetLastError();
}

// Every kernel of this file loaded now (kernels/preload.h says why).
cudaError_t preloadHtKernels() {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(htBeginKernel),
      reinterpret_cast<const void*>(htEndKernel),
      reinterpret_cast<const void*>(htNotifyKernel<false>),
      reinterpret_cast<const void*>(htNotifyKernel<true>),
      reinterpret_cast<const void*>(htDispatchKernel<false, false>),
      reinterpret_cast<const void*>(htDispatchKernel<true, false>),
      reinterpret_cast<const void*>(htDispatchKernel<true, true>),
      reinterpret_cast<const void*>(htDispatchPullKernel),
      reinterpret_cast<const void*>(layoutKernel),
      reinterpret_cast<const void*>(htCombinePullKernel<epBfloat16>),
      reinterpret_cast<const void*>(htCombineKernel<epBfloat16, false, false>),
      reinterpret_cast<const void*>(htCombineKernel<epBfloat16, true, false>),
      reinterpret_cast<const void*>(htCombineKernel<epBfloat16, true, true>),
      reinterpret_cast<const void*>(htCombinePullKernel<epFloat16>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat16, false, false>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat16, true, false>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat16, true, true>),
      reinterpret_cast<const void*>(htCombinePullKernel<epFloat32>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat32, false, false>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat32, true, false>),
      reinterpret_cast<const void*>(htCombineKernel<epFloat32, true, true>),
  };
  return preloadKernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

}  // namespace epcomm
