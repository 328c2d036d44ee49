// The C API's promises under bad input (issue 13): a rejected call never costs the communicator, every failure
// leaves its message in epGetLastError(comm), NULL is epNullPointer everywhere, a stale unique id is refused at
// once where the process can know it, the size helpers validate shapes, and the header's zero-size NULL rule.
// Ranks run as forked processes; World/RankIo (api_world.h) give every rank its inputs and reference checks.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "api_world.h"
#include "epcomm/epcomm.h"
#include "multiproc.h"

namespace {

using epcomm::test::RankIo;
using epcomm::test::World;

#define CHECK(...) EP_RANK_CHECK(rank, __VA_ARGS__)
// A call's result and, on failure, that its message is the communicator's and names `mention`.
#define CHECK_CODE(call, want, mention)                                                                          \
  do {                                                                                                           \
    epResult_t r_ = (call);                                                                                      \
    std::string m_ = epGetLastError(comm);                                                                       \
    CHECK(r_ == (want), "%s returned %s (%s), want %s", #call, epGetErrorString(r_), m_.c_str(),                \
          epGetErrorString(want));                                                                               \
    if ((want) != epSuccess) {                                                                                   \
      CHECK(m_.find(mention) != std::string::npos, "%s: message '%s' does not name '%s'", #call, m_.c_str(),     \
            (mention));                                                                                          \
      CHECK(m_ == epGetLastError(nullptr), "%s: comm message '%s' differs from the thread's '%s'", #call,       \
            m_.c_str(), epGetLastError(nullptr));                                                                \
    }                                                                                                            \
  } while (0)
#define CHECK_OUT(what) \
  do {                  \
    std::string e_ = (what); \
    CHECK(e_.empty(), "%s", e_.c_str()); \
  } while (0)

long long msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

// Runs body(rank, comm) on R forked ranks of one host-engine communicator.
template <typename Body>
void runComm(int R, Body body, int timeout_ms = 10000, int ll_max_tokens = 8) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  auto codes = epcomm::test::runRanks(R, [&](int rank) -> int {
    epConfig_t cfg = EP_CONFIG_INIT;
    cfg.engine = EP_ENGINE_HOST;
    cfg.timeout_ms = timeout_ms;
    cfg.ll_max_tokens_per_rank = ll_max_tokens;
    epComm_t comm = nullptr;
    CHECK(epCommInitRank(&comm, R, &id, rank, &cfg) == epSuccess, "init: %s", epGetLastError(nullptr));
    int rc = body(rank, comm);
    epCommDestroy(comm);
    return rc;
  });
  for (int r = 0; r < R; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

World world(int R, std::vector<int> T, uint64_t seed = 7) {
  World w;
  w.seed = seed;
  w.R = R;
  w.H = 64;
  w.K = 3;
  w.E = 2 * R;
  w.M = 8;
  w.T = std::move(T);
  return w;
}

// A valid LL dispatch + combine in one call each, checked.
int llRoundTrip(RankIo& io, int layout) {
  const int rank = io.me;
  epComm_t comm = io.comm;
  epLlDispatchArgs_t d = io.llDispatchArgs(layout, EP_LL_SEND_RECV, true);
  CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
  CHECK_OUT(io.checkLlDispatch());
  epLlCombineArgs_t c = io.llCombineArgs(EP_LL_SEND_RECV, true);
  CHECK_CODE(epLlCombine(comm, &c, nullptr), epSuccess, "");
  CHECK_OUT(io.checkLlCombine());
  return 0;
}

// ---- Defect 1: a rejected LL receive half is not executed as a whole send + receive ----------------------

// The case at R = 3: rank 1's EP_LL_RECV has recv_x_bytes one byte short. It posts nothing and stays
// outstanding: the other ranks' receives complete, rank 1's valid retry completes, and later calls work.
TEST(LlRejectedHalves, ReceiveRejectedOnOneRankStaysOutstanding) {
  const World w = world(3, {4, 3, 0});
  runComm(3, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    epLlDispatchArgs_t send = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND, true);
    CHECK_CODE(epLlDispatch(comm, &send, nullptr), epSuccess, "");
    epLlDispatchArgs_t recv = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_RECV, false);
    if (rank == 1) {
      epLlDispatchArgs_t bad = recv;
      bad.recv_x_bytes -= 1;
      CHECK_CODE(epLlDispatch(comm, &bad, nullptr), epBufferTooSmall, "recv_x");
      CHECK(io.llDispatchUntouched(), "the rejected receive half wrote its outputs");
    }
    CHECK_CODE(epLlDispatch(comm, &recv, nullptr), epSuccess, "");
    CHECK_OUT(io.checkLlDispatch());
    CHECK_CODE(epCommBarrier(comm, nullptr), epSuccess, "");
    return llRoundTrip(io, EP_LL_RANK_MAJOR);
  });
}

// Every rank's receive half rejected (a NULL output): every rank retries and completes.
TEST(LlRejectedHalves, ReceiveRejectedOnAllRanksCanBeRetried) {
  const World w = world(2, {5, 2});
  runComm(2, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    epLlDispatchArgs_t d = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND_RECV, true);
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    epLlCombineArgs_t send = io.llCombineArgs(EP_LL_SEND, true);
    CHECK_CODE(epLlCombine(comm, &send, nullptr), epSuccess, "");
    epLlCombineArgs_t recv = io.llCombineArgs(EP_LL_RECV, false), bad = recv;
    bad.topk_weights = nullptr;
    CHECK_CODE(epLlCombine(comm, &bad, nullptr), epNullPointer, "topk_weights");
    CHECK(io.ll_out.poisoned(), "the rejected receive half wrote out");
    CHECK_CODE(epLlCombine(comm, &recv, nullptr), epSuccess, "");
    CHECK_OUT(io.checkLlCombine());
    CHECK_CODE(epCommBarrier(comm, nullptr), epSuccess, "");
    return llRoundTrip(io, EP_LL_EXPERT_MAJOR);
  });
}

// A rejected send half returns at once (without waiting for late peers) and posts an error header: the
// peers' receive returns epRemoteError naming the rank, the rank's own receive returns its send half's code.
TEST(LlRejectedHalves, SendRejectedFailsTheReceivesAndReturnsAtOnce) {
  const World w = world(3, {3, 0, 4});
  runComm(3, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // a late peer
    epLlDispatchArgs_t send = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND, true);
    std::vector<int64_t> bad_idx = io.idx;
    if (rank == 2) {
      bad_idx[1] = w.E;
      send.topk_idx = bad_idx.data();
      auto t0 = std::chrono::steady_clock::now();
      CHECK_CODE(epLlDispatch(comm, &send, nullptr), epExpertOutOfRange, "topk_idx");
      CHECK(msSince(t0) < 500, "the rejected send half took %lld ms: it waited for its peers", msSince(t0));
    } else {
      CHECK_CODE(epLlDispatch(comm, &send, nullptr), epSuccess, "");
    }
    epLlDispatchArgs_t recv = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_RECV, false);
    if (rank == 2)
      CHECK_CODE(epLlDispatch(comm, &recv, nullptr), epExpertOutOfRange, "send half");
    else
      CHECK_CODE(epLlDispatch(comm, &recv, nullptr), epRemoteError, "rank 2");
    CHECK(io.llDispatchUntouched(), "a failed receive half wrote its outputs");
    CHECK_CODE(epCommBarrier(comm, nullptr), epSuccess, "");
    return llRoundTrip(io, EP_LL_EXPERT_MAJOR);
  });
}

// A rejected combine send half while the dispatch's receive is outstanding returns its own code.
TEST(LlRejectedHalves, SendRejectedBesideTheOtherPendingReceiveKeepsItsCode) {
  const World w = world(2, {4, 4});
  runComm(2, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    epLlDispatchArgs_t d = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND_RECV, true);
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    epLlCombineArgs_t c = io.llCombineArgs(EP_LL_SEND, true);
    d = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND, false);
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    c.y_bytes -= 1;
    CHECK_CODE(epLlCombine(comm, &c, nullptr), epBufferTooSmall, "y");
    d.phases = EP_LL_RECV;
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    CHECK_OUT(io.checkLlDispatch());
    c = io.llCombineArgs(EP_LL_RECV, true);
    CHECK_CODE(epLlCombine(comm, &c, nullptr), epBufferTooSmall, "send half");
    return llRoundTrip(io, EP_LL_EXPERT_MAJOR);
  });
}

// ---- Defect 2: epGetLastError(comm) names the last failure on comm, whatever the entry point ------------

TEST(LastError, QueriesRecordTheirFailure) {
  runComm(1, [&](int rank, epComm_t comm) -> int {
    CHECK_CODE(epHtDispatch(comm, nullptr, nullptr, nullptr), epNullPointer, "args");
    CHECK_CODE(epCommRank(comm, nullptr), epNullPointer, "rank");
    CHECK_CODE(epCommSize(comm, nullptr), epNullPointer, "size");
    CHECK_CODE(epCommEngine(comm, nullptr), epNullPointer, "engine");
    CHECK_CODE(epCommGetAsyncError(comm, nullptr, nullptr), epNullPointer, "async_error");
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    info.magic = 0;
    epResult_t ae = static_cast<epResult_t>(-5);
    CHECK_CODE(epCommGetAsyncError(comm, &ae, &info), epInvalidArgument, "info");
    CHECK(ae == static_cast<epResult_t>(-5), "a failed epCommGetAsyncError wrote *async_error");
    return 0;
  });
}

// A call refused because the communicator broke (here: a peer never came to a barrier) leaves that refusal
// as the communicator's message, not the earlier timeout's.
TEST(LastError, RefusalOfABrokenCommunicatorIsRecorded) {
  runComm(2, [&](int rank, epComm_t comm) -> int {
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return 0;
    }
    CHECK_CODE(epCommBarrier(comm, nullptr), epTimeout, "no progress");
    CHECK_CODE(epCommBarrier(comm, nullptr), epTimeout, "unusable");
    int r = -1;
    CHECK_CODE(epCommRank(comm, nullptr), epNullPointer, "rank");
    CHECK_CODE(epCommRank(comm, &r), epSuccess, "");
    CHECK_CODE(epLlDispatchSizes(comm, nullptr, nullptr), epTimeout, "unusable");
    return 0;
  }, 300);
}

// ---- Defect 3: one rule for NULL --------------------------------------------------------------------------

TEST(NullPointers, AreEpNullPointerEverywhere) {
  runComm(1, [&](int rank, epComm_t comm) -> int {
    int v = 0;
    epEngine_t e;
    CHECK(epCommRank(nullptr, &v) == epNullPointer, "epCommRank(NULL)");
    CHECK(epCommSize(nullptr, &v) == epNullPointer, "epCommSize(NULL)");
    CHECK(epCommEngine(nullptr, &e) == epNullPointer, "epCommEngine(NULL)");
    CHECK(epHtHandleGetCounts(nullptr, &v, &v) == epNullPointer, "epHtHandleGetCounts(NULL)");
    uint64_t net_bytes = 1;
    CHECK(epCommGetNetBytes(nullptr, &net_bytes) == epNullPointer, "epCommGetNetBytes(NULL comm)");
    CHECK_CODE(epCommGetNetBytes(comm, nullptr), epNullPointer, "bytes_sent");
    CHECK(epCommGetNetBytes(comm, &net_bytes) == epSuccess && net_bytes == 0, "one host: no inter-host bytes");
    double raw_s = 1;
    CHECK(epCommNetRawBandwidth(nullptr, 1, 1, 1, &net_bytes, &raw_s) == epNullPointer, "epCommNetRawBandwidth(NULL)");
    CHECK_CODE(epCommNetRawBandwidth(comm, 1, 1, 1, nullptr, &raw_s), epNullPointer, "bytes_sent");
    CHECK_CODE(epCommNetRawBandwidth(comm, 1, 1, 1, &net_bytes, nullptr), epNullPointer, "seconds");
    CHECK_CODE(epCommNetRawBandwidth(comm, 0, 1, 1, &net_bytes, &raw_s), epInvalidArgument, "bytes_per_peer");
    CHECK_CODE(epCommNetRawBandwidth(comm, 1, 0, 1, &net_bytes, &raw_s), epInvalidArgument, "msg_bytes");
    CHECK_CODE(epCommNetRawBandwidth(comm, 1, 1, 0, &net_bytes, &raw_s), epInvalidArgument, "window");
    CHECK_CODE(epCommNetRawBandwidth(comm, 1, 1, 33, &net_bytes, &raw_s), epInvalidArgument, "window");
    net_bytes = 1;
    CHECK(epCommNetRawBandwidth(comm, 1 << 20, 1 << 16, 4, &net_bytes, &raw_s) == epSuccess && net_bytes == 0 &&
              raw_s == 0, "one host: no raw net stream");
    epHtDispatchArgs_t ha = EP_HT_DISPATCH_ARGS_INIT;
    epLlDispatchArgs_t la = EP_LL_DISPATCH_ARGS_INIT;
    epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
    CHECK_CODE(epHtDispatchSizes(comm, nullptr, 0, &s), epNullPointer, "args");
    CHECK_CODE(epHtDispatchSizes(comm, &ha, 0, nullptr), epNullPointer, "sizes");
    CHECK_CODE(epLlDispatchSizes(comm, nullptr, &s), epNullPointer, "args");
    CHECK_CODE(epLlDispatchSizes(comm, &la, nullptr), epNullPointer, "sizes");
    s.magic = 0;
    CHECK_CODE(epLlDispatchSizes(comm, &la, &s), epInvalidArgument, "EP_BUFFER_SIZES_INIT");
    // Zero-copy regions are a GPU engine feature: the host engine refuses them and leaves the outputs alone.
    void* region = &v;
    size_t region_bytes = 7;
    CHECK_CODE(epHtCombineBuffer(comm, nullptr, &region_bytes), epNullPointer, "x");
    CHECK_CODE(epHtCombineBuffer(comm, &region, nullptr), epNullPointer, "x_bytes");
    CHECK_CODE(epHtCombineBuffer(comm, &region, &region_bytes), epNotSupported, "GPU engine");
    CHECK_CODE(epLlCombineBuffer(comm, &region, &region_bytes), epNotSupported, "GPU engine");
    CHECK(region == &v && region_bytes == 7, "a refused region request wrote its outputs");
    float* scales = reinterpret_cast<float*>(&v);
    size_t scales_bytes = 9;
    CHECK_CODE(epLlDispatchBuffer(comm, &region, &region_bytes, nullptr, &scales_bytes), epNullPointer, "recv_x_scales");
    CHECK_CODE(epLlDispatchBuffer(comm, &region, &region_bytes, &scales, &scales_bytes), epNotSupported, "GPU engine");
    CHECK(region == &v && region_bytes == 7 && scales == reinterpret_cast<float*>(&v) && scales_bytes == 9,
          "a refused dispatch region request wrote its outputs");
    CHECK(epCommBarrier(comm, nullptr) == epSuccess, "the communicator after the refusals");
    return 0;
  });
}

// ---- Defect 4: a stale unique id is refused at once in the process that made it ---------------------------

TEST(StaleUniqueId, IsRefusedAtOnceByTheProcessThatMadeIt) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_HOST;
  cfg.timeout_ms = 3000;
  epComm_t comm = nullptr;
  ASSERT_EQ(epCommInitRank(&comm, 1, &id, 0, &cfg), epSuccess) << epGetLastError(nullptr);
  ASSERT_EQ(epCommDestroy(comm), epSuccess);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(epCommInitRank(&comm, 1, &id, 0, &cfg), epInvalidUniqueId) << epGetLastError(nullptr);
  EXPECT_LT(msSince(t0), 1000);
  EXPECT_NE(std::string(epGetLastError(nullptr)).find("epGetUniqueId"), std::string::npos) << epGetLastError(nullptr);
  EXPECT_EQ(comm, nullptr);
}

// ---- Set-up has a deadline of its own (EPCOMM_SETUP_TIMEOUT_MS), not the no-progress one -------------------

// A short config.timeout_ms is chosen to notice deaths fast; wiring the ranks up may take longer (a rank that
// starts late, connections across hosts on a loaded machine). Two ranks on virtual hosts of their own (net
// connections at creation), timeout_ms = 500, rank 1 calls epCommInitRank 2 s after rank 0: both succeed and run a
// barrier. With EPCOMM_SETUP_TIMEOUT_MS = 500 the same start fails within its bound, and a negative value is refused.
TEST(SetupDeadline, IsItsOwnAndNotTheNoProgressDeadline) {
  for (const char* setup : {"0", "500", "-1"}) {
    epUniqueId id;
    ASSERT_EQ(epGetUniqueId(&id), epSuccess);
    auto codes = epcomm::test::runRanks(2, [&](int rank) -> int {
      setenv("EPCOMM_HOSTID", rank == 0 ? "setup-a" : "setup-b", 1);
      setenv("EPCOMM_NET", "socket", 1);
      setenv("EPCOMM_SETUP_TIMEOUT_MS", setup, 1);
      if (rank == 1 && strcmp(setup, "-1") != 0) usleep(2000 * 1000);
      epConfig_t cfg = EP_CONFIG_INIT;
      cfg.engine = EP_ENGINE_HOST;
      cfg.timeout_ms = 500;
      epComm_t comm = nullptr;
      auto t0 = std::chrono::steady_clock::now();
      const epResult_t r = epCommInitRank(&comm, 2, &id, rank, &cfg);
      const std::string why = epGetLastError(nullptr);
      if (strcmp(setup, "-1") == 0) {
        CHECK(r == epInvalidArgument && why.find("EPCOMM_SETUP_TIMEOUT_MS") != std::string::npos,
              "a negative EPCOMM_SETUP_TIMEOUT_MS: %d '%s'", r, why.c_str());
        return 0;
      }
      if (strcmp(setup, "500") == 0) {
        if (rank == 0)  // (rank 1 may fail or not: rank 0 is gone by the time it arrives)
          CHECK(r != epSuccess && msSince(t0) < 1900, "rank 0: %d after %lld ms with a 500 ms set-up deadline", r,
                msSince(t0));
        if (r == epSuccess) epCommDestroy(comm);
        return 0;
      }
      CHECK(r == epSuccess, "init with a late peer: %s", why.c_str());
      const epResult_t b = epCommBarrier(comm, nullptr);
      epCommDestroy(comm);
      CHECK(b == epSuccess, "barrier: %s", epGetLastError(nullptr));
      return 0;
    }, 30000);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << ", EPCOMM_SETUP_TIMEOUT_MS=" << setup;
  }
}

// ---- Defect 5: the size helpers validate the shape fields with the operations' codes ----------------------

TEST(SizeHelpers, ValidateShapesWithTheOperationsCodes) {
  runComm(2, [&](int rank, epComm_t comm) -> int {
    struct Case {
      const char* field;
      epResult_t want;
      void (*ht)(epHtDispatchArgs_t&);
      void (*ll)(epLlDispatchArgs_t&);
    };
    const Case cases[] = {
        {"hidden", epInvalidHidden, [](epHtDispatchArgs_t& a) { a.hidden = -8; }, [](epLlDispatchArgs_t& a) { a.hidden = -8; }},
        {"hidden", epInvalidHidden, [](epHtDispatchArgs_t& a) { a.hidden = 12; }, [](epLlDispatchArgs_t& a) { a.hidden = 1 << 20; }},
        {"num_experts", epInvalidNumExperts, [](epHtDispatchArgs_t& a) { a.num_experts = -4; },
         [](epLlDispatchArgs_t& a) { a.num_experts = 3; }},
        {"topk", epInvalidTopk, [](epHtDispatchArgs_t& a) { a.topk = 0; }, [](epLlDispatchArgs_t& a) { a.topk = 33; }},
        {"num_tokens", epInvalidArgument, [](epHtDispatchArgs_t& a) { a.num_tokens = -1; },
         [](epLlDispatchArgs_t& a) { a.num_tokens = -1; }},
        {"dtype", epUnsupportedDtype, [](epHtDispatchArgs_t& a) { a.dtype = 99; }, [](epLlDispatchArgs_t& a) { a.dtype = epInt64; }},
    };
    for (const Case& c : cases) {
      epHtDispatchArgs_t ha = EP_HT_DISPATCH_ARGS_INIT;
      ha.num_tokens = 4, ha.hidden = 64, ha.topk = 2, ha.num_experts = 4;
      epLlDispatchArgs_t la = EP_LL_DISPATCH_ARGS_INIT;
      la.num_tokens = 4, la.max_tokens_per_rank = 8, la.hidden = 64, la.topk = 2, la.num_experts = 4;
      epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
      CHECK_CODE(epHtDispatchSizes(comm, &ha, 8, &s), epSuccess, "");
      CHECK_CODE(epLlDispatchSizes(comm, &la, &s), epSuccess, "");
      c.ht(ha);
      c.ll(la);
      s = EP_BUFFER_SIZES_INIT;
      CHECK_CODE(epHtDispatchSizes(comm, &ha, 8, &s), c.want, c.field);
      CHECK_CODE(epLlDispatchSizes(comm, &la, &s), c.want, c.field);
      CHECK(s.recv_x == 0 && s.combined_x == 0, "a failed size helper wrote sizes");
    }
    return 0;
  });
}

// ---- The header's open ends ---------------------------------------------------------------------------------

// Between an LL send half and its receive only LL calls may run: barrier, HT and alltoallv are refused with
// epInvalidUsage and post nothing, so that the receive still completes.
TEST(HeaderRules, OnlyLlCallsBetweenASendHalfAndItsReceive) {
  const World w = world(2, {3, 2});
  runComm(2, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    epLlDispatchArgs_t d = io.llDispatchArgs(EP_LL_RANK_MAJOR, EP_LL_SEND, true);
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    CHECK_CODE(epCommBarrier(comm, nullptr), epInvalidUsage, "EP_LL_RECV");
    io.a2aPrepare(epFloat32);
    CHECK_CODE(io.alltoallv(), epInvalidUsage, "EP_LL_RECV");
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epInvalidUsage, "outstanding");  // a second send half
    d.phases = EP_LL_RECV;
    CHECK_CODE(epLlDispatch(comm, &d, nullptr), epSuccess, "");
    CHECK_OUT(io.checkLlDispatch());
    epLlCombineArgs_t c = io.llCombineArgs(EP_LL_RECV, true);
    CHECK_CODE(epLlCombine(comm, &c, nullptr), epInvalidUsage, "no matching send half");
    CHECK_CODE(io.alltoallv(), epSuccess, "");
    CHECK_OUT(io.checkAlltoallv());
    return 0;
  });
}

// Ranks 0 and 1 disagree on their counts; rank 2 is not involved. All fail before any data moves: the two with
// epInvalidUsage, rank 2 with epRemoteError; nothing is written. Then a valid alltoallv works.
TEST(HeaderRules, AlltoallvCountMismatchFailsEveryRankBeforeData) {
  World w = world(3, {1, 1, 1});
  runComm(3, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    io.a2aPrepare(epInt32);
    const size_t sc1 = io.sc[1];
    if (rank == 0) io.sc[1] += 1000000;  // would read far past rank 0's sendbuf
    epResult_t want = rank == 2 ? epRemoteError : epInvalidUsage;
    CHECK_CODE(io.alltoallv(), want, rank == 2 ? "rank 0" : "alltoallv");
    CHECK(io.a2a_recv.poisoned() && io.a2a_recv.guardsOk(), "the failed alltoallv wrote recvbuf");
    io.sc[1] = sc1;
    CHECK_CODE(io.alltoallv(), epSuccess, "");
    CHECK_OUT(io.checkAlltoallv());
    return 0;
  });
}

// Zero-token ranks and all-empty calls with NULL for every buffer that needs 0 bytes.
TEST(HeaderRules, ZeroSizeBuffersMayBeNull) {
  for (const std::vector<int>& T : {std::vector<int>{0, 5, 0}, std::vector<int>{0, 0, 0}}) {
    const World w = world(3, T);
    runComm(3, [&](int rank, epComm_t comm) -> int {
      RankIo io(w, rank, comm);
      CHECK_CODE(io.layout(), epSuccess, "");
      CHECK_OUT(io.checkLayout());
      CHECK_CODE(epHtHandleCreate(comm, 8, &io.h), epSuccess, "");
      epHtDispatchArgs_t a = io.htDispatchArgs(0);
      CHECK_CODE(io.htNotify(a), epSuccess, "");
      CHECK_OUT(io.checkHtNotify());
      a = io.htDispatchArgs(0);  // exact: a rank receiving 0 rows passes recv_x = NULL
      CHECK(io.ht_rows > 0 || a.recv_x == nullptr, "recv_x should be NULL for 0 rows");
      CHECK_CODE(epHtDispatch(comm, &a, io.h, nullptr), epSuccess, "");
      CHECK_OUT(io.checkHtDispatch());
      epHtCombineArgs_t c = io.htCombineArgs();
      CHECK_CODE(epHtCombine(comm, &c, io.h, nullptr), epSuccess, "");
      CHECK_OUT(io.checkHtCombine());
      a = io.htDispatchArgs(w.sumT() > 0 ? w.sumT() : 1);
      CHECK_CODE(epHtDispatch(comm, &a, io.h, nullptr), epSuccess, "");
      CHECK_OUT(io.checkHtDispatch());
      epHtHandleDestroy(io.h);
      if (llRoundTrip(io, EP_LL_EXPERT_MAJOR) || llRoundTrip(io, EP_LL_RANK_MAJOR)) return 1;
      // alltoallv with nothing to move: every buffer NULL.
      std::vector<size_t> zero(3, 0);
      CHECK_CODE(epAlltoallv(comm, nullptr, zero.data(), zero.data(), nullptr, zero.data(), zero.data(), epFloat32,
                             nullptr), epSuccess, "");
      std::vector<int64_t> dz(3, 0), counts(3, -1);
      CHECK_CODE(epAlltoallvDevice(comm, nullptr, dz.data(), nullptr, 0, counts.data(), nullptr, epBfloat16, nullptr),
                 epSuccess, "");
      CHECK(counts == dz, "recv_counts of an empty alltoallv are not 0");
      return 0;
    });
  }
}

// Every limit the header names has its code.
TEST(HeaderRules, EveryNamedLimitHasItsCode) {
  const World w = world(2, {2, 2});
  runComm(2, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    epLlDispatchArgs_t d = io.llDispatchArgs(EP_LL_EXPERT_MAJOR, EP_LL_SEND_RECV, true), b = d;
    b.max_tokens_per_rank = 0;
    CHECK_CODE(epLlDispatch(comm, &b, nullptr), epInvalidArgument, "max_tokens_per_rank");
    b = d, b.max_tokens_per_rank = 9;
    CHECK_CODE(epLlDispatch(comm, &b, nullptr), epCapacityExceeded, "max_tokens_per_rank");
    b = d, b.hidden = 8192;
    CHECK_CODE(epLlDispatch(comm, &b, nullptr), epInvalidHidden, "ll_max_hidden");
    b = d, b.size = 8;
    CHECK_CODE(epLlDispatch(comm, &b, nullptr), epInvalidArgument, "EP_LL_DISPATCH_ARGS_INIT");
    epHtHandleCreate(comm, 8, &io.h);
    epHtDispatchArgs_t h = io.htDispatchArgs(8);
    h.hidden = 1 << 20;  // rows larger than the queues take
    CHECK_CODE(epHtDispatch(comm, &h, io.h, nullptr), epInvalidHidden, "EPCOMM_QUEUE_BYTES");
    epHtHandleDestroy(io.h);
    return llRoundTrip(io, EP_LL_EXPERT_MAJOR);
  });
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  epComm_t comm = nullptr;
  EXPECT_EQ(epCommInitRank(&comm, EP_MAX_RANKS + 1, &id, 0, nullptr), epRankMismatch);
  EXPECT_EQ(epCommInitRank(&comm, 0, &id, 0, nullptr), epRankMismatch);
}

// epCommRegister on the host engine: arguments checked with their codes, a registration accepted and ignored (its
// combine reads x in place), a deregistered or made-up handle refused, and the communicator usable throughout; a
// region that outlives its communicator is only freed.
TEST(MemoryRegistration, HostEngineChecksArgumentsAndHandles) {
  const World w = world(2, {2, 3});
  runComm(2, [&](int rank, epComm_t comm) -> int {
    RankIo io(w, rank, comm);
    std::vector<uint8_t> mem(4096);
    epMemRegion_t reg = nullptr;
    CHECK_CODE(epCommRegister(comm, mem.data(), mem.size(), nullptr), epNullPointer, "region");
    CHECK_CODE(epCommRegister(comm, nullptr, mem.size(), &reg), epNullPointer, "ptr");
    CHECK_CODE(epCommRegister(comm, mem.data(), 0, &reg), epInvalidArgument, "bytes");
    CHECK(reg == nullptr, "a refused registration wrote its handle");
    CHECK_CODE(epCommRegister(comm, mem.data(), mem.size(), &reg), epSuccess, "");
    CHECK(reg != nullptr, "no handle");
    if (llRoundTrip(io, EP_LL_EXPERT_MAJOR) != 0) return 1;
    CHECK(epCommDeregister(reg) == epSuccess, "deregister: %s", epGetLastError(nullptr));
    CHECK(epCommDeregister(reg) == epInvalidArgument, "deregistered twice");
    CHECK(std::string(epGetLastError(nullptr)).find("twice") != std::string::npos, "message: %s",
          epGetLastError(nullptr));
    CHECK(epCommDeregister(nullptr) == epNullPointer, "deregister(NULL)");
    epMemRegion_t made_up = reinterpret_cast<epMemRegion_t>(mem.data());
    CHECK(epCommDeregister(made_up) == epInvalidArgument, "a made-up handle");
    CHECK_CODE(epCommRegister(comm, mem.data(), mem.size(), &reg), epSuccess, "");
    CHECK(epCommBarrier(comm, nullptr) == epSuccess, "the communicator after the refusals");
    return llRoundTrip(io, EP_LL_RANK_MAJOR);
  });
  // A region left registered when its communicator is destroyed: deregistering it only frees it.
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_HOST;
  epComm_t comm = nullptr;
  ASSERT_EQ(epCommInitRank(&comm, 1, &id, 0, &cfg), epSuccess);
  std::vector<uint8_t> mem(64);
  epMemRegion_t reg = nullptr;
  ASSERT_EQ(epCommRegister(comm, mem.data(), mem.size(), &reg), epSuccess);
  ASSERT_EQ(epCommDestroy(comm), epSuccess);
  // A new communicator (perhaps at the old one's address) is not the region's: deregistering leaves it alone.
  epUniqueId id2;
  ASSERT_EQ(epGetUniqueId(&id2), epSuccess);
  epComm_t comm2 = nullptr;
  ASSERT_EQ(epCommInitRank(&comm2, 1, &id2, 0, &cfg), epSuccess);
  EXPECT_EQ(epCommDeregister(reg), epSuccess);
  EXPECT_EQ(epCommDeregister(reg), epInvalidArgument);
  EXPECT_EQ(epCommBarrier(comm2, nullptr), epSuccess);
  EXPECT_EQ(epCommDestroy(comm2), epSuccess);
}

}  // namespace
