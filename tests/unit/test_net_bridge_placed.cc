// The net bridge's DATA_PLACED frames from a peer that lies (R5): a frame whose pieces overlap, reach past their
// payload or are empty ends the connection, and nothing of its payload lands, neither where the receiver's owner
// placed the pieces before the bad one nor in the inbox. The honest case, in the same harness, shows the pieces do
// land where the receiver says, the rest in the inbox, and a receipt in the inbox where each placed piece would
// stand, so the refusals are not the harness failing; it also checks the diagnostics the GPU proxy's trace prints
// (what went, by kind; the payload's send and receive timed in flight; the calls that carried it).
//
// Two ranks on hosts of their own over the socket backend (the one that scatters): rank 0 pushes a run of stream
// bytes whose pieces its Placement names (honestly or not), rank 1 places every piece into a buffer of its own.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bridge_rank.h"
#include "common/time.h"

namespace {

using epcomm::NetBridge;

constexpr size_t kRing = 1 << 20, kMaxPayload = kRing / 8, kRun = 64 << 10, kPiece = 4096;
constexpr int kTimeoutMs = 20000;

enum class Lie { kNone, kOverlap, kPastPayload, kEmpty };

// Sender: the run's pieces are kPiece bytes every 2 * kPiece; a lie bends the second piece of the frame.
class Sender final : public NetBridge::Placement {
 public:
  explicit Sender(Lie lie) : lie_(lie) {}
  bool nextPayload(int, uint64_t from, uint64_t to, uint64_t* at, uint32_t* len, uint64_t* key) override {
    const uint64_t start = (from + 2 * kPiece - 1) / (2 * kPiece) * (2 * kPiece);  // the next piece's start
    if (start + kPiece > to) return false;
    *at = start, *len = kPiece, *key = start;
    if (++n_ == 2) {
      if (lie_ == Lie::kOverlap) *at = start - kPiece - 1;  // into the first piece
      if (lie_ == Lie::kPastPayload) *len = static_cast<uint32_t>(to - start + 1);
      if (lie_ == Lie::kEmpty) *len = 0;
    }
    return true;
  }
  size_t minRunBytes() const override { return kPiece; }
  void framed(int, uint64_t) override {}
  uint8_t* place(int, uint64_t, uint32_t) override { return nullptr; }

 private:
  Lie lie_;
  int n_ = 0;
};

// Receiver: every piece at its key's offset of `far` (with room to spare, so a lie past the payload stays inside).
class Receiver final : public NetBridge::Placement {
 public:
  std::vector<uint8_t> far = std::vector<uint8_t>(2 * kRun, 0xAB);
  std::atomic<int> placed{0};
  bool nextPayload(int, uint64_t, uint64_t, uint64_t*, uint32_t*, uint64_t*) override { return false; }
  size_t minRunBytes() const override { return 0; }
  void framed(int, uint64_t) override {}
  uint8_t* place(int, uint64_t key, uint32_t len) override {
    if (key + len > far.size()) return nullptr;
    placed.fetch_add(1);
    return far.data() + key;
  }
};

uint8_t streamByte(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 9) + 7); }

int runRank(int rank, const epUniqueId& id, Lie lie) {
  epcomm::test::BridgeRank me;
  if (epcomm::test::openBridgeRank(rank, id, kRing, kMaxPayload, "-bridge-test", kTimeoutMs, &me) != 0) return 1;
  auto& bs = me.bs;
  auto& own = me.own;
  auto& bridge = me.bridge;
  Sender sender(lie);
  Receiver receiver;
  bridge->usePlacement(rank == 0 ? static_cast<NetBridge::Placement*>(&sender) : &receiver);
  bridge->enableCallTiming();  // the diagnostics the honest case checks below (EPCOMM_GPU_PROXY_TRACE prints them)
  EP_RANK_CHECK(rank, bridge->connect(bs.get(), kTimeoutMs) == epSuccess, "connect");
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(kTimeoutMs);
  if (rank == 0) {
    std::vector<uint8_t> run(kRun);
    for (size_t i = 0; i < kRun; ++i) run[i] = streamByte(i);
    EP_RANK_CHECK(rank, bridge->outEnd(0, 1).push(run.data(), kRun) == kRun, "push");
    if (lie == Lie::kNone) {
      // The diagnostics count what went: one placed message of the run (its frame is not a payload), its send
      // timed in flight once it completed, and the backend calls that carried it.
      while (bridge->flightStats().done[0] == 0 && !deadline.expired())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const NetBridge::SendStats st = bridge->sendStats();
      const NetBridge::FlightStats fs = bridge->flightStats();
      EP_RANK_CHECK(rank, st.msgs[NetBridge::kSendPlaced] == 1 && st.bytes[NetBridge::kSendPlaced] == kRun,
                    "placed messages %llu of %llu bytes, not 1 of %zu",
                    static_cast<unsigned long long>(st.msgs[NetBridge::kSendPlaced]),
                    static_cast<unsigned long long>(st.bytes[NetBridge::kSendPlaced]), kRun);
      EP_RANK_CHECK(rank, bridge->bytesSent() == kRun, "bytesSent %llu, not %zu",
                    static_cast<unsigned long long>(bridge->bytesSent()), kRun);
      EP_RANK_CHECK(rank, fs.done[0] == 1 && fs.ns[0] > 0 && fs.done[1] == 0, "payloads in flight: %llu sends (%lld ns), "
                    "%llu receives", static_cast<unsigned long long>(fs.done[0]), static_cast<long long>(fs.ns[0]),
                    static_cast<unsigned long long>(fs.done[1]));
      EP_RANK_CHECK(rank, bridge->callStats().calls[NetBridge::kCallIsend] >= 2, "isend calls %llu",
                    static_cast<unsigned long long>(bridge->callStats().calls[NetBridge::kCallIsend]));
    }
    // Until the receiver has its verdict (it sends nothing back but credits and the barrier's bytes).
  } else {
    epcomm::RingEnd in(own.ringCtl(0, 0), own.ringData(0, 0), kRing);
    std::string why;
    if (lie == Lie::kNone) {
      while (in.available() < kRun && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EP_RANK_CHECK(rank, in.available() == kRun, "%zu of %zu stream bytes in", in.available(), kRun);
      EP_RANK_CHECK(rank, receiver.placed.load() == static_cast<int>(kRun / (2 * kPiece)), "%d pieces placed",
                    receiver.placed.load());
      std::vector<uint8_t> got(kRun);
      in.copyOut(got.data(), 0, kRun);
      for (size_t i = 0; i < kRun; i += 2 * kPiece) {  // the receipt where each placed piece would stand
        NetBridge::Placement::Receipt rc;
        memcpy(&rc, got.data() + i, sizeof(rc));
        EP_RANK_CHECK(rank, rc.magic == NetBridge::Placement::Receipt::kMagic && rc.key == i && rc.len == kPiece,
                      "receipt at %zu: magic %x key %llu len %u", i, rc.magic, static_cast<unsigned long long>(rc.key),
                      rc.len);
      }
      for (size_t i = 0; i < kRun; ++i) {
        const bool placed = i % (2 * kPiece) < kPiece;
        const uint8_t b = placed ? receiver.far[i] : got[i];
        EP_RANK_CHECK(rank, b == streamByte(i), "stream byte %zu (%s): %u, not %u", i, placed ? "placed" : "inbox",
                      b, streamByte(i));
      }
      EP_RANK_CHECK(rank, !bridge->dead(0, &why), "peer dead: %s", why.c_str());
      // Its tail moved once the payload's receive completed, which counted it first.
      EP_RANK_CHECK(rank, bridge->flightStats().done[1] == 1, "payload receives timed: %llu, not 1",
                    static_cast<unsigned long long>(bridge->flightStats().done[1]));
    } else {
      while (!bridge->dead(0, &why) && !deadline.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EP_RANK_CHECK(rank, why.find("a DATA_PLACED piece out of order or past its payload") != std::string::npos,
                    "the lie was not refused as it should be: '%s'", why.c_str());
      EP_RANK_CHECK(rank, in.available() == 0, "%zu stream bytes of the refused frame in the inbox", in.available());
      for (size_t i = 0; i < receiver.far.size(); ++i)
        EP_RANK_CHECK(rank, receiver.far[i] == 0xAB, "byte %zu of the placed memory written by a refused frame", i);
    }
  }
  EP_RANK_CHECK(rank, bs->barrier(kTimeoutMs) == epSuccess, "barrier");
  bridge->shutdown(false, nullptr, 0);
  return 0;
}

class NetBridgePlaced : public ::testing::TestWithParam<Lie> {};

TEST_P(NetBridgePlaced, PiecesLandWhereTheReceiverSaysOrTheLieEndsTheConnection) {
  setenv("EPCOMM_NET", "socket", 1);
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess);
  const Lie lie = GetParam();
  auto codes = epcomm::test::runRanks(2, [&](int rank) { return runRank(rank, id, lie); }, 60000);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

std::string lieName(const ::testing::TestParamInfo<Lie>& i) {
  static const char* const kNames[] = {"Honest", "Overlap", "PastPayload", "Empty"};
  return kNames[static_cast<int>(i.param)];
}

INSTANTIATE_TEST_SUITE_P(Frames, NetBridgePlaced,
                         ::testing::Values(Lie::kNone, Lie::kOverlap, Lie::kPastPayload, Lie::kEmpty), lieName);

}  // namespace
