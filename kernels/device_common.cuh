// Protocol pieces every kernel family of the GPU engine shares (HT, LL, alltoallv): strong loads and stores of
// flags, epochs, the deadline-bounded wait, error and violation records, the last-block completion counter and
// wide copies. Templates over the operation's parameter struct, which carries `err`, `op`, `rank` and
// `timeout_ns`.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_layout.h"

namespace epcomm {
namespace dev {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Flags are acquired and released at system scope, or at GPU scope when every rank that touches them runs on
// this GPU (ranks under MPS): a system-scope release or acquire waits for the system's ordering, which on one GPU
// only adds latency to every LL phase.
__device__ __forceinline__ uint64_t ldAcquire(const uint64_t* p, bool gpu_scope = false) {
  uint64_t v;
  if (gpu_scope) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stRelease(uint64_t* p, uint64_t v, bool gpu_scope = false) {
  if (gpu_scope) asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A flag's value without ordering, so that its load can be in flight beside others; a fenceAcqRel after it, in the
// same thread, makes it an acquire (what follows is ordered after the writes the flag's release covered).
__device__ __forceinline__ uint64_t ldRelaxed(const uint64_t* p, bool gpu_scope = false) {
  uint64_t v;
  if (gpu_scope) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// A strong store without ordering of its own, at GPU scope: for words only this GPU reads.
__device__ __forceinline__ void stRelaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The same at the flags' scope (system, or GPU where every rank runs on this GPU), for words peers read. After a
// fenceAcqRel in the same thread it is a release of what the fence ordered (PTX: a fence followed by a strong
// write in program order is a release pattern), so any number of flags can follow one fence.
__device__ __forceinline__ void stRelaxed(uint64_t* p, uint64_t v, bool gpu_scope) {
  if (gpu_scope) asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// First failure wins (claimed in device memory); the code is stored last, so a host that sees it sees the rest.
// Later waits see err->code and give up at once.
template <class P>
__device__ void recordError(const P& p, int code, int peer, int phase, uint64_t epoch) {
  if (atomicCAS(&p.claims->error, 0, 1) == 0) {
    volatile GpuErrorRecord* r = p.err;
    r->op = p.op;
    r->epoch = epoch;
    r->rank = p.rank;
    r->peer = peer;
    r->phase = phase;
    __threadfence_system();
    r->code = code;
    __threadfence_system();
  }
}

// No failure was recorded on this rank (device memory: cheap to ask). After a failure a sender stops publishing
// tails and tags: rows or tokens it did not write must not look written to a peer, which then times out itself
// instead of reading stale slots as this operation's data.
template <class P>
__device__ __forceinline__ bool noFailure(const P& p) {
  return *reinterpret_cast<volatile int*>(&p.claims->error) == 0;
}

// Counted in device memory; the host's copy is stored after every count and re-stored until it is no smaller
// than the count (a writer delayed between its add and its store may have stored an older value meanwhile).
template <class P>
__device__ void recordViolation(const P& p, int code) {
  volatile GpuErrorRecord* r = p.err;
  if (atomicCAS(&p.claims->violation, 0, 1) == 0) r->violation_code = code;
  unsigned long long n = atomicAdd(&p.claims->violations, 1ull) + 1;
  volatile unsigned long long* count = &p.claims->violations;
  do {
    r->violations = n;
    __threadfence_system();
    n = *count;
  } while (r->violations < n);
}

// The time a device wait has waited. %globaltimer can step backwards or jump when the driver resynchronizes it (seen
// in a VM): elapsed time is the sum of the forward steps between checks, each capped, so a jump never fakes a
// timeout.
struct WaitClock {
  uint64_t last, elapsed;
  __device__ WaitClock() : last(globaltimer()), elapsed(0) {}
  // Takes a step and says whether the wait has passed timeout_ns.
  __device__ __forceinline__ bool over(uint64_t timeout_ns) {
    constexpr uint64_t kMaxStepNs = 10 * 1000 * 1000;
    const uint64_t now = globaltimer();
    const int64_t step = static_cast<int64_t>(now - last);
    last = now;
    if (step > 0) elapsed += static_cast<uint64_t>(step) < kMaxStepNs ? static_cast<uint64_t>(step) : kMaxStepNs;
    return elapsed > timeout_ns;
  }
};

// Waits until *flag >= want, with the communicator's deadline (%globaltimer). False on timeout or abort.
// Acquires at the scope of the operation's ranks (P::gpu_scope).
template <class P>
__device__ bool waitAtLeast(const P& p, const uint64_t* flag, uint64_t want, int peer, int phase, uint64_t epoch) {
  const bool gpu_scope = p.gpu_scope != 0;
  if (ldAcquire(flag, gpu_scope) >= want) return true;
  WaitClock clock;
  volatile GpuErrorRecord* err = p.err;
  for (uint32_t it = 1;; ++it) {
    if (ldAcquire(flag, gpu_scope) >= want) return true;
    if ((it & 127) == 0) {
      if (err->code != 0 || err->abort != 0) return false;
      if (clock.over(p.timeout_ns)) {
        recordError(p, epTimeout, peer, phase, epoch);
        return false;
      }
    }
    __nanosleep(64);
  }
}

// Every thread of the block calls this after its work. The block's writes are made visible to the peers (at system
// scope, or GPU scope when every rank runs on this GPU: `gpu_scope` below), then
// counted in a cumulative counter (never reset, so graph replays need no reset); the block that brings it to
// `target` (= operation number x blocks per launch) returns true. Only that block, after every other block of
// the launch has finished, may advance the epoch the launch was derived from (rule G2). In that block thread 0 has
// just run an acquire-release fence: its strong stores that follow release every block's writes (lastFlags).
// The fences are acquire-release, not sequentially consistent (__threadfence_system): they order this block's
// writes (peer memory included) before the count, and the other blocks' before what the last block writes next,
// at a fraction of the cost, which LL latency feels.
__device__ __forceinline__ void fenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fenceAcqRel(bool gpu_scope) {
  if (gpu_scope) fenceAcqRelGpu();
  else fenceAcqRelSys();
}
// Orders this thread's writes to peers' memory before what it (or its block, after a barrier) publishes next: a
// sequentially consistent fence at system scope, or at GPU scope when every rank runs on this GPU.
__device__ __forceinline__ void fenceForPeers(bool gpu_scope) {
  if (gpu_scope) __threadfence();
  else __threadfence_system();
}
// `gpu_scope`: every rank this block wrote to runs on this GPU (ranks under MPS), so GPU-scope fences order the
// writes for them; they cost about half a microsecond less each than system-scope ones (measured on an H200).
__device__ __forceinline__ bool lastBlockDone(uint64_t* done, uint64_t target, bool gpu_scope = false) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    fenceAcqRel(gpu_scope);
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(done), 1ull);
    s_last = old + 1 == target;
    if (s_last) fenceAcqRel(gpu_scope);
  }
  __syncthreads();
  return s_last != 0;
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

// Zeros `bytes` (a multiple of 16) at 16-byte aligned `dst`, the warp's lanes striding over it.
__device__ __forceinline__ void warpZero16(void* dst, size_t bytes, int lane) {
  int4* d = static_cast<int4*>(dst);
  for (int i = lane; i < static_cast<int>(bytes / 16); i += 32) d[i] = int4{};
}

__device__ __forceinline__ void warpCopy4(void* dst, const void* src, size_t bytes, int lane) {
  const uint32_t* s = static_cast<const uint32_t*>(src);
  uint32_t* d = static_cast<uint32_t*>(dst);
  for (int i = lane; i < static_cast<int>(bytes / 4); i += 32) d[i] = s[i];
}

// Any alignment: 16-byte words when both ends and the length allow, else 4-byte words, else bytes.
__device__ __forceinline__ void warpCopyAny(void* dst, const void* src, size_t bytes, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if ((a & 15) == 0) {
    warpCopy16(dst, src, bytes, lane);
  } else if ((a & 3) == 0) {
    warpCopy4(dst, src, bytes, lane);
  } else {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (size_t i = lane; i < bytes; i += 32) d[i] = s[i];
  }
}

__device__ __forceinline__ int warpSum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// 16 bytes of a row as floats, per element type; conversions by the shared rules of common/dtype.h.
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
  __device__ static void addWeighted(float* acc, int4 v, float w) {  // product and sum rounded separately
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, kToFloat(h[i])));
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
  __device__ static void addWeighted(float* acc, int4 v, float w) {
    const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, f[i]));
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    float* f = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = acc[i];
    return v;
  }
};

}  // namespace dev
}  // namespace epcomm
