// Readiness (NetBackend::openPoller / watchRecv / pollReady): a watched receive comm reads its socket only after a
// poll saw bytes arrive, so no message, and no end of a connection, may ever wait for a test that never reads.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/time.h"
#include "net_pair.h"
#include "transport/net/net.h"

namespace {

using epcomm::net::kNetPtrHost;

// Posts a receive of up to `cap` bytes into `buf` (tag 0, registered as `mh`); *req stays null when the comm takes
// no more receives now.
epResult_t postRecv(epcomm::net::NetBackend* net, void* comm, void* buf, size_t cap, void* mh, void** req) {
  int tag = 0;
  return net->irecv(comm, 1, &buf, &cap, &tag, &mh, req);
}

struct Poller {
  epcomm::net::NetBackend* net;
  void* p;
  explicit Poller(epcomm::net::NetBackend* n) : net(n), p(n->openPoller()) {}
  ~Poller() { net->closePoller(p); }
};

// Messages of every size class (empty, inline, several in one read-ahead, more than the read-ahead, chunked over
// the data sockets), sent in bursts while the receiver posts one receive at a time and polls before each pass of
// tests, as the net bridge does: each arrives whole and in order.
TEST(NetReadiness, WatchedReceivesGetEveryMessage) {
  for (int streams : {0, 1}) {
    SCOPED_TRACE("max_streams " + std::to_string(streams));
    auto* pair = new NetPair;  // closed before the poller (net.h)
    ASSERT_TRUE(connectNetPair(pair, streams)) << epcomm::net::netLastError();
    Poller poller(pair->net);
    ASSERT_NE(poller.p, nullptr);
    ASSERT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess) << epcomm::net::netLastError();
    EXPECT_NE(pair->net->watchRecv(poller.p, pair->recv), epSuccess) << "watched twice";
    EXPECT_NE(pair->net->watchRecv(poller.p, pair->send), epSuccess) << "a send comm watched";

    std::mt19937_64 rng(std::random_device{}());
    const size_t sizes[] = {0, 1, 32, 100, 4096, 20000, 70000, 1 << 20, 3 << 20};
    std::vector<size_t> plan;
    for (int round = 0; round < 6; ++round)
      for (size_t s : sizes) plan.push_back(s);
    std::shuffle(plan.begin(), plan.end(), rng);
    const size_t cap = 3 << 20;
    std::vector<std::vector<uint8_t>> out(plan.size());
    for (size_t i = 0; i < plan.size(); ++i) {
      out[i].resize(plan[i]);
      for (auto& b : out[i]) b = static_cast<uint8_t>(rng());
    }
    std::vector<uint8_t> in(cap);
    void* rmh = nullptr;
    ASSERT_EQ(pair->net->regMr(pair->recv, in.data(), cap, kNetPtrHost, &rmh), epSuccess);
    std::vector<void*> smh(plan.size(), nullptr), sreq(plan.size(), nullptr);
    size_t posted = 0, received = 0;
    void* rreq = nullptr;
    const epcomm::Deadline deadline = epcomm::Deadline::afterMs(30000);
    while (received < plan.size() && !deadline.expired()) {
      // Sends in bursts: up to 8 messages ahead of the receiver.
      while (posted < plan.size() && posted < received + 8) {
        if (smh[posted] == nullptr) {
          ASSERT_EQ(pair->net->regMr(pair->send, out[posted].data(), out[posted].size(), kNetPtrHost, &smh[posted]),
                    epSuccess);
        }
        ASSERT_EQ(pair->net->isend(pair->send, out[posted].data(), out[posted].size(), 0, smh[posted], &sreq[posted]),
                  epSuccess);
        if (sreq[posted] == nullptr) break;
        ++posted;
      }
      for (size_t i = 0; i < posted; ++i) {
        if (sreq[i] == nullptr) continue;  // completed
        int done = 0;
        ASSERT_EQ(pair->net->test(sreq[i], &done, nullptr), epSuccess) << epcomm::net::netLastError();
        if (done) sreq[i] = nullptr;
      }
      if (rreq == nullptr) {
        std::memset(in.data(), 0xEE, cap);
        ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), cap, rmh, &rreq), epSuccess);
        if (rreq == nullptr) continue;
      }
      pair->net->pollReady(poller.p);
      int done = 0;
      size_t got = 0;
      ASSERT_EQ(pair->net->test(rreq, &done, &got), epSuccess) << epcomm::net::netLastError();
      if (!done) continue;
      rreq = nullptr;
      ASSERT_EQ(got, plan[received]) << "message " << received;
      ASSERT_EQ(memcmp(in.data(), out[received].data(), got), 0) << "message " << received;
      ++received;
    }
    ASSERT_EQ(received, plan.size()) << "messages stuck: " << received << " of " << plan.size() << " arrived";
    for (size_t i = 0; i < plan.size(); ++i) pair->net->deregMr(pair->send, smh[i]);
    pair->net->deregMr(pair->recv, rmh);
    delete pair;
  }
}

// Everything is sent before the receiver posts anything: far more control-stream bytes than one read takes. One poll
// only, then tests alone: the receiver must know on its own to read on while its reads come back full.
TEST(NetReadiness, ABacklogLargerThanOneReadIsDrained) {
  auto* pair = new NetPair;
  ASSERT_TRUE(connectNetPair(pair, 1)) << epcomm::net::netLastError();
  Poller poller(pair->net);
  ASSERT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess);
  constexpr int kMsgs = 200;
  constexpr size_t kBytes = 1000;  // inline: the bytes travel on the control socket
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint8_t> out(kMsgs * kBytes), in(kBytes);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  void *smh = nullptr, *rmh = nullptr;
  ASSERT_EQ(pair->net->regMr(pair->send, out.data(), out.size(), kNetPtrHost, &smh), epSuccess);
  ASSERT_EQ(pair->net->regMr(pair->recv, in.data(), in.size(), kNetPtrHost, &rmh), epSuccess);
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
  for (int i = 0; i < kMsgs; i += 8) {  // 8 at a time (the requests a comm takes are bounded), each batch complete
    void* sreq[8] = {};
    for (int j = 0; j < 8 && i + j < kMsgs; ++j)
      while (sreq[j] == nullptr && !deadline.expired())
        ASSERT_EQ(pair->net->isend(pair->send, out.data() + (i + j) * kBytes, kBytes, 0, smh, &sreq[j]), epSuccess);
    for (void* r : sreq) {
      int done = 0;
      while (r != nullptr && !done && !deadline.expired()) ASSERT_EQ(pair->net->test(r, &done, nullptr), epSuccess);
    }
  }
  pair->net->pollReady(poller.p);  // once: from here on the receiver reads on because each read came back full
  for (int i = 0; i < kMsgs; ++i) {
    std::memset(in.data(), 0xEE, in.size());
    void* rreq = nullptr;
    ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), in.size(), rmh, &rreq), epSuccess);
    ASSERT_NE(rreq, nullptr);
    int done = 0;
    size_t got = 0;
    while (!done && !deadline.expired()) ASSERT_EQ(pair->net->test(rreq, &done, &got), epSuccess);
    ASSERT_TRUE(done) << "message " << i << " of " << kMsgs << " never read";
    ASSERT_EQ(got, kBytes);
    ASSERT_EQ(memcmp(in.data(), out.data() + i * kBytes, kBytes), 0) << "message " << i;
  }
  pair->net->deregMr(pair->send, smh);
  pair->net->deregMr(pair->recv, rmh);
  delete pair;
}

// More watched comms with bytes waiting than one epoll_wait buffer of 256 (a rank with hundreds of peers of other
// hosts): a poll returns (level-triggered, a readable socket is reported by every call, so a poll that looped while
// its buffer came back full would never end) and every comm gets its message.
TEST(NetReadiness, MoreReadyCommsThanOneBufferOfEvents) {
  constexpr int kComms = 260;
  std::string why;
  epcomm::net::NetBackend* net = epcomm::net::netSocketBackend(&why);
  ASSERT_NE(net, nullptr) << why;
  if (epcomm::net::ensureDescriptors(kComms * (2 * net->descriptorsPerConnection(1) + 1), "the test's connections") !=
      epSuccess)
    GTEST_SKIP() << epcomm::net::netLastError();
  std::vector<std::unique_ptr<NetPair>> pairs;
  for (int i = 0; i < kComms; ++i) {
    pairs.push_back(std::make_unique<NetPair>());
    ASSERT_TRUE(connectNetPair(pairs.back().get(), 1)) << "pair " << i << ": " << epcomm::net::netLastError();
  }
  void* poller = net->openPoller();
  ASSERT_NE(poller, nullptr);
  for (auto& p : pairs) ASSERT_EQ(net->watchRecv(poller, p->recv), epSuccess);
  std::vector<uint64_t> out(kComms), in(kComms, ~0ull);
  std::vector<void*> sreq(kComms, nullptr), rreq(kComms, nullptr), smh(kComms), rmh(kComms);
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(30000);
  for (int i = 0; i < kComms; ++i) {
    out[i] = 0x1000u + i;
    ASSERT_EQ(net->regMr(pairs[i]->send, &out[i], 8, kNetPtrHost, &smh[i]), epSuccess);
    ASSERT_EQ(net->regMr(pairs[i]->recv, &in[i], 8, kNetPtrHost, &rmh[i]), epSuccess);
    while (sreq[i] == nullptr && !deadline.expired())
      ASSERT_EQ(net->isend(pairs[i]->send, &out[i], 8, 0, smh[i], &sreq[i]), epSuccess);
    for (int done = 0; !done && !deadline.expired();) ASSERT_EQ(net->test(sreq[i], &done, nullptr), epSuccess);
  }
  usleep(20000);  // every message in its receiver's socket
  // A poll in another thread, so that one that never returns fails the test instead of hanging it.
  std::atomic<bool> returned{false};
  std::thread t([&] {
    net->pollReady(poller);
    returned = true;
  });
  for (int i = 0; i < 500 && !returned; ++i) usleep(10000);
  if (!returned) {
    ADD_FAILURE() << "pollReady never returned with " << kComms << " readable comms";
    fflush(stdout);
    _exit(1);  // (the thread cannot be stopped)
  }
  t.join();
  int got = 0;
  for (int i = 0; i < kComms; ++i) {
    ASSERT_EQ(postRecv(net, pairs[i]->recv, &in[i], 8, rmh[i], &rreq[i]), epSuccess);
  }
  for (bool all = false; !all && !deadline.expired();) {
    net->pollReady(poller);
    all = true;
    for (int i = 0; i < kComms; ++i) {
      if (rreq[i] == nullptr) continue;
      int done = 0;
      ASSERT_EQ(net->test(rreq[i], &done, nullptr), epSuccess);
      if (done) {
        rreq[i] = nullptr;
        ++got;
        EXPECT_EQ(in[i], out[i]) << "comm " << i;
      } else {
        all = false;
      }
    }
  }
  EXPECT_EQ(got, kComms);
  pairs.clear();  // the comms before their poller (net.h)
  net->closePoller(poller);
}

// A peer that closes its end while the receiver waits on a watched, idle connection: the poll sees the end, and
// the receive fails (not waits) within the deadline.
TEST(NetReadiness, AClosedPeerFailsTheWatchedReceive) {
  auto* pair = new NetPair;
  ASSERT_TRUE(connectNetPair(pair, 1)) << epcomm::net::netLastError();
  Poller poller(pair->net);
  ASSERT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess);
  std::vector<uint8_t> in(4096);
  void* rmh = nullptr;
  ASSERT_EQ(pair->net->regMr(pair->recv, in.data(), in.size(), kNetPtrHost, &rmh), epSuccess);
  void* rreq = nullptr;
  ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), in.size(), rmh, &rreq), epSuccess);
  ASSERT_NE(rreq, nullptr);
  for (int i = 0; i < 100; ++i) {  // idle: nothing arrives, nothing fails
    pair->net->pollReady(poller.p);
    int done = 0;
    ASSERT_EQ(pair->net->test(rreq, &done, nullptr), epSuccess);
    ASSERT_EQ(done, 0);
  }
  pair->net->closeSend(pair->send);
  pair->send = nullptr;
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(10000);
  epResult_t r = epSuccess;
  while (r == epSuccess && !deadline.expired()) {
    pair->net->pollReady(poller.p);
    int done = 0;
    r = pair->net->test(rreq, &done, nullptr);
    ASSERT_EQ(done, 0);
  }
  EXPECT_NE(r, epSuccess) << "the end of the connection was never seen";
  pair->net->deregMr(pair->recv, rmh);
  delete pair;
}

// A comm taken out of the set reads for itself again: a message that arrives after unwatchRecv completes its receive
// with no poll at all (one that stayed watched would wait for a poll forever).
TEST(NetReadiness, AnUnwatchedCommReadsForItself) {
  auto* pair = new NetPair;
  ASSERT_TRUE(connectNetPair(pair, 1)) << epcomm::net::netLastError();
  Poller poller(pair->net);
  ASSERT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess);
  std::vector<uint8_t> out(100, 0x3C), in(4096);
  void *smh = nullptr, *rmh = nullptr, *sreq = nullptr, *rreq = nullptr;
  ASSERT_EQ(pair->net->regMr(pair->send, out.data(), out.size(), kNetPtrHost, &smh), epSuccess);
  ASSERT_EQ(pair->net->regMr(pair->recv, in.data(), in.size(), kNetPtrHost, &rmh), epSuccess);
  ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), in.size(), rmh, &rreq), epSuccess);
  ASSERT_NE(rreq, nullptr);
  int done = 0;
  pair->net->pollReady(poller.p);  // nothing waits: the next test reads and lowers the flag
  ASSERT_EQ(pair->net->test(rreq, &done, nullptr), epSuccess);
  ASSERT_EQ(done, 0);
  pair->net->unwatchRecv(poller.p, pair->send);  // not watched: nothing happens
  pair->net->unwatchRecv(poller.p, pair->recv);
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(5000);
  while (sreq == nullptr && !deadline.expired())
    ASSERT_EQ(pair->net->isend(pair->send, out.data(), out.size(), 0, smh, &sreq), epSuccess);
  size_t got = 0;
  while (!done && !deadline.expired()) ASSERT_EQ(pair->net->test(rreq, &done, &got), epSuccess);
  ASSERT_TRUE(done) << "the unwatched comm waited for a poll";
  EXPECT_EQ(got, out.size());
  for (int sdone = 0; !sdone && !deadline.expired();) ASSERT_EQ(pair->net->test(sreq, &sdone, nullptr), epSuccess);
  // Watched again: the poll has it back.
  EXPECT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess);
  pair->net->deregMr(pair->send, smh);
  pair->net->deregMr(pair->recv, rmh);
  delete pair;
}

// The last bytes and the end of the connection arrive together (the peer sent a message and exited): one recv()
// returns the bytes and takes the end with them, and the next would return 0. The receive after that message must
// still fail (the poll keeps reporting what waits on the socket), not wait forever.
TEST(NetReadiness, AnEndThatCameWithTheLastBytesIsSeen) {
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto* pair = new NetPair;
    ASSERT_TRUE(connectNetPair(pair, 1)) << epcomm::net::netLastError();
    Poller poller(pair->net);
    ASSERT_EQ(pair->net->watchRecv(poller.p, pair->recv), epSuccess);
    std::vector<uint8_t> out(100, 0x5A), in(4096);
    void *smh = nullptr, *rmh = nullptr, *sreq = nullptr;
    ASSERT_EQ(pair->net->regMr(pair->send, out.data(), out.size(), kNetPtrHost, &smh), epSuccess);
    ASSERT_EQ(pair->net->regMr(pair->recv, in.data(), in.size(), kNetPtrHost, &rmh), epSuccess);
    // Nothing to read yet: a pass that reads finds nothing, and the flag is down before the bytes come.
    int done = 0;
    void* first = nullptr;
    ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), in.size(), rmh, &first), epSuccess);
    pair->net->pollReady(poller.p);
    ASSERT_EQ(pair->net->test(first, &done, nullptr), epSuccess);
    ASSERT_EQ(done, 0);
    const epcomm::Deadline deadline = epcomm::Deadline::afterMs(10000);
    while (sreq == nullptr && !deadline.expired())
      ASSERT_EQ(pair->net->isend(pair->send, out.data(), out.size(), 0, smh, &sreq), epSuccess);
    for (int sdone = 0; !sdone && !deadline.expired();) ASSERT_EQ(pair->net->test(sreq, &sdone, nullptr), epSuccess);
    pair->net->closeSend(pair->send);  // the end right behind the message
    pair->send = nullptr;
    usleep(20000);                     // both are in this socket before the receiver looks again
    size_t got = 0;
    while (!done && !deadline.expired()) {
      pair->net->pollReady(poller.p);
      ASSERT_EQ(pair->net->test(first, &done, &got), epSuccess);
    }
    ASSERT_TRUE(done);
    ASSERT_EQ(got, out.size());
    void* second = nullptr;
    ASSERT_EQ(postRecv(pair->net, pair->recv, in.data(), in.size(), rmh, &second), epSuccess);
    epResult_t r = epSuccess;
    while (r == epSuccess && !deadline.expired()) {
      pair->net->pollReady(poller.p);
      done = 0;
      r = pair->net->test(second, &done, nullptr);
      ASSERT_EQ(done, 0);
    }
    EXPECT_NE(r, epSuccess) << "the end that came with the last bytes was never seen";
    pair->net->deregMr(pair->recv, rmh);
    delete pair;
  }
}

}  // namespace
