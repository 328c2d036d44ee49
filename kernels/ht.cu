// High-throughput (HT) dispatch and combine kernels of the GPU engine, for the ranks of one host.
// Buffer layout and protocol: src/engine/gpu/gpu_types.h. Element rules: src/common/dtype.h (shared with the
// host engine, so both produce the same bits).
#include <cuda_runtime.h>

#include "common/dtype.h"
#include "engine/routing.h"
#include "kernels/ht.h"

namespace epcomm {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t ldAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void stRelaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Starts operation `epoch + 1` (one thread of a one-block kernel). The control words are read and written
// with strong operations, never through a possibly stale L1 line: a stale epoch would put this rank one
// operation behind its peers.
__device__ __forceinline__ uint64_t bumpEpoch(GpuCtrl* c, uint64_t* last_out, uint64_t* prev) {
  const uint64_t e = ldAcquire(&c->epoch) + 1;
  stRelaxed(&c->epoch, e);
  if (last_out != nullptr) {
    *prev = ldAcquire(last_out);
    stRelaxed(last_out, e);
  }
  __threadfence();
  return e;
}

__device__ __forceinline__ GpuCtrl* ctrlOf(const HtParams& p, int r) { return reinterpret_cast<GpuCtrl*>(p.base[r]); }
__device__ __forceinline__ uint64_t currentEpoch(const HtParams& p) { return ldAcquire(&p.ctrl->epoch); }

// First failure wins; later waits see err->code and give up at once.
__device__ void recordError(const HtParams& p, int code, int peer, int phase, uint64_t epoch) {
  if (atomicCAS_system(&p.err->code, 0, code) == 0) {
    p.err->op = p.op;
    p.err->epoch = epoch;
    p.err->rank = p.rank;
    p.err->peer = peer;
    p.err->phase = phase;
    __threadfence_system();
  }
}

__device__ void recordViolation(const HtParams& p, int code) {
  atomicCAS_system(&p.err->violation_code, 0, code);
  atomicAdd_system(reinterpret_cast<unsigned long long*>(&p.err->violations), 1ull);
}

// Waits until *flag >= want, with the communicator's deadline (%globaltimer). False on timeout or abort.
__device__ bool waitAtLeast(const HtParams& p, const uint64_t* flag, uint64_t want, int peer, int phase,
                            uint64_t epoch) {
  if (ldAcquire(flag) >= want) return true;
  // %globaltimer can step backwards or jump when the driver resynchronizes it (seen in a VM): elapsed time is
  // the sum of the forward steps between checks, each capped, so a jump never fakes a timeout.
  constexpr uint64_t kMaxStepNs = 10 * 1000 * 1000;
  uint64_t last = globaltimer(), elapsed = 0;
  volatile GpuErrorRecord* err = p.err;
  for (uint32_t it = 1;; ++it) {
    if (ldAcquire(flag) >= want) return true;
    if ((it & 127) == 0) {
      if (err->code != 0 || err->abort != 0) return false;
      const uint64_t now = globaltimer();
      const int64_t step = static_cast<int64_t>(now - last);
      last = now;
      if (step > 0) elapsed += static_cast<uint64_t>(step) < kMaxStepNs ? static_cast<uint64_t>(step) : kMaxStepNs;
      if (elapsed > p.timeout_ns) {
        recordError(p, epTimeout, peer, phase, epoch);
        return false;
      }
    }
    __nanosleep(64);
  }
}

// Each thread r < R waits on flags[r]; every thread returns the common verdict.
__device__ bool waitAllPeers(const HtParams& p, const uint64_t* flags, uint64_t want, int phase, uint64_t epoch) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  for (int r = threadIdx.x; r < p.nranks; r += blockDim.x)
    if (!waitAtLeast(p, flags + r, want, r, phase, epoch)) s_ok = 0;
  __syncthreads();
  return s_ok != 0;
}

// The last block of a launch to get here raises flag[rank] to `epoch` on every peer (flags selects which
// array of the peers' GpuCtrl), after every block's writes are visible system-wide.
__device__ void lastBlockSignals(const HtParams& p, int counter, size_t flag_offset, uint64_t epoch) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(&p.ctrl->done[counter], 1u) == gridDim.x - 1) {
      p.ctrl->done[counter] = 0;  // not used to derive the epoch, so resetting it here is safe (G2)
      __threadfence_system();
      for (int r = 0; r < p.nranks; ++r) {
        uint64_t* f = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(ctrlOf(p, r)) + flag_offset) + p.rank;
        stRelease(f, epoch);
      }
    }
  }
}

// A warp copies one row of `bytes` (a multiple of 16), four 16-byte loads in flight per lane.
__device__ __forceinline__ void warpCopy16(void* dst, const void* src, size_t bytes, int lane) {
  const int4* s = static_cast<const int4*>(src);
  int4* d = static_cast<int4*>(dst);
  const int n = static_cast<int>(bytes / 16);
  for (int i = lane; i < n; i += 128) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * 32 < n) v[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * 32 < n) d[i + u * 32] = v[u];
  }
}

__device__ __forceinline__ void warpCopy4(void* dst, const void* src, size_t bytes, int lane) {
  const uint32_t* s = static_cast<const uint32_t*>(src);
  uint32_t* d = static_cast<uint32_t*>(dst);
  for (int i = lane; i < static_cast<int>(bytes / 4); i += 32) d[i] = s[i];
}

__device__ __forceinline__ size_t mailboxOffset(const HtParams& p, uint64_t epoch, int src) {
  return p.lay.mailbox + ((epoch & 1) * p.nranks + src) * p.lay.mailbox_entry;
}

// ---------------------------------------------------------------------------------------------------------
// Begin: bumps the epoch (one block, so no other block of this launch reads it) and waits until every peer
// finished reading what this rank wrote into its staging during the previous op that used it.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(64, 1) htBeginKernel(HtParams p, int combine) {
  __shared__ uint64_t s_epoch, s_prev;
  if (threadIdx.x == 0) {
    uint64_t prev = 0;
    s_epoch = bumpEpoch(p.ctrl, combine ? &p.ctrl->last_combine_epoch : &p.ctrl->last_dispatch_epoch, &prev);
    s_prev = prev;
  }
  __syncthreads();
  waitAllPeers(p, combine ? p.ctrl->combine_ack : p.ctrl->dispatch_ack, s_prev, epPhaseHeader, s_epoch);
}

// ---------------------------------------------------------------------------------------------------------
// Notify (one block): layout of this rank's tokens (in_rank, per-destination positions, per-expert counts),
// the exchange of counts through the peers' mailboxes, and the receive-side prefix sums.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(1024, 1) htNotifyKernel(HtParams p) {
  extern __shared__ int s_expert[];  // [E]
  __shared__ uint64_t s_epoch, s_prev;
  __shared__ int s_count[kGpuMaxRanks];
  __shared__ int s_warp[32];
  __shared__ int s_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int R = p.nranks, L = p.L, K = p.K;
  if (tid == 0) {
    uint64_t prev = 0;
    s_epoch = bumpEpoch(p.ctrl, p.begins_dispatch ? &p.ctrl->last_dispatch_epoch : nullptr, &prev);
    s_prev = prev;
  }
  for (int i = tid; i < p.E; i += blockDim.x) s_expert[i] = 0;
  for (int r = tid; r < R; r += blockDim.x) s_count[r] = 0;
  __syncthreads();
  const uint64_t e = s_epoch;

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
        atomicAdd(&s_expert[x], 1);
      }
      for (int r = 0; r < R; ++r) p.h.in_rank[static_cast<size_t>(t) * R + r] = (mask >> r) & 1;
    }
    // Position of t among this chunk's tokens that go to r: warp ballots, then a scan of the warp totals.
    for (int r = 0; r < R; ++r) {
      const int bit = static_cast<int>((mask >> r) & 1);
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
      if (bit) p.h.pos[static_cast<size_t>(t) * R + r] = s_count[r] + s_warp[warp] + in_warp;
      __syncthreads();
      if (tid == 0) s_count[r] += s_total;
      __syncthreads();
    }
  }

  // Before this op writes into the peers' staging, they must be done reading the previous dispatch's rows.
  if (p.begins_dispatch && !waitAllPeers(p, p.ctrl->dispatch_ack, s_prev, epPhaseHeader, e)) return;

  // Mailbox entry for every peer r: counts to every rank, then per local expert of r.
  for (int r = 0; r < R; ++r) {
    int32_t* ent = reinterpret_cast<int32_t*>(p.base[r] + mailboxOffset(p, e, p.rank) + sizeof(MailboxHead));
    for (int j = tid; j < R; j += blockDim.x) ent[j] = s_count[j];
    for (int l = tid; l < L; l += blockDim.x) ent[R + l] = s_expert[r * L + l];
  }
  __threadfence_system();
  __syncthreads();
  for (int r = tid; r < R; r += blockDim.x) {
    MailboxHead* head = reinterpret_cast<MailboxHead*>(p.base[r] + mailboxOffset(p, e, p.rank));
    stRelease(&head->tag, e);
  }
  uint8_t* me = p.base[p.rank];
  __shared__ int s_ok;
  if (tid == 0) s_ok = 1;
  __syncthreads();
  for (int s = tid; s < R; s += blockDim.x) {
    MailboxHead* head = reinterpret_cast<MailboxHead*>(me + mailboxOffset(p, e, s));
    if (!waitAtLeast(p, &head->tag, e, s, epPhaseHeader, e)) s_ok = 0;
  }
  __syncthreads();
  if (!s_ok) return;
  auto countsOf = [&](int s) {
    return reinterpret_cast<const int32_t*>(me + mailboxOffset(p, e, s) + sizeof(MailboxHead));
  };
  for (int i = tid; i < R * R; i += blockDim.x) p.h.matrix[i] = countsOf(i / R)[i % R];
  for (int l = tid; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += countsOf(s)[R + l];
    p.h.per_expert[l] = sum;
    if (p.recv_per_expert_out) p.recv_per_expert_out[l] = sum;
  }
  for (int r = tid; r < R; r += blockDim.x) {
    int b = 0;
    for (int s = 0; s < p.rank; ++s) b += countsOf(s)[r];
    p.h.send_base[r] = b;
  }
  if (tid == 0) {
    int acc = 0;
    p.h.prefix[0] = 0;
    for (int s = 0; s < R; ++s) {
      acc += countsOf(s)[p.rank];
      p.h.prefix[s + 1] = acc;
    }
    *p.h.num_recv = acc;
    if (p.num_recv_out) *p.num_recv_out = acc;
    if (p.worst > 0 && acc > p.worst) recordViolation(p, epCapacityExceeded);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch send: a warp per token writes its row (and scales, local expert ids, weights) straight into the
// final receive row of each destination's staging.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(512) htDispatchKernel(HtParams p) {
  const uint64_t e = currentEpoch(p);
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nw = gridDim.x * (blockDim.x >> 5);
  const int R = p.nranks, K = p.K;
  for (int t = gw; t < p.T; t += nw) {
    for (int r = 0; r < R; ++r) {
      const size_t tr = static_cast<size_t>(t) * R + r;
      if (!p.h.in_rank[tr]) continue;
      const size_t slot = static_cast<size_t>(p.h.send_base[r] + p.h.pos[tr]);
      uint8_t* b = p.base[r];
      warpCopy16(b + p.lay.disp_x + slot * p.lay.x_stride, static_cast<const uint8_t*>(p.x) + t * p.xrow, p.xrow,
                 lane);
      if (p.srow)
        warpCopy4(b + p.lay.disp_scales + slot * p.lay.scale_stride,
                  reinterpret_cast<const uint8_t*>(p.x_scales) + t * p.srow, p.srow, lane);
      if (p.topk_idx != nullptr && lane < K) {
        int64_t x = p.topk_idx[static_cast<size_t>(t) * K + lane];
        bool here = x >= 0 && x < p.E && x / p.L == r;
        reinterpret_cast<int64_t*>(b + p.lay.disp_idx)[slot * kGpuMaxTopk + lane] = here ? x % p.L : -1;
        if (p.topk_weights != nullptr)
          reinterpret_cast<float*>(b + p.lay.disp_w)[slot * kGpuMaxTopk + lane] =
              here ? p.topk_weights[static_cast<size_t>(t) * K + lane] : 0.0f;
      }
    }
  }
  lastBlockSignals(p, kDoneDispatchSend, offsetof(GpuCtrl, data_flag), e);
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch receive: once every source raised its flag, copy the staging rows into the caller's buffers
// (this is the extra pass of caller-memory outputs), pad worst-token rows, and acknowledge to the sources.
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(512) htDispatchRecvKernel(HtParams p) {
  const uint64_t e = currentEpoch(p);
  if (!waitAllPeers(p, p.ctrl->data_flag, e, epPhaseData, e)) return;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nw = gridDim.x * (blockDim.x >> 5);
  const int num_recv = *p.h.num_recv, K = p.K;
  const int rows = p.worst > 0 ? min(num_recv, p.worst) : num_recv;
  const int all_rows = p.worst > 0 ? p.worst : num_recv;
  const uint8_t* me = p.base[p.rank];
  for (int i = gw; i < all_rows; i += nw) {
    if (i < rows) {
      warpCopy16(static_cast<uint8_t*>(p.recv_x) + i * p.xrow, me + p.lay.disp_x + i * p.lay.x_stride, p.xrow,
                 lane);
      if (p.srow)
        warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + i * p.srow, me + p.lay.disp_scales +
                  i * p.lay.scale_stride, p.srow, lane);
      if (lane < K && p.topk_idx != nullptr) {
        if (p.recv_topk_idx)
          p.recv_topk_idx[static_cast<size_t>(i) * K + lane] =
              reinterpret_cast<const int64_t*>(me + p.lay.disp_idx)[static_cast<size_t>(i) * kGpuMaxTopk + lane];
        if (p.recv_topk_weights && p.topk_weights)
          p.recv_topk_weights[static_cast<size_t>(i) * K + lane] =
              reinterpret_cast<const float*>(me + p.lay.disp_w)[static_cast<size_t>(i) * kGpuMaxTopk + lane];
      }
    } else if (lane < K) {  // worst-token padding
      if (p.recv_topk_idx) p.recv_topk_idx[static_cast<size_t>(i) * K + lane] = -1;
      if (p.recv_topk_weights) p.recv_topk_weights[static_cast<size_t>(i) * K + lane] = 0.0f;
    }
  }
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < p.L; l += blockDim.x)
      if (p.recv_per_expert_out) p.recv_per_expert_out[l] = p.h.per_expert[l];
    if (threadIdx.x == 0 && p.num_recv_out) *p.num_recv_out = num_recv;
  }
  lastBlockSignals(p, kDoneDispatchRecv, offsetof(GpuCtrl, dispatch_ack), e);
}

// ---------------------------------------------------------------------------------------------------------
// Combine send: each received row goes back to its source, into the source's combine staging at
// [this rank][its position among the tokens the source sent here].
// ---------------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(512) htCombineSendKernel(HtParams p) {
  const uint64_t e = currentEpoch(p);
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nw = gridDim.x * (blockDim.x >> 5);
  const int num_recv = *p.h.num_recv;
  for (int i = gw; i < num_recv; i += nw) {
    int s = 0;
    while (s + 1 < p.nranks && p.h.prefix[s + 1] <= i) ++s;
    const size_t j = static_cast<size_t>(i - p.h.prefix[s]);
    uint8_t* dst = p.base[s] + p.lay.comb_x + (static_cast<size_t>(p.rank) * p.lay.max_tokens + j) * p.lay.x_stride;
    warpCopy16(dst, static_cast<const uint8_t*>(p.x) + i * p.xrow, p.xrow, lane);
  }
  lastBlockSignals(p, kDoneCombineSend, offsetof(GpuCtrl, combine_flag), e);
}

template <int kDtype>
struct Vec8;  // 16 bytes of a row as floats
// bf16 and fp16: eight 16-bit values per 16 bytes, converted by the shared rules of common/dtype.h.
template <float (*kToFloat)(uint16_t), uint16_t (*kFromFloat)(float)>
struct Vec8Half {
  static constexpr int kN = 8;
  __device__ static void add(float* acc, int4 v) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], kToFloat(h[i]));
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    uint16_t* h = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) h[i] = kFromFloat(acc[i]);
    return v;
  }
};
template <>
struct Vec8<epBfloat16> : Vec8Half<bf16ToFloat, floatToBf16> {};
template <>
struct Vec8<epFloat16> : Vec8Half<fp16ToFloat, floatToFp16> {};
template <>
struct Vec8<epFloat32> {
  static constexpr int kN = 4;
  __device__ static void add(float* acc, int4 v) {
    const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], f[i]);
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    float* f = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = acc[i];
    return v;
  }
};

// ---------------------------------------------------------------------------------------------------------
// Combine reduce: a warp per token sums the rows returned by the ranks that received it, in ascending rank
// order, in fp32, and rounds once.
// ---------------------------------------------------------------------------------------------------------
template <int kDtype>
__global__ void __launch_bounds__(512) htCombineReduceKernel(HtParams p) {
  using V = Vec8<kDtype>;
  const uint64_t e = currentEpoch(p);
  if (!waitAllPeers(p, p.ctrl->combine_flag, e, epPhaseData, e)) return;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nw = gridDim.x * (blockDim.x >> 5);
  const int R = p.nranks, chunks = static_cast<int>(p.xrow / 16);
  const uint8_t* stage = p.base[p.rank] + p.lay.comb_x;
  for (int t = gw; t < p.T; t += nw) {
    for (int c = lane; c < chunks; c += 32) {
      float acc[V::kN];
#pragma unroll
      for (int i = 0; i < V::kN; ++i) acc[i] = 0.0f;
      for (int r = 0; r < R; ++r) {
        const size_t tr = static_cast<size_t>(t) * R + r;
        if (!p.h.in_rank[tr]) continue;
        const int4* src = reinterpret_cast<const int4*>(
            stage + (static_cast<size_t>(r) * p.lay.max_tokens + p.h.pos[tr]) * p.lay.x_stride);
        V::add(acc, src[c]);
      }
      reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.xrow)[c] = V::pack(acc);
    }
  }
  lastBlockSignals(p, kDoneCombineReduce, offsetof(GpuCtrl, combine_ack), e);
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
      if (x < 0 || isRepeatedExpert(row, k)) continue;
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
cudaError_t launchHtBegin(const HtParams& p, bool combine, cudaStream_t s) {
  htBeginKernel<<<1, 64, 0, s>>>(p, combine ? 1 : 0);
  return cudaGetLastError();
}

cudaError_t launchHtNotify(const HtParams& p, cudaStream_t s) {
  const size_t smem = sizeof(int) * static_cast<size_t>(p.E);
  htNotifyKernel<<<1, 1024, smem, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launchHtDispatch(const HtParams& p, int blocks, cudaStream_t s) {
  htDispatchKernel<<<blocks, 512, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  htDispatchRecvKernel<<<blocks, 512, 0, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launchHtCombine(const HtParams& p, int blocks, cudaStream_t s) {
  htCombineSendKernel<<<blocks, 512, 0, s>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  switch (p.dtype) {
    case epBfloat16: htCombineReduceKernel<epBfloat16><<<blocks, 512, 0, s>>>(p); break;
    case epFloat16: htCombineReduceKernel<epFloat16><<<blocks, 512, 0, s>>>(p); break;
    default: htCombineReduceKernel<epFloat32><<<blocks, 512, 0, s>>>(p); break;
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

}  // namespace epcomm
