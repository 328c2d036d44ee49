#include "bootstrap/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "common/checks.h"
#include "common/log.h"
#include "common/param.h"

namespace epcomm::sock {

int Addr::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

void Addr::setPort(int port) {
  if (family() == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(static_cast<uint16_t>(port));
  if (family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(static_cast<uint16_t>(port));
}

bool Addr::isLoopback() const {
  if (family() == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr.s_addr) >> 24) == 127;
  if (family() == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a)) return a.s6_addr[12] == 127;
  }
  return false;
}

bool Addr::sameHostPort(const Addr& o) const {
  if (family() != o.family() || port() != o.port()) return false;
  if (family() == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(&o.ss)->sin_addr.s_addr;
  if (family() == AF_INET6)
    return memcmp(&reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr,
                  &reinterpret_cast<const sockaddr_in6*>(&o.ss)->sin6_addr, sizeof(in6_addr)) == 0;
  return false;
}

const char* Addr::format(char* buf, size_t n) const {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, ip, sizeof(ip));
    if (port() != 0)
      snprintf(buf, n, "%s:%d", ip, port());
    else
      snprintf(buf, n, "%s", ip);
  } else if (family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, ip, sizeof(ip));
    if (port() != 0)
      snprintf(buf, n, "[%s]:%d", ip, port());
    else
      snprintf(buf, n, "%s", ip);
  } else {
    snprintf(buf, n, "(no address)");
  }
  return buf;
}

const char* errStr(int err, char* buf, size_t n) {
#if defined(_GNU_SOURCE) && !defined(__APPLE__)
  return strerror_r(err, buf, n);
#else
  if (strerror_r(err, buf, n) != 0) snprintf(buf, n, "errno %d", err);
  return buf;
#endif
}

epResult_t parseIp(const char* text, const char* what, Addr* out) {
  Addr a;
  auto* in4 = reinterpret_cast<sockaddr_in*>(&a.ss);
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.ss);
  if (inet_pton(AF_INET, text, &in4->sin_addr) == 1) {
    in4->sin_family = AF_INET;
    a.len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, text, &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    a.len = sizeof(sockaddr_in6);
  } else {
    EP_FAIL(epInvalidArgument, "%s='%s' is not an IPv4 or IPv6 address", what, text);
  }
  *out = a;
  return epSuccess;
}

namespace {

bool isV6LinkLocal(const sockaddr* sa) {
  return sa->sa_family == AF_INET6 &&
         IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

// NCCL-like interface filter: "eth,ib" prefixes, "^docker" excludes, "=eth0" exact, "^=eth0" exact exclude.
struct IfFilter {
  bool set = false;
  bool exclude = false;
  bool exact = false;
  char list[256] = {0};

  explicit IfFilter(const char* spec) {
    if (spec == nullptr) return;
    set = true;
    if (*spec == '^') {
      exclude = true;
      ++spec;
    }
    if (*spec == '=') {
      exact = true;
      ++spec;
    }
    snprintf(list, sizeof(list), "%s", spec);
  }

  bool matches(const char* name) const {
    bool any = false;
    const char* p = list;
    while (*p != '\0' && !any) {
      const char* comma = strchr(p, ',');
      size_t len = comma ? static_cast<size_t>(comma - p) : strlen(p);
      if (len > 0) {
        if (exact)
          any = strlen(name) == len && strncmp(name, p, len) == 0;
        else
          any = strncmp(name, p, len) == 0;
      }
      p += len;
      if (*p == ',') ++p;
    }
    return exclude ? !any : any;
  }
};

void fillAddr(const sockaddr* sa, Addr* out) {
  *out = Addr();
  if (sa->sa_family == AF_INET) {
    memcpy(&out->ss, sa, sizeof(sockaddr_in));
    out->len = sizeof(sockaddr_in);
  } else {
    memcpy(&out->ss, sa, sizeof(sockaddr_in6));
    out->len = sizeof(sockaddr_in6);
  }
  out->setPort(0);
}

}  // namespace

epResult_t chooseInterface(int family, Addr* out, char* ifname, size_t ifname_bytes) {
  const char* spec = paramString("EPCOMM_SOCKET_IFNAME");
  IfFilter filter(spec);
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    int e = errno;
    EP_FAIL(epSystemError, "getifaddrs failed while choosing the bootstrap interface: %s", ErrStr(e).str);
  }
  const int passes[2] = {AF_INET, AF_INET6};
  const ifaddrs* found = nullptr;
  for (int fam : passes) {
    if (family != AF_UNSPEC && family != fam) continue;
    // Without a filter, AF_UNSPEC means the first IPv4 interface (then the loopback fallback).
    if (!filter.set && family == AF_UNSPEC && fam == AF_INET6) continue;
    for (const ifaddrs* it = list; it != nullptr && found == nullptr; it = it->ifa_next) {
      if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != fam) continue;
      if ((it->ifa_flags & IFF_UP) == 0) continue;
      if (isV6LinkLocal(it->ifa_addr)) continue;
      if (filter.set) {
        if (!filter.matches(it->ifa_name)) continue;
      } else {
        if ((it->ifa_flags & IFF_LOOPBACK) != 0) continue;
        if (strncmp(it->ifa_name, "docker", 6) == 0) continue;
      }
      found = it;
    }
    if (found != nullptr) break;
  }
  if (found != nullptr) {
    fillAddr(found->ifa_addr, out);
    snprintf(ifname, ifname_bytes, "%s", found->ifa_name);
    freeifaddrs(list);
    return epSuccess;
  }
  if (filter.set) {
    char seen[256] = {0};
    size_t used = 0;
    for (const ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
      if (it->ifa_addr == nullptr) continue;
      if (it->ifa_addr->sa_family != AF_INET && it->ifa_addr->sa_family != AF_INET6) continue;
      if (strstr(seen, it->ifa_name) != nullptr) continue;
      int w = snprintf(seen + used, sizeof(seen) - used, "%s%s%s", used ? ", " : "", it->ifa_name,
                       (it->ifa_flags & IFF_UP) ? "" : " (down)");
      if (w < 0 || static_cast<size_t>(w) >= sizeof(seen) - used) break;
      used += static_cast<size_t>(w);
    }
    freeifaddrs(list);
    EP_FAIL(epInvalidArgument,
            "EPCOMM_SOCKET_IFNAME='%s' matches no up interface with a%s address (interfaces with addresses: %s)",
            spec, family == AF_INET ? "n IPv4" : family == AF_INET6 ? "n IPv6" : "n IP", seen);
  }
  freeifaddrs(list);
  // Fallback: the loopback address of the family.
  Addr a;
  if (family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_loopback;
    a.len = sizeof(sockaddr_in6);
  } else {
    auto* in4 = reinterpret_cast<sockaddr_in*>(&a.ss);
    in4->sin_family = AF_INET;
    in4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.len = sizeof(sockaddr_in);
  }
  *out = a;
  snprintf(ifname, ifname_bytes, "%s", "");
  return epSuccess;
}

namespace {

int newSocket(int family) {
  int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  return fd;
}

void setNoDelay(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

epResult_t listenOn(const Addr& addr, bool reuse_addr, const char* what, int* fd_out, Addr* bound) {
  *fd_out = -1;
  int fd = newSocket(addr.family());
  if (fd < 0) {
    int e = errno;
    EP_FAIL(epSystemError, "%s: socket() failed: %s", what, ErrStr(e).str);
  }
  if (reuse_addr) {
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  }
  if (addr.family() == AF_INET6) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
  }
  if (bind(fd, addr.sa(), addr.len) != 0) {
    int e = errno;
    close(fd);
    AddrStr as(addr);
    if (e == EADDRINUSE)
      EP_FAIL(epAddressInUse, "%s: address %s (port %d) is already in use", what, as.s, addr.port());
    if (e == EADDRNOTAVAIL)
      EP_FAIL(epInvalidArgument, "%s: cannot bind to %s: not an address of this host", what, as.s);
    EP_FAIL(epSystemError, "%s: bind to %s failed: %s", what, as.s, ErrStr(e).str);
  }
  if (listen(fd, 16384) != 0) {
    int e = errno;
    close(fd);
    AddrStr as(addr);
    if (e == EADDRINUSE)
      EP_FAIL(epAddressInUse, "%s: address %s (port %d) is already in use", what, as.s, addr.port());
    EP_FAIL(epSystemError, "%s: listen on %s failed: %s", what, as.s, ErrStr(e).str);
  }
  Addr b;
  b.len = sizeof(b.ss);
  if (getsockname(fd, b.sa(), &b.len) != 0) {
    int e = errno;
    close(fd);
    EP_FAIL(epSystemError, "%s: getsockname failed: %s", what, ErrStr(e).str);
  }
  *bound = b;
  *fd_out = fd;
  return epSuccess;
}

int pollMs(const Deadline& dl, int cap_ms) {
  if (dl.endNs() == INT64_MAX) return cap_ms;
  int64_t left_ns = dl.endNs() - nowNs();
  if (left_ns <= 0) return 0;
  int64_t ms = (left_ns + 999999) / 1000000;
  return static_cast<int>(std::min<int64_t>(ms, cap_ms));
}

Io waitFd(int fd, short events, const Deadline& dl, int abort_fd, short* revents, int* err) {
  pollfd p[2] = {{fd, events, 0}, {abort_fd, POLLIN, 0}};
  const nfds_t n = abort_fd >= 0 ? 2 : 1;
  for (;;) {
    if (abort_fd >= 0) {
      // An abort that arrived earlier wins over data that is ready.
      pollfd a = {abort_fd, POLLIN, 0};
      if (poll(&a, 1, 0) > 0) return Io::kAborted;
    }
    int ms = pollMs(dl);
    int r = poll(p, n, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Io::kError;
    }
    if (n == 2 && p[1].revents != 0) return Io::kAborted;
    if (p[0].revents != 0) {
      if (revents) *revents = p[0].revents;
      return Io::kOk;
    }
    if (dl.expired()) return Io::kTimeout;
  }
}

namespace {

bool retryableConnectError(int e) {
  return e == ECONNREFUSED || e == ETIMEDOUT || e == EHOSTUNREACH || e == ENETUNREACH || e == ECONNRESET ||
         e == EAGAIN || e == ECONNABORTED || e == EADDRNOTAVAIL;
}

// A connection to a local port nobody listens on may, rarely, connect to itself (TCP simultaneous open).
bool isSelfConnect(int fd) {
  Addr l, r;
  l.len = r.len = sizeof(l.ss);
  if (getsockname(fd, l.sa(), &l.len) != 0 || getpeername(fd, r.sa(), &r.len) != 0) return false;
  return l.sameHostPort(r);
}

}  // namespace

Io connectRetry(const Addr& to, const Deadline& dl, int abort_fd, int* fd_out, int* err) {
  *fd_out = -1;
  *err = 0;
  int pause_ms = 5;
  for (;;) {
    int fd = newSocket(to.family());
    if (fd < 0) {
      *err = errno;
      return Io::kError;
    }
    int e = 0;
    if (connect(fd, to.sa(), to.len) != 0) {
      e = errno;
      if (e == EINPROGRESS || e == EINTR) {
        short rev = 0;
        int werr = 0;
        Io w = waitFd(fd, POLLOUT, dl, abort_fd, &rev, &werr);
        if (w != Io::kOk) {
          close(fd);
          if (w == Io::kError) *err = werr;
          return w;
        }
        socklen_t sl = sizeof(e);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0) e = errno;
      }
    }
    if (e == 0 && isSelfConnect(fd)) e = ECONNREFUSED;
    if (e == 0) {
      setNoDelay(fd);
      *fd_out = fd;
      return Io::kOk;
    }
    close(fd);
    *err = e;
    if (!retryableConnectError(e)) return Io::kError;
    if (dl.expired()) return Io::kTimeout;
    // Pause, but wake for an abort.
    Deadline pause = Deadline::afterMs(std::min<int64_t>(pause_ms, dl.remainingMs() + 1));
    if (abort_fd >= 0) {
      pollfd a = {abort_fd, POLLIN, 0};
      int r;
      do {
        r = poll(&a, 1, pollMs(pause));
      } while (r < 0 && errno == EINTR);
      if (r > 0) return Io::kAborted;
    } else {
      while (!pause.expired()) poll(nullptr, 0, pollMs(pause));
    }
    pause_ms = std::min(pause_ms * 2, 200);
  }
}

Io sendAll(int fd, const void* buf, size_t bytes, const Deadline& dl, int abort_fd, int* err) {
  const char* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    ssize_t w = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      bytes -= static_cast<size_t>(w);
      continue;
    }
    int e = errno;
    if (w < 0 && (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)) {
      short rev = 0;
      Io r = waitFd(fd, POLLOUT, dl, abort_fd, &rev, err);
      if (r != Io::kOk) return r;
      continue;
    }
    if (e == EPIPE || e == ECONNRESET || e == ENOTCONN) return Io::kClosed;
    *err = e;
    return Io::kError;
  }
  return Io::kOk;
}

Io recvAll(int fd, void* buf, size_t bytes, const Deadline& dl, int abort_fd, int* err) {
  char* p = static_cast<char*>(buf);
  while (bytes > 0) {
    ssize_t r = recv(fd, p, bytes, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      bytes -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return Io::kClosed;
    int e = errno;
    if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) {
      short rev = 0;
      Io w = waitFd(fd, POLLIN, dl, abort_fd, &rev, err);
      if (w != Io::kOk) return w;
      continue;
    }
    if (e == ECONNRESET || e == ENOTCONN) return Io::kClosed;
    *err = e;
    return Io::kError;
  }
  return Io::kOk;
}

int acceptOne(int listen_fd, Addr* peer) {
  Addr a;
  a.len = sizeof(a.ss);
  int fd;
  do {
    fd = accept4(listen_fd, a.sa(), &a.len, SOCK_NONBLOCK | SOCK_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return -1;
  setNoDelay(fd);
  if (peer) *peer = a;
  return fd;
}

bool localAddr(int fd, Addr* out) {
  Addr a;
  a.len = sizeof(a.ss);
  if (getsockname(fd, a.sa(), &a.len) != 0) return false;
  *out = a;
  return true;
}

void closeFd(int* fd) {
  if (*fd >= 0) {
    close(*fd);
    *fd = -1;
  }
}

}  // namespace epcomm::sock
