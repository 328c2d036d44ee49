// GPU engine, LL dispatch/combine and alltoallv, on the ranks of one host (several ranks may share one GPU
// under CUDA MPS). Exits 77 (skipped) without a GPU. Ranks: EPCOMM_GPU_TEST_RANKS (default "2,4,8").
//  - LL bit-exact against the host engine on fresh random structured inputs, outputs poisoned first: both
//    layouts, capacity 1, 2 and 128, bf16/fp16/fp32 and fp8, hidden 7168 and two other sizes, send and
//    receive halves issued separately (the receive on another stream), uneven and zero token counts;
//  - alltoallv with host counts and with device counts (capacity overflow dropped and counted), bit-exact
//    against the host engine;
//  - CUDA graphs: a 3-layer LL step (dispatch -> stand-in -> combine per layer) captured once and replayed
//    with fresh device-generated inputs, every replay bit-identical to eager calls interleaved with it; two
//    graphs on one communicator replayed alternately; the halves captured in separate graphs with work
//    between; alltoallv with device counts captured and replayed;
//  - late blocks: LL kernels on grids far larger than can be resident (EPCOMM_GPU_LL_BLOCKS), 10,000
//    operations with eager and captured launches mixed, results checked;
//  - split halves whose receives lag behind on a second stream (events only), send halves two operations ahead.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "common/routing.h"
#include "kernels/fp8.cuh"

namespace {

epConfig_t llConfig(int M, int E, int max_hidden = 7168) {
  epConfig_t cfg = gpuConfig();
  cfg.ll_max_tokens_per_rank = M;
  cfg.ll_num_experts = E;
  cfg.ll_max_hidden = max_hidden;
  cfg.ll_zero_copy_dispatch = 1;  // ignored across hosts (epLlDispatchBuffer then refuses)
  return cfg;
}

struct LlCase {
  int M, H, K, E, dtype, fp8, layout, split;  // split: 1 = halves in separate calls (receive on another stream)
};

// Tokens of `rank`: uneven, at most M, zero on rank 1 when R > 2.
int tokensOf(int rank, int R, int M) { return (rank == 1 && R > 2) ? 0 : M - (rank % 3 == 2 ? M / 2 : 0); }

struct LlBufs {  // dispatch outputs of one engine (host vectors or device buffers of the same sizes)
  size_t x, sc, cnt, src, lr, ti;
};

int runLlCase(epComm_t g, epComm_t h, int rank, int R, const LlCase& c, uint64_t seed, cudaStream_t s,
              cudaStream_t s2) {
  const int T = tokensOf(rank, R, c.M);
  Inputs in = makeInputs(seed, rank, T, c.H, c.K, c.E, c.dtype, true);
  epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
  a.num_tokens = T;
  a.max_tokens_per_rank = c.M;
  a.hidden = c.H;
  a.topk = c.K;
  a.num_experts = c.E;
  a.dtype = c.dtype;
  a.use_fp8 = c.fp8;
  a.layout = c.layout;
  epBufferSizes_t sz = EP_BUFFER_SIZES_INIT;
  CKE(epLlDispatchSizes(h, &a, &sz), h);
  // ---- host engine ----
  std::vector<uint8_t> hx(sz.recv_x, 0xA5);
  std::vector<float> hsc(sz.recv_x_scales / 4 + 1);
  memset(hsc.data(), 0xA5, hsc.size() * 4);
  std::vector<int> hcnt(sz.recv_count / 4, -7), hsrc(sz.recv_src_info / 4 + 1, -7);
  std::vector<int64_t> hlr(sz.recv_layout_range / 8 + 1, -7), hti(sz.recv_topk_idx / 8 + 1, -7);
  a.x = in.x.data();
  a.topk_idx = in.idx.data();
  a.recv_x = hx.data();
  a.recv_x_bytes = hx.size();
  a.recv_x_scales = c.fp8 ? hsc.data() : nullptr;
  a.recv_x_scales_bytes = c.fp8 ? hsc.size() * 4 : 0;
  a.recv_count = hcnt.data();
  a.recv_count_bytes = hcnt.size() * 4;
  const bool em = c.layout == EP_LL_EXPERT_MAJOR;
  a.recv_src_info = em ? hsrc.data() : nullptr;
  a.recv_src_info_bytes = em ? hsrc.size() * 4 : 0;
  a.recv_layout_range = em ? hlr.data() : nullptr;
  a.recv_layout_range_bytes = em ? hlr.size() * 8 : 0;
  a.recv_topk_idx = em ? nullptr : hti.data();
  a.recv_topk_idx_bytes = em ? 0 : hti.size() * 8;
  CKE(epLlDispatch(h, &a, nullptr), h);
  // ---- GPU engine ----
  DevBuf<uint8_t> dx(in.x.size() + 16), gx(hx.size());
  DevBuf<int64_t> didx(in.idx.size() + 1), gti(hti.size()), glr(hlr.size());
  DevBuf<float> gsc(hsc.size()), dw(in.w.size() + 1);
  DevBuf<int> gcnt(hcnt.size()), gsrc(hsrc.size());
  dx.upload(in.x);
  didx.upload(in.idx);
  dw.upload(in.w);
  gcnt.upload(std::vector<int>(hcnt.size(), -7));
  gsrc.upload(std::vector<int>(hsrc.size(), -7));
  glr.upload(std::vector<int64_t>(hlr.size(), -7));
  gti.upload(std::vector<int64_t>(hti.size(), -7));
  epLlDispatchArgs_t b = a;
  b.x = dx.p;
  b.topk_idx = didx.p;
  b.recv_x = gx.p;
  b.recv_x_scales = c.fp8 ? gsc.p : nullptr;
  b.recv_count = gcnt.p;
  b.recv_src_info = em ? gsrc.p : nullptr;
  b.recv_layout_range = em ? glr.p : nullptr;
  b.recv_topk_idx = em ? nullptr : gti.p;
  epResult_t ae;
  epErrorInfo_t info = EP_ERROR_INFO_INIT;
  const std::string what = "M " + std::to_string(c.M) + " H " + std::to_string(c.H) + " K " + std::to_string(c.K) +
                           " E " + std::to_string(c.E) + " dtype " + std::to_string(c.dtype) + " fp8 " +
                           std::to_string(c.fp8) + " layout " + std::to_string(c.layout) + " split " +
                           std::to_string(c.split) + " T " + std::to_string(T);
  // One GPU dispatch into (x_out, sc_out), then every output against the host engine's, unwritten rows included.
  auto dispatchAndCheck = [&](epLlDispatchArgs_t d, const char* mode) -> int {
    if (c.split) {
      d.phases = EP_LL_SEND;
      CKE(epLlDispatch(g, &d, s), g);
      CKC(cudaStreamSynchronize(s));  // the receive half on another stream, ordered after the send half
      d.phases = EP_LL_RECV;
      CKE(epLlDispatch(g, &d, s2), g);
      CKC(cudaStreamSynchronize(s2));
    } else {
      CKE(epLlDispatch(g, &d, s), g);
      CKC(cudaStreamSynchronize(s));
    }
    CKE(epCommGetAsyncError(g, &ae, &info), g);
    CK(ae == epSuccess && info.num_violations == 0, "%s LL dispatch (%s): async error %s, %llu violations (first: "
       "%s)", mode, what.c_str(), epGetErrorString(ae), static_cast<unsigned long long>(info.num_violations),
       epGetErrorString(info.violation));
    CK(gcnt.host() == hcnt, "%s: recv_count differs (%s)", mode, what.c_str());
    std::vector<uint8_t> ghx(hx.size());
    CKC(cudaMemcpy(ghx.data(), d.recv_x, hx.size(), cudaMemcpyDeviceToHost));
    const size_t drow = c.fp8 ? c.H : c.H * epDataTypeSize(static_cast<epDataType_t>(c.dtype));
    for (size_t r = 0; r < hx.size() / drow; ++r)
      CK(memcmp(ghx.data() + r * drow, hx.data() + r * drow, drow) == 0, "%s: recv_x row %zu differs (%s)", mode, r,
         what.c_str());
    if (c.fp8) {
      std::vector<uint8_t> gs(sz.recv_x_scales);
      CKC(cudaMemcpy(gs.data(), d.recv_x_scales, gs.size(), cudaMemcpyDeviceToHost));
      CK(memcmp(gs.data(), hsc.data(), gs.size()) == 0, "%s: recv_x_scales differ (%s)", mode, what.c_str());
    }
    if (em) {
      CK(gsrc.host() == hsrc, "%s: recv_src_info differs (%s)", mode, what.c_str());
      CK(glr.host() == hlr, "%s: recv_layout_range differs (%s)", mode, what.c_str());
    } else {
      CK(gti.host() == hti, "%s: recv_topk_idx differs (%s)", mode, what.c_str());
    }
    return 0;
  };
  if (dispatchAndCheck(b, "plain")) return 1;
  // Zero-copy dispatch (expert-major, one host): the senders write the rows straight into this rank's region,
  // poisoned first like the other outputs; refused across hosts and for rank-major rows.
  void* zx = nullptr;
  float* zsc = nullptr;
  size_t zxb = 0, zscb = 0;
  const epResult_t zr = epLlDispatchBuffer(g, &zx, &zxb, &zsc, &zscb);
  if (g_cross_hosts) {
    CK(zr == epNotSupported, "zero-copy LL dispatch across hosts: %s, not epNotSupported", epGetErrorString(zr));
  } else {
    CKE(zr, g);
    CK(zxb >= hx.size() && zscb >= sz.recv_x_scales, "zero-copy regions of %zu / %zu bytes for %zu / %zu", zxb, zscb,
       hx.size(), static_cast<size_t>(sz.recv_x_scales));
    epLlDispatchArgs_t z = b;
    z.recv_x = zx;
    z.recv_x_bytes = zxb;
    z.recv_x_scales = c.fp8 ? zsc : nullptr;
    z.recv_x_scales_bytes = c.fp8 ? zscb : 0;
    if (!em) {
      CK(epLlDispatch(g, &z, s) == epNotSupported, "a rank-major zero-copy dispatch was not refused: %s",
         epGetLastError(g));
    } else {
      CKC(cudaMemset(zx, 0xA5, hx.size()));
      CKC(cudaMemset(zsc, 0xA5, zscb));
      gcnt.upload(std::vector<int>(hcnt.size(), -7));
      gsrc.upload(std::vector<int>(hsrc.size(), -7));
      glr.upload(std::vector<int64_t>(hlr.size(), -7));
      // The host engine dispatches again too (same outputs), so that the masked-drop counters stay comparable.
      CKE(epLlDispatch(h, &a, nullptr), h);
      if (dispatchAndCheck(z, "zero-copy")) return 1;
    }
  }
  // ---- combine: y = stand-in over every row of the expert buffers (unwritten rows are poison on both) ----
  const int cdt = c.fp8 ? epBfloat16 : c.dtype;
  const size_t ces = epDataTypeSize(static_cast<epDataType_t>(cdt)), L = c.E / R;
  const size_t yrows = L * R * c.M, yn = yrows * c.H;
  // Expert input [L, R*M, H]: expert-major, the received rows; rank-major, row [l][s*M + t] = received row [s][t].
  std::vector<uint8_t> yin(yn * ces);
  for (size_t r = 0; r < yrows; ++r) {
    const size_t xr = em ? r : r % (static_cast<size_t>(R) * c.M);
    for (int j = 0; j < c.H; ++j) {
      const size_t i = r * c.H + j, xi = xr * c.H + j;
      const float v = c.fp8 ? epcomm::fp8ToFloat(hx[xi]) * hsc[xr * (c.H / 128) + j / 128]
                            : epcomm::loadAsFloat(hx.data(), xi, c.dtype);
      epcomm::storeFromFloat(yin.data(), i, cdt, v);
    }
  }
  std::vector<uint8_t> hy = expertHost(yin, yn, static_cast<float>(rank + 1), cdt);
  std::vector<uint8_t> hout(static_cast<size_t>(T) * c.H * ces, 0x5A);
  epLlCombineArgs_t ca = EP_LL_COMBINE_ARGS_INIT;
  ca.num_tokens = T;
  ca.max_tokens_per_rank = c.M;
  ca.hidden = c.H;
  ca.topk = c.K;
  ca.num_experts = c.E;
  ca.dtype = cdt;
  ca.layout = c.layout;
  ca.y = hy.data();
  ca.y_bytes = hy.size();
  ca.recv_count = hcnt.data();
  ca.recv_src_info = em ? hsrc.data() : nullptr;
  ca.recv_layout_range = em ? hlr.data() : nullptr;
  ca.recv_topk_idx = em ? nullptr : hti.data();
  ca.topk_idx = in.idx.data();
  ca.topk_weights = in.w.data();
  ca.out = hout.data();
  ca.out_bytes = hout.size();
  CKE(epLlCombine(h, &ca, nullptr), h);
  DevBuf<uint8_t> dyin(yin.size()), dy(yin.size()), dout(hout.size() + 16);
  dyin.upload(yin);
  expert(dyin.p, dy.p, yn, static_cast<float>(rank + 1), cdt, s);
  epLlCombineArgs_t cg = ca;
  cg.y = dy.p;
  cg.recv_count = gcnt.p;
  cg.recv_src_info = em ? gsrc.p : nullptr;
  cg.recv_layout_range = em ? glr.p : nullptr;
  cg.recv_topk_idx = em ? nullptr : gti.p;
  cg.topk_idx = didx.p;
  cg.topk_weights = dw.p;
  cg.out = dout.p;
  if (c.split) {
    cg.phases = EP_LL_SEND;
    CKE(epLlCombine(g, &cg, s), g);
    CKC(cudaStreamSynchronize(s));
    cg.phases = EP_LL_RECV;
    CKE(epLlCombine(g, &cg, s2), g);
    CKC(cudaStreamSynchronize(s2));
  } else {
    CKE(epLlCombine(g, &cg, s), g);
    CKC(cudaStreamSynchronize(s));
  }
  CKE(epCommGetAsyncError(g, &ae, &info), g);
  CK(ae == epSuccess && info.num_violations == 0, "LL combine: async error %s, %llu violations", epGetErrorString(ae),
     static_cast<unsigned long long>(info.num_violations));
  CK(memcmp(dy.host().data(), hy.data(), hy.size()) == 0, "stand-in expert differs (%s)", what.c_str());
  auto check = [&](const char* mode) -> int {
    auto gout = dout.host();
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < c.H; ++j) {
        const size_t i = static_cast<size_t>(t) * c.H + j;
        if (memcmp(gout.data() + i * ces, hout.data() + i * ces, ces) == 0) continue;
        CK(false, "%s combine: out[%d, %d] = %g on the GPU, %g on the host (%s)", mode, t, j,
           epcomm::loadAsFloat(gout.data(), i, cdt), epcomm::loadAsFloat(hout.data(), i, cdt), what.c_str());
      }
    return 0;
  };
  if (check("plain")) return 1;
  // Zero-copy: the expert outputs written into the communicator's region; peers read them from there. Not across
  // hosts (the owners cannot read the expert ranks' memory there): refused, and the communicator goes on.
  void* region = nullptr;
  size_t region_bytes = 0;
  if (g_cross_hosts) {
    CK(epLlCombineBuffer(g, &region, &region_bytes) == epNotSupported, "zero-copy LL combine across hosts was not "
       "refused");
    return 0;
  }
  CKE(epLlCombineBuffer(g, &region, &region_bytes), g);
  CK(region_bytes >= dy.bytes(), "zero-copy region of %zu bytes for %zu bytes of y", region_bytes, dy.bytes());
  CKC(cudaMemcpyAsync(region, dy.p, dy.bytes(), cudaMemcpyDeviceToDevice, s));
  CKC(cudaMemsetAsync(dout.p, 0x5A, dout.bytes(), s));
  cg.y = region;
  if (c.split) {
    cg.phases = EP_LL_SEND;
    CKE(epLlCombine(g, &cg, s), g);
    CKC(cudaStreamSynchronize(s));
    cg.phases = EP_LL_RECV;
    CKE(epLlCombine(g, &cg, s2), g);
    CKC(cudaStreamSynchronize(s2));
  } else {
    cg.phases = EP_LL_SEND_RECV;
    CKE(epLlCombine(g, &cg, s), g);
    CKC(cudaStreamSynchronize(s));
  }
  CKE(epCommGetAsyncError(g, &ae, &info), g);
  CK(ae == epSuccess && info.num_violations == 0, "zero-copy LL combine: async error %s, %llu violations",
     epGetErrorString(ae), static_cast<unsigned long long>(info.num_violations));
  return check("zero-copy");
}

// The GPU communicator under test and its host-engine reference; timeout_ms 0 keeps llConfig()'s deadline.
int initPair(int rank, int R, const epUniqueId& gid, const epUniqueId& hid, int M, int E, epComm_t* g, epComm_t* h,
             int timeout_ms = 0, int hosts = testHosts(), int max_hidden = 7168) {
  epConfig_t cfg = llConfig(M, E, max_hidden);
  if (timeout_ms > 0) cfg.timeout_ms = timeout_ms;
  CKE(initGpuComm(g, R, &gid, rank, &cfg, hosts), nullptr);
  epConfig_t hc = EP_CONFIG_INIT;
  hc.engine = EP_ENGINE_HOST;
  hc.queue_bytes = 16 << 20;
  hc.ll_max_tokens_per_rank = M;
  CKE(epCommInitRank(h, R, &hid, rank, &hc), nullptr);
  return 0;
}

class GpuLl : public ::testing::TestWithParam<int> {};

int runA2aRound(epComm_t g, epComm_t h, int rank, int R, int round, uint64_t seed, cudaStream_t s);

// Every rank runs `body` on a GPU / host communicator pair with capacity M and E experts, and two streams (the second
// for receive halves); the pair is destroyed after it. hosts: virtual hosts of the GPU communicator (default
// EPCOMM_GPU_TEST_HOSTS); max_hidden: config.ll_max_hidden (smaller for large M).
using PairBody = std::function<int(epComm_t g, epComm_t h, int rank, cudaStream_t s, cudaStream_t s2)>;
void runOnLlPair(int R, int M, int E, const PairBody& body, int hosts = testHosts(), int max_hidden = 7168,
                 int timeout_ms = 600000) {
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, M, E, &g, &h, 0, hosts, max_hidden)) return 1;
    cudaStream_t s, s2;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CKC(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    if (body(g, h, rank, s, s2)) return 1;
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, timeout_ms);
  expectAllRanksOk(codes, g_seed);
}

// Every rank runs `cases` (fresh seeds) on such a pair; a2a_rounds: alltoallv rounds after the LL cases on it.
void runCasesOnBothEngines(int R, int M, int E, const std::vector<LlCase>& cases, int hosts = testHosts(),
                           int a2a_rounds = 0, int max_hidden = 7168) {
  runOnLlPair(R, M, E, [&](epComm_t g, epComm_t h, int rank, cudaStream_t s, cudaStream_t s2) -> int {
    uint64_t seed_i = g_seed;
    for (const LlCase& c : cases) {
      if (rank == 0 && getenv("EPCOMM_GPU_TEST_VERBOSE"))
        fprintf(stderr, "LL case M %d H %d K %d E %d dtype %d fp8 %d layout %d split %d\n", c.M, c.H, c.K, c.E,
                c.dtype, c.fp8, c.layout, c.split);
      if (runLlCase(g, h, rank, R, c, ++seed_i, s, s2)) return 1;
    }
    for (int round = 0; round < a2a_rounds; ++round)
      if (runA2aRound(g, h, rank, R, round, seed_i, s)) return 1;
    return 0;
  }, hosts, max_hidden);
}

TEST_P(GpuLl, BitExactAgainstHostEngine) {
  const int R = GetParam();
  const int E = 32 * R;  // a multiple of top-8 blocks and of R
  const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
  runCasesOnBothEngines(R, 128, E, {
      {1, 7168, 8, E, epBfloat16, 0, EM, 0},    {2, 7168, 8, E, epBfloat16, 1, EM, 1},
      {128, 7168, 8, E, epBfloat16, 0, EM, 0},  {128, 7168, 8, E, epBfloat16, 1, EM, 1},
      {128, 7168, 8, E, epBfloat16, 0, RM, 1},  {128, 2048, 8, E, epBfloat16, 1, RM, 0},
      {1, 256, 4, E, epBfloat16, 1, RM, 0},     {2, 2048, 6, E, epFloat16, 0, EM, 1},
      {64, 256, 9, 9 * R, epFloat32, 0, EM, 0}, {64, 256, 9, 9 * R, epFloat32, 0, RM, 1},
      {96, 2048, 8, E, epFloat16, 1, EM, 0},
      // Fewer local experts than top-k: a token sends up to L rows to one rank (the packed combine blocks).
      {64, 2048, 8, 4 * R, epBfloat16, 0, EM, 0}, {64, 2048, 8, 4 * R, epBfloat16, 0, EM, 1},
  });
}

// 128 tokens x top-16 over 528 experts: the combine's table for positions would take 64 chunks x 528 bytes,
// over its 32 KiB, so the expert-major receive half counts positions without it (stageRouting's fallback).
// The zero-copy dispatch's positions without the token masks (more than 32 KiB of them: 1100 tokens x 256 experts):
// from the position table (top-2: the table is half the masks' size) and per warp (top-8: neither fits). Ranks with
// half the tokens still take the masks, so every way meets in one operation.
TEST_P(GpuLl, ZeroCopyDispatchPositionsWithoutTheMasks) {
  const int R = GetParam();
  runCasesOnBothEngines(R, 1100, 256, {
      {1100, 256, 2, 256, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 0},
      {1100, 256, 8, 256, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 1},
  }, testHosts(), 0, 256);
}

// Ranks held to a fifth of the GPU's threads under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read by each rank's
// CUDA initialization after the fork): the results stay exact. Should a fused cooperative launch be refused there
// (fewer blocks resident than the engine counted SMs for), the engine runs the halves as two launches, with a
// warning. On the H200 (s22) no such warning came at R = 2, 4, 8 at EPCOMM_DEBUG=WARN: the launches fitted as the
// ranks saw the GPU. Without MPS the variable has no effect and the test is an ordinary one.
TEST_P(GpuLl, HeldToPartOfTheGpuUnderMps) {
  const int R = GetParam();
  const int E = 32 * R;
  ScopedEnv env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "20");
  // Whether such a client is told fewer SMs (then the engine sizes its grid to them and never needs the fallback).
  printf("a client under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 sees %d SMs\n", gpuShape().sms);
  runCasesOnBothEngines(R, 128, E, {
      {128, 7168, 8, E, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 0},
      {64, 2048, 8, E, epBfloat16, 1, EP_LL_RANK_MAJOR, 0},
  });
}

// A grid (EPCOMM_GPU_LL_BLOCKS) that fits the GPU alone but not once per rank on it: the ranks' fused cooperative
// kernels could not all be resident, and one left waiting for SMs would hold its peers until the deadline; the
// engine runs such calls as two launches. One block more than the GPU's share per rank.
TEST_P(GpuLl, GridAboveEachRanksShareOfTheGpu) {
  const int R = GetParam();
  const int E = 32 * R;
  const GpuShape gpu = gpuShape();
  ASSERT_GT(gpu.devices, 0);
  ASSERT_GT(gpu.sms, 0);
  const int sharing = (R + gpu.devices - 1) / gpu.devices;  // selectDevice: rank % devices
  if (sharing < 2) GTEST_SKIP() << "one rank per GPU";
  ScopedEnv blocks("EPCOMM_GPU_LL_BLOCKS", std::to_string(gpu.sms / sharing + 1));
  runCasesOnBothEngines(R, 128, E, {
      {64, 2048, 8, E, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 0},
      {64, 2048, 8, E, epBfloat16, 1, EP_LL_EXPERT_MAJOR, 1},
      {32, 2048, 8, E, epBfloat16, 0, EP_LL_RANK_MAJOR, 0},
  });
}

TEST_P(GpuLl, CombinePositionsWithoutTheTable) {
  const int R = GetParam();
  const int E = 528;  // a multiple of 2, 4 and 8
  runCasesOnBothEngines(R, 128, E, {
      {128, 2048, 16, E, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 0},
      {128, 2048, 16, E, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 1},
  });
}

// ---------------------------------------------------------------------------------------------------------
// alltoallv
// ---------------------------------------------------------------------------------------------------------
// One alltoallv round on both engines (host counts, then device counts with a capacity that drops part of the
// tail on odd rounds), compared bit for bit.
int runA2aRound(epComm_t g, epComm_t h, int rank, int R, int round, uint64_t seed, cudaStream_t s) {
  // counts[src][dst] from one seed on every rank; sizes from 0 to about 3 MB per pair, odd element sizes
  const epDataType_t dt = round % 3 == 0 ? epFloat32 : round % 3 == 1 ? epBfloat16 : epUint8;
  const size_t es = epDataTypeSize(dt);
  std::mt19937_64 rng(seed * 31 + round);
  std::vector<size_t> cnt(static_cast<size_t>(R) * R);
  for (auto& v : cnt) v = rng() % 5 == 0 ? 0 : rng() % (round < 3 ? 1000 : 1500000 / es);
  std::vector<size_t> sc(R), sd(R), rc(R), rd(R);
  size_t st = 0, rt = 0;
  for (int p = 0; p < R; ++p) {
    sc[p] = cnt[static_cast<size_t>(rank) * R + p];
    sd[p] = st + 3;  // gaps between the pieces
    st += sc[p] + 3;
    rc[p] = cnt[static_cast<size_t>(p) * R + rank];
    rd[p] = rt + 1;
    rt += rc[p] + 1;
  }
  std::vector<uint8_t> send(st * es), hrecv(rt * es, 0xA5);
  for (auto& v : send) v = static_cast<uint8_t>(rng());
  CKE(epAlltoallv(h, send.data(), sc.data(), sd.data(), hrecv.data(), rc.data(), rd.data(), dt, nullptr), h);
  DevBuf<uint8_t> dsend(send.size() + 1), drecv(hrecv.size() + 1);
  dsend.upload(send);
  CKE(epAlltoallv(g, dsend.p, sc.data(), sd.data(), drecv.p, rc.data(), rd.data(), dt, s), g);
  CKC(cudaStreamSynchronize(s));
  CK_CLEAN_BUT_CAPACITY(g, "alltoallv (host counts)");
  auto grecv = drecv.host();
  for (size_t i = 0; i < hrecv.size(); ++i) {
    if (grecv[i] == hrecv[i]) continue;
    int src = 0;  // the source whose receive range holds element i / es
    while (src + 1 < R && rd[src + 1] * es <= i) ++src;
    CK(false, "alltoallv (host counts) round %d differs at byte %zu of %zu (source %d's range: %zu bytes from %zu): "
       "%02x on the GPU, %02x on the host", round, i, hrecv.size(), src, rc[src] * es, rd[src] * es, grecv[i], hrecv[i]);
  }
  // Device counts, packed, with a capacity that drops part of the tail on odd rounds.
  std::vector<int64_t> dsc(R);
  size_t total_in = 0;
  for (int p = 0; p < R; ++p) {
    dsc[p] = static_cast<int64_t>(sc[p]);
    total_in += rc[p];
  }
  std::vector<uint8_t> packed;
  for (int p = 0; p < R; ++p)
    packed.insert(packed.end(), send.begin() + sd[p] * es, send.begin() + (sd[p] + sc[p]) * es);
  const size_t cap = round & 1 ? total_in * 2 / 3 : total_in + 5;
  std::vector<uint8_t> hrecv2((cap + 1) * es, 0xA5);
  std::vector<int64_t> hrc(R, -1);
  int64_t hdrop = -1;
  epResult_t hr = epAlltoallvDevice(h, packed.data(), dsc.data(), hrecv2.data(), cap, hrc.data(), &hdrop, dt, nullptr);
  CK(hr == epSuccess || (hr == epCapacityExceeded && hdrop > 0), "host alltoallvDevice -> %s", epGetErrorString(hr));
  DevBuf<uint8_t> dpacked(packed.size() + 1), drecv2(hrecv2.size());
  DevBuf<int64_t> dcounts(R), drc(R), ddrop(1);
  dpacked.upload(packed);
  dcounts.upload(dsc);
  CKE(epAlltoallvDevice(g, dpacked.p, dcounts.p, drecv2.p, cap, drc.p, ddrop.p, dt, s), g);
  CKC(cudaStreamSynchronize(s));
  CK(memcmp(drecv2.host().data(), hrecv2.data(), hrecv2.size()) == 0, "alltoallv (device counts) round %d differs",
     round);
  CK(drc.host() == hrc, "recv_counts differ (round %d)", round);
  CK(ddrop.host()[0] == hdrop, "num_dropped %lld vs %lld", static_cast<long long>(ddrop.host()[0]),
     static_cast<long long>(hdrop));
  return 0;
}

// Ranks on two hosts (EPCOMM_HOSTID), whatever EPCOMM_GPU_TEST_HOSTS says: LL in both layouts, halves together
// and apart, bf16/fp16 and fp8, then alltoallv with host and device counts (capacity overflow included), through
// the GPU engine's proxy between the hosts, bit-exact against the host engine on one host; zero-copy LL combine
// is refused there (runLlCase checks it).
TEST_P(GpuLl, RanksOnTwoHostsRunThroughTheProxy) {
  const int R = GetParam();
  const int E = 32 * R;
  const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
  runCasesOnBothEngines(R, 128, E, {
      {1, 7168, 8, E, epBfloat16, 0, EM, 0},     {128, 7168, 8, E, epBfloat16, 1, EM, 1},
      {128, 2048, 8, E, epBfloat16, 0, RM, 1},   {2, 2048, 6, E, epFloat16, 0, EM, 1},
      {64, 2048, 8, 4 * R, epBfloat16, 0, EM, 0},
  }, 2, 4);
}

TEST_P(GpuLl, AlltoallvBitExactAgainstHostEngine) {
  const int R = GetParam();
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, 8, 8 * R, &g, &h)) return 1;
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int round = 0; round < 6; ++round)
      if (runA2aRound(g, h, rank, R, round, seed, s)) return 1;
    epResult_t ae;
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    CKE(epCommGetAsyncError(g, &ae, &info), g);
    // Odd rounds overflow on purpose: capacity violations only.
    CK(ae == epSuccess && (info.num_violations == 0 || info.violation == epCapacityExceeded), "async error %d, violation %d",
       ae, info.violation);
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// ---------------------------------------------------------------------------------------------------------
// Graphs and late blocks
// ---------------------------------------------------------------------------------------------------------

struct LlLayer {  // dispatch -> stand-in -> combine on device buffers
  int T, M, H, K, E, R, rank, layout;
  epComm_t comm;
  DevBuf<uint16_t> x, recv_x, y, out;
  DevBuf<float> scales, w;
  DevBuf<int64_t> idx, lr, ti;
  DevBuf<int> cnt, src;
  LlLayer(epComm_t c, int R_, int rank_, int T_, int M_, int H_, int K_, int E_, int layout_)
      : T(T_), M(M_), H(H_), K(K_), E(E_), R(R_), rank(rank_), layout(layout_), comm(c),
        x(static_cast<size_t>(T_) * H_), recv_x(static_cast<size_t>(E_) * M_ * H_), y(static_cast<size_t>(E_) * M_ * H_),
        out(static_cast<size_t>(T_) * H_), scales(1), w(static_cast<size_t>(T_) * K_), idx(static_cast<size_t>(T_) * K_),
        lr(E_), ti(static_cast<size_t>(R_) * M_ * K_), cnt(E_), src(static_cast<size_t>(E_) * M_) {}
  epLlDispatchArgs_t dargs(unsigned phases) {
    epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
    a.num_tokens = T;
    a.max_tokens_per_rank = M;
    a.hidden = H;
    a.topk = K;
    a.num_experts = E;
    a.layout = layout;
    a.phases = phases;
    a.x = x.p;
    a.topk_idx = idx.p;
    a.recv_x = recv_x.p;
    a.recv_x_bytes = recv_x.bytes();
    a.recv_count = cnt.p;
    a.recv_count_bytes = cnt.bytes();
    a.recv_src_info = src.p;
    a.recv_src_info_bytes = src.bytes();
    a.recv_layout_range = lr.p;
    a.recv_layout_range_bytes = lr.bytes();
    a.recv_topk_idx = ti.p;
    a.recv_topk_idx_bytes = ti.bytes();
    return a;
  }
  epLlCombineArgs_t cargs(unsigned phases, uint16_t* dst) {
    epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
    c.num_tokens = T;
    c.max_tokens_per_rank = M;
    c.hidden = H;
    c.topk = K;
    c.num_experts = E;
    c.layout = layout;
    c.phases = phases;
    c.y = y.p;
    c.y_bytes = y.bytes();
    c.recv_count = cnt.p;
    c.recv_src_info = src.p;
    c.recv_layout_range = lr.p;
    c.recv_topk_idx = ti.p;
    c.topk_idx = idx.p;
    c.topk_weights = w.p;
    c.out = dst;
    c.out_bytes = out.bytes();
    return c;
  }
  // One layer; the next layer's input is this layer's output (so three layers chain).
  bool zero_copy = false;  // the stand-in writes into the communicator's region (epLlCombineBuffer)
  bool zero_copy_dispatch = false;  // dispatch writes into the communicator's region (epLlDispatchBuffer)
  epResult_t run(cudaStream_t s, uint16_t* dst) {
    epLlDispatchArgs_t a = dargs(EP_LL_SEND_RECV);
    epResult_t r;
    if (zero_copy_dispatch) {
      float* sc;
      size_t sc_bytes;
      if ((r = epLlDispatchBuffer(comm, &a.recv_x, &a.recv_x_bytes, &sc, &sc_bytes)) != epSuccess) return r;
    }
    if ((r = epLlDispatch(comm, &a, s)) != epSuccess) return r;
    epLlCombineArgs_t c = cargs(EP_LL_SEND_RECV, dst);
    void* yz = y.p;
    size_t yz_bytes = y.bytes();
    if (zero_copy && (r = epLlCombineBuffer(comm, &yz, &yz_bytes)) != epSuccess) return r;
    expert(a.recv_x, yz, static_cast<size_t>(E / R) * R * M * H, static_cast<float>(rank + 1), epBfloat16, s);
    c.y = yz;
    c.y_bytes = yz_bytes;
    return epLlCombine(comm, &c, s);
  }
};

// Three layers share routing buffers but each has its own x; layer i + 1 takes layer i's output as its input.
struct LlStep {
  LlLayer l0, l1, l2;
  DevBuf<uint16_t> final_graph, final_eager;
  LlStep(epComm_t c, int R, int rank, int T, int H, int K, int E, int layout)
      : l0(c, R, rank, T, T, H, K, E, layout), l1(c, R, rank, T, T, H, K, E, layout),
        l2(c, R, rank, T, T, H, K, E, layout), final_graph(static_cast<size_t>(T) * H),
        final_eager(static_cast<size_t>(T) * H) {}
  epResult_t run(cudaStream_t s, uint16_t* dst) {
    epResult_t r;
    if ((r = l0.run(s, l1.x.p)) != epSuccess) return r;
    if ((r = l1.run(s, l2.x.p)) != epSuccess) return r;
    return l2.run(s, dst);
  }
  void gen(cudaStream_t s, uint64_t seed) {
    for (LlLayer* l : {&l0, &l1, &l2})
      genInputs<<<64, 256, 0, s>>>(l->x.p, l->idx.p, l->w.p, l->T, l->H, l->K, l->E, seed + 17 * (l - &l0), false);
  }
};

TEST_P(GpuLl, GraphReplayMatchesEager) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const int replays = getenv("EPCOMM_GPU_TEST_REPLAYS") ? atoi(getenv("EPCOMM_GPU_TEST_REPLAYS")) : 1000;
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int E = 8 * R;
    epConfig_t cfg = llConfig(64, E);
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LlStep A(comm, R, rank, 64, 512, 8, E, EP_LL_EXPERT_MAJOR), B(comm, R, rank, 32, 1024, 4, E, EP_LL_RANK_MAJOR);
    // Graph A's middle layer and graph B's last layer combine zero-copy (the region is captured as a fixed y).
    A.l1.zero_copy = !crossHosts();  // across hosts zero-copy is refused
    B.l2.zero_copy = !crossHosts();
    // Graph A's first two layers dispatch zero-copy (expert-major only): the regions are captured as fixed recv_x.
    A.l0.zero_copy_dispatch = A.l1.zero_copy_dispatch = !crossHosts();
    cudaGraph_t ga, gb;
    cudaGraphExec_t ea, eb;
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CKE(A.run(s, A.final_graph.p), comm);
    CKC(cudaStreamEndCapture(s, &ga));
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CKE(B.run(s, B.final_graph.p), comm);
    CKC(cudaStreamEndCapture(s, &gb));
    CKC(cudaGraphInstantiate(&ea, ga, 0));
    CKC(cudaGraphInstantiate(&eb, gb, 0));
    // The halves captured separately, with other work between them.
    LlLayer H1(comm, R, rank, 48, 48, 256, 6, E, EP_LL_EXPERT_MAJOR);
    DevBuf<uint16_t> h1_graph(static_cast<size_t>(48) * 256), h1_eager(static_cast<size_t>(48) * 256);
    cudaGraph_t gs, gr;
    cudaGraphExec_t es_, er_;
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    {
      epLlDispatchArgs_t a = H1.dargs(EP_LL_SEND);
      CKE(epLlDispatch(comm, &a, s), comm);
    }
    CKC(cudaStreamEndCapture(s, &gs));
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    {
      epLlDispatchArgs_t a = H1.dargs(EP_LL_RECV);
      CKE(epLlDispatch(comm, &a, s), comm);
      expert(H1.recv_x.p, H1.y.p, static_cast<size_t>(E / R) * R * 48 * 256, static_cast<float>(rank + 1), epBfloat16, s);
      epLlCombineArgs_t c = H1.cargs(EP_LL_SEND, h1_graph.p);
      CKE(epLlCombine(comm, &c, s), comm);
      c = H1.cargs(EP_LL_RECV, h1_graph.p);
      CKE(epLlCombine(comm, &c, s), comm);
    }
    CKC(cudaStreamEndCapture(s, &gr));
    CKC(cudaGraphInstantiate(&es_, gs, 0));
    CKC(cudaGraphInstantiate(&er_, gr, 0));
    DevBuf<uint16_t> scratch(1 << 20);
    for (int it = 0; it < replays; ++it) {
      if (it % 3 == 2) {
        genInputs<<<64, 256, 0, s>>>(H1.x.p, H1.idx.p, H1.w.p, H1.T, H1.H, H1.K, H1.E, seed * 100003 + it * 64 + rank, false);
        CKC(cudaGraphLaunch(es_, s));
        CKC(cudaMemsetAsync(scratch.p, it & 0xff, scratch.bytes(), s));  // work between the halves
        CKC(cudaGraphLaunch(er_, s));
        CKE(H1.run(s, h1_eager.p), comm);
        CKC(cudaStreamSynchronize(s));
        CK(h1_graph.host() == h1_eager.host(), "split-half replay %d differs from eager", it);
        continue;
      }
      LlStep& P = (it & 1) ? B : A;
      P.gen(s, seed * 100000 + it * 64 + rank);
      CKC(cudaGraphLaunch((it & 1) ? eb : ea, s));
      // Eager, interleaved on the same communicator with the same inputs (layer inputs 1 and 2 are recomputed).
      CKE(P.run(s, P.final_eager.p), comm);
      CKC(cudaStreamSynchronize(s));
      CK(P.final_graph.host() == P.final_eager.host(), "replay %d differs from eager", it);
    }
    CK_CLEAN(comm, "after the run");
    // alltoallv with device counts, captured and replayed with fresh counts.
    {
      const size_t cap = 4096;
      DevBuf<float> sb(static_cast<size_t>(R) * 512), rb(cap), rb_e(cap);
      DevBuf<int64_t> sc(R), rc(R), rc_e(R), drop(1), drop_e(1);
      cudaGraph_t gv;
      cudaGraphExec_t ev;
      CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      CKE(epAlltoallvDevice(comm, sb.p, sc.p, rb.p, cap, rc.p, drop.p, epFloat32, s), comm);
      CKC(cudaStreamEndCapture(s, &gv));
      CKC(cudaGraphInstantiate(&ev, gv, 0));
      for (int it = 0; it < replays / 4; ++it) {
        std::vector<int64_t> counts(R);
        std::mt19937 rng(static_cast<unsigned>(seed + it * 7 + rank));
        for (auto& v : counts) v = rng() % 513;
        std::vector<float> data(static_cast<size_t>(R) * 512);
        for (auto& v : data) v = static_cast<float>(rng() % 100000);
        sc.upload(counts);
        sb.upload(data);
        CKC(cudaGraphLaunch(ev, s));
        CKE(epAlltoallvDevice(comm, sb.p, sc.p, rb_e.p, cap, rc_e.p, drop_e.p, epFloat32, s), comm);
        CKC(cudaStreamSynchronize(s));
        CK(rc.host() == rc_e.host() && drop.host() == drop_e.host(), "alltoallv replay %d: counts differ", it);
        int64_t n = 0;
        for (int64_t v : rc.host()) n += v;
        auto g = rb.host(), e = rb_e.host();
        CK(memcmp(g.data(), e.data(), static_cast<size_t>(std::min<int64_t>(n, cap)) * 4) == 0,
           "alltoallv replay %d differs from eager", it);
      }
      cudaGraphExecDestroy(ev);
    }
    cudaGraphExecDestroy(ea);
    cudaGraphExecDestroy(eb);
    cudaGraphExecDestroy(es_);
    cudaGraphExecDestroy(er_);
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 900000);
  expectAllRanksOk(codes, seed);
}

// Elastic ranks and graphs: a 3-layer LL step (zero-copy middle layer) captured while every rank is active is
// replayed after the last rank left and was masked, without recapture: every replay equals eager calls under
// the mask, and the replays count the dropped rows.
TEST_P(GpuLl, GraphReplayedAfterAMaskChange) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int E = 8 * R;
    epConfig_t cfg = llConfig(64, E);
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LlStep A(comm, R, rank, 64, 512, 8, E, EP_LL_EXPERT_MAJOR);
    A.l1.zero_copy = !crossHosts();
    cudaGraph_t ga;
    cudaGraphExec_t ea;
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CKE(A.run(s, A.final_graph.p), comm);
    CKC(cudaStreamEndCapture(s, &ga));
    CKC(cudaGraphInstantiate(&ea, ga, 0));
    auto replay = [&](int it) -> int {
      A.gen(s, seed * 100000 + it * 64 + rank);
      CKC(cudaGraphLaunch(ea, s));
      CKE(A.run(s, A.final_eager.p), comm);
      CKC(cudaStreamSynchronize(s));
      CK(A.final_graph.host() == A.final_eager.host(), "replay %d differs from eager", it);
      return 0;
    };
    for (int it = 0; it < 5; ++it)
      if (replay(it)) return 1;
    CKE(epCommBarrier(comm, s), comm);
    if (rank == R - 1) _exit(0);  // leaves between replays
    CKE(maskRanks(comm, R, {R - 1}, s), comm);
    std::vector<int64_t> before(R), after(R);
    CKE(epCommGetMaskedDrops(comm, before.data(), nullptr, s), comm);
    for (int it = 5; it < 55; ++it)
      if (replay(it)) return 1;
    CKE(epCommGetMaskedDrops(comm, after.data(), nullptr, s), comm);
    CK(after[R - 1] > before[R - 1], "graph replays under the mask counted no dropped rows (%lld)",
       static_cast<long long>(after[R - 1]));
    CK_CLEAN(comm, "after the replays");
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 300000);
  for (int r = 0; r < R - 1; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R << ", seed " << seed;
}

// ---------------------------------------------------------------------------------------------------------
// Elastic ranks: the last rank is killed (SIGKILL) mid-run; the survivors' next LL operation times out (once),
// they mask it on both engines, then 100+ operations — LL (both layouts, fp8, split halves) and alltoallv (both
// variants) — match the host engine bit for bit with the same drop counters, with no waiting; barrier among the
// survivors. With R >= 4 rank 1 leaves later, between operations, and the same holds for the rest.
// ---------------------------------------------------------------------------------------------------------
TEST_P(GpuLl, KilledRankMaskedBitExactAgainstHostEngine) {
  const int R = GetParam();
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  const int iters = getenv("EPCOMM_GPU_TEST_ELASTIC_ITERS") ? atoi(getenv("EPCOMM_GPU_TEST_ELASTIC_ITERS")) : 7;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int E = 32 * R;
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, 128, E, &g, &h, 3000)) return 1;
    cudaStream_t s, s2;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CKC(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
    const LlCase cases[] = {
        {128, 7168, 8, E, epBfloat16, 0, EM, 0}, {128, 7168, 8, E, epBfloat16, 1, EM, 1},
        {64, 2048, 8, E, epBfloat16, 0, RM, 1},  {2, 2048, 6, E, epFloat16, 1, RM, 0},
    };
    uint64_t seed_i = seed;
    if (runLlCase(g, h, rank, R, cases[0], ++seed_i, s, s2)) return 1;  // everyone, before the death
    {
      LlLayer L(g, R, rank, 32, 128, 512, 4, E, EM);
      genInputs<<<16, 256, 0, s>>>(L.x.p, L.idx.p, L.w.p, L.T, L.H, L.K, L.E, seed + rank, false);
      CKC(cudaStreamSynchronize(s));
      if (rank == R - 1) kill(getpid(), SIGKILL);
      CKE(L.run(s, L.out.p), g);  // enqueued; its waits for the dead rank end at the deadline
      CKC(cudaStreamSynchronize(s));
      epResult_t ae;
      epErrorInfo_t info = EP_ERROR_INFO_INIT;
      CKE(epCommGetAsyncError(g, &ae, &info), g);
      CK(ae == epTimeout, "the step with a dead rank: async error %s (peer %d)", epGetErrorString(ae), info.peer);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<int> gone = {R - 1};
    CKE(maskRanks(g, R, gone, s), g);
    CKE(maskRanks(h, R, gone, nullptr), h);
    std::vector<int32_t> act(R, -1);
    CKE(epCommGetActiveRanks(g, act.data()), g);
    CK(act[R - 1] == 0 && act[0] == 1, "epCommGetActiveRanks: %d %d", act[0], act[R - 1]);
    int ops = 0;
    for (int phase = 0; phase < 2; ++phase) {
      if (phase == 1) {
        if (R < 4) break;
        if (rank == 1) _exit(0);  // a second rank leaves, between operations
        gone.push_back(1);
        CKE(maskRanks(h, R, gone, nullptr), h);
        CKE(maskRanks(g, R, gone, s), g);
      }
      for (int it = 0; it < (phase == 0 ? iters : 1); ++it) {
        for (const LlCase& c : cases) {
          if (runLlCase(g, h, rank, R, c, ++seed_i, s, s2)) return 1;
          ops += 2;
        }
        // Even rounds only: an odd round's capacity overflow is a (cumulative) violation the LL checks would see.
        for (int round = 0; round < 6; round += 2) {
          if (runA2aRound(g, h, rank, R, round, ++seed_i, s)) return 1;
          ops += 2;
        }
      }
      CK_SAME_DROPS(g, h, R);
      CKE(epCommBarrier(g, s), g);
      CKE(epCommBarrier(h, nullptr), h);
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) printf("elastic: %d GPU operations after the mask, %.0f ms\n", ops, ms);
    std::vector<int64_t> rows(R, 0);
    CKE(epCommGetMaskedDrops(g, rows.data(), nullptr, s), g);
    CK(rows[R - 1] > 0, "no dispatch rows counted as dropped to the masked rank");
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 900000);
  for (int r = 0; r < R - 1; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R << ", seed " << seed;
}

// Recovery without a death. (1) Rank 0 rejects an LL call that the others launch: their waits time out and
// rank 0's LL epochs fall one behind theirs. (2) Every rank calls epCommSetActiveRanks with nobody masked: the
// survivors continue from the largest epochs and the communicator is usable again — LL and alltoallv bit-exact
// against the host engine. (3) A rejected epCommSetActiveRanks (rank 0 masks itself) makes the others fail at
// once, not at their deadline; a correct call afterwards succeeds everywhere.
TEST_P(GpuLl, RecoveryWithoutADeath) {
  const int R = GetParam();
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int E = 32 * R;
    const int timeout_ms = shortDeadlineMs(1500);
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, 128, E, &g, &h, timeout_ms)) return 1;
    cudaStream_t s, s2;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CKC(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    LlLayer P(g, R, rank, 32, 32, 512, 4, E, EP_LL_EXPERT_MAJOR);
    DevBuf<uint16_t> first(static_cast<size_t>(32) * 512), again(static_cast<size_t>(32) * 512);
    genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, seed + rank, false);
    CKE(P.run(s, first.p), g);
    CKC(cudaStreamSynchronize(s));
    const auto want = first.host();
    // (1)
    if (rank == 0) {
      epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV);
      a.recv_x_bytes = 1;  // below what the size helper says: refused here, launched nothing
      const epResult_t r = epLlDispatch(g, &a, s);
      CK(r == epBufferTooSmall, "rank 0's call was not refused: %s", epGetErrorString(r));
    } else {
      CKE(P.run(s, again.p), g);
      CKC(cudaStreamSynchronize(s));
      epResult_t ae;
      CKE(epCommGetAsyncError(g, &ae, nullptr), g);
      CK(ae == epTimeout, "without rank 0 the step should time out, got %s", epGetErrorString(ae));
    }
    // (2)
    CKE(maskRanks(g, R, {}, s), g);
    CK_CLEAN(g, "after the no-op mask");
    const LlCase cases[] = {{128, 7168, 8, E, epBfloat16, 0, EP_LL_EXPERT_MAJOR, 1},
                            {64, 2048, 8, E, epBfloat16, 1, EP_LL_RANK_MAJOR, 0}};
    uint64_t seed_i = seed;
    for (const LlCase& c : cases)
      if (runLlCase(g, h, rank, R, c, ++seed_i, s, s2)) return 1;
    for (int round = 0; round < 4; round += 2)
      if (runA2aRound(g, h, rank, R, round, ++seed_i, s)) return 1;
    // (3)
    const auto t0 = std::chrono::steady_clock::now();
    if (rank == 0) {
      const epResult_t r = maskRanks(g, R, {0}, s);
      CK(r == epInvalidArgument, "masking itself: %s", epGetErrorString(r));
    } else {
      const epResult_t r = maskRanks(g, R, {}, s);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      CK(r == epInvalidUsage, "a peer rejected the call: got %s (%s)", epGetErrorString(r), epGetLastError(g));
      CK(ms < timeout_ms, "the rejection reached this rank after %.0f ms", ms);
    }
    CKE(maskRanks(g, R, {}, s), g);
    CKE(P.run(s, again.p), g);
    CKC(cudaStreamSynchronize(s));
    CK(again.host() == want, "after the recoveries the step's result differs");
    CK_CLEAN(g, "after the run");
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// The rank body of the many-operations tests: an LL layer (16 tokens, hidden 128, top-4, 4 R experts) run once
// eagerly for the reference, a graph of `graph_steps` steps captured, then `ops` operations (a dispatch and a
// combine per step) back to back on one stream, each step a replay or eager as `replay` says, each dispatch
// zero-copy or plain as `zero_copy` says, results checked every `check_every` steps and at the end.
struct ManyOps {
  int ops, graph_steps, check_every;
  const char* what;  // the configuration, for the failure message
  std::function<bool(int step)> replay, zero_copy;
};
int manyOperations(int R, int rank, const epUniqueId& gid, uint64_t seed, const ManyOps& m) {
  const int E = 4 * R;
  epConfig_t cfg = llConfig(16, E);
  epComm_t comm;
  CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
  cudaStream_t s;
  CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LlLayer P(comm, R, rank, 16, 16, 128, 4, E, EP_LL_EXPERT_MAJOR);
  DevBuf<uint16_t> first(static_cast<size_t>(16) * 128), again(static_cast<size_t>(16) * 128);
  genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, seed + rank, false);
  CKE(P.run(s, first.p), comm);
  cudaGraph_t gph;
  cudaGraphExec_t ex;
  CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < m.graph_steps; ++r) CKE(P.run(s, again.p), comm);
  CKC(cudaStreamEndCapture(s, &gph));
  CKC(cudaGraphInstantiate(&ex, gph, 0));
  CKC(cudaStreamSynchronize(s));
  const auto want = first.host();
  for (int i = 0; i < m.ops; i += 2) {  // each step is a dispatch and a combine: ops counts both
    P.zero_copy_dispatch = m.zero_copy(i / 2);
    if (m.replay(i / 2)) CKC(cudaGraphLaunch(ex, s));
    else CKE(P.run(s, again.p), comm);
    if ((i / 2) % m.check_every == 0 || i + 2 >= m.ops) {
      CKC(cudaStreamSynchronize(s));
      CK(again.host() == want, "operation %d (%s): result differs from the first run", i, m.what);
    }
  }
  CK_CLEAN(comm, "after the run");
  cudaGraphExecDestroy(ex);
  CKE(epCommDestroy(comm), comm);
  return 0;
}

TEST_P(GpuLl, LateBlocksManyOperations) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const int ops = getenv("EPCOMM_GPU_TEST_LATE_OPS") ? atoi(getenv("EPCOMM_GPU_TEST_LATE_OPS")) : 10000;
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    setenv("EPCOMM_GPU_LL_BLOCKS", "2048", 1);  // far more blocks than can be resident (132 SMs)
    // Ranks sharing one GPU under MPS: each client gets its share of the SMs, so that one rank's waiting blocks
    // cannot occupy the SMs a peer's send half needs (a scheduling limit of one shared GPU, not of the protocol).
    setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", std::to_string(100 / (R + 1)).c_str(), 1);
    CKC(selectDevice(rank));
    // Eager steps alternate plain and zero-copy dispatches (one host): the same rows, so the same result.
    return manyOperations(R, rank, gid, seed, {ops, 1, 500, "2048 blocks", [](int step) { return step % 3 == 1; },
                                               [](int step) { return !crossHosts() && step % 3 == 2; }});
  }, 900000);
  expectAllRanksOk(codes, seed);
}

// Chained launches (EPCOMM_GPU_LL_PDL_CHAIN=2: each fused kernel parked behind the one before it) at the block count
// that just fits the bound, (2 x ranks on the GPU - 1) x blocks <= SMs, many operations back to back on one stream
// with no host sync between them, eager steps and graph replays mixed: no deadline passes, every checked result
// equals the first run. At R = 2 on one H200 that is the default 44 blocks.
TEST_P(GpuLl, ChainedLaunchesManyOperations) {
  const int R = GetParam();
  if (crossHosts()) GTEST_SKIP() << "chained launches are for ranks of one host";
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const int ops = getenv("EPCOMM_GPU_TEST_CHAIN_OPS") ? atoi(getenv("EPCOMM_GPU_TEST_CHAIN_OPS")) : 2000;
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    int dev = 0, sms = 0, count = 0;
    CKC(cudaGetDevice(&dev));
    CKC(cudaGetDeviceCount(&count));
    CKC(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int sharing = (R + count - 1) / count;  // ranks on this GPU (selectDevice: rank % devices)
    const int blocks = std::max(1, std::min(64, sms / (2 * sharing - 1)));
    setenv("EPCOMM_GPU_LL_PDL_CHAIN", "2", 1);
    setenv("EPCOMM_GPU_LL_BLOCKS", std::to_string(blocks).c_str(), 1);
    const std::string what = std::to_string(blocks) + " blocks, chained";
    // Three steps per replay (chained edges inside the graph); plain and zero-copy dispatches alike.
    return manyOperations(R, rank, gid, seed, {ops, 3, 250, what.c_str(), [](int step) { return step % 4 == 3; },
                                               [](int step) { return step % 4 >= 2; }});
  }, 600000);
  expectAllRanksOk(codes, seed);
}

// Holds the calling stream for `ns` nanoseconds (a receive that lags behind its send half).
__global__ void holdStream(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// Split halves with the receives on a second stream, ordered after their send halves by events only, and the last
// rank's receives held back: its send halves run up to two operations ahead of its receives. Zero-copy dispatches
// whose rows this test does not read, so each send half may be issued at once (the region's lifetime allows it);
// that makes the send half of e + 2 wait for its own rank's acknowledgement of e (zero-copy entries live in four
// slots, and the check of e - 2 comes before a send half completes). Every operation's recv_count,
// recv_src_info and recv_layout_range (caller memory, one set per operation) equal the host engine's.
TEST_P(GpuLl, SplitHalvesWithALaggingReceive) {
  const int R = GetParam();
  if (crossHosts()) GTEST_SKIP() << "zero-copy dispatch is for ranks of one host";
  const int ops = 24, M = 32, H = 512, K = 4, E = 4 * R;
  const uint64_t seed = g_seed;
  runOnLlPair(R, M, E, [&](epComm_t g, epComm_t h, int rank, cudaStream_t s, cudaStream_t s2) -> int {
    const int T = tokensOf(rank, R, M);
    epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
    a.num_tokens = T;
    a.max_tokens_per_rank = M;
    a.hidden = H;
    a.topk = K;
    a.num_experts = E;
    a.dtype = epBfloat16;
    a.layout = EP_LL_EXPERT_MAJOR;
    epBufferSizes_t sz = EP_BUFFER_SIZES_INIT;
    CKE(epLlDispatchSizes(h, &a, &sz), h);
    std::vector<Inputs> in;
    std::vector<std::unique_ptr<DevBuf<uint8_t>>> dx;
    std::vector<std::unique_ptr<DevBuf<int64_t>>> didx, glr;
    std::vector<std::unique_ptr<DevBuf<int>>> gcnt, gsrc;
    std::vector<cudaEvent_t> sent(ops);
    for (int i = 0; i < ops; ++i) {
      in.push_back(makeInputs(seed * 31 + i, rank, T, H, K, E, epBfloat16, true));
      dx.emplace_back(new DevBuf<uint8_t>(in[i].x.size() + 16));
      didx.emplace_back(new DevBuf<int64_t>(in[i].idx.size() + 1));
      dx[i]->upload(in[i].x);
      didx[i]->upload(in[i].idx);
      gcnt.emplace_back(new DevBuf<int>(sz.recv_count / 4));
      gsrc.emplace_back(new DevBuf<int>(sz.recv_src_info / 4));
      glr.emplace_back(new DevBuf<int64_t>(sz.recv_layout_range / 8));
      CKC(cudaEventCreateWithFlags(&sent[i], cudaEventDisableTiming));
    }
    for (int i = 0; i < ops; ++i) {
      void* zx = nullptr;
      float* zsc = nullptr;
      size_t zxb = 0, zscb = 0;
      CKE(epLlDispatchBuffer(g, &zx, &zxb, &zsc, &zscb), g);
      epLlDispatchArgs_t d = a;
      d.x = dx[i]->p;
      d.topk_idx = didx[i]->p;
      d.recv_x = zx;
      d.recv_x_bytes = zxb;
      d.recv_count = gcnt[i]->p;
      d.recv_count_bytes = gcnt[i]->bytes();
      d.recv_src_info = gsrc[i]->p;
      d.recv_src_info_bytes = gsrc[i]->bytes();
      d.recv_layout_range = glr[i]->p;
      d.recv_layout_range_bytes = glr[i]->bytes();
      d.phases = EP_LL_SEND;
      CKE(epLlDispatch(g, &d, s), g);
      CKC(cudaEventRecord(sent[i], s));
      CKC(cudaStreamWaitEvent(s2, sent[i], 0));
      if (rank == R - 1) holdStream<<<1, 1, 0, s2>>>(200000);  // 0.2 ms
      d.phases = EP_LL_RECV;
      CKE(epLlDispatch(g, &d, s2), g);
    }
    CKC(cudaStreamSynchronize(s));
    CKC(cudaStreamSynchronize(s2));
    CK_CLEAN(g, "after the lagging receives");
    for (int i = 0; i < ops; ++i) {
      std::vector<uint8_t> hx(sz.recv_x);
      std::vector<int> hcnt(sz.recv_count / 4, -7), hsrc(sz.recv_src_info / 4, -7);
      std::vector<int64_t> hlr(sz.recv_layout_range / 8, -7);
      epLlDispatchArgs_t d = a;
      d.x = in[i].x.data();
      d.topk_idx = in[i].idx.data();
      d.recv_x = hx.data();
      d.recv_x_bytes = hx.size();
      d.recv_count = hcnt.data();
      d.recv_count_bytes = hcnt.size() * 4;
      d.recv_src_info = hsrc.data();
      d.recv_src_info_bytes = hsrc.size() * 4;
      d.recv_layout_range = hlr.data();
      d.recv_layout_range_bytes = hlr.size() * 8;
      CKE(epLlDispatch(h, &d, nullptr), h);
      CK(gcnt[i]->host() == hcnt, "operation %d: recv_count differs", i);
      CK(glr[i]->host() == hlr, "operation %d: recv_layout_range differs", i);
      // recv_src_info: the rows each expert received (the rest is unwritten poison on both sides).
      const std::vector<int> gs = gsrc[i]->host();
      for (int l = 0; l < E / R; ++l)
        for (int r = 0; r < hcnt[l]; ++r) {
          const size_t k = static_cast<size_t>(l) * R * M + r;
          CK(gs[k] == hsrc[k], "operation %d: recv_src_info[%d][%d] = %d, not %d", i, l, r, gs[k], hsrc[k]);
        }
    }
    for (cudaEvent_t ev : sent) cudaEventDestroy(ev);
    return 0;
  }, testHosts(), 7168, 300000);
}

// The GPU engine's host-side checks (the C API's contract): bad arguments on every rank are rejected before
// anything is launched, with their own code and a message, and the next valid call works (its result checked
// against the first run of the same step). Rejections that only the GPU engine makes are covered too: limits
// its buffers were sized for, the order of halves, alignment, zero-copy regions.
TEST_P(GpuLl, RejectedCallsLeaveTheCommunicatorUsable) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int E = 8 * R;
    epConfig_t cfg = llConfig(32, E);
    cfg.ll_max_hidden = 1024;
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LlLayer P(comm, R, rank, 32, 32, 512, 4, E, EP_LL_EXPERT_MAJOR);
    DevBuf<uint16_t> first(static_cast<size_t>(32) * 512), again(static_cast<size_t>(32) * 512);
    genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, seed + rank, false);
    CKE(P.run(s, first.p), comm);
    CKC(cudaStreamSynchronize(s));
    const auto want = first.host();
    struct Bad {
      const char* what;
      epResult_t code;
      std::function<epResult_t()> call;
    };
    DevBuf<uint8_t> raw(1 << 20);
    std::vector<Bad> bad = {
        {"hidden over config.ll_max_hidden", epInvalidHidden,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV); a.hidden = 2048; return epLlDispatch(comm, &a, s); }},
        {"num_experts over config.ll_num_experts", epInvalidNumExperts,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV); a.num_experts = 2 * E; return epLlDispatch(comm, &a, s); }},
        {"max_tokens_per_rank over the capacity", epCapacityExceeded,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV); a.max_tokens_per_rank = 64; return epLlDispatch(comm, &a, s); }},
        {"recv_x NULL", epNullPointer,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV); a.recv_x = nullptr; return epLlDispatch(comm, &a, s); }},
        {"receive half without a send half", epInvalidUsage,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_RECV); return epLlDispatch(comm, &a, s); }},
        {"x not 16-byte aligned", epInvalidArgument,
         [&] { epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV); a.x = raw.p + 2; return epLlDispatch(comm, &a, s); }},
        {"combine y too small", epBufferTooSmall,
         [&] { epLlCombineArgs_t c = P.cargs(EP_LL_SEND_RECV, again.p); c.y_bytes = 16; return epLlCombine(comm, &c, s); }},
        {"combine receive half without a send half", epInvalidUsage,
         [&] { epLlCombineArgs_t c = P.cargs(EP_LL_RECV, again.p); return epLlCombine(comm, &c, s); }},
        {"alltoallv with a NULL count array", epNullPointer,
         [&] { return epAlltoallvDevice(comm, raw.p, nullptr, raw.p, 16, nullptr, nullptr, epFloat32, s); }},
        {"zero-copy buffer with NULL out pointers", epNullPointer, [&] { return epLlCombineBuffer(comm, nullptr, nullptr); }},
        {"zero-copy dispatch buffer with NULL out pointers", epNullPointer,
         [&] { return epLlDispatchBuffer(comm, nullptr, nullptr, nullptr, nullptr); }},
    };
    // Zero-copy dispatch regions used wrongly (one host: across hosts epLlDispatchBuffer refuses, runLlCase checks).
    void* zx = nullptr;
    float* zsc = nullptr;
    size_t zxb = 0, zscb = 0;
    if (!crossHosts()) {
      CKE(epLlDispatchBuffer(comm, &zx, &zxb, &zsc, &zscb), comm);
      bad.push_back({"recv_x inside a zero-copy dispatch region, not at its start", epInvalidArgument, [&] {
                       epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV);
                       a.recv_x = static_cast<uint8_t*>(zx) + 1024;
                       a.recv_x_bytes = zxb - 1024;
                       return epLlDispatch(comm, &a, s);
                     }});
      bad.push_back({"fp8 zero-copy dispatch with scales outside the region", epInvalidArgument, [&] {
                       epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV);
                       a.use_fp8 = 1;
                       a.recv_x = zx;
                       a.recv_x_bytes = zxb;
                       a.recv_x_scales = P.scales.p;
                       a.recv_x_scales_bytes = static_cast<size_t>(E) * 32 * 4 * 4;
                       return epLlDispatch(comm, &a, s);
                     }});
    }
    for (const Bad& b : bad) {
      const epResult_t r = b.call();
      CK(r == b.code, "%s: got %s, want %s (%s)", b.what, epGetErrorString(r), epGetErrorString(b.code),
         epGetLastError(comm));
      CK(strlen(epGetLastError(comm)) > 0, "%s: no message", b.what);
      CKE(P.run(s, again.p), comm);  // the next valid step works and gives the same result
      CKC(cudaStreamSynchronize(s));
      CK(again.host() == want, "after '%s' the next step's result differs", b.what);
    }
    // A send half outstanding: a second send half is refused, the receive half then completes normally.
    {
      epLlDispatchArgs_t a = P.dargs(EP_LL_SEND);
      CKE(epLlDispatch(comm, &a, s), comm);
      const epResult_t r = epLlDispatch(comm, &a, s);
      CK(r == epInvalidUsage, "a second send half while one is outstanding: %s", epGetErrorString(r));
      a.phases = EP_LL_RECV;
      CKE(epLlDispatch(comm, &a, s), comm);
      epLlCombineArgs_t c = P.cargs(EP_LL_SEND_RECV, again.p);
      expert(P.recv_x.p, P.y.p, static_cast<size_t>(E / R) * R * 32 * 512, static_cast<float>(rank + 1), epBfloat16, s);
      CKE(epLlCombine(comm, &c, s), comm);
      CKC(cudaStreamSynchronize(s));
      CK(again.host() == want, "split halves after a refused second send half: result differs");
    }
    CK_CLEAN(comm, "after the run");
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// A zero-copy combine whose routing names more rows of an expert than its dispatch sent there (every token to
// expert 0): the receive half must not read past the rows the expert rank published. It records an
// epInvalidUsage violation, leaves those contributions out, and the next step with the dispatched routing gives
// the first step's result.
TEST_P(GpuLl, ZeroCopyCombineWithAnotherRoutingIsAViolation) {
  if (crossHosts()) GTEST_SKIP() << "zero-copy LL combine does not cross hosts";
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int T = 32, H = 512, K = 4, E = 8 * R;
    epConfig_t cfg = llConfig(T, E);
    cfg.ll_max_hidden = 1024;
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LlLayer P(comm, R, rank, T, T, H, K, E, EP_LL_EXPERT_MAJOR);
    P.zero_copy = true;
    DevBuf<uint16_t> first(static_cast<size_t>(T) * H), again(static_cast<size_t>(T) * H);
    genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, T, H, K, E, seed + rank, false);
    CKE(P.run(s, first.p), comm);
    CKC(cudaStreamSynchronize(s));
    CK_CLEAN(comm, "after the first step");
    const auto want = first.host();
    const std::vector<int64_t> routing = P.idx.host();
    int to0 = 0;  // this rank's tokens that the dispatch sends to expert 0
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) to0 += routing[static_cast<size_t>(t) * K + k] == 0;
    CK(to0 < T, "the random routing sends all %d tokens to expert 0", T);
    // Dispatch with the routing, stand-in into the region, combine with every token's first pair on expert 0.
    epLlDispatchArgs_t a = P.dargs(EP_LL_SEND_RECV);
    CKE(epLlDispatch(comm, &a, s), comm);
    void* yz = nullptr;
    size_t yz_bytes = 0;
    CKE(epLlCombineBuffer(comm, &yz, &yz_bytes), comm);
    expert(P.recv_x.p, yz, static_cast<size_t>(E / R) * R * T * H, static_cast<float>(rank + 1), epBfloat16, s);
    CKC(cudaStreamSynchronize(s));
    std::vector<int64_t> other = routing;
    for (int t = 0; t < T; ++t) other[static_cast<size_t>(t) * K] = 0;
    for (int t = 0; t < T; ++t)
      for (int k = 1; k < K; ++k)
        if (other[static_cast<size_t>(t) * K + k] == 0) other[static_cast<size_t>(t) * K + k] = -1;
    P.idx.upload(other);
    epLlCombineArgs_t c = P.cargs(EP_LL_SEND_RECV, again.p);
    c.y = yz;
    c.y_bytes = yz_bytes;
    CKE(epLlCombine(comm, &c, s), comm);
    CKC(cudaStreamSynchronize(s));
    epResult_t ae;
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    CKE(epCommGetAsyncError(comm, &ae, &info), comm);
    CK(ae == epSuccess, "async error %s after the mismatched combine", epGetErrorString(ae));
    CK(info.num_violations > 0 && info.violation == epInvalidUsage, "%llu violations, first %s: want epInvalidUsage",
       static_cast<unsigned long long>(info.num_violations), epGetErrorString(info.violation));
    P.idx.upload(routing);
    CKE(P.run(s, again.p), comm);
    CKC(cudaStreamSynchronize(s));
    CK(again.host() == want, "after the refused rows the next step's result differs");
    CKE(epCommGetAsyncError(comm, &ae, nullptr), comm);
    CK(ae == epSuccess, "async error %s after the recovery step", epGetErrorString(ae));
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// For compute-sanitizer runs: rank EPCOMM_GPU_TEST_OOB_RANK writes one element past a buffer, so a run can prove
// that the tool instruments every rank process (they are forked, not exec'd). Skipped unless the variable is set.
__global__ void writePastEnd(int* p, int n) { p[n] = 1; }

TEST_P(GpuLl, SanitizerSeesEveryRank) {
  const char* oob = getenv("EPCOMM_GPU_TEST_OOB_RANK");
  if (oob == nullptr) GTEST_SKIP() << "EPCOMM_GPU_TEST_OOB_RANK is not set";
  const int R = GetParam(), victim = atoi(oob);
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    int* p = nullptr;
    CKC(cudaMalloc(&p, 256 * sizeof(int)));
    writePastEnd<<<1, 1>>>(p, rank == victim ? 1 << 20 : 0);  // 4 MiB past the end of a 1 KiB allocation
    cudaDeviceSynchronize();
    fprintf(stderr, "rank %d (pid %d): %s\n", rank, static_cast<int>(getpid()),
            rank == victim ? "wrote past the end of its buffer" : "wrote in bounds");
    return 0;
  }, 60000);
  (void)codes;  // the verdict is the sanitizer's report, not the exit codes
}

// The device's fp8 conversion (kernels/fp8.cuh, what LL fp8 dispatches quantize with) gives common/dtype.h
// floatToFp8's bits for every 32-bit pattern: finite, subnormal, saturating, infinite and NaN of either sign.
__device__ unsigned long long g_fp8_differ, g_fp8_first;
// swap: the pair (u + 1, u), so that every pattern goes through both lanes of the conversion.
__global__ void fp8EveryPair(uint32_t chunk, bool swap) {
  const uint32_t u = ((chunk << 24) + blockIdx.x * blockDim.x + threadIdx.x) * 2u;  // the pair (u, u + 1)
  const float a = __uint_as_float(swap ? u + 1 : u), b = __uint_as_float(swap ? u : u + 1);
  const uint32_t want = epcomm::floatToFp8(a) | static_cast<uint32_t>(epcomm::floatToFp8(b)) << 8;
  if (epcomm::dev::fp8x2(a, b) != want && atomicAdd(&g_fp8_differ, 1ull) == 0) g_fp8_first = u;
}

TEST(Fp8Conversion, DeviceMatchesTheHostForEveryFloat) {
  auto codes = epcomm::test::runRanks(1, [&](int rank) -> int {  // CUDA only in a child (the tests fork)
    g_rank = rank;
    CKC(selectDevice(0));
    for (int swap = 0; swap < 2; ++swap)
      for (uint32_t chunk = 0; chunk < 128; ++chunk) fp8EveryPair<<<(1u << 24) / 256, 256>>>(chunk, swap != 0);
    CKC(cudaDeviceSynchronize());
    unsigned long long differ = 0, first = 0;
    CKC(cudaMemcpyFromSymbol(&differ, g_fp8_differ, sizeof(differ)));
    CKC(cudaMemcpyFromSymbol(&first, g_fp8_first, sizeof(first)));
    CK(differ == 0, "%llu of 2 x 2^31 pairs differ, the first at input bits 0x%08llx", differ, first);
    return 0;
  }, 120000);
  expectAllRanksOk(codes, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, GpuLl, ::testing::ValuesIn(rankCounts()),
                         [](const ::testing::TestParamInfo<int>& i) { return "R" + std::to_string(i.param); });


}  // namespace

int main(int argc, char** argv) { return runGpuTests(argc, argv); }
