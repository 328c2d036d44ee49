// The socket backend at a peer's orderly close: messages that arrived whole before the end are delivered, even when
// reading on for a later receive met the end first (the net bridge's goodbye and its acknowledgement are such last
// messages), and the receives left fail with epRemoteError.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/time.h"
#include "net_pair.h"
#include "transport/net/net.h"

namespace {

TEST(NetSocketClose, MessagesBeforeAnOrderlyCloseAreDelivered) {
  NetPair p;
  ASSERT_TRUE(connectNetPair(&p)) << epcomm::net::netLastError();
  constexpr int kSent = 2, kPosted = 3;
  std::vector<std::vector<uint8_t>> src(kSent), dst(kPosted, std::vector<uint8_t>(64, 0xAB));
  std::vector<void*> rreq(kPosted, nullptr);
  for (int i = 0; i < kPosted; ++i) {
    void* data = dst[i].data();
    size_t size = dst[i].size();
    int tag = 0;
    ASSERT_EQ(p.net->irecv(p.recv, 1, &data, &size, &tag, nullptr, &rreq[i]), epSuccess);
    ASSERT_NE(rreq[i], nullptr);
  }
  for (int i = 0; i < kSent; ++i) {
    src[i].assign(16 + i, static_cast<uint8_t>(0x10 + i));
    void* sreq = nullptr;
    ASSERT_EQ(p.net->isend(p.send, src[i].data(), src[i].size(), 0, nullptr, &sreq), epSuccess);
    ASSERT_NE(sreq, nullptr);
    int done = 0;
    const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
    while (!done && !deadline.expired()) ASSERT_EQ(p.net->test(sreq, &done, nullptr), epSuccess);
    ASSERT_TRUE(done) << "send " << i;
  }
  p.net->closeSend(p.send);
  p.send = nullptr;
  // The last receive first: reading toward it takes both messages, then meets the end.
  int done = 0;
  epResult_t res = epSuccess;
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
  while (res == epSuccess && !done && !deadline.expired()) res = p.net->test(rreq[kPosted - 1], &done, nullptr);
  EXPECT_EQ(res, epRemoteError) << "the receive past the last message, after the close";
  EXPECT_NE(std::string(epcomm::net::netLastError()).find("closed by the peer"), std::string::npos)
      << epcomm::net::netLastError();
  for (int i = 0; i < kSent; ++i) {
    size_t got = 0;
    done = 0;
    EXPECT_EQ(p.net->test(rreq[i], &done, &got), epSuccess) << "message " << i << ": " << epcomm::net::netLastError();
    EXPECT_TRUE(done) << "message " << i;
    EXPECT_EQ(got, src[i].size()) << "message " << i;
    EXPECT_EQ(memcmp(dst[i].data(), src[i].data(), src[i].size()), 0) << "message " << i;
  }
}

}  // namespace
