// Small TCP helpers for the bootstrap: addresses, interface choice, listeners, and send/recv/connect that
// always wait with a deadline and wake up when an abort descriptor (an eventfd) becomes readable.
// All sockets made here are non-blocking and close-on-exec; sends never raise SIGPIPE.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>

#include "common/time.h"
#include "epcomm/epcomm.h"

namespace epcomm::sock {

struct Addr {
  sockaddr_storage ss{};
  socklen_t len = 0;

  int family() const { return ss.ss_family; }
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&ss); }
  sockaddr* sa() { return reinterpret_cast<sockaddr*>(&ss); }
  int port() const;
  void setPort(int port);
  bool isLoopback() const;
  bool sameHostPort(const Addr& o) const;  // same family, address and port
  // "1.2.3.4:5" or "[fd00::2]:5" (port omitted when 0).
  const char* format(char* buf, size_t n) const;
};

// Addr formatted for a message: AddrStr(a).s
struct AddrStr {
  char s[INET6_ADDRSTRLEN + 32];
  explicit AddrStr(const Addr& a) { a.format(s, sizeof(s)); }
};

// Thread-safe strerror.
const char* errStr(int err, char* buf, size_t n);
struct ErrStr {
  char s[128];
  const char* str;
  explicit ErrStr(int err) : str(errStr(err, s, sizeof(s))) {}
};

// An IPv4 or IPv6 literal (no port). epInvalidArgument naming `what` when it does not parse.
epResult_t parseIp(const char* text, const char* what, Addr* out);

// The interface address to listen on, NCCL-like:
//  - EPCOMM_SOCKET_IFNAME set: a comma-separated list of interface-name prefixes; a leading '^' excludes the
//    listed interfaces instead, a leading '=' (after any '^') makes the names exact. The first matching up
//    interface with an address of `family` (AF_UNSPEC: IPv4 preferred, then IPv6) wins. Nothing matching:
//    epInvalidArgument listing the interfaces seen.
//  - unset: the first up, non-loopback, non-docker interface with an address of `family` (AF_UNSPEC: IPv4),
//    else the loopback address.
// IPv6 link-local addresses are never chosen. *ifname receives the interface name ("" for the fallback).
epResult_t chooseInterface(int family, Addr* out, char* ifname, size_t ifname_bytes);

// Binds a listener to exactly `addr` (port 0: ephemeral) and listens. reuse_addr sets SO_REUSEADDR (for a
// fixed port). EADDRINUSE -> epAddressInUse, EADDRNOTAVAIL -> epInvalidArgument, each naming `what` and the
// address and port. *bound receives the address with the actual port.
epResult_t listenOn(const Addr& addr, bool reuse_addr, const char* what, int* fd, Addr* bound);

// Outcome of a wait on the network. kError carries an errno in *err.
enum class Io { kOk, kClosed, kTimeout, kAborted, kError };

// Milliseconds to give poll() so that it returns at or just after the deadline, at most cap_ms.
int pollMs(const Deadline& dl, int cap_ms = 1000);

// Waits until fd reports one of `events` (revents in *revents), the deadline passes, or abort_fd (may be -1)
// is readable.
Io waitFd(int fd, short events, const Deadline& dl, int abort_fd, short* revents, int* err);

// Connects to `to`, retrying refused/unreachable attempts with a growing pause until the deadline (the far
// side may not listen yet). kTimeout leaves the last connect error in *err (0 when none was seen).
Io connectRetry(const Addr& to, const Deadline& dl, int abort_fd, int* fd, int* err);

Io sendAll(int fd, const void* buf, size_t bytes, const Deadline& dl, int abort_fd, int* err);
Io recvAll(int fd, void* buf, size_t bytes, const Deadline& dl, int abort_fd, int* err);

// accept4 of one pending connection: a non-blocking fd with TCP_NODELAY, or -1 with errno (EAGAIN: none).
int acceptOne(int listen_fd, Addr* peer);

// Local address of a connected or bound socket.
bool localAddr(int fd, Addr* out);

void closeFd(int* fd);

}  // namespace epcomm::sock
