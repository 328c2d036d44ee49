// ll_floor: what an LL dispatch's parts cost on one GPU by themselves, with no protocol around them, so that the
// LL rows of epcomm-bench can be read against a floor measured on the same machine in the same call:
//   launch   back-to-back empty kernels of the LL grid in a CUDA graph (the gap every operation pays)
//   rows     the zero-copy dispatch's row writes alone: every (token, expert) pair's row copied once to its final
//            row, R ranks' worth in one launch (their blocks side by side, as under MPS), a warp per (token, part
//            of the row), 16-byte loads and stores, eight in flight per lane (kernels/ll.cu warpCopyChunks)
//   rows-tma the same rows by bulk copies (cp.async.bulk): a row read once into shared memory, then stored to
//            each of its destinations by the copy engine of the SM
//   write    a plain store of the same byte count (memset-like), and cudaMemcpyAsync of that many bytes
//   flag     one-way latency of a release store seen by an acquire poll in another block (GPU scope), the
//            floor of every hop between ranks on one GPU (count exchange, completion tag)
// Build: part of a CUDA build (build/bench/ll-floor), or nvcc -O3 -std=c++17 -arch=sm_90 -o ll_floor bench/gpu/ll_floor.cu
// Usage: ll-floor [--tokens 64] [--hidden 7168] [--topk 8] [--experts 64] [--ranks 2] [--blocks 44] [--reps 50]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr int kThreads = 512;
constexpr int kMaxK = 16;

__global__ void __launch_bounds__(kThreads) emptyKernel() {}

// Pairs of source rank s: dst_off[(s * T + t) * K + k] = byte offset of the pair's final row in `out`, -1 for none.
// Block b works for rank b / (gridDim.x / R) on that rank's tokens, as a rank's own launch would.
__global__ void __launch_bounds__(kThreads) rowsKernel(const uint8_t* x, uint8_t* out, const int64_t* dst_off, int R,
                                                       int T, int K, int row_bytes) {
  const int per_rank = gridDim.x / R, s = blockIdx.x / per_rank, b = blockIdx.x % per_rank;
  if (s >= R) return;
  const int lane = threadIdx.x & 31, nw = kThreads / 32, gw = b * nw + (threadIdx.x >> 5), NW = per_rank * nw;
  const int units = row_bytes / 16;
  int P = NW / T;
  P = P < 1 ? 1 : P > 8 ? 8 : P;
  for (int item = gw; item < T * P; item += NW) {
    const int t = item / P, part = item % P;
    const int ub = units * part / P, ue = units * (part + 1) / P;
    const int4* src = reinterpret_cast<const int4*>(x + (static_cast<size_t>(s) * T + t) * row_bytes);
    int4* dst[kMaxK];
    int nd = 0;
    for (int k = 0; k < K; ++k) {
      const int64_t o = dst_off[(static_cast<size_t>(s) * T + t) * K + k];
      if (o >= 0) dst[nd++] = reinterpret_cast<int4*>(out + o);
    }
    constexpr int kU = 8;
    for (int i = ub + lane; i < ue; i += 32 * kU) {
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i + u * 32 < ue) v[u] = src[i + u * 32];
      for (int d = 0; d < nd; ++d)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (i + u * 32 < ue) dst[d][i + u * 32] = v[u];
    }
  }
}

__device__ __forceinline__ uint32_t smemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Bulk copies: lane 0 of each of the first `nbuf` warps of a block issues them, each warp with its own buffer and
// barrier. An item (a row, or a part of it when there are fewer rows than warps) is read into shared memory once
// (mbarrier with the byte count), then stored to each destination by a bulk store.
constexpr int kMaxBuf = 16;
__global__ void __launch_bounds__(kThreads) rowsTmaKernel(const uint8_t* x, uint8_t* out, const int64_t* dst_off,
                                                          int R, int T, int K, int row_bytes, int nbuf, int buf_bytes) {
  extern __shared__ __align__(128) uint8_t s_buf[];
  __shared__ __align__(8) uint64_t s_bar[kMaxBuf];
  const int per_rank = gridDim.x / R, s = blockIdx.x / per_rank, b = blockIdx.x % per_rank;
  const int w = threadIdx.x >> 5;
  if (s >= R || (threadIdx.x & 31) != 0 || w >= nbuf) return;
  const int NW = per_rank * nbuf, gw = b * nbuf + w;
  int P = NW / T;
  P = P < 1 ? 1 : P > 8 ? 8 : P;
  const int units = row_bytes / 16;
  uint8_t* buf = s_buf + static_cast<size_t>(w) * buf_bytes;
  uint64_t* bar = &s_bar[w];
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smemAddr(bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t phase = 0;
  for (int item = gw; item < T * P; item += NW) {
    const int t = item / P, part = item % P;
    const int ub = units * part / P, ue = units * (part + 1) / P;
    const uint32_t bytes = static_cast<uint32_t>(ue - ub) * 16;
    const uint8_t* src = x + (static_cast<size_t>(s) * T + t) * row_bytes + static_cast<size_t>(ub) * 16;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smemAddr(bar)), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smemAddr(buf)),
        "l"(src), "r"(bytes), "r"(smemAddr(bar))
        : "memory");
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smemAddr(bar)), "r"(phase)
          : "memory");
    phase ^= 1;
    for (int k = 0; k < K; ++k) {
      const int64_t o = dst_off[(static_cast<size_t>(s) * T + t) * K + k];
      if (o < 0) continue;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out + o + ub * 16),
                   "r"(smemAddr(buf)), "r"(bytes)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // buf free again
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(kThreads) writeKernel(int4* out, size_t n16) {
  const int4 v = make_int4(1, 2, 3, 4);
  for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < n16;
       i += static_cast<size_t>(gridDim.x) * kThreads)
    out[i] = v;
}

// Block 0 and block 1 pass a token back and forth `rounds` times through two words (release store, acquire poll).
__global__ void pingPongKernel(unsigned long long* w, int rounds, unsigned long long* ns) {
  if (threadIdx.x != 0 || blockIdx.x > 1) return;
  const int me = blockIdx.x;
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 1; i <= rounds; ++i) {
    if (me == 0) {
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(w), "l"(static_cast<unsigned long long>(i)) : "memory");
      unsigned long long v = 0;
      do asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(w + 16) : "memory");
      while (v < static_cast<unsigned long long>(i));
    } else {
      unsigned long long v = 0;
      do asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
      while (v < static_cast<unsigned long long>(i));
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(w + 16), "l"(static_cast<unsigned long long>(i))
                   : "memory");
    }
  }
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (me == 0) *ns = t1 - t0;
}

struct Args {
  int T = 64, H = 7168, K = 8, E = 64, R = 2, blocks = 44, reps = 50, per_graph = 20;
};

template <typename F>
double graphUs(cudaStream_t st, int per_graph, int reps, F&& launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < per_graph; ++i) launch();
  CUDA_CHECK(cudaStreamEndCapture(st, &g));
  CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CUDA_CHECK(cudaGraphLaunch(ge, st));
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(a, st));
    CUDA_CHECK(cudaGraphLaunch(ge, st));
    CUDA_CHECK(cudaEventRecord(b, st));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.0 / per_graph);
  }
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaGraphExecDestroy(ge));
  CUDA_CHECK(cudaGraphDestroy(g));
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = atoi(argv[i + 1]);
    if (k == "--tokens") a.T = v;
    else if (k == "--hidden") a.H = v;
    else if (k == "--topk") a.K = v;
    else if (k == "--experts") a.E = v;
    else if (k == "--ranks") a.R = v;
    else if (k == "--blocks") a.blocks = v;
    else if (k == "--reps") a.reps = v;
    else {
      fprintf(stderr, "ll_floor: unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  if (a.K > kMaxK || a.K > a.E || a.E % a.R != 0 || a.T < 1 || a.H % 8 != 0) {
    fprintf(stderr, "ll_floor: need topk <= %d and <= experts, experts %% ranks == 0, hidden %% 8 == 0\n", kMaxK);
    return 2;
  }
  const int R = a.R, T = a.T, K = a.K, E = a.E, L = E / R, row = a.H * 2;  // bf16 rows
  const size_t RM = static_cast<size_t>(R) * T;
  // Routing: K distinct experts per token, uniformly at random; rows packed expert-major per destination rank,
  // each expert's rows by source rank, then token (the zero-copy dispatch's final rows).
  std::mt19937 rng(12345);
  std::vector<int> idx(static_cast<size_t>(R) * T * K);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < T; ++t) {
      std::vector<int> perm(E);
      for (int i = 0; i < E; ++i) perm[i] = i;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int k = 0; k < K; ++k) idx[(static_cast<size_t>(s) * T + t) * K + k] = perm[k];
    }
  std::vector<int> cnt(static_cast<size_t>(R) * E, 0);  // [s][x]
  for (int s = 0; s < R; ++s)
    for (int i = 0; i < T * K; ++i) ++cnt[static_cast<size_t>(s) * E + idx[static_cast<size_t>(s) * T * K + i]];
  const size_t region = static_cast<size_t>(L) * RM * row;  // one destination rank's rows
  std::vector<int64_t> off(idx.size());
  std::vector<int> seen(static_cast<size_t>(R) * E, 0);
  size_t pairs = 0;
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int x = idx[(static_cast<size_t>(s) * T + t) * K + k], d = x / L;
        size_t begin = 0;
        for (int q = 0; q < s; ++q) begin += cnt[static_cast<size_t>(q) * E + x];
        const size_t r = static_cast<size_t>(x % L) * RM + begin + seen[static_cast<size_t>(s) * E + x]++;
        off[(static_cast<size_t>(s) * T + t) * K + k] = static_cast<int64_t>(d * region + r * row);
        ++pairs;
      }
  const size_t bytes = pairs * row;  // what the rows write, all ranks together
  uint8_t *x, *out;
  int64_t* doff;
  unsigned long long *w, *ns;
  CUDA_CHECK(cudaMalloc(&x, static_cast<size_t>(R) * T * row));
  CUDA_CHECK(cudaMalloc(&out, R * region));
  CUDA_CHECK(cudaMalloc(&doff, off.size() * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&w, 4096));
  CUDA_CHECK(cudaMalloc(&ns, 8));
  CUDA_CHECK(cudaMemset(x, 0x3c, static_cast<size_t>(R) * T * row));
  CUDA_CHECK(cudaMemset(out, 0, R * region));
  CUDA_CHECK(cudaMemcpy(doff, off.data(), off.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  uint8_t* scratch;
  CUDA_CHECK(cudaMalloc(&scratch, 2 * bytes + 4096));
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int G = a.blocks * R;  // every rank's blocks in one launch
  const int nbuf = std::max(1, std::min(kMaxBuf, 200 * 1024 / row)), tma_smem = nbuf * row;
  CUDA_CHECK(cudaFuncSetAttribute(rowsTmaKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tma_smem));
  int dev = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  printf("ll_floor: ranks %d, tokens %d, hidden %d (bf16), topk %d, experts %d; %d blocks a rank (%d in all, %d SMs);"
         " rows write %.2f MB in all; graph of %d launches, median of %d replays, us per launch\n",
         R, T, a.H, K, E, a.blocks, G, sms, bytes / 1e6, a.per_graph, a.reps);
  const double t_empty = graphUs(st, a.per_graph, a.reps, [&] { emptyKernel<<<G, kThreads, 0, st>>>(); });
  const double t_empty1 = graphUs(st, a.per_graph, a.reps, [&] { emptyKernel<<<1, 32, 0, st>>>(); });
  // The fused LL kernels are cooperative launches, chained ones also programmatic dependents of the one before.
  auto launchEx = [&](bool coop, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (coop) {
      attr[n].id = cudaLaunchAttributeCooperative;
      attr[n++].val.cooperative = 1;
    }
    if (pdl) {
      attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, emptyKernel));
  };
  const double t_coop = graphUs(st, a.per_graph, a.reps, [&] { launchEx(true, false); });
  const double t_chain = graphUs(st, a.per_graph, a.reps, [&] { launchEx(true, true); });
  printf("%-34s %8.2f us\n", "launch (empty kernel, LL grid)", t_empty);
  printf("%-34s %8.2f us\n", "launch (empty kernel, 1 block)", t_empty1);
  printf("%-34s %8.2f us\n", "launch (cooperative, LL grid)", t_coop);
  printf("%-34s %8.2f us\n", "launch (cooperative + PDL chain)", t_chain);
  for (int g : {a.blocks, sms / R}) {
    const double t = graphUs(st, a.per_graph, a.reps,
                             [&] { rowsKernel<<<g * R, kThreads, 0, st>>>(x, out, doff, R, T, K, row); });
    printf("rows, warps, %3d blocks a rank        %8.2f us  %7.1f GB/s written (incl. launch)\n", g, t,
           bytes / t / 1e3);
  }
  for (int g : {a.blocks, sms / R}) {
    const double t = graphUs(st, a.per_graph, a.reps, [&] {
      rowsTmaKernel<<<g * R, kThreads, tma_smem, st>>>(x, out, doff, R, T, K, row, nbuf, row);
    });
    printf("rows, bulk copies, %3d blocks a rank  %8.2f us  %7.1f GB/s written (incl. launch)\n", g, t,
           bytes / t / 1e3);
  }
  {
    const double t = graphUs(st, a.per_graph, a.reps, [&] {
      writeKernel<<<sms, kThreads, 0, st>>>(reinterpret_cast<int4*>(scratch), bytes / 16);
    });
    printf("%-34s %8.2f us  %7.1f GB/s written\n", "write (stores only, all SMs)", t, bytes / t / 1e3);
    const double c = graphUs(st, a.per_graph, a.reps, [&] {
      CUDA_CHECK(cudaMemcpyAsync(scratch + bytes, scratch, bytes, cudaMemcpyDeviceToDevice, st));
    });
    printf("%-34s %8.2f us  %7.1f GB/s read+written\n", "cudaMemcpyAsync of that many bytes", c, 2 * bytes / c / 1e3);
  }
  {
    const int rounds = 2000;
    CUDA_CHECK(cudaMemset(w, 0, 4096));
    pingPongKernel<<<2, 32, 0, st>>>(w, rounds, ns);
    unsigned long long v = 0;
    CUDA_CHECK(cudaMemcpyAsync(&v, ns, 8, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(cudaStreamSynchronize(st));
    printf("%-34s %8.3f us one way (%d round trips)\n", "flag (release store -> acquire poll)", v / 1e3 / (2.0 * rounds),
           rounds);
  }
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
