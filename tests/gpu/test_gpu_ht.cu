// GPU engine, HT mode, on the ranks of one host (several ranks may share one GPU under CUDA MPS).
// Exits 77 (skipped) without a GPU. Ranks: EPCOMM_GPU_TEST_RANKS (default "2,4,8").
//  - bit-exact against the host engine on fresh random inputs (uneven and zero token counts, -1 routing,
//    worst-token padding, cached handle, fp8 dispatch, bf16/fp16/fp32 combine), outputs poisoned first;
//  - structured rows (source rank and token encoded in the row) so misplaced rows show, per-expert counts
//    against an independent all-rank count;
//  - CUDA graphs: layout -> dispatch -> expert stand-in -> combine captured once and replayed 1000 times with
//    fresh inputs and routing each time, every replay bit-identical to eager calls interleaved with it; two
//    graphs on one communicator replayed alternately;
//  - zero-copy combine (epHtCombineBuffer): the cached second pass of the bit-exact cases and one of the two
//    graphs write the expert outputs into the region and combine from it, against the host engine / eager
//    plain combines;
//  - registered combine input (epCommRegister): the single-pass bit-exact cases on the even ranks (mixed with
//    copying ranks), and graph B of the replay test;
//  - a rank that stops participating: the others report a timeout within the deadline, exit cleanly, and a
//    new communicator works afterwards.
// Ranks over H virtual hosts (EPCOMM_GPU_TEST_HOSTS) run every test across hosts, dispatch hierarchically (a token
// goes to a host once, through the source's forwarder there; the killed-rank test moves forwarders), combine flat
// unless EPCOMM_GPU_HT_COMBINE_HIER=1 (then against a host-engine reference on the same hosts); across 2 hosts one
// test runs the flat dispatch, one the hierarchical combine.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
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
#include "../unit/multiproc.h"
#include "common/dtype.h"
#include "common/routing.h"
#include "engine/comm.h"
#include "engine/gpu/gpu_engine.h"
#include "epcomm/epcomm.h"

namespace {

struct Case {
  int T, H, K, E, dtype, comb_dtype, worst_extra;  // worst_extra < 0: exact mode
  bool cached_again;
};

// One case on both engines; compares every output bit for bit.
// gone: ranks masked on both communicators (their tokens are absent from the expected counts).
int runCase(epComm_t g, epComm_t h, int rank, int R, const Case& c, uint64_t seed, cudaStream_t s,
            const std::vector<int>& gone = {}) {
  const int T = (rank == 1 && R > 2) ? 0 : c.T - rank * 3;  // uneven, and zero tokens on rank 1
  Inputs in = makeInputs(seed, rank, T, c.H, c.K, c.E, c.dtype, true);
  const size_t es = epDataTypeSize(static_cast<epDataType_t>(c.dtype)), xrow = c.H * es;
  const int L = c.E / R;
  // ---- host engine ----
  epHtHandle_t hh, gh;
  CKE(epHtHandleCreate(h, c.T, &hh), h);
  CKE(epHtHandleCreate(g, c.T, &gh), g);
  epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
  a.num_tokens = T;
  a.hidden = c.H;
  a.topk = c.K;
  a.num_experts = c.E;
  a.dtype = c.dtype;
  int num_recv = 0;
  std::vector<int> per_h(L), per_g(L);
  a.topk_idx = in.idx.data();
  CKE(epHtDispatchNotify(h, &a, hh, &num_recv, per_h.data(), nullptr), h);
  const int rows = c.worst_extra >= 0 ? num_recv + c.worst_extra : num_recv;
  std::vector<uint8_t> hx(static_cast<size_t>(rows) * xrow, 0xA5);
  std::vector<float> hsc(static_cast<size_t>(rows) * (c.H / 128 + 1));
  std::vector<int64_t> hidx(static_cast<size_t>(rows) * c.K, 77);
  std::vector<float> hw(static_cast<size_t>(rows) * c.K, 77.0f);
  int h_num_recv = -1;
  a.x = in.x.data();
  a.x_scales = in.scales.empty() ? nullptr : in.scales.data();
  a.topk_weights = in.w.data();
  a.num_worst_tokens = c.worst_extra >= 0 ? rows : 0;
  a.recv_x = hx.data();
  a.recv_x_bytes = hx.size();
  a.recv_x_scales = hsc.data();
  a.recv_x_scales_bytes = hsc.size() * 4;
  a.recv_topk_idx = hidx.data();
  a.recv_topk_idx_bytes = hidx.size() * 8;
  a.recv_topk_weights = hw.data();
  a.recv_topk_weights_bytes = hw.size() * 4;
  a.recv_tokens_per_expert = per_h.data();
  a.num_recv_tokens = &h_num_recv;
  CKE(epHtDispatch(h, &a, hh, nullptr), h);
  // ---- GPU engine ----
  DevBuf<uint8_t> dx(in.x.size() + 16), dgx(hx.size() + 16);
  DevBuf<float> dsc(in.scales.size() + 4), dgsc(hsc.size() + 4), dw(in.w.size() + 4), dgw(hw.size() + 4);
  DevBuf<int64_t> didx(in.idx.size() + 2), dgidx(hidx.size() + 2);
  DevBuf<int> dper(L + 1), dnum(1);
  cudaMemcpy(dx.p, in.x.data(), in.x.size(), cudaMemcpyHostToDevice);
  if (!in.scales.empty()) cudaMemcpy(dsc.p, in.scales.data(), in.scales.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(didx.p, in.idx.data(), in.idx.size() * 8, cudaMemcpyHostToDevice);
  cudaMemcpy(dw.p, in.w.data(), in.w.size() * 4, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  epHtDispatchArgs_t b = a;
  b.x = dx.p;
  b.x_scales = in.scales.empty() ? nullptr : dsc.p;
  b.topk_idx = didx.p;
  b.topk_weights = dw.p;
  b.recv_x = dgx.p;
  b.recv_x_scales = dgsc.p;
  b.recv_topk_idx = dgidx.p;
  b.recv_topk_weights = dgw.p;
  b.recv_tokens_per_expert = dper.p;
  b.num_recv_tokens = dnum.p;
  if (c.worst_extra < 0) {
    int g_num_recv = -1;
    CKE(epHtDispatchNotify(g, &b, gh, &g_num_recv, per_g.data(), s), g);
    CK(g_num_recv == num_recv, "notify: GPU says %d rows, host %d", g_num_recv, num_recv);
    CK(per_g == per_h, "notify: per-expert counts differ from the host engine");
  }
  CKE(epHtDispatch(g, &b, gh, s), g);
  CKC(cudaStreamSynchronize(s));
  {
    epResult_t ae;
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    CKE(epCommGetAsyncError(g, &ae, &info), g);
    CK(ae == epSuccess, "dispatch: async error %s (op %d, epoch %llu, peer %d, phase %d)", epGetErrorString(ae),
       info.op, static_cast<unsigned long long>(info.epoch), info.peer, info.phase);
  }
  // ---- compare dispatch ----
  auto gx = dgx.host();
  for (int i = 0; i < num_recv; ++i) {
    if (memcmp(gx.data() + i * xrow, hx.data() + i * xrow, xrow) == 0) continue;
    auto who = [&](const std::vector<uint8_t>& v, int j) {
      return std::to_string(static_cast<int>(epcomm::loadAsFloat(v.data(), static_cast<size_t>(i) * c.H + j, c.dtype)));
    };
    CK(false, "recv_x row %d of %d differs (T=%d H=%d dtype %d worst %d): GPU row says rank %s token %s+256*%s, host rank %s token %s+256*%s",
       i, num_recv, T, c.H, c.dtype, c.worst_extra, who(gx, 0).c_str(), who(gx, 1).c_str(), who(gx, 2).c_str(),
       who(hx, 0).c_str(), who(hx, 1).c_str(), who(hx, 2).c_str());
  }
  for (size_t i = static_cast<size_t>(num_recv) * xrow; i < hx.size(); ++i)
    CK(gx[i] == 0xA5, "worst-token padding row byte %zu was written", i);
  auto gidx = dgidx.host();
  CK(memcmp(gidx.data(), hidx.data(), hidx.size() * 8) == 0, "recv_topk_idx differs");
  auto gw = dgw.host();
  CK(memcmp(gw.data(), hw.data(), hw.size() * 4) == 0, "recv_topk_weights differs");
  if (c.dtype == epFloat8E4M3) {
    auto gsc = dgsc.host();
    CK(memcmp(gsc.data(), hsc.data(), static_cast<size_t>(num_recv) * (c.H / 128) * 4) == 0, "recv_x_scales differ");
  }
  auto gper = dper.host();
  CK(memcmp(gper.data(), per_h.data(), L * 4) == 0, "recv_tokens_per_expert differs");
  CK(dnum.host()[0] == num_recv, "num_recv_tokens %d vs %d", dnum.host()[0], num_recv);
  // Structured: rows ordered by (source rank, token), per-expert counts equal an independent count.
  std::vector<int> want_per(L, 0);
  int prev_src = -1, prev_tok = -1;
  for (int i = 0; i < num_recv; ++i) {
    int src = static_cast<int>(epcomm::loadAsFloat(hx.data(), static_cast<size_t>(i) * c.H, c.dtype));
    int tok = static_cast<int>(epcomm::loadAsFloat(hx.data(), static_cast<size_t>(i) * c.H + 1, c.dtype)) +
              256 * static_cast<int>(epcomm::loadAsFloat(hx.data(), static_cast<size_t>(i) * c.H + 2, c.dtype));
    if (c.dtype != epFloat8E4M3)
      CK(src > prev_src || (src == prev_src && tok > prev_tok), "row %d (rank %d token %d) out of order", i, src, tok);
    prev_src = src;
    prev_tok = tok;
  }
  for (int r = 0; r < R; ++r) {
    if (std::find(gone.begin(), gone.end(), r) != gone.end()) continue;
    const int Tr = (r == 1 && R > 2) ? 0 : c.T - r * 3;
    Inputs o = makeInputs(seed, r, Tr, 8, c.K, c.E, epFloat32, false);
    for (int t = 0; t < Tr; ++t)
      for (int k = 0; k < c.K; ++k) {
        int64_t e = o.idx[static_cast<size_t>(t) * c.K + k];
        if (e < 0 || e / L != rank || epcomm::isRepeatedExpert(&o.idx[static_cast<size_t>(t) * c.K], k)) continue;
        want_per[e % L]++;
      }
  }
  CK(want_per == per_h, "per-expert counts differ from the all-rank count");
  // ---- combine ----
  if (c.dtype != epFloat8E4M3) {
    for (int pass = 0; pass < (c.cached_again ? 2 : 1); ++pass) {
      const size_t ces = epDataTypeSize(static_cast<epDataType_t>(c.comb_dtype)), crow = c.H * ces;
      // Expert input in the combine type: the received rows converted, then the stand-in.
      std::vector<uint8_t> cx(static_cast<size_t>(rows) * crow);
      for (size_t i = 0; i < static_cast<size_t>(num_recv) * c.H; ++i)
        epcomm::storeFromFloat(cx.data(), i, c.comb_dtype, epcomm::loadAsFloat(hx.data(), i, c.dtype) + pass);
      std::vector<uint8_t> cy = expertHost(cx, static_cast<size_t>(num_recv) * c.H, static_cast<float>(rank + 1), c.comb_dtype);
      std::vector<uint8_t> hout(static_cast<size_t>(T) * crow, 0x5A);
      epHtCombineArgs_t ca = EP_HT_COMBINE_ARGS_INIT;
      ca.num_tokens = T;
      ca.hidden = c.H;
      ca.dtype = c.comb_dtype;
      ca.x = cy.data();
      ca.x_bytes = cy.size();
      ca.combined_x = hout.data();
      ca.combined_x_bytes = hout.size();
      CKE(epHtCombine(h, &ca, hh, nullptr), h);
      DevBuf<uint8_t> dcx(cx.size() + 16), dcy(cx.size() + 16), dout(hout.size() + 16);
      dcx.upload(cx);
      // The second pass (after a cached dispatch) writes the expert outputs into the zero-copy region instead.
      // A single pass registers memory (epCommRegister, collective) and the even ranks write x inside it, not at
      // its start, so that owners read registered and copied rows in one combine.
      uint8_t* ydev = dcy.p;
      // Across hosts neither exists (the owners cannot read the peers' memory there): both are refused.
      DevBuf<uint8_t> dreg(c.cached_again ? 0 : cx.size() + 512);
      epMemRegion_t reg = nullptr;
      if (!c.cached_again && g_cross_hosts) {
        CK(epCommRegister(g, dreg.p, dreg.bytes(), &reg) == epNotSupported && reg == nullptr,
           "epCommRegister across hosts was not refused");
      } else if (!c.cached_again) {
        CKE(epCommRegister(g, dreg.p, dreg.bytes(), &reg), g);
        if (rank % 2 == 0) ydev = dreg.p + 256;
      }
      if (pass == 1 && g_cross_hosts) {
        void* region = nullptr;
        size_t region_bytes = 0;
        CK(epHtCombineBuffer(g, &region, &region_bytes) == epNotSupported, "zero-copy HT combine across hosts was "
           "not refused");
      } else if (pass == 1) {
        void* region = nullptr;
        size_t region_bytes = 0;
        CKE(epHtCombineBuffer(g, &region, &region_bytes), g);
        CK(region_bytes >= cy.size(), "zero-copy region of %zu bytes for %zu bytes of x", region_bytes, cy.size());
        ydev = static_cast<uint8_t*>(region);
        // x inside the region but not at its start is refused, and the communicator goes on.
        epHtCombineArgs_t off = ca;
        off.x = ydev + 16;
        off.combined_x = dout.p;
        CK(epHtCombine(g, &off, gh, s) == epInvalidArgument, "x inside the region, not at its start, was accepted");
      }
      expert(dcx.p, ydev, static_cast<size_t>(num_recv) * c.H, static_cast<float>(rank + 1), c.comb_dtype, s);
      epHtCombineArgs_t cg = ca;
      cg.x = ydev;
      cg.combined_x = dout.p;
      CKE(epHtCombine(g, &cg, gh, s), g);
      CKC(cudaStreamSynchronize(s));
      {
        epResult_t ae;
        epErrorInfo_t info = EP_ERROR_INFO_INIT;
        CKE(epCommGetAsyncError(g, &ae, &info), g);
        CK(ae == epSuccess, "combine: async error %s (op %d, epoch %llu, peer %d, phase %d)", epGetErrorString(ae),
           info.op, static_cast<unsigned long long>(info.epoch), info.peer, info.phase);
      }
      std::vector<uint8_t> gy(static_cast<size_t>(num_recv) * crow);
      CKC(cudaMemcpy(gy.data(), ydev, gy.size(), cudaMemcpyDeviceToHost));
      CK(memcmp(gy.data(), cy.data(), gy.size()) == 0, "stand-in expert differs (pass %d)", pass);
      if (reg != nullptr) CKE(epCommDeregister(reg), g);
      auto gout = dout.host();
      for (size_t i = 0; i < static_cast<size_t>(T) * c.H; ++i) {
        float gv = epcomm::loadAsFloat(gout.data(), i, c.comb_dtype), hv = epcomm::loadAsFloat(hout.data(), i, c.comb_dtype);
        if (memcmp(gout.data() + i * ces, hout.data() + i * ces, ces) == 0) continue;
        const int t = static_cast<int>(i / c.H);
        std::string to;
        for (int k = 0; k < c.K; ++k) to += std::to_string(in.idx[static_cast<size_t>(t) * c.K + k]) + " ";
        CK(false, "combined_x[%d, %zu] = %g on the GPU, %g on the host (pass %d, dtype %d, T %d, experts %s)", t,
           i % c.H, gv, hv, pass, c.comb_dtype, T, to.c_str());
      }
      if (pass == 0 && c.cached_again) {  // dispatch again with the cached layout and new x
        // New values, same routing (never NaN: NaN payloads are not part of the bit-exact contract).
        for (size_t i = 0; i < static_cast<size_t>(T) * c.H; ++i)
          epcomm::storeFromFloat(in.x.data(), i, c.dtype, epcomm::loadAsFloat(in.x.data(), i, c.dtype) * 0.5f + 0.25f);
        a.x = in.x.data();
        a.flags = EP_HT_USE_HANDLE_LAYOUT;
        b.flags = EP_HT_USE_HANDLE_LAYOUT;
        cudaMemcpy(dx.p, in.x.data(), in.x.size(), cudaMemcpyHostToDevice);
        cudaDeviceSynchronize();
        CKE(epHtDispatch(h, &a, hh, nullptr), h);
        CKE(epHtDispatch(g, &b, gh, s), g);
        CKC(cudaStreamSynchronize(s));
        gx = dgx.host();
        CK(memcmp(gx.data(), hx.data(), static_cast<size_t>(num_recv) * xrow) == 0, "cached dispatch recv_x differs");
      }
    }
  }
  epHtHandleDestroy(hh);
  epHtHandleDestroy(gh);
  epResult_t ae;
  epErrorInfo_t info = EP_ERROR_INFO_INIT;
  CKE(epCommGetAsyncError(g, &ae, &info), g);
  CK(ae == epSuccess && info.num_violations == 0, "async error %d, %llu violations", ae,
     static_cast<unsigned long long>(info.num_violations));
  return 0;
}

// EPCOMM_GPU_HT_COMBINE_HIER=1 (read once per process, at its first GPU communicator): across hosts the GPU engine
// combines hierarchically, in the host engine's order across the same hosts; otherwise flat, in the one-host order.
bool hierCombine() {
  const char* v = getenv("EPCOMM_GPU_HT_COMBINE_HIER");
  return v != nullptr && atoi(v) != 0;
}

// The GPU communicator under test and its host-engine reference: on the same hosts where the GPU combine is
// hierarchical (both then sum per host first, in the order epcomm.h states), else on one host (the one-host order,
// which the flat combine keeps); timeout_ms 0 keeps gpuConfig()'s deadline.
int initPair(int rank, int R, const epUniqueId& gid, const epUniqueId& hid, epComm_t* g, epComm_t* h,
             int timeout_ms = 0, int hosts = testHosts()) {
  epConfig_t cfg = gpuConfig();
  if (timeout_ms > 0) cfg.timeout_ms = timeout_ms;
  CKE(initGpuComm(g, R, &gid, rank, &cfg, hosts), nullptr);
  epConfig_t hc = EP_CONFIG_INIT;
  hc.engine = EP_ENGINE_HOST;
  hc.queue_bytes = 8 << 20;
  CKE(initOnHosts(h, R, &hid, rank, &hc, hierCombine() ? hosts : 1), nullptr);
  return 0;
}

class GpuHt : public ::testing::TestWithParam<int> {};

TEST_P(GpuHt, BitExactAgainstHostEngine) {
  const int R = GetParam();
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, &g, &h)) return 1;
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int E = 16 * R;
    const Case cases[] = {
        {64, 128, 4, E, epBfloat16, epBfloat16, -1, true},   // exact mode + cached handle
        {96, 256, 8, E, epBfloat16, epBfloat16, 5, false},   // worst-token padding
        {40, 7168, 8, E, epBfloat16, epBfloat16, 0, false},  // DeepSeek hidden, exactly full worst-token
        {50, 512, 6, E, epFloat8E4M3, epBfloat16, 3, false}, // fp8 dispatch
        {33, 64, 1, E, epFloat16, epFloat16, -1, false},     // fp16, top-1
        {45, 96, 9, 9 * R, epFloat32, epFloat32, 2, true},   // fp32, top-9
    };
    uint64_t seed_i = seed;
    for (const Case& c : cases)
      if (runCase(g, h, rank, R, c, ++seed_i, s)) return 1;
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}


struct Pipeline {  // layout -> worst-token dispatch -> stand-in -> combine, on device buffers
  int T, H, K, E, W, R, rank;
  epComm_t comm;
  epHtHandle_t h;
  DevBuf<uint16_t> x, recv_x, y, out, out_eager;
  DevBuf<int64_t> idx, recv_idx;
  DevBuf<float> w, recv_w;
  DevBuf<int> per_rank, per_expert, recv_per, num_recv;
  DevBuf<uint8_t> in_rank;
  Pipeline(epComm_t c, int R_, int rank_, int T_, int H_, int K_, int E_)
      : T(T_), H(H_), K(K_), E(E_), W(T_ * R_), R(R_), rank(rank_), comm(c),
        x(static_cast<size_t>(T_) * H_), recv_x(static_cast<size_t>(T_) * R_ * H_), y(static_cast<size_t>(T_) * R_ * H_),
        out(static_cast<size_t>(T_) * H_), out_eager(static_cast<size_t>(T_) * H_), idx(static_cast<size_t>(T_) * K_),
        recv_idx(static_cast<size_t>(T_) * R_ * K_), w(static_cast<size_t>(T_) * K_), recv_w(static_cast<size_t>(T_) * R_ * K_),
        per_rank(R_), per_expert(E_), recv_per(E_ / R_), num_recv(1), in_rank(static_cast<size_t>(T_) * R_) {
    epHtHandleCreate(comm, T, &h);
  }
  ~Pipeline() { epHtHandleDestroy(h); }
  // zero_copy: the stand-in writes into the communicator's zero-copy combine region, which the combine reads.
  // y_at: the stand-in writes there instead of y.
  epResult_t run(cudaStream_t s, uint16_t* dst, bool zero_copy = false, uint16_t* y_at = nullptr) {
    epResult_t r = epGetDispatchLayout(comm, idx.p, T, K, E, per_rank.p, per_expert.p, in_rank.p, s);
    if (r != epSuccess) return r;
    epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
    a.num_tokens = T;
    a.hidden = H;
    a.topk = K;
    a.num_experts = E;
    a.dtype = epBfloat16;
    a.num_worst_tokens = W;
    a.x = x.p;
    a.topk_idx = idx.p;
    a.topk_weights = w.p;
    a.recv_x = recv_x.p;
    a.recv_x_bytes = recv_x.bytes();
    a.recv_topk_idx = recv_idx.p;
    a.recv_topk_idx_bytes = recv_idx.bytes();
    a.recv_topk_weights = recv_w.p;
    a.recv_topk_weights_bytes = recv_w.bytes();
    a.recv_tokens_per_expert = recv_per.p;
    a.num_recv_tokens = num_recv.p;
    if ((r = epHtDispatch(comm, &a, h, s)) != epSuccess) return r;
    void* ydev = y_at != nullptr ? y_at : y.p;
    size_t region_bytes = 0;
    if (zero_copy && (r = epHtCombineBuffer(comm, &ydev, &region_bytes)) != epSuccess) return r;
    if (region_bytes && region_bytes < y.bytes()) return epBufferTooSmall;
    expert(recv_x.p, ydev, static_cast<size_t>(W) * H, static_cast<float>(rank + 1), epBfloat16, s);
    epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
    c.num_tokens = T;
    c.hidden = H;
    c.dtype = epBfloat16;
    c.x = ydev;
    c.x_bytes = y.bytes();
    c.combined_x = dst;
    c.combined_x_bytes = out.bytes();
    return epHtCombine(comm, &c, h, s);
  }
};

TEST_P(GpuHt, GraphReplayMatchesEager) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const int replays = getenv("EPCOMM_GPU_TEST_REPLAYS") ? atoi(getenv("EPCOMM_GPU_TEST_REPLAYS")) : 1000;
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epConfig_t cfg = gpuConfig();
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Pipeline A(comm, R, rank, 128, 512, 8, 8 * R), B(comm, R, rank, 64, 1024, 4, 4 * R);
    // B's expert outputs live in registered memory: its combines (graph and eager) read them in place, and the
    // eager run's stand-in rewrites them right after each replay's combine, so a combine that completed before
    // every owner had read its rows would show here.
    // Across hosts neither registration nor zero-copy exists: both graphs combine plainly.
    epMemRegion_t reg = nullptr;
    if (!g_cross_hosts) CKE(epCommRegister(comm, B.y.p, B.y.bytes(), &reg), comm);
    cudaGraph_t ga, gb;
    cudaGraphExec_t ea, eb;
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CKE(A.run(s, A.out.p, !g_cross_hosts), comm);  // A's graph combines zero-copy; its eager reference does not
    CKC(cudaStreamEndCapture(s, &ga));
    CKC(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CKE(B.run(s, B.out.p), comm);
    CKC(cudaStreamEndCapture(s, &gb));
    CKC(cudaGraphInstantiate(&ea, ga, 0));
    CKC(cudaGraphInstantiate(&eb, gb, 0));
    size_t bad = 0;
    for (int it = 0; it < replays; ++it) {
      Pipeline& P = (it & 1) ? B : A;
      genInputs<<<64, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, seed * 100000 + it * 64 + rank, true);
      CKC(cudaGraphLaunch((it & 1) ? eb : ea, s));
      CKE(P.run(s, P.out_eager.p), comm);  // eager, interleaved on the same communicator, same inputs
      CKC(cudaStreamSynchronize(s));
      auto g = P.out.host(), e = P.out_eager.host();
      if (memcmp(g.data(), e.data(), g.size() * 2) != 0) ++bad;
      CK(bad == 0, "replay %d differs from eager", it);
    }
    CK_CLEAN(comm, "after the run");
    cudaGraphExecDestroy(ea);
    cudaGraphExecDestroy(eb);
    if (reg != nullptr) CKE(epCommDeregister(reg), comm);
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 600000);
  expectAllRanksOk(codes, seed);
}

// Implicit registration (EPCOMM_GPU_HT_AUTO_REGISTER, on by default): plain combines from caller allocations (of
// whole 2 MiB pages) that come and go: one allocation freed and allocated again (likely at the same address)
// after the owners began reading it in place, more allocations than the engine's slots (kGpuAutoRegions), x at
// varying offsets. Each combine equals the zero-copy combine of the same expert outputs just before it (itself
// checked against the host engine in BitExactAgainstHostEngine), outputs poisoned first, and the owners read x in
// place in some of them (none across hosts, where the combine pushes).
TEST_P(GpuHt, ImplicitRegistrationFollowsTheCallersAllocations) {
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epConfig_t cfg = gpuConfig();
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Pipeline P(comm, R, rank, 96, 256, 6, 8 * R);
    // Allocations of 2 MiB pages, as PyTorch's segments (smaller ones share pages and are copied, never shared).
    const size_t n = std::max<size_t>(P.y.n + 3 * 64, size_t{1} << 20);
    std::vector<std::unique_ptr<DevBuf<uint16_t>>> pool;
    for (int k = 0; k <= 40; ++k) pool.push_back(std::make_unique<DevBuf<uint16_t>>(n));
    // Which allocation each combine reads (-1: free allocation 0 and allocate it again first).
    std::vector<int> order(8, 0);
    order.push_back(-1);
    for (int i = 0; i < 8; ++i) order.push_back(0);
    for (int i = 0; i < 80; ++i) order.push_back(1 + i % 40);
    for (int i = 0; i < 8; ++i) order.push_back(i & 1);
    int it = 0;
    for (int k : order) {
      if (k < 0) {
        pool[0].reset();
        pool[0] = std::make_unique<DevBuf<uint16_t>>(n);
        continue;
      }
      genInputs<<<64, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, seed * 100000 + it * 64 + rank, true);
      if (!g_cross_hosts) CKE(P.run(s, P.out_eager.p, true), comm);  // the reference: zero-copy
      else CKE(P.run(s, P.out_eager.p), comm);
      CKC(cudaMemsetAsync(P.out.p, 0xFF, P.out.bytes(), s));
      CKE(P.run(s, P.out.p, false, pool[k]->p + 64 * (it % 3)), comm);
      CKC(cudaStreamSynchronize(s));
      auto g = P.out.host(), e = P.out_eager.host();
      CK(memcmp(g.data(), e.data(), g.size() * 2) == 0, "combine %d (allocation %d) differs from the zero-copy one",
         it, k);
      ++it;
    }
    CK_CLEAN(comm, "after the run");
    auto* engine = dynamic_cast<epcomm::GpuEngine*>(comm->engine.get());
    CK(engine != nullptr, "not the GPU engine");
    const uint64_t used = engine->implicitCombines();
    if (g_cross_hosts)
      CK(used == 0, "%llu combines read x in place across hosts", static_cast<unsigned long long>(used));
    else
      CK(used >= 4, "only %llu of %d combines read x in place", static_cast<unsigned long long>(used), it);
    printf("rank %d: %llu of %d plain combines read x in place\n", rank, static_cast<unsigned long long>(used), it);
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// epCommRegister refused on one rank is refused on every rank, with the refusing rank's code and name, nothing
// stays registered, and the communicator goes on: memory inside the communicator's own buffer, a NULL pointer,
// stream-ordered (cudaMallocAsync) memory that CUDA IPC cannot export, more regions than EP_MAX_MEM_REGIONS; a
// deregistered handle is refused. Then an HT step combines from registered memory, equal to a plain one.
// (cudaMallocAsync memory: cudaIpcGetMemHandle refuses it, epNotSupported, unless cuMemGetAddressRange already
// did, epInvalidArgument; either is accepted.)
TEST_P(GpuHt, RegistrationRefusalsLeaveTheCommunicatorUsable) {
  if (crossHosts()) GTEST_SKIP() << "registration does not cross hosts";
  const int R = GetParam();
  epUniqueId gid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epConfig_t cfg = gpuConfig();
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DevBuf<uint8_t> mem(1 << 20);
    auto refusedEverywhere = [&](epResult_t mine, epResult_t want_here, const char* what) -> int {
      const std::string msg = epGetLastError(comm);
      CK(mine == want_here, "%s: %s (%s), want %s", what, epGetErrorString(mine), msg.c_str(),
         epGetErrorString(want_here));
      return 0;
    };
    epMemRegion_t reg = nullptr;
    // Rank 1 passes memory of the communicator's own buffer (the zero-copy region): epInvalidArgument there, and
    // on the other ranks the same code, naming rank 1.
    void* zc = nullptr;
    size_t zc_bytes = 0;
    CKE(epHtCombineBuffer(comm, &zc, &zc_bytes), comm);
    epResult_t r = epCommRegister(comm, rank == 1 ? zc : mem.p, 4096, &reg);
    if (refusedEverywhere(r, epInvalidArgument, "own buffer on rank 1")) return 1;
    if (rank != 1)
      CK(std::string(epGetLastError(comm)).find("rank 1") != std::string::npos, "message '%s' names no rank 1",
         epGetLastError(comm));
    CK(reg == nullptr, "a refused registration wrote its handle");
    // Rank 0 passes NULL.
    r = epCommRegister(comm, rank == 0 ? nullptr : mem.p, 4096, &reg);
    if (refusedEverywhere(r, epNullPointer, "NULL on rank 0")) return 1;
    // The last rank passes cudaMallocAsync memory: not exportable over CUDA IPC.
    void* pool = nullptr;
    CKC(cudaMallocAsync(&pool, 1 << 16, s));
    CKC(cudaStreamSynchronize(s));
    r = epCommRegister(comm, rank == R - 1 ? pool : mem.p, 4096, &reg);
    CK(r == epNotSupported || r == epInvalidArgument, "stream-ordered memory on the last rank: %s (%s)",
       epGetErrorString(r), epGetLastError(comm));
    CKC(cudaFreeAsync(pool, s));
    // EP_MAX_MEM_REGIONS regions fit (different pieces of one allocation), one more does not.
    std::vector<epMemRegion_t> many;
    for (int i = 0; i < EP_MAX_MEM_REGIONS; ++i) {
      epMemRegion_t m = nullptr;
      CKE(epCommRegister(comm, mem.p + i * 4096, 4096, &m), comm);
      many.push_back(m);
    }
    r = epCommRegister(comm, mem.p, 4096, &reg);
    if (refusedEverywhere(r, epInvalidUsage, "one region too many")) return 1;
    for (epMemRegion_t m : many) CKE(epCommDeregister(m), comm);
    CK(epCommDeregister(many[0]) == epInvalidArgument, "a deregistered handle was accepted");
    // The communicator goes on: one HT step plain, then the same combine from registered memory.
    Pipeline P(comm, R, rank, 64, 512, 4, 4 * R);
    genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, 11 + rank, true);
    CKE(P.run(s, P.out_eager.p), comm);
    CKE(epCommRegister(comm, P.y.p, P.y.bytes(), &reg), comm);
    CKE(P.run(s, P.out.p), comm);
    CKC(cudaStreamSynchronize(s));
    auto a = P.out.host(), b = P.out_eager.host();
    CK(memcmp(a.data(), b.data(), a.size() * 2) == 0, "the registered combine differs from the plain one");
    CKE(epCommDeregister(reg), comm);
    CK_CLEAN(comm, "after the refusals");
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 120000);
  for (int r = 0; r < R; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R;
}

// A step whose peer fails: its error is asynchronous, so a call of the step may already return it (a later call of
// the same step, made after the first kernel's deadline passed: across hosts the launches take longer) or the
// step launches and epCommGetAsyncError reports it. Either is the contract; the test checks the reported error.
#define CK_FAILING_STEP(expr)                                                                              \
  do {                                                                                                     \
    const epResult_t step_r_ = (expr);                                                                     \
    CK(step_r_ == epSuccess || step_r_ == epTimeout || step_r_ == epRemoteError, "%s -> %s", #expr,        \
       epGetErrorString(step_r_));                                                                         \
  } while (0)

TEST_P(GpuHt, StoppedRankTimesOutAndANewCommWorks) {
  const int R = GetParam();
  epUniqueId gid, gid2;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&gid2), epSuccess);
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epConfig_t cfg = gpuConfig();
    cfg.timeout_ms = shortDeadlineMs(1000);
    epComm_t comm;
    CKE(initGpuComm(&comm, R, &gid, rank, &cfg), nullptr);
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      Pipeline P(comm, R, rank, 32, 256, 2, 2 * R);
      genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, 5 + rank, true);
      CKE(P.run(s, P.out.p), comm);
      CKC(cudaStreamSynchronize(s));
      if (rank != R - 1) {  // the last rank stops participating
        auto t0 = std::chrono::steady_clock::now();
        CK_FAILING_STEP(P.run(s, P.out.p));
        CKC(cudaStreamSynchronize(s));
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        epResult_t ae;
        epErrorInfo_t info = EP_ERROR_INFO_INIT;
        CKE(epCommGetAsyncError(comm, &ae, &info), comm);
        CK(ae == epTimeout && info.peer == R - 1, "async error %d peer %d (after %.0f ms)", ae, info.peer, ms);
        CK(ms < cfg.timeout_ms * 3 + shortDeadlineMs(2000), "timeout reported after %.0f ms", ms);
      }
    }
    CKE(epCommAbort(comm), comm);
    // A new communicator works afterwards.
    epConfig_t cfg2 = gpuConfig();
    CKE(initGpuComm(&comm, R, &gid2, rank, &cfg2), nullptr);
    {
      Pipeline P(comm, R, rank, 32, 256, 2, 2 * R);
      genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, 9 + rank, true);
      CKE(P.run(s, P.out.p), comm);
      CKC(cudaStreamSynchronize(s));
      epResult_t ae;
      CKE(epCommGetAsyncError(comm, &ae, nullptr), comm);
      CK(ae == epSuccess, "new communicator: async error %d", ae);
    }
    CKE(epCommDestroy(comm), comm);
    return 0;
  }, 120000);
  for (int r = 0; r < R; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R;
}

// Ranks on two hosts (EPCOMM_HOSTID, as epcomm-run --hosts sets it), whatever EPCOMM_GPU_TEST_HOSTS says: the GPU
// engine maps only the ranks of its own host and reaches the others through its proxy. HT (exact, cached and
// worst-token dispatch, every combine type) is bit-exact against the host engine; the zero-copy combine region and
// registration, which would need the peers' memory, are refused with epNotSupported (runCase checks both).
// Dispatch is hierarchical there by default (a token crosses to a host once, to the source's forwarder, which hands
// it to the ranks of its host); `flat` runs the same cases with EPCOMM_HT_HIERARCHICAL=0, `hier_combine` with
// EPCOMM_GPU_HT_COMBINE_HIER=1 (that forwarder also sends back one partial sum of its host's expert outputs, against
// a host engine on the same hosts).
void ranksOnTwoHosts(int R, bool flat, bool hier_combine = false) {
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    if (flat) setenv("EPCOMM_HT_HIERARCHICAL", "0", 1);  // read once per process, at the first communicator
    if (hier_combine) setenv("EPCOMM_GPU_HT_COMBINE_HIER", "1", 1);
    CKC(selectDevice(rank));
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, &g, &h, 0, 2)) return 1;
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int E = 16 * R;
    const Case cases[] = {
        {64, 128, 4, E, epBfloat16, epBfloat16, -1, true},   // exact mode + cached handle
        {96, 256, 8, E, epBfloat16, epBfloat16, 5, false},   // worst-token padding
        {50, 512, 6, E, epFloat8E4M3, epBfloat16, 3, false}, // fp8 dispatch
    };
    uint64_t seed_i = seed;
    for (const Case& c : cases)
      if (runCase(g, h, rank, R, c, ++seed_i, s)) return 1;
    CK_CLEAN(g, "across two hosts");
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}
TEST_P(GpuHt, RanksOnTwoHostsRunThroughTheProxy) { ranksOnTwoHosts(GetParam(), false); }
TEST_P(GpuHt, RanksOnTwoHostsFlatDispatch) { ranksOnTwoHosts(GetParam(), true); }
TEST_P(GpuHt, RanksOnTwoHostsHierarchicalCombine) { ranksOnTwoHosts(GetParam(), false, true); }

// Elastic ranks: the last rank is killed (SIGKILL) while the others run an HT step; they get epTimeout once,
// mask it on the GPU communicator (broken until then) and on a host-engine one, and every HT case afterwards
// matches the host engine bit for bit with the same drop counters, on the same communicator, with no waiting.
TEST_P(GpuHt, KilledRankMaskedAndTheCommunicatorGoesOn) {
  const int R = GetParam();
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    const int timeout_ms = shortDeadlineMs(3000);
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, &g, &h, timeout_ms)) return 1;
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      Pipeline P(g, R, rank, 32, 256, 2, 2 * R);
      genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, 5 + rank, true);
      CKE(P.run(s, P.out.p), g);
      CKC(cudaStreamSynchronize(s));
      if (rank == R - 1) kill(getpid(), SIGKILL);  // dies before the next step
      CK_FAILING_STEP(P.run(s, P.out.p));
      CKC(cudaStreamSynchronize(s));
      epResult_t ae;
      epErrorInfo_t info = EP_ERROR_INFO_INIT;
      CKE(epCommGetAsyncError(g, &ae, &info), g);
      CK(ae == epTimeout || ae == epRemoteError, "the step with a dead rank: async error %s (peer %d)",
         epGetErrorString(ae), info.peer);
      CK(epCommBarrier(g, s) == ae, "a broken communicator refuses other calls");
    }
    const auto t0 = std::chrono::steady_clock::now();
    CKE(maskRanks(g, R, {R - 1}, s), g);
    CKE(maskRanks(h, R, {R - 1}, nullptr), h);
    const int E = 16 * R;
    const Case cases[] = {
        {64, 128, 4, E, epBfloat16, epBfloat16, -1, true},  // exact mode + cached handle
        {96, 256, 8, E, epBfloat16, epBfloat16, 5, false},  // worst-token padding
        {50, 512, 6, E, epFloat8E4M3, epBfloat16, 3, false},
    };
    uint64_t seed_i = seed;
    for (int it = 0; it < 4; ++it)
      for (const Case& c : cases)
        if (runCase(g, h, rank, R, c, ++seed_i, s, {R - 1})) return 1;
    CK_SAME_DROPS(g, h, R);
    CKE(epCommBarrier(g, s), g);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    CK(ms < 4 * timeout_ms, "recovery and the cases after it took %.0f ms: something waited", ms);
    CK_CLEAN(g, "after the mask");
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  for (int r = 0; r < R - 1; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R << ", seed " << seed;
}

// A failed HT step and the recovery from it without a death: every rank runs one good pipeline step (inputs from
// input_seed + rank), then `fail` (the step that goes wrong on some ranks, checked by the callee), then a no-op
// epCommSetActiveRanks, and `cases` bit-exact against the host engine on the same communicator.
using FailStep = std::function<int(epComm_t g, int rank, Pipeline& P, cudaStream_t s)>;
void recoveryWithoutADeath(int R, int input_seed, const FailStep& fail, const std::vector<Case>& cases) {
  epUniqueId gid, hid;
  ASSERT_EQ(epGetUniqueId(&gid), epSuccess);
  ASSERT_EQ(epGetUniqueId(&hid), epSuccess);
  const uint64_t seed = g_seed;
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    g_rank = rank;
    CKC(selectDevice(rank));
    epComm_t g, h;
    if (initPair(rank, R, gid, hid, &g, &h, shortDeadlineMs(1500))) return 1;
    cudaStream_t s;
    CKC(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      Pipeline P(g, R, rank, 32, 256, 2, 2 * R);
      genInputs<<<16, 256, 0, s>>>(P.x.p, P.idx.p, P.w.p, P.T, P.H, P.K, P.E, input_seed + rank, true);
      CKE(P.run(s, P.out.p), g);
      CKC(cudaStreamSynchronize(s));
      if (fail(g, rank, P, s)) return 1;
    }
    CKE(maskRanks(g, R, {}, s), g);
    CK_CLEAN(g, "after the no-op mask");
    uint64_t seed_i = seed;
    for (const Case& c : cases)
      if (runCase(g, h, rank, R, c, ++seed_i, s)) return 1;
    CK_CLEAN(g, "after the run");
    CKE(epCommDestroy(g), g);
    CKE(epCommDestroy(h), h);
    return 0;
  }, 300000);
  expectAllRanksOk(codes, seed);
}

// Rank 0 rejects an HT step the others launch (their notify times out; rank 0's HT epoch falls behind theirs).
TEST_P(GpuHt, RecoveryWithoutADeath) {
  const int R = GetParam();
  const int E = 16 * R;
  recoveryWithoutADeath(R, 5, [&](epComm_t g, int rank, Pipeline& P, cudaStream_t s) -> int {
    if (rank == 0) return 0;  // rank 0 sits this step out (as if its call had been refused)
    CK_FAILING_STEP(P.run(s, P.out.p));
    CKC(cudaStreamSynchronize(s));
    epResult_t ae;
    CKE(epCommGetAsyncError(g, &ae, nullptr), g);
    CK(ae == epTimeout, "without rank 0 the step should time out, got %s", epGetErrorString(ae));
    return 0;
  }, {{64, 128, 4, E, epBfloat16, epBfloat16, -1, true}, {96, 256, 8, E, epBfloat16, epBfloat16, 5, false}});
}

// Ranks that issue different operations at one epoch, both counting through the mailboxes (rank 0 an alltoallv with
// device counts, the others the HT pipeline, whose notify comes first): the mailbox tags name the operation, so
// every rank records epInvalidUsage instead of reading the other operation's counts as its own; the recovery then
// makes the communicator usable.
TEST_P(GpuHt, MismatchedOperationsAreReportedNotMisread) {
  const int R = GetParam();
  recoveryWithoutADeath(R, 7, [&](epComm_t g, int rank, Pipeline& P, cudaStream_t s) -> int {
    if (rank == 0) {
      DevBuf<int64_t> sc(R), rc(R), dropped(1);
      DevBuf<float> sb(static_cast<size_t>(R) * 64), rb(static_cast<size_t>(R) * 64);
      sc.upload(std::vector<int64_t>(R, 64));
      const epResult_t r = epAlltoallvDevice(g, sb.p, sc.p, rb.p, static_cast<size_t>(R) * 64, rc.p, dropped.p,
                                             epFloat32, s);
      CK(r == epSuccess || r == epInvalidUsage || r == epTimeout || r == epRemoteError, "alltoallv -> %s",
         epGetErrorString(r));
    } else {
      const epResult_t r = P.run(s, P.out.p);
      CK(r == epSuccess || r == epInvalidUsage || r == epTimeout || r == epRemoteError, "HT pipeline -> %s",
         epGetErrorString(r));
    }
    CKC(cudaStreamSynchronize(s));
    epResult_t ae;
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    CKE(epCommGetAsyncError(g, &ae, &info), g);
    CK(ae == epInvalidUsage, "a mismatch against %s should be epInvalidUsage, got %s (peer %d)",
       rank == 0 ? "HT notify" : "an alltoallv", epGetErrorString(ae), info.peer);
    return 0;
  }, {{64, 128, 4, 16 * R, epBfloat16, epBfloat16, -1, true}});
}

INSTANTIATE_TEST_SUITE_P(Ranks, GpuHt, ::testing::ValuesIn(rankCounts()),
                         [](const ::testing::TestParamInfo<int>& i) { return "R" + std::to_string(i.param); });


}  // namespace


int main(int argc, char** argv) { return runGpuTests(argc, argv); }
