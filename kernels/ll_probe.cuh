// Phase timestamps of LL dispatch launches, for latency work only: compiled in with -DEPCOMM_LL_PROBE (both
// cuda_args and cpp_args; `meson setup build-probe -Dcuda_args=-DEPCOMM_LL_PROBE -Dcpp_args=-DEPCOMM_LL_PROBE`),
// empty otherwise. Thread 0 of every block stamps %globaltimer at each phase of operations e with e % 128 < 2
// (16 such pairs kept, so 2048 operations between resets do not mix);
// per (operation, phase) the earliest and latest block are kept. epcommLlProbeDump prints them relative to the
// operation's first send stamp, and the gap from an operation's end to the next one's start
// (epcomm-bench --probe calls it after each LL row). A stamp costs an atomicMin and an atomicMax.
#pragma once
#include <cstdint>

namespace epcomm {
enum LlProbePhase {
  kPrSendStart, kPrAck, kPrEntries, kPrPeers, kPrBegins, kPrSent, kPrTagged,
  kPrRecvStart, kPrTags, kPrLayout, kPrCopied, kPrAcked,
  // zero-copy fused dispatch only: the publisher block past its routing words, row blocks' last warp done, the
  // receive-side blocks past the layout and past recv_src_info, every block past a fence before its completion
  kPrPublished, kPrRowsDone, kPrRsideLayout, kPrRsideInfo, kPrFenced, kPrPhases
};
}  // namespace epcomm

#ifdef EPCOMM_LL_PROBE
namespace epcomm {
constexpr int kLlProbeOps = 32;
__device__ unsigned long long g_ll_probe[kLlProbeOps][kPrPhases][2];
__device__ __forceinline__ uint64_t llProbeClock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void llProbe(uint64_t e, int phase, uint64_t t = llProbeClock()) {
  if (threadIdx.x != 0 || (e & 127) >= 2) return;
  unsigned long long* r = g_ll_probe[((e >> 7) % (kLlProbeOps / 2)) * 2 + (e & 1)][phase];
  atomicMin(&r[0], t);
  atomicMax(&r[1], t);
}
}  // namespace epcomm
#define LL_PROBE(e, phase) ::epcomm::llProbe((e), (phase))
#define LL_PROBE_CLOCK() ::epcomm::llProbeClock()
#define LL_PROBE_AT(e, phase, t) ::epcomm::llProbe((e), (phase), (t))
#else
#define LL_PROBE(e, phase) ((void)0)
#define LL_PROBE_CLOCK() uint64_t{0}
#define LL_PROBE_AT(e, phase, t) ((void)(t))
#endif
