// What a connection costs the process, and the limit on it: NetBackend::connectStreams caps a socket connection's
// data sockets (and so its helper threads) on both ends, descriptorsPerConnection says what one end holds, and
// ensureDescriptors makes room under RLIMIT_NOFILE before the net bridge opens a connection per rank of other hosts
// (hundreds at 32 hosts), or says which limit to raise.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/time.h"
#include "net_pair.h"
#include "transport/net/net.h"

namespace {

using epcomm::net::NetBackend;
using epcomm::net::openDescriptors;

// A message of `bytes` random bytes, through the pair, arrives whole.
void roundTrip(NetPair* p, size_t bytes) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint8_t> out(bytes), in(bytes + 64, 0xEE);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  void *smh = nullptr, *rmh = nullptr, *sreq = nullptr, *rreq = nullptr;
  ASSERT_EQ(p->net->regMr(p->send, out.data(), out.size(), epcomm::net::kNetPtrHost, &smh), epSuccess);
  ASSERT_EQ(p->net->regMr(p->recv, in.data(), in.size(), epcomm::net::kNetPtrHost, &rmh), epSuccess);
  void* data = in.data();
  size_t cap = in.size();
  int tag = 7;
  ASSERT_EQ(p->net->irecv(p->recv, 1, &data, &cap, &tag, &rmh, &rreq), epSuccess);
  const epcomm::Deadline deadline = epcomm::Deadline::afterMs(20000);
  while (sreq == nullptr && !deadline.expired())
    ASSERT_EQ(p->net->isend(p->send, out.data(), out.size(), 7, smh, &sreq), epSuccess);
  ASSERT_NE(rreq, nullptr);
  ASSERT_NE(sreq, nullptr);
  size_t got = 0;
  ASSERT_TRUE(completeBoth(p->net, sreq, rreq, &got)) << epcomm::net::netLastError();
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(memcmp(in.data(), out.data(), bytes), 0);
  for (size_t i = bytes; i < in.size(); ++i) ASSERT_EQ(in[i], 0xEE) << "a byte past the message's end at " << i;
  p->net->deregMr(p->send, smh);
  p->net->deregMr(p->recv, rmh);
}

// Both ends of a connection hold what descriptorsPerConnection says, with the default streams and with one, and a
// message of several chunks still arrives whole over a single data socket.
TEST(NetLimits, ConnectStreamsCapsTheConnectionOnBothEnds) {
  for (int streams : {0, 1, 2}) {
    SCOPED_TRACE("max_streams " + std::to_string(streams));
    NetPair p;
    const size_t before = openDescriptors();
    ASSERT_TRUE(connectNetPair(&p, streams)) << epcomm::net::netLastError();
    const size_t added = openDescriptors() - before - 1;  // the listening socket is one
    EXPECT_EQ(added, 2u * p.net->descriptorsPerConnection(streams));
    EXPECT_LE(p.net->descriptorsPerConnection(streams), p.net->descriptorsPerConnection(0));
    roundTrip(&p, (3u << 20) + 12345);
  }
  std::string why;
  NetBackend* net = epcomm::net::netSocketBackend(&why);
  ASSERT_NE(net, nullptr) << why;
  EXPECT_EQ(net->descriptorsPerConnection(1), 4);  // control, one data socket, liveness, one helper's eventfd
}

// Run in a child: the limits it sets are its own.
int inChild(void (*body)()) {
  const pid_t pid = fork();
  if (pid == 0) {
    body();
    _exit(::testing::Test::HasFailure() ? 1 : 0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Under a low soft limit and a higher hard one, room is made by raising the soft limit; past the hard limit the call
// fails with a message naming both limits and what to change.
void ensureDescriptorsInChild() {
  const rlim_t open_now = openDescriptors();
  rlimit lim{open_now + 100, open_now + 3000};
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lim), 0) << strerror(errno);
  EXPECT_EQ(epcomm::net::ensureDescriptors(20, "the test"), epSuccess);  // 20 and the margin (64) fit in 100
  getrlimit(RLIMIT_NOFILE, &lim);
  EXPECT_EQ(lim.rlim_cur, open_now + 100) << "raised although there was room";
  EXPECT_EQ(epcomm::net::ensureDescriptors(1000, "the test's 1000"), epSuccess) << epcomm::net::netLastError();
  getrlimit(RLIMIT_NOFILE, &lim);
  EXPECT_GE(lim.rlim_cur, open_now + 1000);
  EXPECT_LE(lim.rlim_cur, open_now + 3000);
  EXPECT_EQ(epcomm::net::ensureDescriptors(5000, "the test's 5000"), epSystemError);
  const std::string msg = epcomm::net::netLastError();
  EXPECT_NE(msg.find("the test's 5000 need about 5000 more file descriptors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("RLIMIT_NOFILE"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hard limit " + std::to_string(open_now + 3000)), std::string::npos) << msg;
  EXPECT_NE(msg.find("EPCOMM_NET_STREAM_BUDGET"), std::string::npos) << msg;
}

TEST(NetLimits, EnsureDescriptorsRaisesTheSoftLimitOrSaysWhich) { EXPECT_EQ(inChild(ensureDescriptorsInChild), 0); }

}  // namespace
