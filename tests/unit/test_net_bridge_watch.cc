// The net bridge's watch: a request the transport has not completed for half of EPCOMM_TIMEOUT_MS while the peer is
// alive is reported, once, with the state of the connections (NetBridge::describe), and nothing else changes: the
// peer stays alive and the stream arrives whole once it is taken. Without the report such a stall (the backend's
// deadline fires only on a silent peer) would leave the engine's deadline with no cause in the log.
//
// Two ranks on hosts of their own over the socket backend, EPCOMM_TIMEOUT_MS = 2000. Rank 1 makes its bridge's net
// calls itself (Progress::kCaller) and makes none for 5 s, while its heartbeats go on; rank 0 pushes more than the
// socket between them holds (one data socket), so a payload send of rank 0 cannot complete meanwhile.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bridge_rank.h"
#include "common/time.h"

namespace {

using epcomm::NetBridge;

constexpr size_t kRing = 64 << 20, kMaxPayload = kRing / 8, kStream = kRing - (4 << 20);
constexpr int kTimeoutMs = 20000;  // set-up and the test's own waits (the transport's is EPCOMM_TIMEOUT_MS)
constexpr int kPauseMs = 5000;     // rank 1 makes no net calls (> EPCOMM_TIMEOUT_MS: its heartbeats keep it alive)

uint8_t streamByte(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 11) + 3); }

int runRank(int rank, const epUniqueId& id, const std::string& log) {
  epcomm::test::BridgeRank me;
  if (epcomm::test::openBridgeRank(rank, id, kRing, kMaxPayload, "-watch-test", kTimeoutMs, &me) != 0) return 1;
  auto& bs = me.bs;
  auto& own = me.own;
  auto& bridge = me.bridge;
  EP_RANK_CHECK(rank, bridge->connect(bs.get(), kTimeoutMs,
                                      rank == 0 ? NetBridge::Progress::kOwnThread : NetBridge::Progress::kCaller) ==
                          epSuccess, "connect");
  EP_RANK_CHECK(rank, bs->barrier(kTimeoutMs) == epSuccess, "barrier after connect");
  std::string why;
  if (rank == 0) {
    // The bridge's warnings go to stderr: into the file `log` while rank 1 takes nothing.
    fflush(stderr);
    const int saved = dup(2);
    FILE* f = fopen(log.c_str(), "w");
    EP_RANK_CHECK(rank, f != nullptr && dup2(fileno(f), 2) == 2, "redirecting stderr");
    std::vector<uint8_t> bytes(kStream);
    for (size_t i = 0; i < kStream; ++i) bytes[i] = streamByte(i);
    EP_RANK_CHECK(rank, bridge->outEnd(0, 1).push(bytes.data(), kStream) == kStream, "push");
    // Until the report comes, at most while rank 1 takes nothing (the sockets absorb tens of MiB first).
    auto said_now = [&] {
      fflush(stderr);
      std::ifstream in(log);
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    };
    const epcomm::Deadline quiet = epcomm::Deadline::afterMs(kPauseMs - 500);
    while (said_now().find("has not completed in") == std::string::npos && !quiet.expired())
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::string state = bridge->describe(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // (a second report would come now)
    const std::string said = said_now();
    dup2(saved, 2);
    close(saved);
    fclose(f);
    fprintf(stderr, "rank 0 said while rank 1 took nothing:\n%s", said.c_str());
    EP_RANK_CHECK(rank, said.find("a send to rank 1 over net/socket has not completed in") != std::string::npos,
                  "no report of the pending send; %s", state.c_str());
    EP_RANK_CHECK(rank, said.find("sends in flight") != std::string::npos, "the report lacks the peer's state");
    const size_t first = said.find("has not completed in");
    EP_RANK_CHECK(rank, said.find("has not completed in", first + 1) == std::string::npos,
                  "the same stall was reported twice");
    EP_RANK_CHECK(rank, state.find("sends in flight") != std::string::npos, "describe: '%s'", state.c_str());
    EP_RANK_CHECK(rank, !bridge->dead(1, &why), "rank 1 taken for dead: %s", why.c_str());
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(kPauseMs));  // no net calls: nothing is taken
    epcomm::RingEnd in(own.ringCtl(0, 0), own.ringData(0, 0), kRing);
    const epcomm::Deadline deadline = epcomm::Deadline::afterMs(kTimeoutMs);
    while (in.available() < kStream && !deadline.expired()) bridge->assist();
    EP_RANK_CHECK(rank, in.available() == kStream, "%zu of %zu stream bytes in", in.available(), kStream);
    std::vector<uint8_t> got(kStream);
    in.copyOut(got.data(), 0, kStream);
    for (size_t i = 0; i < kStream; ++i)
      EP_RANK_CHECK(rank, got[i] == streamByte(i), "stream byte %zu: %u, not %u", i, got[i], streamByte(i));
    EP_RANK_CHECK(rank, !bridge->dead(0, &why), "rank 0 taken for dead: %s", why.c_str());
  }
  // Rank 1 keeps making its calls until rank 0 is through the barrier too (its credits go out that way).
  std::atomic<bool> done{false};
  std::thread helper;
  if (rank == 1) helper = std::thread([&] {
      while (!done.load()) bridge->assist();
    });
  const bool met = bs->barrier(kTimeoutMs) == epSuccess;
  done = true;
  if (helper.joinable()) helper.join();
  EP_RANK_CHECK(rank, met, "final barrier");
  bridge->shutdown(false, nullptr, 0);
  return 0;
}

TEST(NetBridgeWatch, ReportsASendThePeerDoesNotTakeOnceWithTheConnectionsState) {
  setenv("EPCOMM_NET", "socket", 1);
  setenv("EPCOMM_TIMEOUT_MS", "2000", 1);
  setenv("EPCOMM_DEBUG", "WARN", 1);  // (the suite runs with NONE)
  // One data socket: the kernel's buffers for it (tcp_wmem + tcp_rmem, here at most 36 MiB) hold less than the stream.
  setenv("EPCOMM_NET_NTHREADS", "1", 1);
  setenv("EPCOMM_NET_NSOCKS", "1", 1);
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  char dir[] = "/tmp/epcomm-watch-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string log = std::string(dir) + "/rank0.log";
  auto codes = epcomm::test::runRanks(2, [&](int rank) { return runRank(rank, id, log); }, 60000);
  unlink(log.c_str());
  rmdir(dir);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

}  // namespace
