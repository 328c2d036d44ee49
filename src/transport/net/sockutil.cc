#include "transport/net/sockutil.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/param.h"
#include "common/time.h"
#include "transport/net/net.h"

namespace epcomm::net {

EP_PARAM(TimeoutMs, "TIMEOUT_MS", 30000);
// Socket buffer size asked for when the kernel's *mem_max allows it; otherwise autotuning is kept, because an
// explicit SO_SNDBUF below the autotuning ceiling would make loopback slower, not faster.
EP_PARAM(NetSockBuf, "NET_SOCKBUF", 4 << 20);

int64_t netTimeoutMs() {
  int64_t t = epParamTimeoutMs();
  return t > 0 ? t : 30000;
}

// A quarter of the stall deadline: a peer that misses a beat or two (scheduling, a busy host) is still heard from
// well within it (common/time.h).
int64_t netHeartbeatMs() { return heartbeatMs(netTimeoutMs()); }

int64_t netMissedTurnNs() { return missedTurnNs(netTimeoutMs()); }

std::string addrToString(const NetAddr& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  char out[INET6_ADDRSTRLEN + 16];
  if (a.sa.sa_family == AF_INET) {
    inet_ntop(AF_INET, &a.sin.sin_addr, host, sizeof(host));
    snprintf(out, sizeof(out), "%s:%u", host, ntohs(a.sin.sin_port));
  } else if (a.sa.sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &a.sin6.sin6_addr, host, sizeof(host));
    snprintf(out, sizeof(out), "[%s]:%u", host, ntohs(a.sin6.sin6_port));
  } else {
    snprintf(out, sizeof(out), "<family %d>", a.sa.sa_family);
  }
  return out;
}

socklen_t addrLen(const NetAddr& a) {
  return a.sa.sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

bool ifnameMatches(const char* spec, const char* ifname) {
  bool exclude = false, exact = false;
  if (*spec == '^') exclude = true, ++spec;
  if (*spec == '=') exact = true, ++spec;
  bool hit = false;
  char buf[512];
  snprintf(buf, sizeof(buf), "%s", spec);
  for (char* save = nullptr; char* tok = strtok_r(save ? nullptr : buf, ",", &save);) {
    if (char* colon = strchr(tok, ':')) *colon = '\0';  // NCCL allows "eth0:port"; the port is ignored
    if (*tok == '\0') continue;
    if (exact ? strcmp(tok, ifname) == 0 : strncmp(tok, ifname, strlen(tok)) == 0) {
      hit = true;
      break;
    }
  }
  return exclude ? !hit : hit;
}

namespace {

int readSpeed(const std::string& ifname) {
  std::string path = "/sys/class/net/" + ifname + "/speed";
  FILE* f = fopen(path.c_str(), "r");
  int speed = -1;
  if (f) {
    if (fscanf(f, "%d", &speed) != 1) speed = -1;
    fclose(f);
  }
  return speed > 0 ? speed : 10000;
}

std::string readPciPath(const std::string& ifname) {
  std::string link = "/sys/class/net/" + ifname + "/device";
  char real[PATH_MAX];
  if (realpath(link.c_str(), real) == nullptr) return "";
  // Only a PCI function is useful to NCCL's topology ("/sys/devices/pci0000:00/0000:00:03.0"); a virtio
  // child ("…/virtio0") is cut back to its PCI parent.
  std::string p = real;
  if (p.find("/pci") == std::string::npos) return "";
  size_t slash = p.rfind('/');
  if (slash != std::string::npos && p.compare(slash + 1, 6, "virtio") == 0) p.resize(slash);
  return p;
}

std::vector<NetIf> collect(const char* spec) {
  std::vector<NetIf> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (int pass = 0; pass < 2; ++pass) {  // IPv4 first, then IPv6 for interfaces that have no IPv4
    for (ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || !(a->ifa_flags & IFF_UP)) continue;
      int fam = a->ifa_addr->sa_family;
      if (fam != (pass == 0 ? AF_INET : AF_INET6)) continue;
      if (fam == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr))
        continue;
      if (!ifnameMatches(spec, a->ifa_name)) continue;
      bool seen = false;
      for (auto& i : out) seen |= i.name == a->ifa_name;
      if (seen) continue;
      NetIf ni;
      ni.name = a->ifa_name;
      memcpy(&ni.addr, a->ifa_addr, fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
      ni.pciPath = readPciPath(ni.name);
      ni.speedMbps = readSpeed(ni.name);
      out.push_back(ni);
    }
  }
  freeifaddrs(list);
  return out;
}

}  // namespace

const std::vector<NetIf>& netInterfaces() {
  static std::vector<NetIf> ifs = [] {
    std::vector<NetIf> v;
    const char* spec = paramString("EPCOMM_SOCKET_IFNAME");
    if (!spec) spec = paramString("NCCL_SOCKET_IFNAME");  // one knob for NCCL and its plugin
    if (spec) {
      v = collect(spec);
    } else {
      v = collect("^docker,lo,virbr");
      if (v.empty()) v = collect("docker,virbr");
      if (v.empty()) v = collect("lo");
    }
    if (v.size() > static_cast<size_t>(kNetMaxDevs)) v.resize(kNetMaxDevs);
    for (auto& i : v)
      NET_INFO("NET/epcomm: interface %s %s speed %d Mb/s pci %s", i.name.c_str(), addrToString(i.addr).c_str(),
               i.speedMbps, i.pciPath.empty() ? "-" : i.pciPath.c_str());
    return v;
  }();
  return ifs;
}

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  static int bufBytes = [] {
    int64_t want = epParamNetSockBuf();
    if (want <= 0) return 0;
    auto rd = [](const char* p) {
      long v = 0;
      if (FILE* f = fopen(p, "r")) {
        if (fscanf(f, "%ld", &v) != 1) v = 0;
        fclose(f);
      }
      return v;
    };
    long lim = std::min(rd("/proc/sys/net/core/wmem_max"), rd("/proc/sys/net/core/rmem_max"));
    if (lim < want) {
      NET_INFO("NET/epcomm: keeping socket buffer autotuning (core/[rw]mem_max %ld < EPCOMM_NET_SOCKBUF %ld)", lim,
               static_cast<long>(want));
      return 0;
    }
    return static_cast<int>(want);
  }();
  if (bufBytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufBytes, sizeof(bufBytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufBytes, sizeof(bufBytes));
  }
  // A peer that vanishes without a FIN/RST (power loss, partition) becomes an error within the timeout.
  int64_t tmo = netTimeoutMs();
  unsigned int utmo = static_cast<unsigned int>(tmo);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &utmo, sizeof(utmo));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = static_cast<int>(std::max<int64_t>(1, tmo / 3000));
  int intvl = std::max(1, idle / 3);
  int cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

epResult_t tcpListen(const NetIf& ifc, int* fdOut, NetAddr* bound) {
  NetAddr a = ifc.addr;
  if (a.sa.sa_family == AF_INET) a.sin.sin_port = 0;
  else a.sin6.sin6_port = 0;
  int fd = socket(a.sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) NET_FAIL(epSystemError, "NET/epcomm: socket(): %s", strerror(errno));
  // Bound to the chosen interface's address only (DESIGN R5), not INADDR_ANY.
  if (bind(fd, &a.sa, addrLen(a)) != 0 || ::listen(fd, 16384) != 0) {
    int e = errno;
    ::close(fd);
    NET_FAIL(epSystemError, "NET/epcomm: bind/listen on %s (%s): %s", ifc.name.c_str(), addrToString(a).c_str(),
             strerror(e));
  }
  socklen_t len = sizeof(NetAddr);
  getsockname(fd, &bound->sa, &len);
  *fdOut = fd;
  return epSuccess;
}

epResult_t TcpConnector::progress(const NetAddr& peer) {
  if (connected) return epSuccess;
  int64_t now = nowNs();
  if (deadlineNs == 0) deadlineNs = now + netTimeoutMs() * 1000000LL;
  if (fd < 0) {
    if (now < retryAtNs) return epSuccess;
    fd = socket(peer.sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) NET_FAIL(epSystemError, "NET/epcomm: socket(): %s", strerror(errno));
    tuneSocket(fd);  // before connect so that window scaling is negotiated for the big buffers
    if (::connect(fd, &peer.sa, addrLen(peer)) == 0) {
      connected = true;
      return epSuccess;
    }
    if (errno != EINPROGRESS) goto failed;
    return epSuccess;
  }
  {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, 0) <= 0) {
      if (now > deadlineNs) goto failed_timeout;
      return epSuccess;
    }
    int err = 0;
    socklen_t el = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err == 0) {
      connected = true;
      return epSuccess;
    }
    errno = err;
  }
failed:
  if ((errno == ECONNREFUSED || errno == ETIMEDOUT || errno == EAGAIN) && nowNs() < deadlineNs) {
    ::close(fd);
    fd = -1;
    retryAtNs = nowNs() + 10 * 1000000LL;  // retry in 10 ms
    return epSuccess;
  }
  {
    int e = errno;
    close();
    NET_FAIL(epRemoteError, "NET/epcomm: connect to peer %s failed: %s", addrToString(peer).c_str(), strerror(e));
  }
failed_timeout:
  close();
  NET_FAIL(epTimeout, "NET/epcomm: connect to peer %s: no answer within %lld ms", addrToString(peer).c_str(),
           static_cast<long long>(netTimeoutMs()));
}

void TcpConnector::close() {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

ssize_t sendSome(int fd, const void* p, size_t n, std::string* err) {
  for (;;) {
    ssize_t r = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) return r;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *err = strerror(errno);
    return -1;
  }
}

const char* const kClosedByPeer = "connection closed by peer";

ssize_t recvSome(int fd, void* p, size_t n, std::string* err) {
  if (n == 0) return 0;
  iovec v{p, n};
  return recvSomeV(fd, &v, 1, err);
}

ssize_t recvSomeV(int fd, iovec* iov, int niov, std::string* err) {
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = static_cast<size_t>(niov);
  for (;;) {
    ssize_t r = ::recvmsg(fd, &mh, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0) {
      *err = kClosedByPeer;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *err = strerror(errno);
    return -1;
  }
}

uint64_t randomU64() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof(v), 0) != sizeof(v)) v = static_cast<uint64_t>(nowNs()) * 0x9E3779B97F4A7C15ull ^ getpid();
  return v;
}

}  // namespace epcomm::net
