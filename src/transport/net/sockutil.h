// TCP helpers shared by the socket backend and the libfabric backend's out-of-band handshake: interface
// selection (NCCL's rules), addresses, socket tuning, non-blocking listen/connect/accept state machines.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/epcomm.h"

namespace epcomm::net {

union NetAddr {
  sockaddr sa;
  sockaddr_in sin;
  sockaddr_in6 sin6;
};
static_assert(sizeof(NetAddr) == 28);

std::string addrToString(const NetAddr& a);  // "1.2.3.4:port" / "[::1]:port"
socklen_t addrLen(const NetAddr& a);

struct NetIf {
  std::string name;
  NetAddr addr{};         // port 0
  std::string pciPath;    // realpath of /sys/class/net/<if>/device, empty when virtual
  int speedMbps = 10000;  // /sys/class/net/<if>/speed, NCCL's default when unknown
};

// Interfaces in NCCL's order: EPCOMM_SOCKET_IFNAME (else NCCL_SOCKET_IFNAME) when set — "a,b" prefixes,
// "^a,b" excludes, leading "=" exact names; else everything but docker*/lo*/virbr*, then docker*/virbr*, then
// lo last. One address per interface (IPv4 preferred, no link-local IPv6). Cached after the first call.
const std::vector<NetIf>& netInterfaces();
// Exposed for tests: does `ifname` pass the filter `spec`?
bool ifnameMatches(const char* spec, const char* ifname);

// Socket tuning applied to every data socket: TCP_NODELAY, large buffers when the kernel allows them,
// keepalive + TCP_USER_TIMEOUT so that an unreachable peer turns into an error within EPCOMM_TIMEOUT_MS.
// (The socket backend clears TCP_USER_TIMEOUT once a connection is up: socket_net.cc says why.)
void tuneSocket(int fd);
int64_t netTimeoutMs();    // EPCOMM_TIMEOUT_MS (default 30000)
int64_t netHeartbeatMs();  // stall heartbeats: min(EPCOMM_TIMEOUT_MS / 4, 1 s), at least 5 ms
// A heartbeat thread takes a turn at least once per heartbeat period; a gap longer than this means the process
// was stopped (a suspended job: its peers too, so they could not beat) or starved, and heard nothing meanwhile.
int64_t netMissedTurnNs();

// The turns of a backend's heartbeat thread, for the stall deadline: time this process spent stopped does not
// count against its peers (the clocks restart at the first turn after missed ones), and right after a resume,
// before the thread's first turn, no peer is judged.
struct NetTurnClock {
  std::atomic<int64_t> turnNs{0};     // the thread's last turn
  std::atomic<int64_t> resumedNs{0};  // its first turn after missed ones
  void start(int64_t now) { turnNs.store(now, std::memory_order_release); }
  void turn(int64_t now) {
    if (now - turnNs.load(std::memory_order_relaxed) > netMissedTurnNs())
      resumedNs.store(now, std::memory_order_relaxed);
    turnNs.store(now, std::memory_order_release);  // after resumedNs: see quietNs
  }
  // How long a peer last heard at `heardNs` has been quiet at `now`, a resume counting as a sign of life; -1
  // while this process cannot judge (its thread missed turns and has not had one since: it was stopped).
  // turnNs is read before resumedNs, the reverse of turn()'s writes, so a reader that sees the first turn after
  // a stop also sees the resume it recorded. Read the other way round, a turn landing between the two reads (both
  // threads wake at the same SIGCONT) paired a stale resume with "awake", and the process blamed its peer for the
  // seconds it had been stopped itself.
  int64_t quietNs(int64_t now, int64_t heardNs) const {
    if (now - turnNs.load(std::memory_order_acquire) > netMissedTurnNs()) return -1;
    return now - std::max(heardNs, resumedNs.load(std::memory_order_acquire));
  }
};

// Listening socket bound to `ifc` (port 0 = any); fills *bound with the address peers must use.
epResult_t tcpListen(const NetIf& ifc, int* fd, NetAddr* bound);

// Non-blocking connect of one socket, driven by repeated calls. Retries refused connections until the
// deadline (the peer's listener is created before the handle is exchanged, but a full backlog can refuse).
struct TcpConnector {
  int fd = -1;
  bool connected = false;
  int64_t deadlineNs = 0;
  int64_t retryAtNs = 0;
  // Returns epSuccess with connected==true when done, epSuccess with connected==false to be called again.
  epResult_t progress(const NetAddr& peer);
  void close();
};

// Moves bytes without blocking. Returns bytes moved (>=0; 0 = would block), or -1 with *err set (peer closed,
// reset, ...). For recv, a peer that closed yields -1 with *err = kClosedByPeer.
ssize_t sendSome(int fd, const void* p, size_t n, std::string* err);
ssize_t recvSome(int fd, void* p, size_t n, std::string* err);
// What *err says when the peer closed the connection (an orderly end: recv() returned 0).
extern const char* const kClosedByPeer;
// recvSome into `niov` pieces in order (one recvmsg).
ssize_t recvSomeV(int fd, iovec* iov, int niov, std::string* err);

uint64_t randomU64();  // from getrandom(); secrets and connection ids

}  // namespace epcomm::net
