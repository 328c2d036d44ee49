// Bootstrap: unique ids, the socket rendezvous and star (one forked process per rank), the callback path.
#include "bootstrap/bootstrap.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/proto.h"
#include "bootstrap/socket.h"
#include "common/checks.h"
#include "multiproc.h"

namespace epcomm {
namespace {

using test::runRanks;

// The root waits this long for missing ranks (the parameter is cached on first use, so set it before any).
struct EnvSetup {
  EnvSetup() { setenv("EPCOMM_BOOTSTRAP_ROOT_TIMEOUT_MS", "4000", 0); }
} gEnvSetup;

int64_t msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

// In a child: report and return a distinct exit code.
#define CHILD_CHECK(cond, code)                                                                          \
  do {                                                                                                   \
    if (!(cond)) {                                                                                       \
      fprintf(stderr, "[child rank %d] check failed: %s (last error: %s)\n", rank, #cond, threadLastError()); \
      return (code);                                                                                     \
    }                                                                                                    \
  } while (0)

void expectAllZero(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "process " << r;
}

uint8_t pattern(int rank, size_t size, int round, size_t i) {
  return static_cast<uint8_t>(rank * 131 + size * 7 + round * 17 + i * 29 + (i >> 8));
}

// ------------------------------------------------------------------------------------------------------
// Unique ids
// ------------------------------------------------------------------------------------------------------
TEST(BootstrapId, StringRoundTrip) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  EXPECT_EQ(bootstrapCheckUniqueId(&id), epSuccess);
  char text[EP_UNIQUE_ID_STRING_BYTES];
  ASSERT_EQ(uniqueIdToString(&id, text, sizeof(text)), epSuccess);
  EXPECT_EQ(strlen(text), 2u * EP_UNIQUE_ID_BYTES);
  for (size_t i = 0; i < strlen(text); ++i) EXPECT_TRUE(isdigit(text[i]) || (text[i] >= 'a' && text[i] <= 'f'));
  epUniqueId back;
  ASSERT_EQ(uniqueIdFromString(text, &back), epSuccess) << threadLastError();
  EXPECT_EQ(memcmp(&id, &back, sizeof(id)), 0);
  // Upper case parses too.
  for (char& c : text) c = static_cast<char>(toupper(c));
  ASSERT_EQ(uniqueIdFromString(text, &back), epSuccess) << threadLastError();
  EXPECT_EQ(memcmp(&id, &back, sizeof(id)), 0);

  EXPECT_EQ(uniqueIdToString(&id, text, sizeof(text) - 1), epBufferTooSmall);
  EXPECT_NE(strstr(threadLastError(), "buf_bytes"), nullptr) << threadLastError();
  EXPECT_EQ(uniqueIdToString(nullptr, text, sizeof(text)), epNullPointer);
  EXPECT_EQ(uniqueIdFromString(nullptr, &back), epNullPointer);

  // Two ids differ (random secret, and a fresh port).
  epUniqueId other;
  ASSERT_EQ(bootstrapGetUniqueId(&other), epSuccess);
  EXPECT_NE(memcmp(&id, &other, sizeof(id)), 0);
}

TEST(BootstrapId, GarbledIdsAreRejected) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();

  epUniqueId bad = id;
  bad.internal[EP_UNIQUE_ID_BYTES / 2] ^= 0x10;  // a byte in the middle
  EXPECT_EQ(bootstrapCheckUniqueId(&bad), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "checksum"), nullptr) << threadLastError();
  bad = id;
  bad.internal[12] ^= 0x01;  // inside the secret
  EXPECT_EQ(bootstrapCheckUniqueId(&bad), epInvalidUniqueId);

  bad = id;
  bad.internal[0] ^= 0x55;  // magic
  EXPECT_EQ(bootstrapCheckUniqueId(&bad), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "magic"), nullptr) << threadLastError();

  // Another version, with a checksum that matches: the version is what is reported.
  bad = id;
  uint8_t* p = reinterpret_cast<uint8_t*>(bad.internal);
  bsproto::put32(p + 4, EPCOMM_VERSION_CODE + 1);
  bsproto::put64(p + bsproto::kIdChecksumOffset, bsproto::fnv1a64(p, bsproto::kIdChecksumOffset));
  EXPECT_EQ(bootstrapCheckUniqueId(&bad), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "version"), nullptr) << threadLastError();

  // All zero.
  memset(&bad, 0, sizeof(bad));
  EXPECT_EQ(bootstrapCheckUniqueId(&bad), epInvalidUniqueId);
  EXPECT_EQ(bootstrapCheckUniqueId(nullptr), epNullPointer);

  // Text: truncated, too long, a non-hex digit, a flipped digit.
  char text[EP_UNIQUE_ID_STRING_BYTES];
  ASSERT_EQ(uniqueIdToString(&id, text, sizeof(text)), epSuccess);
  epUniqueId out;
  std::string s(text);
  EXPECT_EQ(uniqueIdFromString(s.substr(0, 200).c_str(), &out), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "200"), nullptr) << threadLastError();
  EXPECT_EQ(uniqueIdFromString("", &out), epInvalidUniqueId);
  EXPECT_EQ(uniqueIdFromString((s + "0").c_str(), &out), epInvalidUniqueId);
  std::string nonhex = s;
  nonhex[100] = 'g';
  EXPECT_EQ(uniqueIdFromString(nonhex.c_str(), &out), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "100"), nullptr) << threadLastError();
  std::string flipped = s;
  flipped[130] = flipped[130] == '0' ? '1' : '0';
  EXPECT_EQ(uniqueIdFromString(flipped.c_str(), &out), epInvalidUniqueId);
  EXPECT_NE(strstr(threadLastError(), "checksum"), nullptr) << threadLastError();

  // A garbled id is refused before any connection attempt.
  bad = id;
  bad.internal[70] ^= 1;
  std::unique_ptr<Bootstrap> bs;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(bootstrapInitSocket(&bad, 0, 2, 5000, &bs), epInvalidUniqueId);
  EXPECT_LT(msSince(t0), 500);
  EXPECT_EQ(bs, nullptr);
}

TEST(BootstrapId, InitArgumentChecks) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess);
  std::unique_ptr<Bootstrap> bs;
  EXPECT_EQ(bootstrapInitSocket(nullptr, 0, 1, 1000, &bs), epNullPointer);
  EXPECT_EQ(bootstrapInitSocket(&id, 0, 1, 1000, nullptr), epNullPointer);
  EXPECT_EQ(bootstrapInitSocket(&id, 0, 0, 1000, &bs), epInvalidArgument);
  EXPECT_EQ(bootstrapInitSocket(&id, 2, 2, 1000, &bs), epRankMismatch);
  EXPECT_NE(strstr(threadLastError(), "rank=2"), nullptr) << threadLastError();
  EXPECT_EQ(bootstrapInitSocket(&id, -1, 2, 1000, &bs), epRankMismatch);
  EXPECT_EQ(bootstrapInitSocket(&id, 0, 2, 0, &bs), epInvalidArgument);
  EXPECT_EQ(bootstrapGetUniqueId(nullptr), epNullPointer);
  EXPECT_EQ(bootstrapInitCallback(nullptr, nullptr, 0, 1, &bs), epNullPointer);
}

// ------------------------------------------------------------------------------------------------------
// Address and port choice (in forked children: the environment changes stay there)
// ------------------------------------------------------------------------------------------------------
int boundLoopbackListener(int* port) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(s, 4) != 0) return -1;
  socklen_t len = sizeof(a);
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return s;
}

TEST(BootstrapAddr, PortInUse) {
  int port = 0;
  int s = boundLoopbackListener(&port);
  ASSERT_GE(s, 0);
  auto codes = runRanks(1, [&](int rank) {
    setenv("EPCOMM_BOOTSTRAP_ADDR", "127.0.0.1", 1);
    setenv("EPCOMM_BOOTSTRAP_PORT", std::to_string(port).c_str(), 1);
    epUniqueId id;
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epAddressInUse, 2);
    CHILD_CHECK(strstr(threadLastError(), std::to_string(port).c_str()) != nullptr, 3);
    CHILD_CHECK(strstr(threadLastError(), "127.0.0.1") != nullptr, 4);
    return 0;
  }, 10000);
  close(s);
  expectAllZero(codes);
}

TEST(BootstrapAddr, EnvironmentChoosesTheAddress) {
  auto codes = runRanks(1, [&](int rank) {
    epUniqueId id;
    bsproto::IdInfo info;
    // A fixed, free port on a fixed address.
    int port = 0;
    int s = boundLoopbackListener(&port);
    CHILD_CHECK(s >= 0, 2);
    close(s);
    setenv("EPCOMM_BOOTSTRAP_ADDR", "127.0.0.1", 1);
    setenv("EPCOMM_BOOTSTRAP_PORT", std::to_string(port).c_str(), 1);
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epSuccess, 3);
    CHILD_CHECK(bsproto::decodeUniqueId(&id, &info) == epSuccess, 4);
    CHILD_CHECK(info.root.port() == port && info.root.isLoopback(), 5);
    // The fixed port is taken now (by that rendezvous).
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epAddressInUse, 6);
    unsetenv("EPCOMM_BOOTSTRAP_PORT");

    setenv("EPCOMM_BOOTSTRAP_ADDR", "not-an-ip", 1);
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epInvalidArgument, 7);
    CHILD_CHECK(strstr(threadLastError(), "EPCOMM_BOOTSTRAP_ADDR") != nullptr, 8);
    unsetenv("EPCOMM_BOOTSTRAP_ADDR");

    setenv("EPCOMM_SOCKET_IFNAME", "=lo", 1);
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epSuccess, 9);
    CHILD_CHECK(bsproto::decodeUniqueId(&id, &info) == epSuccess && info.root.isLoopback(), 10);
    setenv("EPCOMM_SOCKET_IFNAME", "^lo", 1);
    if (bootstrapGetUniqueId(&id) == epSuccess) {  // a machine without another interface fails here
      CHILD_CHECK(bsproto::decodeUniqueId(&id, &info) == epSuccess && !info.root.isLoopback(), 11);
    }
    setenv("EPCOMM_SOCKET_IFNAME", "nosuchif0", 1);
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epInvalidArgument, 12);
    CHILD_CHECK(strstr(threadLastError(), "nosuchif0") != nullptr, 13);
    unsetenv("EPCOMM_SOCKET_IFNAME");
    // Loopback rendezvous: a whole (one-rank) bootstrap works on it.
    setenv("EPCOMM_BOOTSTRAP_ADDR", "127.0.0.1", 1);
    CHILD_CHECK(bootstrapGetUniqueId(&id) == epSuccess, 14);
    std::unique_ptr<Bootstrap> bs;
    CHILD_CHECK(bootstrapInitSocket(&id, 0, 1, 3000, &bs) == epSuccess, 15);
    return 0;
  }, 15000);
  expectAllZero(codes);
}

// ------------------------------------------------------------------------------------------------------
// The socket bootstrap
// ------------------------------------------------------------------------------------------------------
int allgatherRounds(Bootstrap* bs, int rank, int n) {
  const size_t sizes[] = {0, 1, 7, 4096, 100000};
  for (int round = 0; round < 2; ++round) {
    for (size_t size : sizes) {
      std::vector<uint8_t> buf(size * n + 1, 0xEE);
      for (size_t i = 0; i < size; ++i) buf[rank * size + i] = pattern(rank, size, round, i);
      CHILD_CHECK(bs->allgather(buf.data(), size, 5000) == epSuccess, 20);
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < size; ++i) CHILD_CHECK(buf[r * size + i] == pattern(r, size, round, i), 21);
      CHILD_CHECK(buf[size * n] == 0xEE, 22);  // nothing written past the end
    }
  }
  CHILD_CHECK(bs->barrier(5000) == epSuccess, 23);
  return 0;
}

class BootstrapSocketN : public ::testing::TestWithParam<int> {};

TEST_P(BootstrapSocketN, AllgatherAndBarrier) {
  const int n = GetParam();
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  bsproto::IdInfo info;
  ASSERT_EQ(bsproto::decodeUniqueId(&id, &info), epSuccess);
  auto codes = runRanks(n, [&](int rank) {
    std::unique_ptr<Bootstrap> bs;
    CHILD_CHECK(bootstrapInitSocket(&id, rank, n, 5000, &bs) == epSuccess, 2);
    CHILD_CHECK(bs->rank() == rank && bs->nranks() == n, 3);
    CHILD_CHECK(memcmp(bs->secret(), info.secret, kSecretBytes) == 0, 4);
    if (int rc = allgatherRounds(bs.get(), rank, n); rc != 0) return rc;
    return 0;
  }, 30000);
  expectAllZero(codes);
}

INSTANTIATE_TEST_SUITE_P(Ranks, BootstrapSocketN, ::testing::Values(1, 2, 3, 4, 8));

TEST(BootstrapSocket, MissingRankTimesOutNamingIt) {
  // 3 of 4 ranks start. Ranks 0 and 1 give up after their own 2 s; rank 2 waits longer and hears from the root
  // (EPCOMM_BOOTSTRAP_ROOT_TIMEOUT_MS=4000 here) which ranks never came.
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  auto codes = runRanks(3, [&](int rank) {
    const int timeout = rank == 2 ? 8000 : 2000;
    auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Bootstrap> bs;
    epResult_t r = bootstrapInitSocket(&id, rank, 4, timeout, &bs);
    int64_t el = msSince(t0);
    fprintf(stderr, "[rank %d] %d after %lld ms: %s\n", rank, r, static_cast<long long>(el), threadLastError());
    CHILD_CHECK(r == epTimeout, 2);
    CHILD_CHECK(bs == nullptr, 3);
    if (rank < 2) {
      CHILD_CHECK(el >= timeout - 50 && el < timeout + 1000, 4);
      // The root's latest report lists rank 3 (and perhaps rank 0 or 1 if it gave up a moment earlier).
      const char* w = strstr(threadLastError(), "waiting for ranks ");
      CHILD_CHECK(w != nullptr, 5);
      std::string list(w + strlen("waiting for ranks "));
      list = list.substr(0, list.find(' '));
      CHILD_CHECK(list == "3" || (list.size() > 2 && list.compare(list.size() - 2, 2, ",3") == 0), 8);
    } else {
      CHILD_CHECK(el >= 3500 && el < 6000, 6);
      CHILD_CHECK(strstr(threadLastError(), "3 never arrived") != nullptr, 7);
    }
    return 0;
  }, 20000);
  expectAllZero(codes);
}

TEST(BootstrapSocket, NoRootTimesOut) {
  // An id whose rendezvous is gone (a port nobody listens on).
  int port = 0;
  int s = boundLoopbackListener(&port);
  ASSERT_GE(s, 0);
  close(s);
  // An id by hand: magic, version, address and checksum.
  epUniqueId id;
  uint8_t* p = reinterpret_cast<uint8_t*>(id.internal);
  memset(p, 0, sizeof(id));
  bsproto::put32(p, bsproto::kIdMagic);
  bsproto::put32(p + 4, EPCOMM_VERSION_CODE);
  sock::Addr a;
  ASSERT_EQ(sock::parseIp("127.0.0.1", "test", &a), epSuccess);
  a.setPort(port);
  bsproto::encodeAddr(a, p + 24);
  bsproto::put64(p + bsproto::kIdChecksumOffset, bsproto::fnv1a64(p, bsproto::kIdChecksumOffset));
  std::unique_ptr<Bootstrap> bs;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(bootstrapInitSocket(&id, 0, 2, 1000, &bs), epTimeout);
  EXPECT_LT(msSince(t0), 2000);
  EXPECT_NE(strstr(threadLastError(), "could not reach the bootstrap root"), nullptr) << threadLastError();
}

// A stranger that knows the address: it connects to the rendezvous (and to rank 0's star listener) with garbage,
// oversized and silent messages and hellos with a wrong secret. The real ranks complete regardless.
int connectTo(const sock::Addr& a) {
  int fd = socket(a.family(), SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (connect(fd, a.sa(), a.len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::vector<uint8_t> frameBytes(uint16_t type, uint64_t len, const uint8_t* payload, size_t n) {
  std::vector<uint8_t> f(bsproto::kHeaderBytes + n);
  bsproto::FrameHeader h;
  h.type = type;
  h.len = len;
  bsproto::encodeHeader(h, f.data());
  if (n) memcpy(f.data() + bsproto::kHeaderBytes, payload, n);
  return f;
}

std::vector<int> gStrangerFds;  // kept open until the process exits

bool sendAllBlocking(int fd, const std::vector<uint8_t>& b) {
  return fd >= 0 && send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
}

int attackRendezvous(const bsproto::IdInfo& info) {
  const std::vector<uint8_t> garbage(64, 0xAB);
  int ok = 0;
  int fd = connectTo(info.root);
  ok += sendAllBlocking(fd, garbage);
  gStrangerFds.push_back(fd);

  for (int claim = 0; claim < 2; ++claim) {  // well-formed hellos with a wrong secret
    bsproto::Hello h;
    memcpy(h.secret, info.secret, kSecretBytes);
    h.secret[3] ^= 0x40;
    h.rank = claim;
    h.nranks = claim == 0 ? 4 : 7;
    h.pid = 1;
    h.listen = info.root;
    uint8_t payload[bsproto::kHelloBytes];
    bsproto::encodeHello(h, payload);
    fd = connectTo(info.root);
    ok += sendAllBlocking(fd, frameBytes(bsproto::kHello, sizeof(payload), payload, sizeof(payload)));
    gStrangerFds.push_back(fd);
  }
  // A header announcing a huge message, then bytes.
  fd = connectTo(info.root);
  ok += sendAllBlocking(fd, frameBytes(bsproto::kHello, 1ull << 40, garbage.data(), garbage.size()));
  gStrangerFds.push_back(fd);
  // Half a header, then silence.
  fd = connectTo(info.root);
  ok += sendAllBlocking(fd, std::vector<uint8_t>(10, 0));
  gStrangerFds.push_back(fd);
  // Connect and close at once.
  fd = connectTo(info.root);
  if (fd >= 0) close(fd);
  return ok;
}

void attackStar(const sock::Addr& listen) {
  const std::vector<uint8_t> garbage(48, 0x5A);
  int fd = connectTo(listen);
  sendAllBlocking(fd, garbage);
  gStrangerFds.push_back(fd);
  uint8_t payload[bsproto::kStarHelloBytes] = {};
  memset(payload, 0x11, kSecretBytes);  // not the secret
  bsproto::put32(payload + kSecretBytes, 1);
  bsproto::put32(payload + kSecretBytes + 4, 4);
  fd = connectTo(listen);
  sendAllBlocking(fd, frameBytes(bsproto::kStarHello, sizeof(payload), payload, sizeof(payload)));
  gStrangerFds.push_back(fd);
  fd = connectTo(listen);  // silent
  gStrangerFds.push_back(fd);
}

TEST(BootstrapSocket, StrangersAreDropped) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  bsproto::IdInfo info;
  ASSERT_EQ(bsproto::decodeUniqueId(&id, &info), epSuccess);
  const int n = 4;
  auto codes = runRanks(n + 1, [&](int rank) {
    if (rank == n) {  // the stranger
      int ok = attackRendezvous(info);
      CHILD_CHECK(ok == 5, 30);
      usleep(3000 * 1000);
      return 0;
    }
    if (rank == 0) bsproto::setStarListenHookForTest(attackStar);
    if (rank == n - 1) usleep(500 * 1000);  // the strangers get in before the rendezvous completes
    std::unique_ptr<Bootstrap> bs;
    CHILD_CHECK(bootstrapInitSocket(&id, rank, n, 8000, &bs) == epSuccess, 2);
    CHILD_CHECK(memcmp(bs->secret(), info.secret, kSecretBytes) == 0, 3);
    if (int rc = allgatherRounds(bs.get(), rank, n); rc != 0) return rc;
    return 0;
  }, 30000);
  expectAllZero(codes);
}

TEST(BootstrapSocket, RankCountMismatchFailsEveryone) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  auto codes = runRanks(4, [&](int rank) {
    if (rank == 3) usleep(200 * 1000);
    const int nranks = rank == 3 ? 5 : 4;
    auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Bootstrap> bs;
    epResult_t r = bootstrapInitSocket(&id, rank, nranks, 5000, &bs);
    CHILD_CHECK(r == epRankMismatch, 2);
    CHILD_CHECK(msSince(t0) < 3000, 3);
    CHILD_CHECK(strstr(threadLastError(), "disagree") != nullptr, 4);
    return 0;
  }, 20000);
  expectAllZero(codes);
}

TEST(BootstrapSocket, DuplicateRankFailsEveryone) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  auto codes = runRanks(4, [&](int rank) {
    const int me = rank == 3 ? 2 : rank;  // two processes claim rank 2, nobody is rank 3
    auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Bootstrap> bs;
    epResult_t r = bootstrapInitSocket(&id, me, 4, 5000, &bs);
    CHILD_CHECK(r == epRankMismatch, 2);
    CHILD_CHECK(msSince(t0) < 3000, 3);
    CHILD_CHECK(strstr(threadLastError(), "rank 2 arrived twice") != nullptr, 4);
    return 0;
  }, 20000);
  expectAllZero(codes);
}

TEST(BootstrapSocket, DeadPeerIsReported) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  const int n = 4;
  auto codes = runRanks(n, [&](int rank) {
    std::unique_ptr<Bootstrap> bs;
    CHILD_CHECK(bootstrapInitSocket(&id, rank, n, 5000, &bs) == epSuccess, 2);
    if (rank == 2) _exit(0);
    std::vector<uint8_t> buf(64 * n, static_cast<uint8_t>(rank));
    auto t0 = std::chrono::steady_clock::now();
    epResult_t r = bs->allgather(buf.data(), 64, 3000);
    int64_t el = msSince(t0);
    fprintf(stderr, "[rank %d] %d after %lld ms: %s\n", rank, r, static_cast<long long>(el), threadLastError());
    CHILD_CHECK(r == epRemoteError || r == epTimeout, 3);
    CHILD_CHECK(el < 3500, 4);
    CHILD_CHECK(strstr(threadLastError(), "rank 2") != nullptr, 5);
    // The bootstrap stays failed.
    CHILD_CHECK(bs->allgather(buf.data(), 64, 1000) != epSuccess, 6);
    return 0;
  }, 20000);
  expectAllZero(codes);
}

TEST(BootstrapSocket, MismatchedSizesFailEveryone) {
  epUniqueId id;
  ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
  const int n = 3;
  auto codes = runRanks(n, [&](int rank) {
    std::unique_ptr<Bootstrap> bs;
    CHILD_CHECK(bootstrapInitSocket(&id, rank, n, 5000, &bs) == epSuccess, 2);
    const size_t size = rank == 1 ? 16 : 8;
    std::vector<uint8_t> buf(size * n, 1);
    auto t0 = std::chrono::steady_clock::now();
    epResult_t r = bs->allgather(buf.data(), size, 3000);
    CHILD_CHECK(r == epInvalidUsage, 3);
    CHILD_CHECK(msSince(t0) < 2000, 4);
    return 0;
  }, 20000);
  expectAllZero(codes);
}

// Abort from another thread ends a wait for a peer that does not come (rank 0 and a non-root rank each).
TEST(BootstrapSocket, AbortUnblocksAllgather) {
  for (int waiter = 0; waiter < 2; ++waiter) {
    epUniqueId id;
    ASSERT_EQ(bootstrapGetUniqueId(&id), epSuccess) << threadLastError();
    auto codes = runRanks(2, [&](int rank) {
      std::unique_ptr<Bootstrap> bs;
      CHILD_CHECK(bootstrapInitSocket(&id, rank, 2, 5000, &bs) == epSuccess, 2);
      if (rank != waiter) {  // never joins the allgather
        usleep(1500 * 1000);
        return 0;
      }
      std::atomic<int64_t> abort_ns{0};
      std::thread t([&]() {
        usleep(300 * 1000);
        abort_ns.store(nowNs());
        bs->abort();
      });
      std::vector<uint8_t> buf(2 * 32);
      epResult_t r = bs->allgather(buf.data(), 32, 5000);
      int64_t end_ns = nowNs();
      t.join();
      int64_t lag_ms = (end_ns - abort_ns.load()) / 1000000;
      fprintf(stderr, "[rank %d] %d, %lld ms after abort: %s\n", rank, r, static_cast<long long>(lag_ms),
              threadLastError());
      CHILD_CHECK(r == epAborted, 3);
      CHILD_CHECK(abort_ns.load() != 0 && lag_ms < 100, 4);
      CHILD_CHECK(bs->allgather(buf.data(), 32, 5000) == epAborted, 5);
      CHILD_CHECK(bs->barrier(5000) == epAborted, 6);
      return 0;
    }, 20000);
    expectAllZero(codes);
  }
}

// ------------------------------------------------------------------------------------------------------
// The callback bootstrap, over threads
// ------------------------------------------------------------------------------------------------------
struct FakeGather {
  explicit FakeGather(int n) : nranks(n), sync(n) {}
  int nranks;
  std::barrier<> sync;
  std::vector<uint8_t> shared;
  std::atomic<bool> fail{false};
  std::atomic<int> calls{0};
};
thread_local int tRank = -1;

int fakeAllgather(void* ctx, const void* sendbuf, void* recvbuf, size_t bytes) {
  auto* f = static_cast<FakeGather*>(ctx);
  f->calls.fetch_add(1);
  if (f->fail.load()) return 7;
  f->sync.arrive_and_wait();
  if (tRank == 0) f->shared.assign(bytes * f->nranks, 0);
  f->sync.arrive_and_wait();
  if (bytes) memcpy(f->shared.data() + tRank * bytes, sendbuf, bytes);
  f->sync.arrive_and_wait();
  if (bytes) memcpy(recvbuf, f->shared.data(), bytes * f->nranks);
  f->sync.arrive_and_wait();
  return 0;
}

TEST(BootstrapCallback, SecretAllgatherAndFailure) {
  const int n = 4;
  FakeGather fake(n);
  std::vector<std::unique_ptr<Bootstrap>> bss(n);
  std::vector<int> results(n, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r]() {
      tRank = r;
      const int rank = r;
      auto body = [&]() -> int {
        CHILD_CHECK(bootstrapInitCallback(fakeAllgather, &fake, rank, n, &bss[rank]) == epSuccess, 2);
        Bootstrap* bs = bss[rank].get();
        CHILD_CHECK(bs->rank() == rank && bs->nranks() == n, 3);
        if (int rc = allgatherRounds(bs, rank, n); rc != 0) return rc;
        return 0;
      };
      results[r] = body();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_EQ(results[r], 0) << "rank " << r;
  static const uint8_t kZero[kSecretBytes] = {};
  EXPECT_NE(memcmp(bss[0]->secret(), kZero, kSecretBytes), 0);
  for (int r = 1; r < n; ++r) EXPECT_EQ(memcmp(bss[0]->secret(), bss[r]->secret(), kSecretBytes), 0) << r;

  // A failing callback.
  fake.fail.store(true);
  std::vector<uint8_t> buf(n * 8);
  EXPECT_EQ(bss[1]->allgather(buf.data(), 8, 1000), epRemoteError);
  EXPECT_NE(strstr(threadLastError(), "external allgather failed"), nullptr) << threadLastError();
  // Abort: later allgathers fail without calling the callback.
  fake.fail.store(false);
  int before = fake.calls.load();
  bss[2]->abort();
  EXPECT_EQ(bss[2]->allgather(buf.data(), 8, 1000), epAborted);
  EXPECT_EQ(bss[2]->barrier(1000), epAborted);
  EXPECT_EQ(fake.calls.load(), before);
  // Once the communicator is created the callback is never called again (its context may be gone).
  bss[3]->creationDone();
  EXPECT_EQ(bss[3]->allgather(buf.data(), 8, 1000), epInternalError);
  EXPECT_NE(strstr(threadLastError(), "after creation"), nullptr) << threadLastError();
  EXPECT_EQ(bss[3]->barrier(1000), epInternalError);
  EXPECT_EQ(fake.calls.load(), before);
}

TEST(BootstrapCallback, FailingCallbackAtInit) {
  FakeGather fake(1);
  fake.fail.store(true);
  std::unique_ptr<Bootstrap> bs;
  EXPECT_EQ(bootstrapInitCallback(fakeAllgather, &fake, 0, 1, &bs), epRemoteError);
  EXPECT_EQ(bs, nullptr);
  EXPECT_NE(strstr(threadLastError(), "external allgather failed"), nullptr) << threadLastError();
}

TEST(BootstrapCallback, RankCountMismatch) {
  const int n = 4;
  FakeGather fake(n);
  std::vector<epResult_t> results(n, epSuccess);
  std::vector<std::string> msgs(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r]() {
      tRank = r;
      std::unique_ptr<Bootstrap> bs;
      // Rank 3 believes in 5 ranks; its buffer is larger than what the (4-rank) callback fills.
      results[r] = bootstrapInitCallback(fakeAllgather, &fake, r, r == 3 ? 5 : 4, &bs);
      msgs[r] = threadLastError();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(results[r], epRankMismatch) << r << ": " << msgs[r];
    EXPECT_NE(msgs[r].find("disagree"), std::string::npos) << msgs[r];
  }
}

}  // namespace
}  // namespace epcomm
