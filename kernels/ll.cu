// Low-latency (LL) dispatch and combine kernels of the GPU engine, for the ranks of one host.
// Buffer layout and protocol: LlLayout in src/common/gpu_layout.h. Element rules (fp8 quantization,
// bf16/fp16 rounding): src/common/dtype.h, shared with the host engine so both produce the same bits.
//
// Every kernel runs on a fixed grid (LlParams::blocks) and a warp is the unit of work: a part of a token's row
// to send or to place, a part of an expert-output row to return, or 32 16-byte chunks of an output row to
// reduce. A half launched alone never waits for another block of its own launch, so any grid size works; the
// fused kernel (both halves) does, and is launched cooperatively, every block resident at once.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>
#ifdef EPCOMM_LL_PROBE
#include <cstdio>  // epcommLlProbeDump
#endif

#include "common/dtype.h"
#include "common/routing.h"
#include "kernels/device_common.cuh"
#include "kernels/fp8.cuh"
#include "kernels/ll.h"
#include "kernels/ll_probe.cuh"
#include "kernels/preload.h"
#include "kernels/remote.cuh"

namespace epcomm {
namespace {

using namespace dev;

constexpr int kLlThreads = 512;
constexpr int kLlMaxRanks = 16;  // the GPU engine's rank limit (GpuEngine::init); plain dispatch: lane r holds rank r
// The routing words' index field (llZdRoutingWord) holds any T the dispatch stages (12 bytes of routing a pair).
static_assert(kLlMaxSmem / 12 < 65536, "a token index fits 16 bits");

__device__ __forceinline__ LlCtrl* ctrlOf(const LlParams& p) { return reinterpret_cast<LlCtrl*>(p.base[p.rank]); }
// Tag of family `fam`, parity `par`, written by `src` into `owner`'s buffer.
__device__ __forceinline__ uint64_t* tagPtr(const LlParams& p, int owner, int fam, int par, int src) {
  return reinterpret_cast<uint64_t*>(baseOf(p, owner, src) + p.lay.tag) + (fam * 2 + par) * p.nranks + src;
}
// Acknowledgement of family `fam` that `peer` wrote into `owner`'s buffer.
__device__ __forceinline__ uint64_t* ackPtr(const LlParams& p, int owner, int fam, int peer) {
  return reinterpret_cast<uint64_t*>(baseOf(p, owner, peer) + p.lay.ack) + fam * p.nranks + peer;
}
// Dispatch count entry of `src` in `owner`'s buffer: [0] = T of src, [4 + l] = pairs for local expert l.
__device__ __forceinline__ int32_t* countEntry(const LlParams& p, int owner, int par, int src) {
  return reinterpret_cast<int32_t*>(baseOf(p, owner, src) + p.lay.counts +
                                    (static_cast<size_t>(par) * p.nranks + src) * p.lay.count_entry);
}
__device__ __forceinline__ uint8_t* slotPtr(const LlParams& p, int owner, int par, int src, int t) {
  return baseOf(p, owner, src) + p.lay.slots +
         ((static_cast<size_t>(par) * p.nranks + src) * p.lay.max_tokens + t) * p.lay.slot;
}
// Rank-major combine slot of `expert` (written by the expert's rank) for token t.
__device__ __forceinline__ uint8_t* combPtr(const LlParams& p, int owner, int par, int expert, int t) {
  return baseOf(p, owner, expert / p.L) + p.lay.comb +
         ((static_cast<size_t>(par) * p.lay.max_experts + expert) * p.lay.max_tokens + t) * p.lay.comb_row;
}

// Expert-major combines pack the rows that expert rank A returns to this rank into A's block of M * L rows (a
// token sends at most L experts to one rank; the blocks of all R ranks fill E x M): expert by expert, each
// expert's rows in token order. The block does not depend on the call's top-k.
// Packed, the rows of one operation fill a few pages instead of one page per (expert, rank): sparse writes over
// E x M slots measured 3-5x slower at R = 8 (one H200, MPS), the GPU's address translation being the suspect.
__device__ __forceinline__ uint8_t* combPackedPtr(const LlParams& p, int owner, int par, int A, size_t q) {
  const size_t block = static_cast<size_t>(p.lay.max_tokens) * p.L;
  return baseOf(p, owner, A) + p.lay.comb +
         ((static_cast<size_t>(par) * p.lay.max_experts * p.lay.max_tokens) + A * block + q) * p.lay.comb_row;
}

// Zero-copy dispatch entry of `src` in `owner`'s buffer, its per-expert counts and its routing words; slot: the
// operation number % kLlZdSlots (zdSlot).
__device__ __forceinline__ int zdSlot(uint64_t e) { return static_cast<int>(e % kLlZdSlots); }
__device__ __forceinline__ LlZdEntry* zdEntry(const LlParams& p, int owner, int slot, int src) {
  return reinterpret_cast<LlZdEntry*>(p.base[owner] + p.lay.zd_ent +
                                      (static_cast<size_t>(slot) * p.nranks + src) * p.lay.zd_ent_size);
}
__device__ __forceinline__ int32_t* zdCounts(LlZdEntry* ent) { return reinterpret_cast<int32_t*>(ent + 1); }
__device__ __forceinline__ const int32_t* zdCounts(const LlZdEntry* ent) {
  return reinterpret_cast<const int32_t*>(ent + 1);
}
__device__ __forceinline__ uint32_t* zdRouting(const LlParams& p, int owner, int slot, int src) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(zdEntry(p, owner, slot, src)) + p.lay.zd_routing);
}

__device__ __forceinline__ LlZcHeader* zcHeader(const LlParams& p, int owner, int par) {
  return reinterpret_cast<LlZcHeader*>(p.base[owner] + p.lay.zc + par * p.lay.zc_entry);
}

// The operation number of this launch (one more than the family's completed count), read once per block. Only
// this rank's earlier launches of the same kind wrote it, and they are complete (stream order), so a relaxed
// load suffices.
__device__ __forceinline__ uint64_t launchEpoch(const uint64_t* completed) {
  __shared__ uint64_t s_e;
  if (threadIdx.x == 0) s_e = *reinterpret_cast<const volatile uint64_t*>(completed) + 1;
  __syncthreads();
  return s_e;
}

// The calling warp replaces a[0], a[stride], ... a[(n - 1) * stride] (shared memory) by their exclusive prefix sums.
__device__ __forceinline__ void warpExclusiveScan(int* a, int n, int stride, int lane) {
  int carry = 0;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int i = i0 + lane, c = i < n ? a[i * stride] : 0;
    int v = c;
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(kFull, v, d);
      if (lane >= d) v += u;
    }
    if (i < n) a[i * stride] = carry + v - c;
    carry += __shfl_sync(kFull, v, 31);
  }
}

// The active-ranks mask, read once per half at its start (it changes between operations only), so that no wait
// or loop pays a dependent load for it.
__device__ __forceinline__ uint64_t activeMask(const LlParams& p) { return p.el->active; }

// Threads 0..R-1 each wait for one active peer's flag to reach `want` (masked peers, not in `act`, are not waited
// for); false in every thread if one failed. The flag is loaded before the mask is looked at (one latency, not
// two, when the flag is already there).
__device__ bool waitPeers(const LlParams& p, uint64_t act, uint64_t* (*flag)(const LlParams&, int, int), int arg,
                          uint64_t want, uint64_t e) {
  bool ok = true;
  if (threadIdx.x < p.nranks) {
    const uint64_t* f = flag(p, threadIdx.x, arg);
    ok = ldAcquire(f, p.gpu_scope) >= want || !((act >> threadIdx.x) & 1) ||
         waitAtLeast(p, f, want, threadIdx.x, epPhaseData, e);
  }
  return __syncthreads_and(ok) != 0;  // no shared flag: a kernel may call this twice in a row
}
__device__ uint64_t* ackFlag(const LlParams& p, int peer, int fam) { return ackPtr(p, p.rank, fam, peer); }
// Zero-copy combines: the expert outputs of the next combine are written after a dispatch's receive half, into a
// region peers may still be reading from; every combine this rank sent must have been read by every active peer
// (waited for only with zc_guard). False in every thread if the wait failed.
__device__ bool combinesRead(const LlParams& p, const LlCtrl* ctrl, uint64_t act, uint64_t e) {
  if (!p.zc_guard) return true;
  const uint64_t sent = *reinterpret_cast<const volatile uint64_t*>(&ctrl->send_epoch[kLlCombine]);
  return waitPeers(p, act, ackFlag, kLlCombine, sent, e);
}
__device__ uint64_t* tagFlag(const LlParams& p, int peer, int fam_par) {
  return tagPtr(p, p.rank, fam_par >> 1, fam_par & 1, peer);
}
__device__ uint64_t* zdEntryFlag(const LlParams& p, int peer, int slot) {
  return &zdEntry(p, p.rank, slot, peer)->epoch;
}
__device__ uint64_t* zdStartedFlag(const LlParams& p, int peer, int slot) {
  return &zdEntry(p, p.rank, slot, peer)->started;
}
__device__ uint64_t* zdRoutedFlag(const LlParams& p, int peer, int slot) {
  return &zdEntry(p, p.rank, slot, peer)->routed;
}

// Rows are split into parts only when there are fewer rows than warps: part p of P covers units
// [n*p/P, n*(p+1)/P) of a row of n units (16-byte chunks, or 128-column blocks with fp8). P = warps / rows
// (1 to cap), so no warp copies two parts of a phase one after the other: each copy is a chain of memory latencies
// (metadata, then the row), and those chains, not bandwidth, are what an LL phase takes. The cap is 8, or for the
// zero-copy dispatch's rows LlParams::zd_parts: there more parts (every warp of the row blocks busy) pay once the
// receive side has blocks of its own (LlParams::zd_rside; bench/results/h200-s24.log), not before (s17's log).
__device__ __forceinline__ int partsOf(int rows, int warps, int cap = 8) {
  const int p = rows > 0 ? warps / rows : cap;
  return p < 1 ? 1 : p > cap ? cap : p;
}
__device__ __forceinline__ int partBegin(int n, int P, int p) { return static_cast<int>(static_cast<int64_t>(n) * p / P); }

// The destinations of a warp's row part, each a row and (fp8) its scales: an array the warp shares, or one per lane
// of `lanes`, held in that lane's registers and handed round by shuffles. `each` calls f(row, scales) for every one,
// in every lane of the warp (LaneDsts shuffles: every lane must call it). Arrays of up to 32 pointers sat in local
// memory (the fused dispatch kernel's 832-byte stack frame), one load per destination a round: the zero-copy
// dispatch's moved to LaneDsts in s24 (17.2 -> 14.7 us on an H100 with its parts change), the plain dispatch's
// (send: a lane per destination rank; receive: a lane per expert row) in s25.
struct ArrayDsts {
  uint8_t* const* dst;
  float* const* sc;  // nullptr: rows only (a plain copy)
  int nd;
  template <class F>
  __device__ __forceinline__ void each(F&& f) const {
    for (int d = 0; d < nd; ++d) f(dst[d], sc != nullptr ? sc[d] : nullptr);
  }
};
struct LaneDsts {
  unsigned lanes;
  uint8_t* row;
  float* sc;
  template <class F>
  __device__ __forceinline__ void each(F&& f) const {
    for (unsigned m = lanes; m; m &= m - 1) {
      const int from = __ffs(m) - 1;
      f(reinterpret_cast<uint8_t*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(row), from)),
        reinterpret_cast<float*>(__shfl_sync(kFull, reinterpret_cast<unsigned long long>(sc), from)));
    }
  }
};
// A warp copies 16-byte chunks [b, e) of `src` to every destination of `ds`, eight loads in flight per lane
// (sixteen measured no faster on an H200), its rounds the same in every lane (the shuffles of LaneDsts need the
// whole warp).
template <class D>
__device__ __forceinline__ void warpCopyTo(const D& ds, const uint8_t* src, int b, int e, int lane) {
  constexpr int kU = 8;
  const int4* s = reinterpret_cast<const int4*>(src);
  for (int base = b; base < e; base += 32 * kU) {
    const int i = base + lane;
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (i + u * 32 < e) v[u] = s[i + u * 32];
    ds.each([&](uint8_t* row, float*) {
      int4* o = reinterpret_cast<int4*>(row);
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i + u * 32 < e) o[i + u * 32] = v[u];
    });
  }
}
// One destination.
__device__ __forceinline__ void warpCopyChunks(uint8_t* dst, const uint8_t* src, int b, int e, int lane) {
  warpCopyTo(ArrayDsts{&dst, nullptr, 1}, src, b, e, lane);
}

// fp8 quantization of 128-column blocks [b, e) of one row, written to every destination with its scale: a lane
// takes 32 bytes of a block (two 16-byte loads: 16 bf16/fp16 values or 8 fp32), so a block is 8 or 16 lanes and
// its fp8 values go out as one 16- or 8-byte store per lane (8 values per lane measured about 0.5 us slower per
// row part at R = 2: twice the rounds, each a load's latency, and half-width stores to every destination). amax
// over the block, scale = fp8BlockScale(amax), values multiplied by fp8BlockScaleInv(amax), as the host engine does.
template <int kDtype, class D>
__device__ void quantizeBlocks(const D& ds, const uint8_t* xr, int b, int e, int lane) {
  constexpr int kEl = kDtype == epFloat32 ? 4 : 2, kV = 2, kPer = kV * 16 / kEl;  // bytes in, loads, values
  constexpr int kG = 128 / kPer, kNb = 32 / kG;  // lanes per block, blocks per round
  const int4* x4 = reinterpret_cast<const int4*>(xr);
  for (int b0 = b; b0 < e; b0 += kNb) {
    const int blk = b0 + lane / kG, g = lane % kG;
    const bool live = blk < e;
    int4 v[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u)
      v[u] = live ? x4[static_cast<size_t>(blk) * (8 * kEl) + g * kV + u] : make_int4(0, 0, 0, 0);
    float f[kPer], amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int4& w = v[j / (16 / kEl)];
      const int k = j % (16 / kEl);
      f[j] = kDtype == epFloat32 ? reinterpret_cast<const float*>(&w)[k]
                                 : (kDtype == epBfloat16 ? bf16ToFloat(reinterpret_cast<const uint16_t*>(&w)[k])
                                                         : fp16ToFloat(reinterpret_cast<const uint16_t*>(&w)[k]));
      amax = fmaxf(amax, fabsf(f[j]));
    }
#pragma unroll
    for (int o = kG / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const float inv = fp8BlockScaleInv(amax), scale = fp8BlockScale(amax);
    uint32_t q[kPer / 4] = {};
#pragma unroll
    for (int j = 0; j < kPer; j += 2)
      q[j / 4] |= fp8x2(__fmul_rn(f[j], inv), __fmul_rn(f[j + 1], inv)) << (8 * (j % 4));
    const size_t off = static_cast<size_t>(blk) * EP_FP8_BLOCK + g * kPer;
    ds.each([&](uint8_t* row, float* sc) {
      if (!live) return;
      if constexpr (kPer == 16) *reinterpret_cast<uint4*>(row + off) = make_uint4(q[0], q[1], q[2], q[3]);
      else *reinterpret_cast<uint2*>(row + off) = make_uint2(q[0], q[1]);
      if (g == 0) sc[blk] = scale;
    });
  }
}

// 128-column blocks [ub, ue) of row xr (of type p.dtype) quantized to fp8 into nd destinations, each block's scale
// into sc[d].
template <class D>
__device__ __forceinline__ void quantizeRowPartTo(const LlParams& p, const D& ds, const uint8_t* xr, int ub, int ue,
                                                  int lane) {
  if (p.dtype == epFloat32) quantizeBlocks<epFloat32>(ds, xr, ub, ue, lane);
  else if (p.dtype == epFloat16) quantizeBlocks<epFloat16>(ds, xr, ub, ue, lane);
  else quantizeBlocks<epBfloat16>(ds, xr, ub, ue, lane);
}
__device__ __forceinline__ void quantizeRowPart(const LlParams& p, uint8_t* const* dst, float* const* sc, int nd,
                                                const uint8_t* xr, int ub, int ue, int lane) {
  quantizeRowPartTo(p, ArrayDsts{dst, sc, nd}, xr, ub, ue, lane);
}
// Units [ub, ue) of row xr to the destinations of the live lanes (LaneDsts): 16-byte chunks copied, or with fp8
// 128-column blocks quantized.
__device__ __forceinline__ void writeRowPartToLanes(const LlParams& p, const LaneDsts& ds, const uint8_t* xr, int ub,
                                                    int ue, int lane) {
  if (!p.use_fp8) warpCopyTo(ds, xr, ub, ue, lane);
  else quantizeRowPartTo(p, ds, xr, ub, ue, lane);
}

// Token pairs whose rank is masked (bits of `dropped`) are counted per rank, once per token.
__device__ __forceinline__ void countMaskedDrops(const LlParams& p, unsigned dropped) {
  for (unsigned mm = dropped; mm; mm &= mm - 1) atomicAdd(&p.el->drops[kDropTokenRows][__ffs(mm) - 1], 1ull);
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch, send half. Every block first stages this rank's routing in shared memory (repeats of an expert
// within a token removed) and counts the pairs per expert; the counts go to the experts' ranks. Then per (token,
// part of its row) a warp writes the part once to every rank that hosts one of the token's experts, into slot
// [this rank][t] there; the warp of part 0 adds the token's local expert ids and, per expert, the index of t
// among this rank's tokens of that expert (tokenPositions), which fixes the token's row on the receiver.
// The combine's receive half (expert-major) needs those indices for every token: it stages them in one pass
// (stageRouting with positions: per chunk of 32 pairs, lanes by __match_any_sync, chunks by a table of counts).
// fp8: each 128-column block is quantized once, in registers, and written to every destination.
// ---------------------------------------------------------------------------------------------------------
struct SendSmem {
  int32_t* idx;  // [T, K] expert ids, -1 for none, out of range, or a repeat within the token
  int32_t* raw;  // [T, K] expert ids as given (-1 for out of range): what the receiver's rank-major rows show
  int32_t* pos;  // [T, K] index of t among this rank's tokens of idx[t, k] (staged only with positions)
  int32_t* cnt;  // [E] pairs per expert
};

// stageRouting's table for positions, when it takes at most 32 KiB (else positions are counted without it).
__host__ __device__ __forceinline__ size_t positionTableBytes(int T, int K, int E) {
  const size_t bytes = (static_cast<size_t>(T) * K + 31) / 32 * E;
  return bytes <= 32 * 1024 ? (bytes + 15) / 16 * 16 : 0;
}
// SendSmem's arrays (3 T K + E ints), rounded up to 16 bytes: what follows them (a table, addresses) is aligned.
__host__ __device__ __forceinline__ size_t sendSmemArrayBytes(int T, int K, int E) {
  return (sizeof(int32_t) * (3 * static_cast<size_t>(T) * K + E) + 15) / 16 * 16;
}
// A zero-copy dispatch's send half adds, per expert, where this rank's rows start among the expert's rows.
__host__ __device__ __forceinline__ size_t zdBeginBytes(int E) {
  return (sizeof(int32_t) * static_cast<size_t>(E) + 15) / 16 * 16;
}
// A fused kernel's receive layout (dispatchSendZeroCopy's pre): L (R + 1) + R ints, at most 2 E + kGpuMaxRanks.
__host__ __device__ __forceinline__ size_t zdLayoutBytes(int E) {
  return (sizeof(int32_t) * (2 * static_cast<size_t>(E) + kGpuMaxRanks) + 15) / 16 * 16;
}
// Token masks: per expert, bit t of word t / 32 says that token t names it (stageRouting), so a token's index among
// the tokens of an expert is a few popcounts (maskPosition).
__host__ __device__ __forceinline__ size_t tokenMaskBytes(int T, int E) {
  return (sizeof(uint32_t) * static_cast<size_t>((T + 31) / 32) * E + 15) / 16 * 16;
}
__device__ __forceinline__ int32_t maskPosition(const uint32_t* masks, int W, int x, int t) {
  const uint32_t* w = masks + static_cast<size_t>(x) * W;
  int n = __popc(w[t >> 5] & ((1u << (t & 31)) - 1));
  for (int i = 0; i < (t >> 5); ++i) n += __popc(w[i]);
  return n;
}

// A zero-copy send half's shared memory: its arrays and per-expert starts, then optional parts, each taken only
// while the total stays within kLlMaxSmem (a call whose arrays fit is never refused for them): token masks, else
// stageRouting's position table, else positions per warp (tokenPositions); and in a fused kernel the receive
// layout (else the receive half derives it). Offsets are 0 for a part left out; host and device compute the same.
struct ZdSmem {
  size_t mask_off, table_off, pre_off, bytes;
};
__host__ __device__ __forceinline__ ZdSmem zdSmem(int T, int K, int E, bool fused) {
  ZdSmem z{0, 0, 0, sendSmemArrayBytes(T, K, E) + zdBeginBytes(E)};
  const size_t masks = tokenMaskBytes(T, E), table = positionTableBytes(T, K, E);
  if (masks <= 32 * 1024 && z.bytes + masks <= kLlMaxSmem) {
    z.mask_off = z.bytes;
    z.bytes += masks;
  } else if (table > 0 && z.bytes + table <= kLlMaxSmem) {
    z.table_off = z.bytes;
    z.bytes += table;
  }
  if (fused && z.bytes + zdLayoutBytes(E) <= kLlMaxSmem) {
    z.pre_off = z.bytes;
    z.bytes += zdLayoutBytes(E);
  }
  return z;
}

// Positions by stageRouting's table, for routing already staged in `m` (idx): each chunk of 32 pairs counts its
// experts into its row of the table (one __match_any_sync per chunk, all chunks at once); a pair's position is the
// lanes before it in its chunk plus its expert's counts in the earlier chunks, and an expert's total (into m.cnt
// when `counts`) the sum of its column. `table`: positionTableBytes(T, K, E) bytes.
__device__ void stageTablePositions(const LlParams& p, const SendSmem& m, uint8_t* table, bool counts) {
  const int TK = p.T * p.K, C = (TK + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (size_t i = threadIdx.x; i < (static_cast<size_t>(C) * p.E + 3) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(table)[i] = 0;  // whole words: the table's size is a multiple of 16 bytes
  __syncthreads();
  for (int c = warp; c < C; c += nwarps) {
    const int i = c * 32 + lane;
    const int32_t x = i < TK ? m.idx[i] : -1;
    const unsigned same = __match_any_sync(kFull, x);
    const int before = __popc(same & ((1u << lane) - 1));
    if (x >= 0) m.pos[i] = before;
    if (x >= 0 && before == 0) table[static_cast<size_t>(c) * p.E + x] = static_cast<uint8_t>(__popc(same));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < TK; i += blockDim.x) {
    const int32_t x = m.idx[i];
    int n = 0;
    for (int c = 0; x >= 0 && c < i / 32; ++c) n += table[static_cast<size_t>(c) * p.E + x];
    if (x >= 0) m.pos[i] += n;
  }
  for (int x = threadIdx.x; counts && x < p.E; x += blockDim.x) {
    int n = 0;
    for (int c = 0; c < C; ++c) n += table[static_cast<size_t>(c) * p.E + x];
    m.cnt[x] = n;
  }
  __syncthreads();
}

// With `positions` false only idx, raw and cnt are staged (cnt by shared atomics, in any order); pos is then left
// to tokenPositions, per token, by the warps that need it. An expert id outside [-1, E) is taken as -1; the
// dispatch counts it as a violation, the combine (same routing) does not count it again. `table`: scratch for
// positions, one byte per (chunk of 32 pairs, expert), or nullptr (a slower count without it).
// masks (positions false only): also the token masks (tokenMaskBytes), for maskPosition.
__device__ SendSmem stageRouting(const LlParams& p, int32_t* smem, bool positions, uint8_t* table = nullptr,
                                 uint32_t* masks = nullptr) {
  SendSmem m{smem, smem + p.T * p.K, smem + 2 * p.T * p.K, smem + 3 * p.T * p.K};
  const int TK = p.T * p.K;
  for (int i = threadIdx.x; i < TK; i += blockDim.x) {
    int64_t x = p.topk_idx[i];
    if (x < -1 || x >= p.E) {
      if (blockIdx.x == 0 && p.op == epOpLlDispatch) recordViolation(p, epExpertOutOfRange);
      x = -1;
    }
    m.raw[i] = static_cast<int32_t>(x);
  }
  for (int i = threadIdx.x; i < p.E; i += blockDim.x) m.cnt[i] = 0;
  const int W = (p.T + 31) / 32;
  for (int i = threadIdx.x; masks != nullptr && i < W * p.E; i += blockDim.x) masks[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < TK; i += blockDim.x) {
    const int t = i / p.K, k = i % p.K;
    int32_t x = m.raw[i];
    for (int j = 0; j < k && x >= 0; ++j)
      if (m.raw[t * p.K + j] == x) x = -1;
    m.idx[i] = x;
    if (!positions && x >= 0) atomicAdd(&m.cnt[x], 1);
    if (masks != nullptr && x >= 0) atomicOr(&masks[x * W + (t >> 5)], 1u << (t & 31));
  }
  __syncthreads();
  if (!positions) return m;
  if (table != nullptr) {
    stageTablePositions(p, m, table, true);
    return m;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // Without room for the table: rounds of one pair per thread; within a round the warps add to the per-expert
  // counters in warp order.
  for (int base = 0; base < TK; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int32_t x = i < TK ? m.idx[i] : -1;
    const unsigned same = __match_any_sync(kFull, x);
    const int before = __popc(same & ((1u << lane) - 1));
    for (int w = 0; w < nwarps; ++w) {
      if (warp == w && x >= 0) {
        m.pos[i] = m.cnt[x] + before;
        __syncwarp(same);
        if (before == 0) m.cnt[x] += __popc(same);
      }
      __syncthreads();
    }
  }
  return m;
}

// Lane k < K of the calling warp gets the index of token t among this rank's tokens of expert x = idx[t, k] (the
// entries of earlier tokens that name x): the same numbers as stageRouting's count, found by one warp without
// waiting for the others. Eight experts at a time, each held by every lane in registers; the warp reads 32
// earlier entries at a time and counts each expert's matches with one ballot. The combine's receive half stages
// every token's indices instead (stageRouting): per token (per item, or a warp per token before the wait) this
// measured slower there at 128 tokens (R = 2 zero-copy: 55 us staged, 57-64 us per token).
__device__ __forceinline__ int32_t tokenPositions(const int32_t* idx, int t, int K, int32_t x, int lane) {
  int32_t r = -1;
  for (int k0 = 0; k0 < K; k0 += 8) {
    int32_t xs[8], n[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      xs[u] = __shfl_sync(kFull, x, (k0 + u) & 31);
      if (k0 + u >= K) xs[u] = -1;
      n[u] = 0;
    }
    for (int c = 0; c < t * K; c += 32) {
      const int32_t y = c + lane < t * K ? idx[c + lane] : -1;
#pragma unroll
      for (int u = 0; u < 8; ++u) n[u] += __popc(__ballot_sync(kFull, y >= 0 && y == xs[u]));
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (lane == k0 + u) r = n[u];
  }
  return r;
}

// The dispatch send halves' start: the launch's operation number e, the active mask, the acknowledgements of
// operation e - 2 (every receiver read that parity's slots and entries) and the routing are loaded together, one
// memory latency instead of three in a row; the acknowledgements are checked once the routing is staged (waited
// for only when one is not in yet). Only this rank's earlier dispatch send halves wrote the epoch, and they are
// complete (stream order).
struct SendStart {
  uint64_t e, act;
  bool ok;  // every active receiver acknowledged e - 2 (false: a wait failed; the error is recorded)
  SendSmem m;
};
// acks false: the block writes nothing the e - 2 acknowledgements guard (a zero-copy dispatch's row writers: the
// receivers' started words guard their regions), so it skips the check and its fence (ok stays true).
__device__ __forceinline__ SendStart sendStart(const LlParams& p, LlCtrl* ctrl, int32_t* smem, bool acks = true,
                                               uint32_t* masks = nullptr) {
  __shared__ uint64_t s_e;
  const uint64_t t_entry = LL_PROBE_CLOCK();
  const int peer = threadIdx.x;
  const uint64_t* ack = acks && peer < p.nranks ? ackPtr(p, p.rank, kLlDispatch, peer) : nullptr;
  const uint64_t seen = ack != nullptr ? ldRelaxed(ack, p.gpu_scope) : 0;
  if (threadIdx.x == 0) s_e = *reinterpret_cast<const volatile uint64_t*>(&ctrl->send_epoch[kLlDispatch]) + 1;
  SendStart st;
  st.act = activeMask(p);
  st.m = stageRouting(p, smem, false, nullptr, masks);  // its barriers also publish s_e
  st.e = s_e;
  LL_PROBE_AT(st.e, kPrSendStart, t_entry);
  bool ok = true;
  if (st.e > 2 && ack != nullptr && ((st.act >> peer) & 1)) {
    if (seen >= st.e - 2) fenceAcqRel(p.gpu_scope);  // with the relaxed load: an acquire
    else ok = waitAtLeast(p, ack, st.e - 2, peer, epPhaseData, st.e);
  }
  st.ok = __syncthreads_and(ok) != 0;
  LL_PROBE(st.e, kPrAck);
  return st;
}

// Lets the receive half launched after this kernel start now (programmatic dependent launch): it waits on device
// flags, not on this kernel's completion, and every block of this kernel is already resident.
__device__ __forceinline__ void launchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// A fused kernel launched as a programmatic dependent (LlParams::pdl_chain) waits here, before its first load, for
// the kernel before it to complete and its writes to be visible (a no-op in a kernel launched plainly).
__device__ __forceinline__ void gridDependencyWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Token t's part `part` (units [ub, ue) of its row) for remote rank r, slot [this rank][t] there, as records (the
// slot's metadata with part 0, the row piece, and with fp8 the scales): what the mapped path writes in place.
// rk: the rank of this lane's expert; pos: this lane's index from tokenPositions (expert-major part 0, else -1).
__device__ __forceinline__ void sendSlotPartRemote(const LlParams& p, int r, int par, int t, int part, int ub, int ue,
                                                int rk, int32_t pos, const int32_t* raw, const uint8_t* xr,
                                                uint64_t e) {
  const int lane = threadIdx.x & 31, K = p.K, L = p.L;
  const uint64_t so = remoteOff(slotPtr(p, r, par, p.rank, t));
  if (part == 0) {
    const RemoteSlot rs = remoteDataWarp(p, r, kRemoteLlBuffer, so, (16 + 8 * K + 15) & ~15, e);
    if (rs.hdr != nullptr) {
      LlSlotMeta* meta = reinterpret_cast<LlSlotMeta*>(rs.payload());
      if (lane < K) {
        const int32_t x = raw[t * K + lane];
        meta->expert[2 * lane] = x >= 0 && x / L == r ? x % L : -1;
        meta->expert[2 * lane + 1] = rk == r ? pos : -1;
      }
      if (lane == 0) {
        meta->epoch = e;
        meta->token = t;
        meta->pad = 0;
      }
      remoteCommitWarp(rs);
    }
  }
  if (ue <= ub) return;
  if (!p.use_fp8) {
    const RemoteSlot rs = remoteDataWarp(p, r, kRemoteLlBuffer, so + p.lay.slot_row + static_cast<uint64_t>(ub) * 16,
                                         static_cast<uint32_t>(ue - ub) * 16, e);
    if (rs.hdr == nullptr) return;
    uint8_t* d = rs.payload() - static_cast<size_t>(ub) * 16;  // the copy writes chunks [ub, ue) of the row
    warpCopyChunks(d, xr, ub, ue, lane);
    remoteCommitWarp(rs);
    return;
  }
  const RemoteSlot rv = remoteDataWarp(p, r, kRemoteLlBuffer,
                                       so + p.lay.slot_row + static_cast<uint64_t>(ub) * EP_FP8_BLOCK,
                                       static_cast<uint32_t>(ue - ub) * EP_FP8_BLOCK, e);
  const RemoteSlot rc = remoteDataWarp(p, r, kRemoteLlBuffer, so + p.lay.slot_scales + static_cast<uint64_t>(ub) * 4,
                                       static_cast<uint32_t>(ue - ub) * 4, e);
  if (rv.hdr == nullptr || rc.hdr == nullptr) return;  // a failed wait: the communicator is broken
  uint8_t* d = rv.payload() - static_cast<size_t>(ub) * EP_FP8_BLOCK;
  float* sc = reinterpret_cast<float*>(rc.payload()) - ub;
  quantizeRowPart(p, &d, &sc, 1, xr, ub, ue, lane);
  remoteCommitWarp(rv);
  remoteCommitWarp(rc);
}

// The count entry of this rank for every rank in `far` (active, of other hosts), as one record each, a warp per rank
// (kept out of line, like sendSlotPartRemote, so that the mapped path's registers stay as they were).
__device__ __forceinline__ void sendCountsRemote(const LlParams& p, uint64_t far, int par, const int32_t* cnt, int gw,
                                              int NW, uint64_t e) {
  const int lane = threadIdx.x & 31, L = p.L;
  for (int r = gw; r < p.nranks; r += NW) {
    if (!((far >> r) & 1)) continue;
    const RemoteSlot rs = remoteDataWarp(p, r, kRemoteLlBuffer, remoteOff(countEntry(p, r, par, p.rank)),
                                         static_cast<uint32_t>(16 + 4 * L), e);
    if (rs.hdr == nullptr) continue;
    int32_t* ent = reinterpret_cast<int32_t*>(rs.payload());
    if (lane == 0) ent[0] = p.T;
    for (int l = lane; l < L; l += 32) ent[4 + l] = cnt[r * L + l];
    remoteCommitWarp(rs);
  }
}

// Chunks [ub, ue) of one expert-output row to `d` in token owner s's combine slots: in place, or as a record
// when s is on another host.
template <bool kX>
__device__ __forceinline__ void sendCombineRowPart(const LlParams& p, int s, uint8_t* d, const uint8_t* src, int ub,
                                                   int ue, uint64_t e) {
  const int lane = threadIdx.x & 31;
  if (!isRemote(farMask<kX>(p), s)) {
    warpCopyChunks(d, src, ub, ue, lane);
    return;
  }
  if (ue <= ub) return;
  const RemoteSlot rs = remoteDataWarp(p, s, kRemoteLlBuffer, remoteOff(d) + static_cast<uint64_t>(ub) * 16,
                                       static_cast<uint32_t>(ue - ub) * 16, e);
  if (rs.hdr == nullptr) return;
  uint8_t* o = rs.payload() - static_cast<size_t>(ub) * 16;
  warpCopyChunks(o, src, ub, ue, lane);
  remoteCommitWarp(rs);
}

// The flags the last block of a launch raises toward the peers in `mask` (tags, acknowledgements), each the
// address flagOf(rank), value e. Thread 0 stores those of this host's ranks relaxed, behind the fence lastBlockDone
// ended with in that thread, which is their release. Release stores by threads 0..R-1 compiled to a second
// warp-wide fence right after that one (and the fused zero-copy dispatch's acknowledgements to a third), on the
// critical path of every LL phase: the s26 probe lines had 3 us from the last block's fence to its tags
// (bench/results/h100-s26.log). Ranks of other hosts get FLAG records (publish). Call it only from the block for
// which lastBlockDone returned true, with every thread.
template <bool kX, class FlagOf>
__device__ __forceinline__ void lastFlags(const LlParams& p, uint64_t mask, FlagOf flagOf, uint64_t e) {
  if (threadIdx.x == 0)
    for (int r = 0; r < p.nranks; ++r)
      if (((mask >> r) & 1) && !isRemote(farMask<kX>(p), r)) stRelaxed(flagOf(r), e, p.gpu_scope);
  if constexpr (kX)
    for (int r = threadIdx.x; r < p.nranks; r += blockDim.x)
      if (((mask >> r) & 1) && isRemote(farMask<kX>(p), r))
        publish<kX>(p, r, kRemoteLlBuffer, flagOf(r), e, e, p.gpu_scope);
}
// The tags, to every rank of `act` or (after a failure on this rank) to none: rows it did not write must not look
// written (noFailure).
template <bool kX, class FlagOf>
__device__ __forceinline__ void lastTags(const LlParams& p, uint64_t act, FlagOf flagOf, uint64_t e) {
  lastFlags<kX>(p, noFailure(p) ? act : 0, flagOf, e);
}

// The receive half's row layout, from every source's T and per-expert pair counts (count entries, or a zero-copy
// dispatch's entries) into s_begin ([L][R + 1]: the first row of each source, then the total; expert-major) and s_T
// ([R]); the block with `out` writes recv_count and recv_layout_range. own_cnt: this rank's own counts, staged by the caller
// (its T is p.T), instead of its entry.
// In two parts, so that a caller can load other things beside the counts before the barrier between them.
// par: the operation's parity (count entries), or a zero-copy dispatch's entry slot (zdSlot).
__device__ __forceinline__ void dispatchLayoutLoad(const LlParams& p, int par, uint64_t act, int* s_begin, int* s_T,
                                                   const int32_t* own_cnt, bool out) {
  const int R = p.nranks, L = p.L, M = p.M;
  const bool em = p.layout == EP_LL_EXPERT_MAJOR;
  // Every source's T and per-expert counts are loaded at once (one memory latency), then checked.
  if (em)
    for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
      const int l = i / R, s = i % R;
      s_begin[l * (R + 1) + s] = own_cnt != nullptr && s == p.rank ? own_cnt[p.rank * L + l]
                                 : p.zd ? zdCounts(zdEntry(p, p.rank, par, s))[p.rank * L + l]
                                        : countEntry(p, p.rank, par, s)[4 + l];
    }
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    int T = 0;  // a masked source sends nothing
    if ((act >> s) & 1) {
      if (own_cnt != nullptr && s == p.rank) T = p.T;
      else if (!p.zd) T = countEntry(p, p.rank, par, s)[0];
      else T = zdEntry(p, p.rank, par, s)->T;  // the entry is of this operation (waited for by the caller)
    }
    if (T < 0 || T > M) {  // bounds-check what a peer wrote before using it as an index
      recordViolation(p, epInternalError);
      T = 0;
    }
    s_T[s] = T;
    if (!em && out) p.recv_count[s] = T;
  }
}
// After a barrier that follows dispatchLayoutLoad.
__device__ __forceinline__ void dispatchLayoutScan(const LlParams& p, int* s_begin, const int* s_T, bool out) {
  const int R = p.nranks, L = p.L;
  if (p.layout == EP_LL_EXPERT_MAJOR)
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        // An entry of a source that sent no token is stale (a count of an earlier operation): ignored.
        int c = s_T[s] > 0 ? s_begin[l * (R + 1) + s] : 0;
        if (c < 0 || c > s_T[s]) {
          recordViolation(p, epInternalError);
          c = 0;
        }
        s_begin[l * (R + 1) + s] = acc;
        if (out) p.recv_layout_range[static_cast<size_t>(l) * R + s] = packLayoutRange(c, acc);
        acc += c;
      }
      s_begin[l * (R + 1) + R] = acc;
      if (out) p.recv_count[l] = acc;
    }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------------
// Zero-copy dispatch (ranks of one host, expert-major; config.ll_zero_copy_dispatch). The receivers' outputs are
// regions of their LL buffers, so each (token, expert) row is written once, straight to its final row:
// block 0 first publishes to every active rank a started word (this rank issued send half n, so its region's
// earlier contents are no longer read, the lifetime epLlDispatchBuffer states, and which region n uses), then
// writes this rank's entry (T, every expert's pair count) to every active rank, in slot n % 4; every block stages
// its routing with per-expert token masks (a pair's position is a few popcounts), waits for the receivers' started
// words and the lower sources' counts, derives where this rank's rows start among each expert's rows (after those
// of lower sources), and a warp per (token, part of its row) writes the part to every expert's row (fp8:
// quantized once, in registers). Positions per warp instead (tokenPositions, in every warp of a block at once)
// kept the goal shape (R = 2, 64 tokens, one H200) about a microsecond slower (bench/results/h200-s15.log, calls
// 2-3); the position table, about 1.4 us per block, gave way to the masks (bench/results/h200-s19.log).
// The last block also publishes this rank's routing words (expert and index of each pair) in the same entries;
// from them each receiver derives recv_src_info itself, while the rows are still landing, so nothing is left to
// read once the tags are in. In a fused kernel the blocks that have no rows to write do that (with the layout,
// from every source's entry; the first of them writes recv_count and recv_layout_range), and the last block
// to finish acknowledges the peers' entries beside publishing the tags: one block then waits for the peers' tags
// and the launch ends (the receive half's copy of the source tokens after the tags and its own last-block
// acknowledgement were 3 us of the goal shape's 17: bench/results/h200-s17.log probe lines).
// ---------------------------------------------------------------------------------------------------------

// This rank's routing words (llZdRoutingWord: expert and index among this rank's pairs of that expert, the
// positions the rows are written at) into the entry of every active rank, then `routed` = e. One block; positions
// from the token masks, or the block's table when staged, else a warp per token.
__device__ void publishRoutingWords(const LlParams& p, const SendSmem& m, bool staged, const uint32_t* masks, int W,
                                    uint64_t act, int zs, uint64_t e) {
  const int K = p.K, TK = p.T * K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (masks != nullptr) {
    for (int i = threadIdx.x; i < TK; i += blockDim.x)
      m.pos[i] = m.idx[i] >= 0 ? maskPosition(masks, W, m.idx[i], i / K) : 0;
    __syncthreads();
  } else if (!staged) {
    for (int t = warp; t < p.T; t += nwarps) {
      const int32_t xk = lane < K ? m.idx[t * K + lane] : -1;
      const int32_t pos = tokenPositions(m.idx, t, K, xk, lane);
      if (lane < K) m.pos[t * K + lane] = pos;
    }
    __syncthreads();
  }
  for (int r = 0; r < p.nranks; ++r) {
    if (!((act >> r) & 1)) continue;
    uint32_t* w = zdRouting(p, r, zs, p.rank);
    for (int i = threadIdx.x; i < TK; i += blockDim.x) w[i] = llZdRoutingWord(m.idx[i], m.pos[i]);
  }
  __syncthreads();
  if (threadIdx.x < p.nranks && ((act >> threadIdx.x) & 1)) {
    // The block's words (ordered before this thread by the barrier), then `routed`: a fence and a strong store are a
    // release (device_common.cuh), one barrier instruction where a release store after the fence made two.
    fenceAcqRel(p.gpu_scope);
    stRelaxed(&zdEntry(p, threadIdx.x, zs, p.rank)->routed, e, p.gpu_scope);
  }
}

// recv_src_info of zero-copy dispatch e from every active source's routing words (in its entry here): source s's
// pair (t, k) naming local expert l sits at row begin(l, s) + its index, and that row's source token is t. Blocks
// [b0, b1) share the pairs; s_begin / s_T: the layout (dispatchLayoutScan). Waits for the words first;
// false if that failed. What a peer wrote is bounds-checked before it indexes anything.
__device__ bool zdSourceInfo(const LlParams& p, int zs, uint64_t act, const int* s_begin, const int* s_T, uint64_t e,
                             int b0, int b1) {
  if (!waitPeers(p, act, zdRoutedFlag, zs, e, e)) return false;
  const int R = p.nranks, L = p.L, K = p.K;
  const size_t RM = static_cast<size_t>(R) * p.M;
  int total = 0;
  for (int s = 0; s < R; ++s) total += s_T[s] * K;  // 0 for masked sources
  const int stride = (b1 - b0) * blockDim.x;
  for (int j = (blockIdx.x - b0) * blockDim.x + threadIdx.x; j < total; j += stride) {
    int s = 0, i = j;
    while (i >= s_T[s] * K) i -= s_T[s++] * K;
    const uint32_t w = zdRouting(p, p.rank, zs, s)[i];
    const int x = llZdRoutingExpert(w), pos = llZdRoutingPos(w);
    if (x < 0 || x / L != p.rank) continue;  // an id past E names no rank here (x / L >= R)
    const int l = x - p.rank * L, b = s_begin[l * (R + 1) + s], c = s_begin[l * (R + 1) + s + 1] - b;
    if (pos >= c) {
      recordViolation(p, epInternalError);
      continue;
    }
    p.recv_src_info[static_cast<size_t>(l) * RM + b + pos] = i / K;
  }
  return true;
}

// pre: where a fused kernel wants the receive half's layout, or nullptr (a send half launched alone, or a fused
// kernel without room for it, whose receive half then derives it: dispatchRecvBody). With pre the whole operation
// ends here (the fused path above); a block writes pre only where its waits succeeded.
__device__ __forceinline__ void dispatchSendZeroCopy(const LlParams& p, int* pre) {
  extern __shared__ __align__(16) int32_t s_dyn[];
  __shared__ uint64_t s_xoff[kGpuMaxRanks];  // each rank's region (its scales zd_x_bytes further)
  launchDependents();
  LlCtrl* ctrl = ctrlOf(p);
  const int R = p.nranks, L = p.L, K = p.K, M = p.M;
  // First of all, block 0 tells every active peer that this rank's output region is free for operation e, and
  // which of the two it is: the peers' rows may come in from then on (no count is needed for that). The same
  // threads load the acknowledgements of e - 2, checked before this block completes (the entries of e go to slot
  // e % 4, last read in e - 4, whose acknowledgements were checked in e - 2).
  uint64_t seen = ~0ull;
  if (blockIdx.x == 0 && threadIdx.x < R) {
    seen = ldRelaxed(ackPtr(p, p.rank, kLlDispatch, threadIdx.x), p.gpu_scope);
    const uint64_t e0 = *reinterpret_cast<const volatile uint64_t*>(&ctrl->send_epoch[kLlDispatch]) + 1;
    if (threadIdx.x != p.rank && ((activeMask(p) >> threadIdx.x) & 1)) {
      const int region = p.zd_x_off >= p.lay.zd + p.lay.zd_region ? 1 : 0;
      stRelease(&zdEntry(p, threadIdx.x, zdSlot(e0), p.rank)->started, llZdStartedWord(e0, region), p.gpu_scope);
    }
  }
  const ZdSmem zsm = zdSmem(p.T, p.K, p.E, false);
  int32_t* s_beg = s_dyn + sendSmemArrayBytes(p.T, p.K, p.E) / sizeof(int32_t);
  uint8_t* table = zsm.table_off > 0 ? reinterpret_cast<uint8_t*>(s_dyn) + zsm.table_off : nullptr;
  static_assert(kLlMaxRanks <= 32, "threads 0..R-1 and 32..32+R-1 wait for different things");
  uint32_t* masks = zsm.mask_off > 0 ? reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(s_dyn) + zsm.mask_off)
                                     : nullptr;
  const int W = (p.T + 31) / 32;  // words of a token mask
  const SendStart st = sendStart(p, ctrl, s_dyn, false, masks);
  const uint64_t e = st.e, act = st.act, me = 1ull << p.rank;
  const SendSmem& m = st.m;
  bool ok = true;
  const int par = static_cast<int>(e & 1), zs = zdSlot(e);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // The row writers: blocks [0, row_blocks). In a fused kernel where this rank has fewer rows than warps, the last
  // zd_rside blocks only derive the receive side (with more rows every warp is needed for them).
  const bool rside = pre != nullptr && p.zd_rside > 0 && p.T < static_cast<int>(gridDim.x) * (kLlThreads / 32);
  const int row_blocks = max(1, static_cast<int>(gridDim.x) - (rside ? p.zd_rside : 0));
  const int gw = blockIdx.x * nwarps + warp, NW = row_blocks * nwarps;
  if (blockIdx.x == 0)
    for (int r = warp; r < R; r += nwarps) {
      if (!((act >> r) & 1)) continue;
      LlZdEntry* ent = zdEntry(p, r, zs, p.rank);
      int32_t* c = zdCounts(ent);
      for (int x = lane; x < p.E; x += 32) c[x] = m.cnt[x];
      if (lane == 0) ent->T = p.T;
      __syncwarp();  // every lane's writes before lane 0's fence, then its strong store: a release (as above)
      if (lane == 0) {
        fenceAcqRel(p.gpu_scope);
        stRelaxed(&ent->epoch, e, p.gpu_scope);
      }
    }
  // Every warp needs its token's positions (to find its rows): from the token masks stageRouting built, else
  // staged once per block while the peers' entries come in (instead of by each warp, tokenPositions).
  if (masks == nullptr && table != nullptr) stageTablePositions(p, m, table, false);
  if (blockIdx.x == gridDim.x - 1) {
    publishRoutingWords(p, m, table != nullptr, masks, W, act, zs, e);
    LL_PROBE(e, kPrPublished);
  }
  LL_PROBE(e, kPrEntries);
  // The rows need every active receiver's started word (its region) and the counts of the active sources below
  // this rank (its rows follow theirs): rank 0 waits for no count. Thread r < R waits for receiver r, thread 32 + s
  // for source s; this rank's own part comes from this block's staging. Every active rank's started word, also of
  // ranks this one sends nothing to: a rank's started word of e means its send half e - 2 is complete, so no
  // sender's rows of e - 2 still land in the region that e reuses (the wait that keeps two operations' writes
  // apart).
  {
    const uint64_t want = llZdStartedWord(e, 0), hi = p.lay.zd + 2 * p.lay.zd_region;
    const size_t RM = static_cast<size_t>(R) * M, need = static_cast<size_t>(L) * RM * p.drow;
    bool w = true;
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      uint64_t xo = p.zd_x_off;
      if (r != p.rank && ((act >> r) & 1)) {
        const uint64_t* f = zdStartedFlag(p, r, zs);
        uint64_t v = ldAcquire(f, p.gpu_scope);
        if (v < want && (w = waitAtLeast(p, f, want, r, epPhaseData, e))) v = ldAcquire(f, p.gpu_scope);
        xo = p.lay.zd + llZdStartedRegion(v) * p.lay.zd_region;
        // Bounds-check the rows against the region (the peer's shapes are the operation's, as this rank's).
        if (w && ((v >> 1) != e || xo + need > hi || (p.srow && xo + p.lay.zd_x_bytes + RM * L * p.srow > hi))) {
          recordViolation(p, epInternalError);
          xo = ~0ull;
        }
      }
      s_xoff[r] = xo;
    } else if (threadIdx.x >= 32 && threadIdx.x < 32 + p.rank) {
      const int s = threadIdx.x - 32;
      if ((act >> s) & 1) {
        const uint64_t* f = zdEntryFlag(p, s, zs);
        w = ldAcquire(f, p.gpu_scope) >= e || waitAtLeast(p, f, e, s, epPhaseData, e);
      }
    }
    ok = __syncthreads_and(w) != 0;
  }
  LL_PROBE(e, kPrPeers);
  if (ok) {
    const size_t RM = static_cast<size_t>(R) * M;
    for (int x = threadIdx.x; x < p.E; x += blockDim.x) {
      int acc = 0;
      for (int s = 0; s < p.rank; ++s) {
        if (!((act >> s) & 1)) continue;  // a masked source sends nothing
        const LlZdEntry* ent = zdEntry(p, p.rank, zs, s);
        const int T = ent->T, c0 = zdCounts(ent)[x];  // both loaded at once
        int c = T > 0 ? c0 : 0;
        if (T > M || c < 0 || c > T) {
          recordViolation(p, epInternalError);
          c = 0;
        }
        acc += c;
      }
      s_beg[x] = acc;
    }
    __syncthreads();
    LL_PROBE(e, kPrBegins);
    const int units = p.use_fp8 ? p.H / EP_FP8_BLOCK : static_cast<int>(p.xrow / 16);
    // More parts than 8 only beside blocks of the receive side's own (without them they measured slower), and never
    // more parts than the row has units.
    const int P = min(partsOf(p.T, NW, rside ? p.zd_parts : 8), units);
    for (int item = gw; item < p.T * P && gw < NW; item += NW) {
      const int t = item / P, part = item % P;
      const int32_t xk = lane < K ? m.idx[t * K + lane] : -1;
      const int rk = xk >= 0 ? xk / L : -1;
      const unsigned routed = __reduce_or_sync(kFull, rk >= 0 ? 1u << rk : 0u);
      if (part == 0 && lane == 0) countMaskedDrops(p, routed & ~static_cast<unsigned>(act));
      const bool live = rk >= 0 && ((act >> rk) & 1) && s_xoff[rk] != ~0ull;
      const unsigned lanes = __ballot_sync(kFull, live);
      if (lanes == 0) continue;
      const int32_t pos = masks != nullptr   ? (live ? maskPosition(masks, W, xk, t) : -1)
                          : table != nullptr ? (live ? m.pos[t * K + lane] : -1)
                                             : tokenPositions(m.idx, t, K, xk, lane);
      // Each live lane's (token, expert) row and scales, in that lane's registers.
      LaneDsts ds{lanes, nullptr, nullptr};
      if (live) {
        const int64_t row = static_cast<int64_t>(xk % L) * static_cast<int64_t>(RM) + s_beg[xk] + pos;
        uint8_t* region = p.base[rk] + s_xoff[rk];
        ds.row = region + row * p.drow;
        ds.sc = reinterpret_cast<float*>(region + p.lay.zd_x_bytes + row * p.srow);
      }
      const int ub = partBegin(units, P, part), ue = partBegin(units, P, part + 1);
      const uint8_t* xr = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * p.xrow;
      writeRowPartToLanes(p, ds, xr, ub, ue, lane);
    }
    const auto busyBlocks = [&] { return min((p.T * P + nwarps - 1) / nwarps, row_blocks); };  // had rows to write
#ifdef EPCOMM_LL_PROBE
    __syncthreads();
    if (static_cast<int>(blockIdx.x) < busyBlocks()) LL_PROBE(e, kPrRowsDone);
#endif
    // A fused kernel's receive side, by the blocks that had no rows to write (every block when each has some): the
    // layout from every source's counts (the first of them writes recv_count and recv_layout_range), then
    // recv_src_info.
    if (pre != nullptr) {
      const int busy = busyBlocks(), b0 = busy < static_cast<int>(gridDim.x) ? busy : 0;
      // The last block, which published the routing words before its rows, gets here last: where other blocks
      // share the receive side, it leaves that to them.
      const int G = static_cast<int>(gridDim.x), b1 = G - 1 > b0 ? G - 1 : G;
      if (static_cast<int>(blockIdx.x) >= b0 && static_cast<int>(blockIdx.x) < b1 &&
          waitPeers(p, act & ~me, zdEntryFlag, zs, e, e)) {
        const bool out = static_cast<int>(blockIdx.x) == b0;
        dispatchLayoutLoad(p, zs, act, pre, pre + L * (R + 1), m.cnt, out);
        __syncthreads();
        dispatchLayoutScan(p, pre, pre + L * (R + 1), out);
        LL_PROBE(e, kPrRsideLayout);
        zdSourceInfo(p, zs, act, pre, pre + L * (R + 1), e, b0, b1);
#ifdef EPCOMM_LL_PROBE
        __syncthreads();
        LL_PROBE(e, kPrRsideInfo);
#endif
      }
    }
  }
  LL_PROBE(e, kPrSent);
  // Every active receiver must have read operation e - 2 before operation e + 2 overwrites its slot: checked before
  // this block's completion counts (so before the tags; a receive that completes e implies the check), with the
  // loads of the start made acquires by a fence when they were in. Free in a fused run: a peer's started word of e
  // means its launch e - 2, which acknowledged e - 2, is complete. Timing out here still leaves e's rows and tags
  // sent (the peers complete e; this rank reports the error, and the elastic resync realigns the epochs).
  if (blockIdx.x == 0 && threadIdx.x < R && e > 2 && ((act >> threadIdx.x) & 1)) {
    if (seen >= e - 2) fenceAcqRel(p.gpu_scope);
    else waitAtLeast(p, ackPtr(p, p.rank, kLlDispatch, threadIdx.x), e - 2, threadIdx.x, epPhaseData, e);
  }
#ifdef EPCOMM_LL_PROBE
  __syncthreads();
  if (threadIdx.x == 0) {
    fenceAcqRel(p.gpu_scope);
    LL_PROBE(e, kPrFenced);
  }
#endif
  if (lastBlockDone(&ctrl->send_done[kLlDispatch], e * gridDim.x, p.gpu_scope)) {
    lastTags<false>(p, act, [&](int r) { return tagPtr(p, r, kLlDispatch, par, p.rank); }, e);
    if (pre != nullptr) {
      // Every block has read the peers' entries (counts and routing words) of operation e: acknowledged now, and
      // the receive half's epoch and completion count advance as a receive launch's would (every block of this
      // launch took e from the send epoch, which a fused launch shares with the receive: none is outstanding).
      lastFlags<false>(p, act, [&](int s) { return ackPtr(p, s, kLlDispatch, p.rank); }, e);
      if (threadIdx.x == 0) {
        stRelaxed(&ctrl->recv_epoch[kLlDispatch], e);
        atomicAdd(reinterpret_cast<unsigned long long*>(&ctrl->recv_done[kLlDispatch]), gridDim.x);
      }
    }
    if (threadIdx.x == 0) stRelaxed(&ctrl->send_epoch[kLlDispatch], e);
    LL_PROBE(e, kPrTagged);
  }
  if (blockIdx.x != 0) return;
  if (pre != nullptr) {
    // One block waits for the peers' rows (their tags), after the zero-copy combine guard (combinesRead).
    LL_PROBE(e, kPrRecvStart);
    if (combinesRead(p, ctrl, act, e)) waitPeers(p, act, tagFlag, kLlDispatch * 2 + par, e, e);
    LL_PROBE(e, kPrTags);
    LL_PROBE(e, kPrAcked);
  }
}

template <bool kX>
__device__ __forceinline__ void dispatchSendBody(const LlParams& p, int* pre = nullptr) {
  if (!kX && p.zd) return dispatchSendZeroCopy(p, pre);  // one host only (the engine refuses it across hosts)
  extern __shared__ __align__(16) int32_t s_dyn[];
  launchDependents();
  LlCtrl* ctrl = ctrlOf(p);
  // Every receiver must have read operation e - 2, which used the same parity. Masked ranks get nothing; their
  // pairs are counted as dropped.
  const SendStart st = sendStart(p, ctrl, s_dyn);
  const uint64_t e = st.e, act = st.act;
  const SendSmem& m = st.m;
  const bool ok = st.ok;
  const int par = static_cast<int>(e & 1), R = p.nranks, L = p.L, K = p.K;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5), NW = gridDim.x * nwarps;
  const bool em = p.layout == EP_LL_EXPERT_MAJOR;
  const uint64_t far_mask = farMask<kX>(p), near = act & ~far_mask;  // near: active ranks mapped here
  if (ok) {
    for (int x = gw; x < p.E; x += NW)
      if (lane == 0 && ((near >> (x / L)) & 1)) countEntry(p, x / L, par, p.rank)[4 + x % L] = m.cnt[x];
    if (gw == 0)
      for (int r = lane; r < R; r += 32)
        if ((near >> r) & 1) countEntry(p, r, par, p.rank)[0] = p.T;
    if ((act & far_mask) != 0) sendCountsRemote(p, act & far_mask, par, m.cnt, gw, NW, e);
    const int units = p.use_fp8 ? p.H / EP_FP8_BLOCK : static_cast<int>(p.xrow / 16);
    const int P = partsOf(p.T, NW);
    for (int item = gw; item < p.T * P; item += NW) {
      const int t = item / P, part = item % P;
      const int32_t xk = lane < K ? m.idx[t * K + lane] : -1;
      const int rk = xk >= 0 ? xk / L : -1;
      const unsigned routed = __reduce_or_sync(kFull, rk >= 0 ? 1u << rk : 0u);
      const unsigned reached = routed & static_cast<unsigned>(act);
      if (part == 0 && lane == 0) countMaskedDrops(p, routed & ~reached);
      const unsigned mask = reached & ~static_cast<unsigned>(far_mask);  // ranks of other hosts: the loop below
      if (mask == 0) continue;
      if (part == 0) {
        // Expert-major rows need the token's index among this rank's tokens of each expert; rank-major rows sit at
        // the token's slot. (Staging every token's index with stageRouting's table instead measured about even at
        // 64 tokens on one H200: each block stages 1-3 us longer; bench/results/h200-ll-dispatch-s6.log, run47.)
        const int32_t pos = em ? tokenPositions(m.idx, t, K, xk, lane) : -1;
        for (unsigned mm = mask; mm; mm &= mm - 1) {
          const int r = __ffs(mm) - 1;
          LlSlotMeta* meta = reinterpret_cast<LlSlotMeta*>(slotPtr(p, r, par, p.rank, t));
          if (lane < K) {
            const int32_t raw = m.raw[t * K + lane];
            meta->expert[2 * lane] = raw >= 0 && raw / L == r ? raw % L : -1;
            meta->expert[2 * lane + 1] = rk == r ? pos : -1;
          }
          if (lane == 0) {
            meta->token = t;
            meta->epoch = e;
          }
        }
      }
      // Lane r holds rank r's slot (ranks <= kLlMaxRanks < 32): LaneDsts, no pointer array in local memory.
      const bool mine = (mask >> lane) & 1;
      uint8_t* slot = mine ? slotPtr(p, lane, par, p.rank, t) : nullptr;
      const LaneDsts ds{mask, mine ? slot + p.lay.slot_row : nullptr,
                        mine ? reinterpret_cast<float*>(slot + p.lay.slot_scales) : nullptr};
      const uint8_t* xr = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * p.xrow;
      writeRowPartToLanes(p, ds, xr, partBegin(units, P, part), partBegin(units, P, part + 1), lane);
    }
    // Ranks of other hosts (a loop of its own, so that the one above keeps its registers): the slot's pieces as
    // records (remote.cuh).
    for (int item = gw; (act & far_mask) != 0 && item < p.T * P; item += NW) {
      const int t = item / P, part = item % P;
      const int32_t xk = lane < K ? m.idx[t * K + lane] : -1;
      const int rk = xk >= 0 ? xk / L : -1;
      const unsigned far = __reduce_or_sync(kFull, rk >= 0 ? 1u << rk : 0u) & static_cast<unsigned>(act & far_mask);
      if (far == 0) continue;
      const int32_t pos = part == 0 && em ? tokenPositions(m.idx, t, K, xk, lane) : -1;
      const uint8_t* xr = static_cast<const uint8_t*>(p.x) + static_cast<size_t>(t) * p.xrow;
      for (unsigned mm = far; mm; mm &= mm - 1)
        sendSlotPartRemote(p, __ffs(mm) - 1, par, t, part, partBegin(units, P, part), partBegin(units, P, part + 1),
                           rk, pos, m.raw, xr, e);
    }
  }
  LL_PROBE(e, kPrSent);
  if (lastBlockDone(&ctrl->send_done[kLlDispatch], e * gridDim.x, p.gpu_scope)) {
    lastTags<kX>(p, act, [&](int r) { return tagPtr(p, r, kLlDispatch, par, p.rank); }, e);
    if (threadIdx.x == 0) stRelaxed(&ctrl->send_epoch[kLlDispatch], e);
    LL_PROBE(e, kPrTagged);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch, receive half: once every peer's tag is in, each block derives the expert-major row ranges from the
// count entries (rows of local expert l from source s begin after those of lower sources), and a warp per slot
// [s][t] copies the token's row to its final rows: expert-major [l][begin(l, s) + index], or rank-major [s][t].
// A zero-copy dispatch's rows are in place already: the layout comes from the entries and recv_src_info from the
// routing words, both before the tags.
// ---------------------------------------------------------------------------------------------------------
template <bool kX>
__device__ __forceinline__ void dispatchRecvBody(const LlParams& p) {
  extern __shared__ __align__(16) int s_begin[];  // [L][R + 1] first row of each source, then the total
  __shared__ int s_T[kGpuMaxRanks];
  LlCtrl* ctrl = ctrlOf(p);
  const uint64_t e = launchEpoch(&ctrl->recv_epoch[kLlDispatch]);
  LL_PROBE(e, kPrRecvStart);
  const int par = static_cast<int>(e & 1), R = p.nranks, L = p.L, M = p.M, K = p.K;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5), NW = gridDim.x * nwarps;
  const bool em = p.layout == EP_LL_EXPERT_MAJOR;
  const size_t RM = static_cast<size_t>(R) * M;
  const uint64_t act = activeMask(p);
  // A zero-copy dispatch has every source's T and counts in its entry, which the source writes before its rows:
  // the layout is derived while the rows are still landing.
  const int zs = zdSlot(e);
  const bool in = combinesRead(p, ctrl, act, e) && (p.zd ? waitPeers(p, act, zdEntryFlag, zs, e, e)
                                                        : waitPeers(p, act, tagFlag, kLlDispatch * 2 + par, e, e));
  LL_PROBE(e, kPrTags);
  if (in) {
    dispatchLayoutLoad(p, p.zd ? zs : par, act, s_begin, s_T, nullptr, blockIdx.x == 0);
    __syncthreads();
    dispatchLayoutScan(p, s_begin, s_T, blockIdx.x == 0);
    LL_PROBE(e, kPrLayout);
    // The rows are in place once the tags are (the senders wrote them); their source tokens come from the routing
    // words, before.
    if (p.zd && zdSourceInfo(p, zs, act, s_begin, s_T, e, 0, gridDim.x))
      waitPeers(p, act, tagFlag, kLlDispatch * 2 + par, e, e);
    const int units = static_cast<int>(p.drow / 16), P = partsOf(R * M, NW);
    for (int item = gw; !p.zd && item < R * M * P; item += NW) {
      const int i = item / P, part = item % P, s = i / M, t = i % M;
      const uint8_t* slot = slotPtr(p, p.rank, par, s, t);
      const LlSlotMeta* meta = reinterpret_cast<const LlSlotMeta*>(slot);
      // The slot's tag and its expert list are loaded together (one memory latency, not two).
      const bool in_range = t < s_T[s];
      const uint64_t tag = in_range ? meta->epoch : 0;
      const int32_t l_in = in_range && lane < K ? meta->expert[2 * lane] : -1;
      const int32_t idx_in = in_range && lane < K ? meta->expert[2 * lane + 1] : -1;
      const bool present = tag == e;
      const int ub = partBegin(units, P, part), ue = partBegin(units, P, part + 1);
      if (!em) {
        const size_t row = static_cast<size_t>(s) * M + t;
        if (part == 0 && lane < K) p.recv_topk_idx[row * K + lane] = present ? l_in : -1;
        if (!present) continue;
        uint8_t* d = static_cast<uint8_t*>(p.recv_x) + row * p.drow;
        warpCopyChunks(d, slot + p.lay.slot_row, ub, ue, lane);
        if (p.srow && part == 0)
          warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + row * p.srow, slot + p.lay.slot_scales, p.srow, lane);
        continue;
      }
      if (!present) continue;
      int64_t dst = -1;
      if (lane < K) {
        const int l = l_in, idx = idx_in;
        if (idx >= 0) {  // bounds-check the peer's metadata against its own counts
          if (l < 0 || l >= L || idx >= s_begin[l * (R + 1) + s + 1] - s_begin[l * (R + 1) + s])
            recordViolation(p, epInternalError);
          else
            dst = static_cast<int64_t>(l) * RM + s_begin[l * (R + 1) + s] + idx;
        }
      }
      const unsigned live = __ballot_sync(kFull, dst >= 0);
      if (part == 0)
        for (unsigned m = live; m; m &= m - 1) {
          const int64_t row = __shfl_sync(kFull, dst, __ffs(m) - 1);
          if (lane == 0) p.recv_src_info[row] = t;
          if (p.srow) warpCopy4(reinterpret_cast<uint8_t*>(p.recv_x_scales) + row * p.srow, slot + p.lay.slot_scales,
                                p.srow, lane);
        }
      // Each live lane holds its own final row (LaneDsts), no pointer array in local memory.
      const LaneDsts ds{live, dst >= 0 ? static_cast<uint8_t*>(p.recv_x) + dst * p.drow : nullptr, nullptr};
      warpCopyTo(ds, slot + p.lay.slot_row, ub, ue, lane);
    }
  }
  LL_PROBE(e, kPrCopied);
  if (lastBlockDone(&ctrl->recv_done[kLlDispatch], e * gridDim.x, p.gpu_scope)) {
    lastFlags<kX>(p, act, [&](int s) { return ackPtr(p, s, kLlDispatch, p.rank); }, e);
    if (threadIdx.x == 0) stRelaxed(&ctrl->recv_epoch[kLlDispatch], e);
    LL_PROBE(e, kPrAcked);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Combine, send half: every expert-output row goes back to its token's rank (the source reduces from its own
// routing): expert-major rows, found from recv_count / recv_layout_range, into this rank's packed block there
// (combPackedPtr; recv_src_info only validates the token index); rank-major rows, found from recv_count /
// recv_topk_idx, into slot [expert][t] there.
// ---------------------------------------------------------------------------------------------------------
// s_pre: shared memory for L + 1 + L * R ints (expert-major): the prefix of recv_count, then per (l, source) the
// rows of that source's earlier local experts (where expert l's rows start in the source's packed block).
template <bool kX>
__device__ __forceinline__ void combineSendBody(const LlParams& p, int* s_pre) {
  launchDependents();
  LlCtrl* ctrl = ctrlOf(p);
  const uint64_t e = launchEpoch(&ctrl->send_epoch[kLlCombine]);
  const int par = static_cast<int>(e & 1), R = p.nranks, L = p.L, M = p.M, K = p.K;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5), NW = gridDim.x * nwarps;
  const size_t RM = static_cast<size_t>(R) * M;
  const uint8_t* y = static_cast<const uint8_t*>(p.y);
  const uint64_t act = activeMask(p);
  const bool ok = e <= 2 || waitPeers(p, act, ackFlag, kLlCombine, e - 2, e);
  const int units = static_cast<int>(p.xrow / 16);
  if (ok && p.zero_copy) {
    // Nothing moves: publish where the rows are and the layout they follow; the peers read them.
    if (blockIdx.x == 0) {
      LlZcHeader* h = zcHeader(p, p.rank, par);
      int64_t* lr = reinterpret_cast<int64_t*>(h + 1);
      if (p.layout == EP_LL_EXPERT_MAJOR)
        for (int i = threadIdx.x; i < L * R; i += blockDim.x) lr[i] = p.recv_layout_range[i];
      if (threadIdx.x == 0) h->y_off = p.y_off;
    }
  } else if (ok && p.layout == EP_LL_EXPERT_MAJOR) {
    int* s_at = s_pre + L + 1;  // [l * R + s]
    for (int i = threadIdx.x; i < L * R; i += blockDim.x) {
      const int c = layoutRangeCount(p.recv_layout_range[i]);
      s_at[i] = c > 0 && c <= M ? c : 0;
    }
    if (threadIdx.x == 0) {
      int acc = 0;
      for (int l = 0; l < L; ++l) {
        s_pre[l] = acc;
        const int c = p.recv_count[l];
        acc += c >= 0 && c <= static_cast<int>(RM) ? c : 0;
      }
      s_pre[L] = acc;
    }
    __syncthreads();
    for (int s = threadIdx.x >> 5; s < R; s += nwarps) warpExclusiveScan(s_at + s, L, R, lane);  // a warp per source
    __syncthreads();
    const size_t block = static_cast<size_t>(M) * L;
    const int P = partsOf(s_pre[L], NW);
    for (int item = gw; item < s_pre[L] * P; item += NW) {
      const int i = item / P, part = item % P;
      int lo = 0, hi = L - 1;  // the expert whose rows hold i: last l with s_pre[l] <= i
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_pre[mid] <= i) lo = mid;
        else hi = mid - 1;
      }
      const int l = lo, j = i - s_pre[l];
      int src = -1, b = 0;
      if (lane < R) {
        const int64_t lr = p.recv_layout_range[static_cast<size_t>(l) * R + lane];
        const int c = layoutRangeCount(lr);
        b = layoutRangeBegin(lr);
        if (j >= b && j < b + c) src = lane;
      }
      const unsigned hit = __ballot_sync(kFull, src >= 0);
      const int s = hit ? __ffs(hit) - 1 : -1;
      const int t = p.recv_src_info[static_cast<size_t>(l) * RM + j];
      const size_t q = s >= 0 ? static_cast<size_t>(s_at[l * R + s]) + (j - __shfl_sync(kFull, b, s)) : block;
      if (s < 0 || t < 0 || t >= M || q >= block) {
        if (lane == 0) recordViolation(p, epInvalidUsage);
        continue;
      }
      if (!((act >> s) & 1)) continue;  // the token's rank was masked after the dispatch
      if (p.own_in_y && s == p.rank) continue;  // read in y by the receive half
      sendCombineRowPart<kX>(p, s, combPackedPtr(p, s, par, p.rank, q), y + (static_cast<size_t>(l) * RM + j) * p.xrow,
                         partBegin(units, P, part), partBegin(units, P, part + 1), e);
    }
  } else if (ok) {
    const int P = partsOf(R * M, NW);
    for (int item = gw; item < R * M * P; item += NW) {
      const int i = item / P, part = item % P, s = i / M, t = i % M;
      const int n = p.recv_count[s];
      if (t >= n || !((act >> s) & 1) || (p.own_in_y && s == p.rank)) continue;
      const int64_t* ti = p.recv_topk_idx + (static_cast<size_t>(s) * M + t) * K;
      int64_t l = lane < K ? ti[lane] : -1;
      if (l >= L || l < -1) {
        recordViolation(p, epInvalidUsage);
        l = -1;
      }
      for (int j = 0; j < K; ++j)  // a local expert named twice is returned once
        if (__shfl_sync(kFull, l, j) == l && j < lane) l = -1;
      for (unsigned m = __ballot_sync(kFull, l >= 0); m; m &= m - 1) {
        const int64_t lj = __shfl_sync(kFull, l, __ffs(m) - 1);
        sendCombineRowPart<kX>(p, s, combPtr(p, s, par, p.rank * L + static_cast<int>(lj), t),
                           y + (static_cast<size_t>(lj) * RM + static_cast<size_t>(s) * M + t) * p.xrow,
                           partBegin(units, P, part), partBegin(units, P, part + 1), e);
      }
    }
  }
  if (lastBlockDone(&ctrl->send_done[kLlCombine], e * gridDim.x, p.gpu_scope)) {
    lastTags<kX>(p, act, [&](int s) { return tagPtr(p, s, kLlCombine, par, p.rank); }, e);
    if (threadIdx.x == 0) stRelaxed(&ctrl->send_epoch[kLlCombine], e);
  }
}

// Chunks ch and ch + 32 of one output row (the two halves of a 1 KiB span): the sum over k in order of
// w_k * row_k[chunk], where rowOf(k) is expert k's row (nullptr when absent) and lane k holds w_k in `wl`. The rows'
// chunks are loaded eight experts at a time and only then added in k order: sixteen loads in flight per lane, one
// memory latency per eight experts, and the same sum.
template <int kDtype, typename RowOf>
__device__ __forceinline__ void reduceSpan(int K, int chunks, int ch, float wl, const RowOf& rowOf, int4* out) {
  using V = Vec8<kDtype>;
  constexpr int kG = 2;
  bool in[kG];
  float acc[kG][V::kN];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    in[g] = ch + 32 * g < chunks;
#pragma unroll
    for (int u = 0; u < V::kN; ++u) acc[g][u] = 0.0f;
  }
  for (int k0 = 0; k0 < K; k0 += 8) {
    int4 v[8][kG];
    float w[8];
    bool use[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int k = k0 + u < K ? k0 + u : K - 1;  // every lane shuffles, so no early exit
      const int4* r = rowOf(k);
      w[u] = __shfl_sync(kFull, wl, k);
      use[u] = k0 + u < K && r != nullptr;
#pragma unroll
      for (int g = 0; g < kG; ++g)
        if (use[u] && in[g]) v[u][g] = r[ch + 32 * g];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
#pragma unroll
      for (int g = 0; g < kG; ++g)
        if (use[u] && in[g]) V::addWeighted(acc[g], v[u][g], w[u]);
  }
#pragma unroll
  for (int g = 0; g < kG; ++g)
    if (in[g]) out[ch + 32 * g] = V::pack(acc[g]);
}

// What the receive half reads for each (token, k), staged in shared memory before it waits for the peers, so
// that a warp's row loads depend on no other global load. After the wait, the address of every pair's row:
// first[x[i]] + row[i] * stride.
struct CombStage {
  const int32_t* x;    // [T, K] expert, -1 for none or out of range
  const int32_t* row;  // [T, K] the row's index among this rank's rows of expert x (a repeat: its first's), or t
  const int32_t* at;   // [E] expert-major: this rank's rows of the same expert rank's earlier experts
  uint64_t* first;     // [E] address of this rank's first row of expert x, 0 if x's rank is masked
  uint64_t* addr;      // [T, K] address of the pair's row, 0 if absent
};

__host__ __device__ __forceinline__ size_t combStageBytes(int T, int K, int E) {
  const size_t tk = static_cast<size_t>(T) * K;
  return sendSmemArrayBytes(T, K, E) + sizeof(uint64_t) * (E + tk) + positionTableBytes(T, K, E);
}

__device__ CombStage stageCombine(const LlParams& p, int32_t* smem) {
  // Expert-major rows of one expert follow the token order of each source (positions); rank-major rows sit at t.
  const bool em = p.layout == EP_LL_EXPERT_MAJOR;
  const int TK = p.T * p.K;
  uint64_t* first = reinterpret_cast<uint64_t*>(smem) + sendSmemArrayBytes(p.T, p.K, p.E) / sizeof(uint64_t);
  uint8_t* table = positionTableBytes(p.T, p.K, p.E) ? reinterpret_cast<uint8_t*>(first + p.E + TK) : nullptr;
  const SendSmem m = stageRouting(p, smem, em, table);
  for (int i = threadIdx.x; i < TK; i += blockDim.x) {
    const int t = i / p.K, k = i % p.K;
    if (!em) {
      m.pos[i] = t;
    } else if (m.idx[i] < 0 && m.raw[i] >= 0) {  // a repeat reads its first occurrence's row (pos not rewritten)
      for (int j = 0; j < k; ++j)
        if (m.raw[t * p.K + j] == m.raw[i]) {
          m.pos[i] = m.pos[t * p.K + j];
          break;
        }
    }
  }
  if (em && !p.zero_copy)  // packed blocks (combPackedPtr): a warp per expert rank, over its experts
    for (int A = threadIdx.x >> 5; A < p.nranks; A += blockDim.x >> 5)
      warpExclusiveScan(m.cnt + A * p.L, p.L, 1, threadIdx.x & 31);
  __syncthreads();
  return CombStage{m.raw, m.pos, m.cnt, first, first + p.E};
}

// ---------------------------------------------------------------------------------------------------------
// Combine, receive half: out[t] = sum over k (in order) of topk_weights[t, k] * row(expert k, t), in fp32, the
// product and the sum rounded separately, rounded once to the output type. A warp handles a 1 KiB span (two
// 16-byte chunks per lane) of one token's row.
// ---------------------------------------------------------------------------------------------------------
template <int kDtype, bool kX>
__device__ __forceinline__ void combineRecvBody(const LlParams& p, const CombStage& st) {
  LlCtrl* ctrl = ctrlOf(p);
  const uint64_t e = launchEpoch(&ctrl->recv_epoch[kLlCombine]);
  const int par = static_cast<int>(e & 1), R = p.nranks, K = p.K, L = p.L;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5), NW = gridDim.x * nwarps;
  const size_t RM = static_cast<size_t>(R) * p.M;
  const uint64_t act = activeMask(p);
  if (waitPeers(p, act, tagFlag, kLlCombine * 2 + par, e, e)) {
    // Zero-copy: each expert rank published where its rows are (LlZcHeader), rows begin(l, this rank) + index
    // (expert-major) or l * R * M + rank * M + t (rank-major) of its region. Plain: this rank's slots, except its
    // own rows with both halves in one call (own_in_y), which sit in y at those rows.
    const bool em = p.layout == EP_LL_EXPERT_MAJOR;
    for (int x = threadIdx.x; x < p.E; x += blockDim.x) {
      const int A = x / L, l = x % L;
      const uint8_t* a = nullptr;  // masked: its contributions are absent
      if ((act >> A) & 1) {
        if (p.zero_copy) {
          // Expert-major: the rows this call names (st.at[x], from its routing) must lie within the rows the
          // expert rank published for this rank (a routing other than the dispatched one could name more, up to
          // past the end of its region); rank-major rows are t < T <= M.
          const LlZcHeader* h = zcHeader(p, A, par);
          const int64_t lr = em ? reinterpret_cast<const int64_t*>(h + 1)[l * R + p.rank] : 0;
          const int64_t b = em ? layoutRangeBegin(lr) : static_cast<int64_t>(p.rank) * p.M, c = layoutRangeCount(lr);
          if (em && (b < 0 || st.at[x] > c || b + c > static_cast<int64_t>(RM))) recordViolation(p, epInvalidUsage);
          else a = p.base[A] + h->y_off + (static_cast<size_t>(l) * RM + b) * p.xrow;
        } else if (p.own_in_y && A == p.rank) {  // this rank's own rows, in y at the rows dispatch gave
          const int64_t lr = em ? p.recv_layout_range[static_cast<size_t>(l) * R + p.rank] : 0;
          const int64_t b = em ? layoutRangeBegin(lr) : static_cast<int64_t>(p.rank) * p.M, c = layoutRangeCount(lr);
          if (b < 0 || c < 0 || b + c > static_cast<int64_t>(RM)) recordViolation(p, epInvalidUsage);  // not read
          else a = static_cast<const uint8_t*>(p.y) + (static_cast<size_t>(l) * RM + b) * p.xrow;
        } else {
          a = em ? combPackedPtr(p, p.rank, par, A, st.at[x]) : combPtr(p, p.rank, par, x, 0);
        }
      }
      st.first[x] = reinterpret_cast<uint64_t>(a);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.T * K; i += blockDim.x) {
      uint64_t a = st.x[i] >= 0 ? st.first[st.x[i]] : 0;
      const bool own = p.own_in_y && st.x[i] / L == p.rank;
      // Own rows in y (expert-major): a routing other than the dispatched one could name a row past the expert's
      // rows, even past y's end; the packed slots' copy checks that in the send half.
      if (a && own && em &&
          st.row[i] >= layoutRangeCount(p.recv_layout_range[static_cast<size_t>(st.x[i] % L) * R + p.rank])) {
        recordViolation(p, epInvalidUsage);
        a = 0;
      }
      const bool in_y = p.zero_copy || own;  // rows of y, else packed slots
      st.addr[i] = a ? a + static_cast<size_t>(st.row[i]) * (in_y ? p.xrow : p.lay.comb_row) : 0;
    }
    __syncthreads();
    const int chunks = static_cast<int>(p.xrow / 16), spans = (chunks + 63) / 64;
    for (int i = gw; i < p.T * spans; i += NW) {
      const int t = i / spans, ch = (i % spans) * 64 + lane;
      const float wl = lane < K ? p.topk_weights[static_cast<size_t>(t) * K + lane] : 0.0f;
      const uint64_t* rows = st.addr + t * K;
      int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.out) + static_cast<size_t>(t) * p.xrow);
      // The same shared-memory word for every lane: a broadcast.
      reduceSpan<kDtype>(K, chunks, ch, wl, [&](int k) { return reinterpret_cast<const int4*>(rows[k]); }, out);
    }
  }
  if (lastBlockDone(&ctrl->recv_done[kLlCombine], e * gridDim.x, p.gpu_scope)) {
    lastFlags<kX>(p, act, [&](int s) { return ackPtr(p, s, kLlCombine, p.rank); }, e);
    if (threadIdx.x == 0) stRelaxed(&ctrl->recv_epoch[kLlCombine], e);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Kernels: each half alone, or both halves in one cooperative launch (every block resident at once, so a block
// may wait for the tags that the other blocks' send halves publish). The halves' epochs and completion counters
// are separate, so a fused launch advances them exactly as two launches do.
// ---------------------------------------------------------------------------------------------------------
template <bool kX>
__global__ void __launch_bounds__(kLlThreads) llDispatchSendKernel(LlParams p) { dispatchSendBody<kX>(p); }
template <bool kX>
__global__ void __launch_bounds__(kLlThreads) llDispatchRecvKernel(LlParams p) { dispatchRecvBody<kX>(p); }
template <bool kX>
__global__ void __launch_bounds__(kLlThreads) llDispatchKernel(LlParams p) {
  gridDependencyWait();
  // A zero-copy send half's blocks without rows derive the receive half's layout (from the same entries), into
  // shared memory past the send half's, and do what the receive half would (dispatchSendZeroCopy): the operation
  // ends there. Without room for the layout, the receive half follows as in any other fused kernel.
  extern __shared__ __align__(16) int32_t s_dyn[];
  const size_t pre_off = !kX && p.zd ? zdSmem(p.T, p.K, p.E, true).pre_off : 0;
  int* pre = pre_off > 0 ? s_dyn + pre_off / sizeof(int32_t) : nullptr;
  dispatchSendBody<kX>(p, pre);
  if (pre != nullptr) return;
  __syncthreads();  // the dynamic shared memory changes hands
  dispatchRecvBody<kX>(p);
}
template <bool kX>
__global__ void __launch_bounds__(kLlThreads) llCombineSendKernel(LlParams p) {
  extern __shared__ __align__(16) int32_t s_dyn[];
  combineSendBody<kX>(p, s_dyn);
}
template <int kDtype, bool kX>
__global__ void __launch_bounds__(kLlThreads) llCombineRecvKernel(LlParams p) {
  extern __shared__ __align__(16) int32_t s_dyn[];
  combineRecvBody<kDtype, kX>(p, stageCombine(p, s_dyn));
}
// The receive half's staging follows the send half (its own shared memory): a block stages while the last
// block publishes the tags and the peers finish their sends.
template <int kDtype, bool kX>
__global__ void __launch_bounds__(kLlThreads) llCombineKernel(LlParams p) {
  gridDependencyWait();
  extern __shared__ __align__(16) int32_t s_dyn[];
  combineSendBody<kX>(p, s_dyn + combStageBytes(p.T, p.K, p.E) / sizeof(int32_t));
  combineRecvBody<kDtype, kX>(p, stageCombine(p, s_dyn));
}

}  // namespace

// Every LL launch: the fixed grid, `smem` bytes of dynamic shared memory (every kernel opted in, optInSmem below),
// and how the kernel relates to the one before it on the stream: plainly after it; as a programmatic dependent (a
// receive half that may start while its send half runs, LlParams::pdl), which the send kernels allow at their start;
// or as a cooperative launch (both halves in one kernel: every block resident at once), itself a programmatic
// dependent of the kernel before it where LlParams::pdl_chain (it waits for that kernel before its first load).
enum class Launch { kPlain, kDependent, kCooperative };

// Opts a kernel in to kLlMaxSmem bytes of dynamic shared memory, once per kernel and device. Every kernel is opted
// in, not only launches above 48 KiB of dynamic memory: the 48 KiB limit counts the kernel's static shared memory
// too (up to 800 bytes here), so a fused dispatch with 48,416 dynamic bytes was refused on the H200 ("too many
// blocks in cooperative launch": an occupancy of zero).
cudaError_t optInSmem(const void* kernel) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  static std::mutex mu;
  static std::vector<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  const std::pair<const void*, int> key(kernel, dev);
  if (std::find(done.begin(), done.end(), key) != done.end()) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kLlMaxSmem));
  if (e == cudaSuccess) done.push_back(key);
  return e;
}

template <typename... Args>
cudaError_t launchLl(const LlParams& p, void (*kernel)(Args...), size_t smem, Launch how, cudaStream_t s) {
  if (cudaError_t e = optInSmem(reinterpret_cast<const void*>(kernel)); e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.blocks);
  cfg.blockDim = dim3(kLlThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (how == Launch::kCooperative) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  if ((how == Launch::kDependent && p.pdl) || (how == Launch::kCooperative && p.pdl_chain)) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

size_t llSendSmemBytes(int T, int K, int E, bool zero_copy) {
  return zero_copy ? zdSmem(T, K, E, false).bytes : sendSmemArrayBytes(T, K, E);
}

size_t dispatchRecvSmem(const LlParams& p) {
  return p.layout == EP_LL_EXPERT_MAJOR ? sizeof(int) * static_cast<size_t>(p.L) * (p.nranks + 1) : 0;
}
size_t combineSendSmem(const LlParams& p) {
  return p.layout == EP_LL_EXPERT_MAJOR ? sizeof(int) * (static_cast<size_t>(p.L) + 1 + p.E) : 0;
}
size_t combineRecvSmem(const LlParams& p) { return combStageBytes(p.T, p.K, p.E); }
size_t llCombineSmemBytes(int T, int K, int E, int L) {
  return combStageBytes(T, K, E) + sizeof(int) * (static_cast<size_t>(L) + 1 + E);
}

// Every kernel in two instances (kernels/remote.cuh): with ranks of other hosts or without.
cudaError_t launchLlDispatch(const LlParams& p, cudaStream_t s) {
  const size_t send =
      p.zd && !p.remote ? zdSmem(p.T, p.K, p.E, true).bytes : llSendSmemBytes(p.T, p.K, p.E, p.zd);
  const size_t smem = std::max(send, dispatchRecvSmem(p));
  return launchLl(p, p.remote ? llDispatchKernel<true> : llDispatchKernel<false>, smem, Launch::kCooperative, s);
}

cudaError_t launchLlDispatchSend(const LlParams& p, cudaStream_t s) {
  return launchLl(p, p.remote ? llDispatchSendKernel<true> : llDispatchSendKernel<false>,
                  llSendSmemBytes(p.T, p.K, p.E, p.zd), Launch::kPlain, s);
}

cudaError_t launchLlDispatchRecv(const LlParams& p, cudaStream_t s) {
  return launchLl(p, p.remote ? llDispatchRecvKernel<true> : llDispatchRecvKernel<false>, dispatchRecvSmem(p),
                  Launch::kDependent, s);
}

cudaError_t launchLlCombineSend(const LlParams& p, cudaStream_t s) {
  return launchLl(p, p.remote ? llCombineSendKernel<true> : llCombineSendKernel<false>, combineSendSmem(p),
                  Launch::kPlain, s);
}

// The combine's receiving kernels are templated on the row type.
template <template <int, bool> class Kernel>
cudaError_t launchCombineTyped(const LlParams& p, size_t smem, Launch how, cudaStream_t s) {
  const bool x = p.remote != 0;
  switch (p.dtype) {
    case epBfloat16: return launchLl(p, x ? Kernel<epBfloat16, true>::fn : Kernel<epBfloat16, false>::fn, smem, how, s);
    case epFloat16: return launchLl(p, x ? Kernel<epFloat16, true>::fn : Kernel<epFloat16, false>::fn, smem, how, s);
    default: return launchLl(p, x ? Kernel<epFloat32, true>::fn : Kernel<epFloat32, false>::fn, smem, how, s);
  }
}
template <int kDtype, bool kX>
struct CombineRecvOf {
  static constexpr auto fn = llCombineRecvKernel<kDtype, kX>;
};
template <int kDtype, bool kX>
struct CombineOf {
  static constexpr auto fn = llCombineKernel<kDtype, kX>;
};

cudaError_t launchLlCombineRecv(const LlParams& p, cudaStream_t s) {
  return launchCombineTyped<CombineRecvOf>(p, combineRecvSmem(p), Launch::kDependent, s);
}

cudaError_t launchLlCombine(const LlParams& p, cudaStream_t s) {
  return launchCombineTyped<CombineOf>(p, combineRecvSmem(p) + combineSendSmem(p), Launch::kCooperative, s);
}

#ifdef EPCOMM_LL_PROBE
extern "C" __attribute__((visibility("default"))) void epcommLlProbeReset() {
  static unsigned long long init[kLlProbeOps][kPrPhases][2];
  for (auto& op : init)
    for (auto& ph : op) {
      ph[0] = ~0ull;
      ph[1] = 0;
    }
  cudaDeviceSynchronize();
  cudaMemcpyToSymbol(g_ll_probe, init, sizeof(init));
}
// One line per recorded operation: each phase's earliest / latest block in ns after the first send stamp.
extern "C" __attribute__((visibility("default"))) void epcommLlProbeDump(const char* what, int rank) {
  static unsigned long long v[kLlProbeOps][kPrPhases][2];
  static const char* const names[kPrPhases] = {"s0", "ack", "ent", "peers", "begin", "sent", "tag",
                                               "r0", "tags", "layout", "copied", "end", "pub", "rowsdone",
                                               "rslayout", "rsinfo", "fenced"};
  cudaDeviceSynchronize();
  cudaMemcpyFromSymbol(v, g_ll_probe, sizeof(v));
  for (int i = 0; i < kLlProbeOps; i += 2) {
    const unsigned long long t0 = v[i][kPrSendStart][0];
    if (t0 == ~0ull) continue;
    char line[1024];
    int n = snprintf(line, sizeof(line), "PROBE %s r%d", what, rank);
    const unsigned long long next = v[i + 1][kPrSendStart][0], end = v[i][kPrAcked][1];
    if (next != ~0ull && end != 0) n += snprintf(line + n, sizeof(line) - n, " gap %lld |", (long long)(next - end));
    for (int ph = 0; ph < kPrPhases && n < (int)sizeof(line) - 40; ++ph) {
      if (v[i][ph][1] == 0) continue;
      n += snprintf(line + n, sizeof(line) - n, " %s %lld/%lld", names[ph], (long long)(v[i][ph][0] - t0),
                    (long long)(v[i][ph][1] - t0));
    }
    fprintf(stderr, "%s\n", line);
  }
}
#endif

// Every kernel of this file loaded now (kernels/preload.h says why).
cudaError_t preloadLlKernels() {
  const void* const kernels[] = {
      reinterpret_cast<const void*>(llDispatchSendKernel<false>),
      reinterpret_cast<const void*>(llDispatchSendKernel<true>),
      reinterpret_cast<const void*>(llDispatchRecvKernel<false>),
      reinterpret_cast<const void*>(llDispatchRecvKernel<true>),
      reinterpret_cast<const void*>(llDispatchKernel<false>),
      reinterpret_cast<const void*>(llDispatchKernel<true>),
      reinterpret_cast<const void*>(llCombineSendKernel<false>),
      reinterpret_cast<const void*>(llCombineSendKernel<true>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epBfloat16, false>),
      reinterpret_cast<const void*>(llCombineKernel<epBfloat16, false>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epBfloat16, true>),
      reinterpret_cast<const void*>(llCombineKernel<epBfloat16, true>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epFloat16, false>),
      reinterpret_cast<const void*>(llCombineKernel<epFloat16, false>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epFloat16, true>),
      reinterpret_cast<const void*>(llCombineKernel<epFloat16, true>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epFloat32, false>),
      reinterpret_cast<const void*>(llCombineKernel<epFloat32, false>),
      reinterpret_cast<const void*>(llCombineRecvKernel<epFloat32, true>),
      reinterpret_cast<const void*>(llCombineKernel<epFloat32, true>),
  };
  return preloadKernels(kernels, sizeof(kernels) / sizeof(kernels[0]));
}

}  // namespace epcomm
