// Every invalid argument returns its own result code and a message naming the argument; the next valid call
// on the same communicator succeeds (DESIGN.md R2). Ranks run as forked processes.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "epcomm/epcomm.h"
#include "multiproc.h"

namespace {

constexpr int kR = 2, kT = 6, kH = 128, kK = 2, kE = 4;

#define EXPECT_OR_FAIL(...) EP_RANK_CHECK(rank, __VA_ARGS__)

// One rank's valid HT inputs and buffers; dispatch + combine with the identity as the expert stand-in.
struct Ht {
  epComm_t comm;
  int rank;
  std::vector<uint16_t> x, recv_x, out;
  std::vector<int64_t> idx, recv_idx;
  std::vector<float> w, recv_w;
  epHtHandle_t h = nullptr;
  epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;

  Ht(epComm_t c, int r) : comm(c), rank(r) {
    x.resize(kT * kH);
    for (size_t i = 0; i < x.size(); ++i) x[i] = epcomm::floatToBf16(0.25f * static_cast<float>((i + 7 * r) % 13) + 1);
    for (int t = 0; t < kT; ++t)
      for (int k = 0; k < kK; ++k) {
        idx.push_back((t + k + r) % kE);
        w.push_back(0.5f);
      }
    recv_x.assign(kR * kT * kH, 0);
    recv_idx.assign(kR * kT * kK, 0);
    recv_w.assign(kR * kT * kK, 0);
    out.assign(kT * kH, 0);
    epHtHandleCreate(comm, kT, &h);
    a.num_tokens = kT;
    a.hidden = kH;
    a.topk = kK;
    a.num_experts = kE;
    a.dtype = epBfloat16;
    a.x = x.data();
    a.topk_idx = idx.data();
    a.topk_weights = w.data();
    a.num_worst_tokens = kR * kT;
    a.recv_x = recv_x.data();
    a.recv_x_bytes = recv_x.size() * 2;
    a.recv_topk_idx = recv_idx.data();
    a.recv_topk_idx_bytes = recv_idx.size() * 8;
    a.recv_topk_weights = recv_w.data();
    a.recv_topk_weights_bytes = recv_w.size() * 4;
  }
  ~Ht() { epHtHandleDestroy(h); }

  // A valid round trip: every token goes to >= 1 rank, combine of the identity gives x times the number of
  // ranks that received each token.
  int roundTrip() {
    epHtDispatchArgs_t d = a;
    EXPECT_OR_FAIL(epHtDispatch(comm, &d, h, nullptr) == epSuccess, "valid dispatch failed: %s",
                   epGetLastError(comm));
    int nt = 0, nr = 0;
    epHtHandleGetCounts(h, &nt, &nr);
    epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
    c.num_tokens = kT;
    c.hidden = kH;
    c.dtype = epBfloat16;
    c.x = recv_x.data();
    c.x_bytes = static_cast<size_t>(nr) * kH * 2;
    c.combined_x = out.data();
    c.combined_x_bytes = out.size() * 2;
    EXPECT_OR_FAIL(epHtCombine(comm, &c, h, nullptr) == epSuccess, "valid combine failed: %s",
                   epGetLastError(comm));
    for (int t = 0; t < kT; ++t) {
      int ranks = 0;
      for (int rr = 0; rr < kR; ++rr) {
        bool in = false;
        for (int k = 0; k < kK; ++k) in = in || idx[t * kK + k] / (kE / kR) == rr;
        ranks += in;
      }
      for (int j = 0; j < kH; ++j) {
        float want = epcomm::bf16ToFloat(x[t * kH + j]) * ranks;
        float got = epcomm::bf16ToFloat(out[t * kH + j]);
        EXPECT_OR_FAIL(got == epcomm::bf16ToFloat(epcomm::floatToBf16(want)), "combine[%d,%d] = %g, want %g", t, j,
                       got, want);
      }
    }
    return 0;
  }
};

struct Case {
  const char* name;
  epResult_t expect;
  const char* mention;  // the message must name this
  std::function<epResult_t(Ht&)> call;
};

std::vector<Case> cases() {
  return {
      {"null args", epNullPointer, "args", [](Ht& s) { return epHtDispatch(s.comm, nullptr, s.h, nullptr); }},
      {"null x", epNullPointer, "x",
       [](Ht& s) {
         auto a = s.a;
         a.x = nullptr;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"null handle", epNullPointer, "handle", [](Ht& s) { return epHtDispatch(s.comm, &s.a, nullptr, nullptr); }},
      {"bad magic", epInvalidArgument, "EP_HT_DISPATCH_ARGS_INIT",
       [](Ht& s) {
         auto a = s.a;
         a.magic = 0;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"unsupported dtype", epUnsupportedDtype, "dtype",
       [](Ht& s) {
         auto a = s.a;
         a.dtype = epInt32;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"hidden not a multiple of 8", epInvalidHidden, "hidden",
       [](Ht& s) {
         auto a = s.a;
         a.hidden = 12;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"fp8 hidden not a multiple of 128", epInvalidHidden, "hidden",
       [](Ht& s) {
         auto a = s.a;
         a.dtype = epFloat8E4M3;
         a.hidden = 136;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"top-k over the limit", epInvalidTopk, "topk",
       [](Ht& s) {
         auto a = s.a;
         a.topk = EP_MAX_TOPK + 1;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"top-k zero", epInvalidTopk, "topk",
       [](Ht& s) {
         auto a = s.a;
         a.topk = 0;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"E % R != 0", epInvalidNumExperts, "num_experts",
       [](Ht& s) {
         auto a = s.a;
         a.num_experts = 3;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"expert id >= E", epExpertOutOfRange, "topk_idx",
       [](Ht& s) {
         auto a = s.a;
         std::vector<int64_t> bad = s.idx;
         bad[3] = kE;
         a.topk_idx = bad.data();
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"expert id < -1", epExpertOutOfRange, "topk_idx",
       [](Ht& s) {
         std::vector<int64_t> bad = s.idx;
         bad[0] = -2;
         int per_rank[kR], per_expert[kE];
         return epGetDispatchLayout(s.comm, bad.data(), kT, kK, kE, per_rank, per_expert, nullptr, nullptr);
       }},
      {"more tokens than the handle's capacity", epCapacityExceeded, "max_tokens",
       [](Ht& s) {
         auto a = s.a;
         a.num_tokens = kT + 1;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"worst-token capacity overflow", epCapacityExceeded, "num_worst_tokens",
       [](Ht& s) {
         auto a = s.a;
         a.num_worst_tokens = 1;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"buffer smaller than the size helper", epBufferTooSmall, "recv_x",
       [](Ht& s) {
         auto a = s.a;
         a.recv_x_bytes -= 2;
         return epHtDispatch(s.comm, &a, s.h, nullptr);
       }},
      {"LL more tokens than the capacity", epCapacityExceeded, "max_tokens_per_rank",
       [](Ht& s) {
         epLlDispatchArgs_t d = EP_LL_DISPATCH_ARGS_INIT;
         d.num_tokens = kT;
         d.max_tokens_per_rank = kT - 1;
         d.hidden = kH;
         d.topk = kK;
         d.num_experts = kE;
         d.x = s.x.data();
         d.topk_idx = s.idx.data();
         return epLlDispatch(s.comm, &d, nullptr);
       }},
      {"LL unsupported dtype", epUnsupportedDtype, "dtype",
       [](Ht& s) {
         epLlDispatchArgs_t d = EP_LL_DISPATCH_ARGS_INIT;
         d.num_tokens = kT;
         d.max_tokens_per_rank = kT;
         d.hidden = kH;
         d.topk = kK;
         d.num_experts = kE;
         d.dtype = epFloat8E4M3;
         d.x = s.x.data();
         d.topk_idx = s.idx.data();
         return epLlDispatch(s.comm, &d, nullptr);
       }},
      {"LL receive half without a send half", epInvalidUsage, "EP_LL_RECV",
       [](Ht& s) {
         epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
         c.num_tokens = kT;
         c.max_tokens_per_rank = kT;
         c.hidden = kH;
         c.topk = kK;
         c.num_experts = kE;
         c.phases = EP_LL_RECV;
         std::vector<uint16_t> out(kT * kH);
         c.topk_idx = s.idx.data();
         c.topk_weights = s.w.data();
         c.out = out.data();
         c.out_bytes = out.size() * 2;
         return epLlCombine(s.comm, &c, nullptr);
       }},
      {"alltoallv count mismatch", epInvalidUsage, "alltoallv",
       [](Ht& s) {
         std::vector<float> sb(8, 1.0f), rb(8);
         size_t sc[kR] = {1, 1}, sd[kR] = {0, 1}, rc[kR] = {1, 2}, rd[kR] = {0, 1};
         return epAlltoallv(s.comm, sb.data(), sc, sd, rb.data(), rc, rd, epFloat32, nullptr);
       }},
  };
}

TEST(InvalidArgs, EachHasItsCodeAndTheCommStaysUsable) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  auto codes = epcomm::test::runRanks(kR, [&](int rank) -> int {
    epConfig_t cfg = EP_CONFIG_INIT;
    cfg.engine = EP_ENGINE_HOST;
    cfg.timeout_ms = 10000;
    cfg.ll_max_tokens_per_rank = kT;
    epComm_t comm;
    EXPECT_OR_FAIL(epCommInitRank(&comm, kR, &id, rank, &cfg) == epSuccess, "init: %s", epGetLastError(nullptr));
    Ht s(comm, rank);
    if (s.roundTrip()) return 1;
    for (const Case& c : cases()) {
      epResult_t r = c.call(s);
      std::string msg = epGetLastError(comm);
      // A data-dependent rejection is decided where the data is; peers see epRemoteError.
      EXPECT_OR_FAIL(r == c.expect, "%s: got %s (%s), want %s", c.name, epGetErrorString(r), msg.c_str(),
                     epGetErrorString(c.expect));
      EXPECT_OR_FAIL(msg.find(c.mention) != std::string::npos, "%s: message '%s' does not name '%s'", c.name,
                     msg.c_str(), c.mention);
      if (s.roundTrip()) {
        fprintf(stderr, "rank %d: after case '%s'\n", rank, c.name);
        return 1;
      }
    }
    EXPECT_OR_FAIL(epCommDestroy(comm) == epSuccess, "destroy");
    return 0;
  });
  for (int r = 0; r < kR; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Bad input on one rank only: that rank gets its specific code, the other epRemoteError, nobody hangs, and
// the communicator keeps working.
TEST(InvalidArgs, OneRankRejectsAndAllRanksFailTogether) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  auto codes = epcomm::test::runRanks(kR, [&](int rank) -> int {
    epConfig_t cfg = EP_CONFIG_INIT;
    cfg.engine = EP_ENGINE_HOST;
    cfg.timeout_ms = 10000;
    epComm_t comm;
    EXPECT_OR_FAIL(epCommInitRank(&comm, kR, &id, rank, &cfg) == epSuccess, "init: %s", epGetLastError(nullptr));
    Ht s(comm, rank);
    auto a = s.a;
    std::vector<int64_t> bad = s.idx;
    if (rank == 1) bad[5] = 1000;
    a.topk_idx = bad.data();
    epResult_t r = epHtDispatch(comm, &a, s.h, nullptr);
    epResult_t want = rank == 1 ? epExpertOutOfRange : epRemoteError;
    EXPECT_OR_FAIL(r == want, "got %s (%s), want %s", epGetErrorString(r), epGetLastError(comm),
                   epGetErrorString(want));
    if (rank == 0)
      EXPECT_OR_FAIL(std::string(epGetLastError(comm)).find("rank 1") != std::string::npos,
                     "message '%s' does not name rank 1", epGetLastError(comm));
    if (s.roundTrip()) return 1;
    epCommDestroy(comm);
    return 0;
  });
  for (int r = 0; r < kR; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(InvalidArgs, InitArguments) {
  epComm_t comm = nullptr;
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  EXPECT_EQ(epCommInitRank(nullptr, 2, &id, 0, nullptr), epNullPointer);
  EXPECT_EQ(epCommInitRank(&comm, 2, &id, 2, nullptr), epRankMismatch);
  EXPECT_NE(std::string(epGetLastError(nullptr)).find("rank"), std::string::npos);
  EXPECT_EQ(epCommInitRank(&comm, 0, &id, 0, nullptr), epRankMismatch);
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.magic = 1;
  EXPECT_EQ(epCommInitRank(&comm, 1, &id, 0, &cfg), epInvalidArgument);
  EXPECT_NE(std::string(epGetLastError(nullptr)).find("EP_CONFIG_INIT"), std::string::npos);
  cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_HOST;
  cfg.num_channels = -1;
  EXPECT_EQ(epCommInitRank(&comm, 1, &id, 0, &cfg), epInvalidArgument);
  EXPECT_NE(std::string(epGetLastError(nullptr)).find("num_channels = -1"), std::string::npos);
  epUniqueId garbled = id;
  garbled.internal[40] ^= 0x5a;
  EXPECT_EQ(epCommInitRank(&comm, 1, &garbled, 0, nullptr), epInvalidUniqueId);
  EXPECT_EQ(epUniqueIdFromString("zz", &garbled), epInvalidUniqueId);
}

// Ranks that disagree on the rank count all fail with epRankMismatch instead of hanging.
TEST(InvalidArgs, MismatchedRankCount) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  auto codes = epcomm::test::runRanks(2, [&](int rank) -> int {
    epConfig_t cfg = EP_CONFIG_INIT;
    cfg.engine = EP_ENGINE_HOST;
    cfg.timeout_ms = 5000;
    epComm_t comm;
    epResult_t r = epCommInitRank(&comm, rank == 0 ? 2 : 3, &id, rank, &cfg);
    EXPECT_OR_FAIL(r == epRankMismatch, "got %s (%s)", epGetErrorString(r), epGetLastError(nullptr));
    return 0;
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
