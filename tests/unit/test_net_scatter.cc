// The socket backend's scattered receive (NetBackend::irecvScatter, which the net bridge uses to place GPU proxy
// payloads straight into the far copies): every byte of a message lands in its piece, in order, whether the message
// travels inline on the control socket or in chunks over the data sockets, and pieces of one byte or across chunk
// boundaries are no different. Also its cork (NetBackend::cork), which the bridge uses for its frames.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "net_pair.h"
#include "transport/net/net.h"

namespace {

// With the backend's default smallest chunk (64 KiB) and with the net bridge's (256 KiB, a hint of the connecting
// side that the accepting side must follow: both cut each message by the same plan).
TEST(NetSocketScatter, EveryByteLandsInItsPiece) {
  for (size_t min_chunk : {size_t{0}, size_t{256} << 10}) {
    SCOPED_TRACE("min_chunk " + std::to_string(min_chunk));
    NetPair p;
    ASSERT_TRUE(connectNetPair(&p, 0, min_chunk)) << epcomm::net::netLastError();
    ASSERT_TRUE(p.net->scatters());
    std::mt19937 rng(20261206);
    // Inline (up to the backend's 64 KiB default), exactly that, and chunked over the data sockets (512 KiB chunks;
    // 300000 bytes: 5 chunks of at least 64 KiB, or 2 of at least 256 KiB); pieces of up to 40000 bytes, or of up to
    // 400 so that a chunk spans far more pieces than one recvmsg takes (kIov), or 4000.
    const std::pair<size_t, size_t> cases[] = {{1, 40000},     {1000, 40000},  {65536, 40000},  {65537, 40000},
                                               {70000, 400},   {300000, 4000}, {(3u << 20) + 7, 40000}};
    for (const auto& [size, max_piece] : cases) {
      std::vector<uint8_t> src(size);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      // Pieces of random sizes (some of 1 byte) that together cover the message, each at a shuffled place of dst
      // with a byte of gap after it, so a piece written past its end or into the wrong place shows.
      std::vector<std::pair<size_t, size_t>> pieces;  // (offset in the message, length)
      for (size_t at = 0; at < size;) {
        const size_t n = std::min<size_t>(size - at, rng() % 3 == 0 ? 1 : 1 + rng() % max_piece);
        pieces.emplace_back(at, n);
        at += n;
      }
      ASSERT_LE(pieces.size(), static_cast<size_t>(epcomm::net::kNetMaxScatter));
      std::vector<size_t> order(pieces.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<uint8_t> dst(size + pieces.size(), 0xAB);
      std::vector<size_t> place(pieces.size());
      size_t at = 0;
      for (size_t i : order) {
        place[i] = at;
        at += pieces[i].second + 1;
      }
      std::vector<iovec> iov(pieces.size());
      for (size_t i = 0; i < pieces.size(); ++i) iov[i] = iovec{dst.data() + place[i], pieces[i].second};
      void *mh_s = nullptr, *sreq = nullptr, *rreq = nullptr;
      ASSERT_EQ(p.net->regMr(p.send, src.data(), size, epcomm::net::kNetPtrHost, &mh_s), epSuccess);
      ASSERT_EQ(p.net->irecvScatter(p.recv, iov.data(), static_cast<int>(iov.size()), &rreq), epSuccess);
      ASSERT_NE(rreq, nullptr);
      ASSERT_EQ(p.net->isend(p.send, src.data(), size, 0, mh_s, &sreq), epSuccess);
      ASSERT_NE(sreq, nullptr);
      size_t got = 0;
      ASSERT_TRUE(completeBoth(p.net, sreq, rreq, &got)) << "size " << size << ": " << epcomm::net::netLastError();
      EXPECT_EQ(got, size);
      for (size_t i = 0; i < pieces.size(); ++i) {
        ASSERT_EQ(memcmp(dst.data() + place[i], src.data() + pieces[i].first, pieces[i].second), 0)
            << "size " << size << ": piece " << i << " of " << pieces.size();
        ASSERT_EQ(dst[place[i] + pieces[i].second], 0xAB) << "size " << size << ": past piece " << i;
      }
      p.net->deregMr(p.send, mh_s);
    }
  }
}

// A message shorter than the pieces together (as NCCL allows a receive larger than the send) fills them in order up to
// its end, leaves the rest untouched and reports its own size; inline and chunked alike.
TEST(NetSocketScatter, ShorterMessageFillsThePiecesUpToItsEnd) {
  NetPair p;
  ASSERT_TRUE(connectNetPair(&p)) << epcomm::net::netLastError();
  std::mt19937 rng(20261207);
  for (const size_t size : {size_t{100}, size_t{65536}, size_t{(1u << 20) + 3}}) {
    std::vector<uint8_t> src(size);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    const size_t piece = size / 3 + 1, npieces = 5;  // 5/3 of the message
    std::vector<uint8_t> dst(piece * npieces, 0xAB);
    std::vector<iovec> iov(npieces);
    for (size_t i = 0; i < npieces; ++i) iov[i] = iovec{dst.data() + i * piece, piece};
    void *mh_s = nullptr, *sreq = nullptr, *rreq = nullptr;
    ASSERT_EQ(p.net->regMr(p.send, src.data(), size, epcomm::net::kNetPtrHost, &mh_s), epSuccess);
    ASSERT_EQ(p.net->irecvScatter(p.recv, iov.data(), static_cast<int>(iov.size()), &rreq), epSuccess);
    ASSERT_EQ(p.net->isend(p.send, src.data(), size, 0, mh_s, &sreq), epSuccess);
    size_t got = 0;
    ASSERT_TRUE(completeBoth(p.net, sreq, rreq, &got)) << "size " << size << ": " << epcomm::net::netLastError();
    EXPECT_EQ(got, size);
    EXPECT_EQ(memcmp(dst.data(), src.data(), size), 0) << "size " << size;
    EXPECT_EQ(std::count(dst.begin() + size, dst.end(), 0xAB), static_cast<long>(dst.size() - size))
        << "size " << size << ": bytes past the message were written";
    p.net->deregMr(p.send, mh_s);
  }
}

// Corked (NetBackend::cork, the net bridge's frames): messages posted while on go out together once it is off, as
// many per sendmsg as its iovec holds, and a send the socket takes only in part resumes inside a header or an inline
// payload. 120 messages of every kind (empty, a byte, inline up to the 64 KiB limit, chunked over the data sockets),
// 3.9 MB of inline payloads in all, more than the socket takes at once: all arrive in order, byte-exact.
TEST(NetSocketScatter, CorkedMessagesArriveInOrder) {
  NetPair p;
  ASSERT_TRUE(connectNetPair(&p)) << epcomm::net::netLastError();
  std::mt19937 rng(20261208);
  constexpr int kMsgs = 120;
  const size_t kinds[] = {0, 1, 100, 65535, 65536, 64000, 65537, 300000, 65536, 4096};
  std::vector<std::vector<uint8_t>> src(kMsgs), dst(kMsgs);
  std::vector<void*> sreq(kMsgs), rreq(kMsgs), mh(kMsgs);
  for (int i = 0; i < kMsgs; ++i) {
    src[i].resize(kinds[i % 10] + (i % 10 == 5 ? i : 0));
    for (auto& b : src[i]) b = static_cast<uint8_t>(rng());
    dst[i].assign(src[i].size() + 1, 0xAB);
    void* data = dst[i].data();
    size_t size = dst[i].size();
    int tag = i;
    ASSERT_EQ(p.net->irecv(p.recv, 1, &data, &size, &tag, nullptr, &rreq[i]), epSuccess);
    ASSERT_NE(rreq[i], nullptr);
  }
  p.net->cork(p.send, true);
  for (int i = 0; i < kMsgs; ++i) {
    ASSERT_EQ(p.net->regMr(p.send, src[i].data(), src[i].size(), epcomm::net::kNetPtrHost, &mh[i]), epSuccess);
    ASSERT_EQ(p.net->isend(p.send, src[i].data(), src[i].size(), i, mh[i], &sreq[i]), epSuccess);
    ASSERT_NE(sreq[i], nullptr);
  }
  p.net->cork(p.send, false);
  for (int i = 0; i < kMsgs; ++i) {
    size_t got = 0;
    ASSERT_TRUE(completeBoth(p.net, sreq[i], rreq[i], &got)) << "message " << i << ": " << epcomm::net::netLastError();
    ASSERT_EQ(got, src[i].size()) << "message " << i;
    ASSERT_EQ(memcmp(dst[i].data(), src[i].data(), got), 0) << "message " << i;
    ASSERT_EQ(dst[i][got], 0xAB) << "message " << i << ": a byte past its end";
    p.net->deregMr(p.send, mh[i]);
  }
}

TEST(NetSocketScatter, TooManyPiecesIsAnError) {
  NetPair p;
  ASSERT_TRUE(connectNetPair(&p)) << epcomm::net::netLastError();
  uint8_t b[8];
  std::vector<iovec> iov(epcomm::net::kNetMaxScatter + 1, iovec{b, 1});
  void* req = nullptr;
  EXPECT_EQ(p.net->irecvScatter(p.recv, iov.data(), static_cast<int>(iov.size()), &req), epInvalidArgument);
  const std::string why = epcomm::net::netLastError();  // names the call and the limit
  EXPECT_NE(why.find("irecvScatter of 1025 pieces (1..1024)"), std::string::npos) << why;
  EXPECT_EQ(req, nullptr);
}

}  // namespace
