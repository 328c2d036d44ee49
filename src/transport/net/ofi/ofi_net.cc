// The ofi backend: libfabric reliable-datagram endpoints (FI_EP_RDM) with tagged messages.
//
// - libfabric is dlopen()ed (libfabric.so.1): a plugin built with it still loads where it is absent, and
//   EPCOMM_NET=ofi then says why it is not offered. Only the five exported entry points are looked up; every
//   other fi_* call is an inline wrapper over the provider's ops tables.
// - One fabric/domain/endpoint/CQ/AV per device, shared by all comms of that device (as NCCL's IB plugin
//   shares a context), every libfabric call under the device mutex; progress is manual, driven by test().
// - Matching: the 64-bit tag is [0][recv comm id:15][NCCL tag:24][sequence:24], with one sequence per (comm,
//   NCCL tag) on both sides. Posting order per connection therefore decides the match even where the
//   provider does not order messages, and grouped receives pick their buffer by NCCL tag.
// - Connection setup and liveness use a small TCP side channel (like NCCL's IB plugin): it carries the secret
//   (DESIGN R5) and the endpoint names, and its EOF/RST is how a dead peer becomes an error — an RDM endpoint
//   has no connection to lose, so a receive from a dead peer would otherwise wait forever.
// - Stall deadline: a per-process heartbeat thread writes one byte on every side channel each
//   min(EPCOMM_TIMEOUT_MS / 4, 1 s); a process that is alive but idle (computing, no collective posted) keeps
//   beating, one that is stopped, frozen or cut off does not. A request that waits while its peer has shown no
//   sign of life (heartbeat or completion) for EPCOMM_TIMEOUT_MS fails with a timeout instead of hanging. Time
//   this process was stopped itself (the heartbeat thread missed its turns) does not count.
// - Close cancels every operation of the comm (fi_cancel, sends too) and drains the CQ until each has completed
//   or been cancelled, for at most EPCOMM_OFI_CLOSE_MS: memory the caller frees after close is then no longer
//   in the provider's hands. Operations the provider neither finishes nor cancels in time (a peer that never
//   posts the matching receive) are reported and left orphaned (their contexts stay allocated).
#include <dlfcn.h>
#include <errno.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/param.h"
#include "common/thread_name.h"
#include "common/time.h"
#include "transport/net/net.h"
#include "transport/net/sockutil.h"

namespace epcomm::net {
namespace {

constexpr uint32_t kHandleMagic = 0x45504f48;  // "EPOH"
constexpr uint32_t kHelloMagic = 0x45504f4c;
constexpr uint32_t kVersion = 2;  // 2: the side channel carries heartbeats
constexpr int kMaxEpName = 256;
constexpr uint64_t kCommBits = 15, kTagBits = 24, kSeqBits = 24;
constexpr uint32_t kMaxCommId = (1u << kCommBits) - 1;

// ---- libfabric, loaded at run time ----------------------------------------------------------------------------
struct Fi {
  void* lib = nullptr;
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*, struct fi_info**) = nullptr;
  void (*freeinfo)(struct fi_info*) = nullptr;
  struct fi_info* (*dupinfo)(const struct fi_info*) = nullptr;
  int (*fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*) = nullptr;
  const char* (*strerror)(int) = nullptr;
};
Fi gFi;

bool loadFabric(std::string* why) {
  const char* names[] = {"libfabric.so.1", "libfabric.so"};
  for (const char* n : names) {
    gFi.lib = dlopen(n, RTLD_NOW | RTLD_LOCAL);
    if (gFi.lib) break;
  }
  if (!gFi.lib) {
    *why = std::string("libfabric not found: ") + dlerror() + " (install libfabric1 / libfabric-dev)";
    return false;
  }
  gFi.getinfo = reinterpret_cast<decltype(gFi.getinfo)>(dlsym(gFi.lib, "fi_getinfo"));
  gFi.freeinfo = reinterpret_cast<decltype(gFi.freeinfo)>(dlsym(gFi.lib, "fi_freeinfo"));
  gFi.dupinfo = reinterpret_cast<decltype(gFi.dupinfo)>(dlsym(gFi.lib, "fi_dupinfo"));
  gFi.fabric = reinterpret_cast<decltype(gFi.fabric)>(dlsym(gFi.lib, "fi_fabric"));
  gFi.strerror = reinterpret_cast<decltype(gFi.strerror)>(dlsym(gFi.lib, "fi_strerror"));
  if (!gFi.getinfo || !gFi.freeinfo || !gFi.dupinfo || !gFi.fabric || !gFi.strerror) {
    *why = "libfabric lacks fi_getinfo/fi_freeinfo/fi_dupinfo/fi_fabric/fi_strerror";
    return false;
  }
  return true;
}

const char* fiErr(int rc) { return gFi.strerror(rc < 0 ? -rc : rc); }

// ---- objects ----------------------------------------------------------------------------------------------------
struct OfiComm;
struct OfiRequest;

struct SubOp {
  fi_context2 ctx;  // must be first: libfabric hands &ctx back as op_context
  OfiRequest* req;
  int idx;
};

struct OfiRequest {
  OfiComm* comm = nullptr;  // null once the comm is closed: the completion then just frees it
  bool isSend = false;
  int n = 0;
  int completed = 0;
  int outstanding = 0;  // sub-ops posted and not yet completed
  int error = 0;        // first failing libfabric error
  SubOp ops[kNetMaxRecvs];
  size_t got[kNetMaxRecvs];
};

struct OfiDev {
  std::mutex mu;  // every libfabric call on this device
  bool ready = false;
  std::string initError;
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  char epName[kMaxEpName];
  size_t epNameLen = 0;
  uint64_t mrMode = 0;
  uint64_t nextKey = 1;
  uint32_t nextCommId = 1;
  std::vector<bool> commIdUsed = std::vector<bool>(kMaxCommId + 1, false);
  OfiRequest* sinkWaiting = nullptr;  // closeRecv's stray sink being waited for; complete() clears it
  bool warnedCq = false;  // pollCq has said once that the CQ reported what no request can be told
};

struct OfiComm {
  bool isSend = false;
  int dev = 0;
  OfiDev* d = nullptr;
  int fd = -1;  // TCP side channel: liveness
  std::string peer;
  uint32_t recvCommId = 0;      // the id in the tags (allocated by the receiver)
  fi_addr_t peerAddr = FI_ADDR_UNSPEC;
  std::map<int, uint32_t> seq;  // per NCCL tag
  int inflight = 0;
  int errCode = 0;
  std::string errMsg;
  int64_t nextLivenessNs = 0;
  int64_t peerGoneNs = 0;
  int64_t lastHeardNs = 0;  // last heartbeat byte read from the side channel, or last completion
  std::vector<OfiRequest*> live;  // posted, not yet returned done by test()

  epResult_t fail(epResult_t code, const std::string& msg) {
    if (errCode == 0) {
      errCode = code;
      errMsg = msg;
      NET_WARN("%s", msg.c_str());
    }
    return netQuietError(static_cast<epResult_t>(errCode), errMsg.c_str());
  }
  epResult_t error() {
    return errCode ? netQuietError(static_cast<epResult_t>(errCode), errMsg.c_str()) : epSuccess;
  }
};

struct OfiMr {
  OfiDev* d = nullptr;  // the domain it is registered in: deregMr needs no open comm (it may follow close)
  fid_mr* mr = nullptr;
  void* desc = nullptr;
};

struct OfiHandle {
  uint32_t magic;
  uint32_t version;
  uint64_t secret;  // same offset as the socket backend's handle
  NetAddr addr;     // TCP side channel
  uint32_t pad;
  void* stage;
};
static_assert(sizeof(OfiHandle) <= kNetHandleSize);

struct OfiHello {  // connector -> listener
  uint32_t magic, version;
  uint64_t secret;
  uint32_t epNameLen, pad;
  char epName[kMaxEpName];
};
struct OfiReply {  // listener -> connector
  uint32_t magic, recvCommId;
  uint32_t epNameLen, pad;
  char epName[kMaxEpName];
};

struct OfiListen {
  int dev = 0;
  int fd = -1;
  uint64_t secret = 0;
  NetAddr addr{};
  struct Pending {
    int fd;
    NetAddr from;
    int64_t startNs;
    OfiHello hello;
    size_t got;
    OfiReply reply;
    size_t sent;
    OfiComm* comm;  // allocated once the hello checked out
  };
  std::vector<Pending> pend;
};

struct OfiConnectStage {
  TcpConnector tc;
  OfiHello hello{};
  size_t sent = 0;
  OfiReply reply{};
  size_t got = 0;
  NetAddr peer{};
};

EP_PARAM(OfiMaxDevs, "OFI_MAX_DEVS", kNetMaxDevs);
EP_PARAM(OfiCloseMs, "OFI_CLOSE_MS", 1000);  // longest wait for cancelled operations at close

uint64_t makeTag(uint32_t comm, int tag, uint32_t seq) {
  return (static_cast<uint64_t>(comm) << (kTagBits + kSeqBits)) |
         (static_cast<uint64_t>(static_cast<uint32_t>(tag) & ((1u << kTagBits) - 1)) << kSeqBits) |
         (seq & ((1u << kSeqBits) - 1));
}

class OfiBackend final : public NetBackend {
 public:
  bool init(std::string* why) {
    if (!loadFabric(why)) return false;
    fi_info* hints = gFi.dupinfo(nullptr);
    hints->caps = FI_TAGGED | FI_SEND | FI_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->control_progress = FI_PROGRESS_UNSPEC;
    hints->domain_attr->data_progress = FI_PROGRESS_UNSPEC;
    const char* prov = paramString("EPCOMM_OFI_PROVIDER");
    if (prov) hints->fabric_attr->prov_name = strdup(prov);
    fi_info* list = nullptr;
    int rc = gFi.getinfo(FI_VERSION(1, 10), nullptr, nullptr, 0, hints, &list);
    gFi.freeinfo(hints);
    if (rc != 0 || list == nullptr) {
      *why = std::string("fi_getinfo(FI_EP_RDM, FI_TAGGED") + (prov ? std::string(", provider '") + prov + "'" : "") +
             "): " + fiErr(rc);
      return false;
    }
    // Without EPCOMM_OFI_PROVIDER, prefer real fabrics, then tcp;ofi_rxm; shm only serves one host.
    std::string chosen;
    if (prov) {
      chosen = list->fabric_attr->prov_name;
    } else {
      const char* pref[] = {"efa", "cxi", "verbs;ofi_rxm", "psm3", "opx", "tcp;ofi_rxm", "shm"};
      for (const char* p : pref) {
        for (fi_info* i = list; i && chosen.empty(); i = i->next)
          if (strcasecmp(i->fabric_attr->prov_name, p) == 0) chosen = p;
        if (!chosen.empty()) break;
      }
      if (chosen.empty()) chosen = list->fabric_attr->prov_name;
    }
    // One device per distinct domain of that provider; for socket-like domains, honour the interface filter.
    const char* ifspec = paramString("EPCOMM_SOCKET_IFNAME");
    if (!ifspec) ifspec = paramString("NCCL_SOCKET_IFNAME");
    std::vector<fi_info*> cands;
    for (fi_info* i = list; i; i = i->next) {
      if (strcasecmp(i->fabric_attr->prov_name, chosen.c_str()) != 0) continue;
      bool dup = false;
      for (fi_info* c : cands) dup |= strcmp(c->domain_attr->name, i->domain_attr->name) == 0;
      if (!dup) cands.push_back(i);
    }
    std::vector<fi_info*> filtered;
    if (ifspec)
      for (fi_info* c : cands)
        if (ifnameMatches(ifspec, c->domain_attr->name)) filtered.push_back(c);
    if (!filtered.empty()) cands = filtered;
    int maxDevs = static_cast<int>(std::clamp<int64_t>(epParamOfiMaxDevs(), 1, kNetMaxDevs));
    for (fi_info* c : cands) {
      if (static_cast<int>(devs_.size()) >= maxDevs) break;
      auto d = std::make_unique<OfiDev>();
      d->info = gFi.dupinfo(c);
      devs_.push_back(std::move(d));
    }
    gFi.freeinfo(list);
    if (devs_.empty()) {
      *why = "no libfabric domain for provider " + chosen;
      return false;
    }
    provider_ = chosen;
    if (netInterfaces().empty()) {
      *why = "no IP interface for the connection side channel (check EPCOMM_SOCKET_IFNAME)";
      return false;
    }
    NET_INFO("NET/epcomm: libfabric provider %s, %zu domain(s), first %s", provider_.c_str(), devs_.size(),
             devs_[0]->info->domain_attr->name);
    return true;
  }

  const char* name() const override { return "ofi"; }
  bool matchesByTag() const override { return true; }  // (makeTag: the tag and its own sequence)
  int devices() const override { return static_cast<int>(devs_.size()); }

  epResult_t getProperties(int dev, NetProperties* p) override {
    if (dev < 0 || dev >= devices()) NET_FAIL(epInvalidArgument, "NET/epcomm: device %d out of range", dev);
    fi_info* i = devs_[dev]->info;
    *p = NetProperties{};
    p->name = provider_ + ":" + i->domain_attr->name;
    p->guid = 0x0f10000ull + dev;
    p->ptrSupport = kNetPtrHost;
    // Link speed: the NIC's when libfabric knows it, else the interface's (tcp), else NCCL's default.
    p->speedMbps = 10000;
    if (i->nic && i->nic->link_attr && i->nic->link_attr->speed > 0)
      p->speedMbps = static_cast<int>(std::min<uint64_t>(i->nic->link_attr->speed / 1000000, 1u << 30));
    for (const auto& ni : netInterfaces())
      if (ni.name == i->domain_attr->name) {
        p->speedMbps = ni.speedMbps;
        p->pciPath = ni.pciPath;
      }
    if (i->nic && i->nic->bus_attr && i->nic->bus_attr->bus_type == FI_BUS_PCI) {
      const auto& pci = i->nic->bus_attr->attr.pci;
      char buf[128];
      snprintf(buf, sizeof(buf), "/sys/bus/pci/devices/%04x:%02x:%02x.%x", pci.domain_id, pci.bus_id, pci.device_id,
               pci.function_id);
      char real[4096];
      if (realpath(buf, real)) p->pciPath = real;
    }
    p->maxComms = kMaxCommId;
    p->maxRecvs = kNetMaxRecvs;
    return epSuccess;
  }

  epResult_t listen(int dev, void* handle, void** listenComm) override {
    *listenComm = nullptr;
    NETCHECK(openDev(dev));
    auto* l = new OfiListen();
    l->dev = dev;
    l->secret = randomU64();
    epResult_t r = tcpListen(netInterfaces()[0], &l->fd, &l->addr);
    if (r != epSuccess) {
      delete l;
      return r;
    }
    memset(handle, 0, kNetHandleSize);
    auto* h = static_cast<OfiHandle*>(handle);
    h->magic = kHandleMagic;
    h->version = kVersion;
    h->secret = l->secret;
    h->addr = l->addr;
    *listenComm = l;
    return epSuccess;
  }

  // The TCP side channel; a provider that connects per peer (tcp, rxm over it) may hold one more.
  int descriptorsPerConnection(int max_streams) const override {
    (void)max_streams;
    return 2;
  }

  epResult_t connect(int dev, void* handle, void** sendComm) override {
    *sendComm = nullptr;
    auto* h = static_cast<OfiHandle*>(handle);
    if (h->magic != kHandleMagic || h->version != kVersion)
      NET_FAIL(epInvalidArgument, "NET/epcomm: connect() got a handle that is not an epcomm ofi handle");
    NETCHECK(openDev(dev));
    OfiDev* d = devs_[dev].get();
    auto* st = static_cast<OfiConnectStage*>(h->stage);
    if (!st) {
      st = new OfiConnectStage();
      st->peer = h->addr;
      st->hello.magic = kHelloMagic;
      st->hello.version = kVersion;
      st->hello.secret = h->secret;
      st->hello.epNameLen = static_cast<uint32_t>(d->epNameLen);
      memcpy(st->hello.epName, d->epName, d->epNameLen);
      h->stage = st;
    }
    auto abandon = [&]() {
      st->tc.close();
      delete st;
      h->stage = nullptr;
    };
    epResult_t r = st->tc.progress(st->peer);
    if (r != epSuccess) {
      abandon();
      return r;
    }
    if (!st->tc.connected) return epSuccess;
    std::string err;
    if (st->sent < sizeof(OfiHello)) {
      ssize_t k = sendSome(st->tc.fd, reinterpret_cast<char*>(&st->hello) + st->sent, sizeof(OfiHello) - st->sent, &err);
      if (k < 0) {
        std::string peer = addrToString(st->peer);
        abandon();
        NET_FAIL(epRemoteError, "NET/epcomm: connect to peer %s: %s", peer.c_str(), err.c_str());
      }
      st->sent += k;
      if (st->sent < sizeof(OfiHello)) return epSuccess;
    }
    ssize_t k = recvSome(st->tc.fd, reinterpret_cast<char*>(&st->reply) + st->got, sizeof(OfiReply) - st->got, &err);
    if (k < 0) {
      std::string peer = addrToString(st->peer);
      abandon();
      NET_FAIL(epRemoteError, "NET/epcomm: connect to peer %s: %s (wrong secret?)", peer.c_str(), err.c_str());
    }
    st->got += k;
    if (st->got < sizeof(OfiReply)) return epSuccess;
    if (st->reply.magic != kHelloMagic || st->reply.epNameLen == 0 || st->reply.epNameLen > kMaxEpName ||
        st->reply.recvCommId == 0 || st->reply.recvCommId > kMaxCommId) {
      std::string peer = addrToString(st->peer);
      abandon();
      NET_FAIL(epRemoteError, "NET/epcomm: peer %s sent a malformed connection reply", peer.c_str());
    }
    auto* c = new OfiComm();
    c->isSend = true;
    c->dev = dev;
    c->d = d;
    c->fd = st->tc.fd;
    c->peer = addrToString(st->peer);
    c->recvCommId = st->reply.recvCommId;
    {
      std::lock_guard<std::mutex> g(d->mu);
      int n = fi_av_insert(d->av, st->reply.epName, 1, &c->peerAddr, 0, nullptr);
      if (n != 1) {
        std::string peer = c->peer;
        close(c->fd);
        delete c;
        delete st;
        h->stage = nullptr;
        NET_FAIL(epSystemError, "NET/epcomm: fi_av_insert of peer %s: %s", peer.c_str(), fiErr(n));
      }
    }
    delete st;
    h->stage = nullptr;
    startHeartbeat(c);
    *sendComm = c;
    NET_INFO("NET/epcomm: ofi send comm to %s (recv comm id %u)", c->peer.c_str(), c->recvCommId);
    return epSuccess;
  }

  epResult_t accept(void* listenComm, void** recvComm) override {
    *recvComm = nullptr;
    auto* l = static_cast<OfiListen*>(listenComm);
    if (!l) NET_FAIL(epInvalidUsage, "NET/epcomm: accept() on a null listen comm");
    OfiDev* d = devs_[l->dev].get();
    int64_t now = nowNs();
    for (;;) {
      NetAddr from{};
      socklen_t fl = sizeof(from);
      int fd = accept4(l->fd, &from.sa, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        NET_FAIL(epSystemError, "NET/epcomm: accept: %s", strerror(errno));
      }
      if (l->pend.size() >= 4096) {
        close(fd);
        continue;
      }
      tuneSocket(fd);
      OfiListen::Pending p{};
      p.fd = fd;
      p.from = from;
      p.startNs = now;
      l->pend.push_back(p);
    }
    for (size_t i = 0; i < l->pend.size();) {
      auto& p = l->pend[i];
      std::string err;
      const char* drop = nullptr;
      if (p.got < sizeof(OfiHello)) {
        ssize_t k = recvSome(p.fd, reinterpret_cast<char*>(&p.hello) + p.got, sizeof(OfiHello) - p.got, &err);
        if (k < 0) drop = "closed before its hello";
        else p.got += k;
        if (!drop && p.got == sizeof(OfiHello)) {
          const OfiHello& hh = p.hello;
          volatile uint64_t diff = hh.secret ^ l->secret;
          if (hh.magic != kHelloMagic || hh.version != kVersion) drop = "is not an epcomm ofi peer of this version";
          else if (diff != 0) drop = "presented a wrong secret";
          else if (hh.epNameLen == 0 || hh.epNameLen > kMaxEpName) drop = "sent a bad endpoint name";
          else {
            uint32_t id = allocCommId(d);
            if (id == 0) drop = "found no free comm id";
            else {
              auto* c = new OfiComm();
              c->isSend = false;
              c->dev = l->dev;
              c->d = d;
              c->fd = p.fd;
              c->peer = addrToString(p.from);
              c->recvCommId = id;
              p.comm = c;
              p.reply.magic = kHelloMagic;
              p.reply.recvCommId = id;
              p.reply.epNameLen = static_cast<uint32_t>(d->epNameLen);
              memcpy(p.reply.epName, d->epName, d->epNameLen);
            }
          }
        }
      }
      if (!drop && p.comm) {
        ssize_t k = sendSome(p.fd, reinterpret_cast<char*>(&p.reply) + p.sent, sizeof(OfiReply) - p.sent, &err);
        if (k < 0) drop = "closed during the handshake";
        else p.sent += k;
        if (!drop && p.sent == sizeof(OfiReply)) {
          startHeartbeat(p.comm);
          *recvComm = p.comm;
          NET_INFO("NET/epcomm: ofi recv comm %u from %s", p.comm->recvCommId, p.comm->peer.c_str());
          l->pend.erase(l->pend.begin() + i);
          return epSuccess;
        }
      }
      if (!drop && now - p.startNs > netTimeoutMs() * 1000000LL) drop = "did not finish the handshake in time";
      if (drop) {
        NET_WARN("NET/epcomm: dropping connection from %s: it %s", addrToString(p.from).c_str(), drop);
        if (p.comm) {
          freeCommId(d, p.comm->recvCommId);
          delete p.comm;
        }
        close(p.fd);
        l->pend.erase(l->pend.begin() + i);
        continue;
      }
      ++i;
    }
    return epSuccess;
  }

  epResult_t regMr(void* comm, void* data, size_t size, int type, void** mhandle) override {
    *mhandle = nullptr;
    if (type != kNetPtrHost) NET_FAIL(epNotSupported, "NET/epcomm: the ofi backend registers host memory only");
    auto* c = static_cast<OfiComm*>(comm);
    OfiDev* d = c->d;
    auto* m = new OfiMr();
    m->d = d;
    // Providers that do not ask for local registration (tcp;ofi_rxm, shm) need no MR on the data path.
    if (d->mrMode & FI_MR_LOCAL) {
      std::lock_guard<std::mutex> g(d->mu);
      uint64_t key = (d->mrMode & FI_MR_PROV_KEY) ? 0 : d->nextKey++;
      int rc = fi_mr_reg(d->domain, data, size, FI_SEND | FI_RECV, 0, key, 0, &m->mr, nullptr);
      if (rc == 0 && (d->mrMode & FI_MR_ENDPOINT)) {
        rc = fi_mr_bind(m->mr, &d->ep->fid, 0);
        if (rc == 0) rc = fi_mr_enable(m->mr);
      }
      if (rc != 0) {
        if (m->mr) fi_close(&m->mr->fid);
        delete m;
        NET_FAIL(epSystemError, "NET/epcomm: fi_mr_reg(%p, %zu): %s", data, size, fiErr(rc));
      }
      m->desc = fi_mr_desc(m->mr);
    }
    *mhandle = m;
    return epSuccess;
  }

  // The comm is not used: it may already be closed (close cancels and drains its operations, so a caller that
  // closes first and deregisters afterwards never releases a region an operation still references).
  epResult_t deregMr(void* comm, void* mhandle) override {
    (void)comm;
    auto* m = static_cast<OfiMr*>(mhandle);
    if (!m) return epSuccess;
    if (m->mr) {
      std::lock_guard<std::mutex> g(m->d->mu);
      fi_close(&m->mr->fid);
    }
    delete m;
    return epSuccess;
  }

  epResult_t isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request) override {
    *request = nullptr;
    auto* c = static_cast<OfiComm*>(sendComm);
    NETCHECK(checkComm(c));
    if (tag < 0 || tag >= (1 << kTagBits)) NET_FAIL(epInvalidArgument, "NET/epcomm: tag %d outside [0, 2^24)", tag);
    if (c->inflight >= kNetRequestPool) return epSuccess;
    OfiDev* d = c->d;
    auto* r = new OfiRequest();
    r->comm = c;
    r->isSend = true;
    r->n = 1;
    r->ops[0].req = r;
    r->ops[0].idx = 0;
    r->got[0] = size;
    void* desc = mhandle ? static_cast<OfiMr*>(mhandle)->desc : nullptr;
    uint32_t& s = c->seq[tag];
    std::lock_guard<std::mutex> g(d->mu);
    ssize_t rc = fi_tsend(d->ep, data, size, desc, c->peerAddr, makeTag(c->recvCommId, tag, s), &r->ops[0].ctx);
    if (rc == -FI_EAGAIN) {
      pollCq(d);  // make room; NCCL retries — unless the peer is gone, which would make that forever
      delete r;
      return liveness(c);
    }
    if (rc != 0) {
      delete r;
      return c->fail(epSystemError, std::string("NET/epcomm: fi_tsend to peer ") + c->peer + ": " + fiErr(static_cast<int>(rc)));
    }
    ++s;
    r->outstanding = 1;
    c->inflight++;
    c->live.push_back(r);
    *request = r;
    return epSuccess;
  }

  epResult_t irecv(void* recvComm, int n, void** data, const size_t* sizes, const int* tags, void** mhandles,
                   void** request) override {
    *request = nullptr;
    auto* c = static_cast<OfiComm*>(recvComm);
    NETCHECK(checkComm(c));
    if (n < 1 || n > kNetMaxRecvs) NET_FAIL(epInvalidArgument, "NET/epcomm: irecv of %d buffers (1..%d)", n, kNetMaxRecvs);
    for (int i = 0; i < n; ++i)
      if (tags[i] < 0 || tags[i] >= (1 << kTagBits)) NET_FAIL(epInvalidArgument, "NET/epcomm: tag %d outside [0, 2^24)", tags[i]);
    if (c->inflight >= kNetRequestPool) return epSuccess;
    OfiDev* d = c->d;
    auto* r = new OfiRequest();
    r->comm = c;
    r->n = n;
    std::lock_guard<std::mutex> g(d->mu);
    // All n receives or none: a partial group would desynchronise the per-tag sequences.
    std::map<int, uint32_t> seq = c->seq;
    for (int i = 0; i < n; ++i) {
      r->ops[i].req = r;
      r->ops[i].idx = i;
      r->got[i] = 0;
      void* desc = (mhandles && mhandles[i]) ? static_cast<OfiMr*>(mhandles[i])->desc : nullptr;
      uint32_t& s = seq[tags[i]];
      ssize_t rc = fi_trecv(d->ep, data[i], sizes[i], desc, FI_ADDR_UNSPEC, makeTag(c->recvCommId, tags[i], s), 0,
                            &r->ops[i].ctx);
      if (rc != 0) {
        if (i > 0) {
          // Cannot un-post cleanly: cancel what was posted; the request is orphaned and freed on completion.
          for (int j = 0; j < i; ++j) fi_cancel(&d->ep->fid, &r->ops[j].ctx);
          r->comm = nullptr;
          r->outstanding = i;
        } else {
          delete r;
        }
        if (rc == -FI_EAGAIN && i == 0) {
          pollCq(d);
          return liveness(c);
        }
        return c->fail(epSystemError, std::string("NET/epcomm: fi_trecv from peer ") + c->peer + ": " + fiErr(static_cast<int>(rc)));
      }
      ++s;
    }
    c->seq = std::move(seq);
    r->outstanding = n;
    c->inflight++;
    c->live.push_back(r);
    *request = r;
    return epSuccess;
  }

  epResult_t test(void* request, int* done, size_t* sizes) override {
    *done = 0;
    auto* r = static_cast<OfiRequest*>(request);
    if (!r || !r->comm) NET_FAIL(epInvalidUsage, "NET/epcomm: test() of a request not in flight");
    OfiComm* c = r->comm;
    OfiDev* d = c->d;
    {
      std::lock_guard<std::mutex> g(d->mu);
      pollCq(d);
    }
    if (r->error) {
      int e = r->error;
      std::string msg = std::string("NET/epcomm: ") + (c->isSend ? "send to" : "receive from") + " peer " + c->peer +
                        ": " + (e == FI_ETRUNC ? "message larger than the receive buffer" : fiErr(e));
      return c->fail(epRemoteError, msg);
    }
    if (r->outstanding == 0) {
      *done = 1;
      if (sizes)
        for (int i = 0; i < r->n; ++i) sizes[i] = r->got[i];
      c->inflight--;
      c->live.erase(std::find(c->live.begin(), c->live.end(), r));
      delete r;
      return epSuccess;
    }
    NETCHECK(c->error());
    return liveness(c);
    return epSuccess;
  }

  epResult_t closeSend(void* comm) override { return closeComm(static_cast<OfiComm*>(comm)); }
  epResult_t closeRecv(void* comm) override { return closeComm(static_cast<OfiComm*>(comm)); }

  epResult_t closeListen(void* listenComm) override {
    auto* l = static_cast<OfiListen*>(listenComm);
    if (!l) return epSuccess;
    OfiDev* d = devs_[l->dev].get();
    for (auto& p : l->pend) {
      if (p.comm) {
        freeCommId(d, p.comm->recvCommId);
        delete p.comm;
      }
      close(p.fd);
    }
    if (l->fd >= 0) close(l->fd);
    delete l;
    return epSuccess;
  }

 private:
  std::vector<std::unique_ptr<OfiDev>> devs_;
  std::string provider_;

  // Called whenever a request waits. A peer whose side channel closed cannot complete anything any more
  // (completions already queued get a moment to land first: the peer may have closed right after its last
  // send completed). A peer that is silent — no heartbeat, no completion — for EPCOMM_TIMEOUT_MS is stopped,
  // frozen or cut off: the waiting request fails with a timeout instead of hanging.
  epResult_t liveness(OfiComm* c) {
    int64_t now = nowNs();
    if (now < c->nextLivenessNs) return epSuccess;
    c->nextLivenessNs = now + 1000000;  // at most once per ms
    if (c->peerGoneNs == 0) {
      char b[64];
      for (;;) {
        ssize_t k = recv(c->fd, b, sizeof(b), MSG_DONTWAIT);
        if (k > 0) {
          c->lastHeardNs = now;
          continue;
        }
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c->peerGoneNs = now;
        if (k < 0 && errno == EINTR) continue;
        break;
      }
    }
    if (c->peerGoneNs && now - c->peerGoneNs > 200 * 1000000LL)
      return c->fail(epRemoteError, std::string("NET/epcomm: ") + (c->isSend ? "send" : "recv") +
                                        " connection with peer " + c->peer +
                                        ": peer closed or died with transfers outstanding");
    // Time this process spent stopped does not count (a suspended job: the peer could not beat either); right
    // after a resume the heartbeat thread may not have had its turn yet, and until it has there is no verdict.
    int64_t silentMs = hbTurns_.quietNs(now, c->lastHeardNs) / 1000000LL;  // -1 ms: cannot judge yet
    if (c->peerGoneNs == 0 && silentMs > netTimeoutMs())
      return c->fail(epTimeout, std::string("NET/epcomm: ") + (c->isSend ? "send" : "recv") +
                                    " connection with peer " + c->peer + ": no sign of life from the peer for " +
                                    std::to_string(silentMs) + " ms with transfers outstanding (stopped or hung?)");
    return epSuccess;
  }

  // ---- heartbeats: one thread per process while any comm is open -------------------------------------------------
  struct Heartbeat {
    std::thread th;
    bool stop = false;  // under hbMu_
  };
  std::mutex hbMu_;
  std::condition_variable hbCv_;
  std::vector<OfiComm*> hbComms_;
  std::unique_ptr<Heartbeat> hb_;
  NetTurnClock hbTurns_;  // the heartbeat thread's turns

  void heartbeatLoop(Heartbeat* h) {
    nameThisThread("epcomm-ofi-hb");
    std::unique_lock<std::mutex> lk(hbMu_);
    while (!h->stop) {
      hbTurns_.turn(nowNs());
      for (OfiComm* c : hbComms_) {
        char b = 'h';
        ssize_t k = send(c->fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);  // a full buffer just skips a beat
        (void)k;
      }
      hbCv_.wait_for(lk, std::chrono::milliseconds(netHeartbeatMs()));
    }
  }
  void startHeartbeat(OfiComm* c) {
    c->lastHeardNs = nowNs();
    std::lock_guard<std::mutex> g(hbMu_);
    hbComms_.push_back(c);
    if (!hb_) {
      hbTurns_.start(nowNs());
      hb_ = std::make_unique<Heartbeat>();
      hb_->th = std::thread(&OfiBackend::heartbeatLoop, this, hb_.get());
    }
  }
  // The thread stops with the last comm, so that no thread of ours outlives the comms NCCL closes before it
  // unloads the plugin.
  void stopHeartbeat(OfiComm* c) {
    std::unique_ptr<Heartbeat> h;
    {
      std::lock_guard<std::mutex> g(hbMu_);
      auto it = std::find(hbComms_.begin(), hbComms_.end(), c);
      if (it == hbComms_.end()) return;
      hbComms_.erase(it);
      if (!hbComms_.empty() || !hb_) return;
      h = std::move(hb_);
      h->stop = true;
    }
    hbCv_.notify_all();
    h->th.join();
  }

  epResult_t checkComm(OfiComm* c) {
    if (!c) NET_FAIL(epInvalidUsage, "NET/epcomm: null comm");
    return c->error();
  }

  uint32_t allocCommId(OfiDev* d) {
    std::lock_guard<std::mutex> g(d->mu);
    // Round-robin so that an id is reused as late as possible (stale messages for an old comm stay unmatched).
    for (uint32_t k = 0; k < kMaxCommId; ++k) {
      uint32_t id = d->nextCommId;
      d->nextCommId = d->nextCommId % kMaxCommId + 1;
      if (!d->commIdUsed[id]) {
        d->commIdUsed[id] = true;
        return id;
      }
    }
    return 0;
  }
  void freeCommId(OfiDev* d, uint32_t id) {
    std::lock_guard<std::mutex> g(d->mu);
    if (id > 0 && id <= kMaxCommId) d->commIdUsed[id] = false;
  }

  // Caller holds d->mu.
  void pollCq(OfiDev* d) {
    fi_cq_tagged_entry ent[32];
    for (;;) {
      ssize_t n = fi_cq_read(d->cq, ent, 32);
      if (n > 0) {
        for (ssize_t i = 0; i < n; ++i) complete(d, static_cast<SubOp*>(ent[i].op_context), ent[i].len, 0);
        continue;
      }
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        const ssize_t got = fi_cq_readerr(d->cq, &err, 0);
        if (got <= 0) {  // (the entry fi_cq_read announced is not there: stop, rather than spin holding d->mu)
          cqWarnOnce(d, "fi_cq_readerr found no error entry after fi_cq_read's -FI_EAVAIL", got);
          break;
        }
        if (err.op_context == nullptr) {  // an error of no request (e.g. of a connection): none will see it
          char buf[160];
          cqWarnOnce(d, fi_cq_strerror(d->cq, err.prov_errno, err.err_data, buf, sizeof(buf)), -err.err);
        }
        complete(d, static_cast<SubOp*>(err.op_context), 0, err.err ? err.err : FI_EOTHER);
        continue;
      }
      if (n != -FI_EAGAIN) cqWarnOnce(d, "fi_cq_read failed", n);
      break;  // -FI_EAGAIN or a CQ failure (reported through the requests that never complete + liveness)
    }
  }
  // The first CQ event no request can be told of (later ones stay quiet): a request it stalls then has a cause in
  // the log.
  static void cqWarnOnce(OfiDev* d, const char* what, ssize_t rc) {
    if (d->warnedCq) return;
    d->warnedCq = true;
    NET_WARN("NET/epcomm: ofi completion queue: %s (%zd: %s)", what, rc, fiErr(static_cast<int>(rc)));
  }

  void complete(OfiDev* d, SubOp* op, size_t len, int err) {
    if (!op) return;
    OfiRequest* r = op->req;
    if (!r->isSend) r->got[op->idx] = len;
    if (r->comm && !err) r->comm->lastHeardNs = nowNs();
    // A cancellation is expected only for operations of a closed comm; on a live request (the provider gave
    // up on it, e.g. the peer closed) it is an error, never a short success.
    if (err && r->error == 0 && (err != FI_ECANCELED || r->comm != nullptr)) r->error = err;
    r->outstanding--;
    if (r == d->sinkWaiting && r->outstanding == 0) d->sinkWaiting = nullptr;
    if (r->comm == nullptr && r->outstanding == 0) delete r;  // its comm was closed: nobody tests it any more
  }

  epResult_t closeComm(OfiComm* c) {
    if (!c) return epSuccess;
    OfiDev* d = c->d;
    stopHeartbeat(c);
    // Cancel and drain: NCCL may free or reuse the buffers right after close, so every operation of this comm
    // is cancelled (receives and sends) and the CQ is read until each one has completed — done or cancelled —
    // or EPCOMM_OFI_CLOSE_MS has passed. The lock is dropped between rounds so other comms keep going.
    int64_t t0 = nowNs();
    int64_t deadline = t0 + std::min<int64_t>(std::max<int64_t>(epParamOfiCloseMs(), 0), netTimeoutMs()) * 1000000LL;
    size_t left = 0;
    {
      std::lock_guard<std::mutex> g(d->mu);
      pollCq(d);
      for (OfiRequest* r : c->live)
        if (r->outstanding > 0)
          for (int i = 0; i < r->n; ++i) fi_cancel(&d->ep->fid, &r->ops[i].ctx);  // -FI_ENOENT when done
    }
    for (;;) {
      {
        std::lock_guard<std::mutex> g(d->mu);
        pollCq(d);
        left = 0;
        for (OfiRequest* r : c->live) left += r->outstanding;
      }
      if (left == 0 || nowNs() > deadline) break;
      // A dead peer finishes nothing more; what is already queued lands within a few polls.
      if (c->peerGoneNs == 0) {
        char b[64];
        ssize_t k = recv(c->fd, b, sizeof(b), MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c->peerGoneNs = nowNs();
      }
      if (c->peerGoneNs && nowNs() - c->peerGoneNs > 50 * 1000000LL) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    {
      std::lock_guard<std::mutex> g(d->mu);
      for (OfiRequest* r : c->live) {
        if (r->outstanding == 0) {
          delete r;
        } else {
          r->comm = nullptr;  // orphaned: complete() frees it if the provider ever reports it
        }
      }
      c->live.clear();
    }
    // Sinks only where strays block later traffic (shm). Under tcp;ofi_rxm a zero-byte sink that matches a
    // rendezvous-size stray crashes inside the provider (seen in the close-in-flight test, about 1 run in 5), and
    // a stray there blocks nothing.
    if (!c->isSend && strcmp(d->info->fabric_attr->prov_name, "shm") == 0) sinkStrays(c);
    if (left > 0)
      NET_WARN("NET/epcomm: closing %s comm with peer %s: %zu operation(s) neither completed nor cancelled within "
               "%lld ms; the provider may still use their buffers",
               c->isSend ? "send" : "recv", c->peer.c_str(), left, static_cast<long long>((nowNs() - t0) / 1000000LL));
    else
      NET_INFO("NET/epcomm: closed %s comm with peer %s (drained in %lld us)", c->isSend ? "send" : "recv",
               c->peer.c_str(), static_cast<long long>((nowNs() - t0) / 1000));
    if (!c->isSend) freeCommId(d, c->recvCommId);
    if (c->fd >= 0) close(c->fd);
    delete c;
    return epSuccess;
  }

  // A closing receiver consumes the messages already sent to it that no receive will match: sends the sender
  // could not cancel (shm cancels receives only) stay in flight otherwise, and shm keeps later traffic between
  // the same two endpoints waiting behind them. Each sink is a zero-byte receive matching any tag of this comm
  // (truncated: nothing is copied); sinks are posted while they keep matching, at most for a short while.
  void sinkStrays(OfiComm* c) {
    OfiDev* d = c->d;
    const uint64_t tag = makeTag(c->recvCommId, 0, 0), ignore = (1ull << (kTagBits + kSeqBits)) - 1;
    int64_t end = nowNs() + 200 * 1000000LL;
    int consumed = 0;
    for (int k = 0; k < 4096 && nowNs() < end; ++k) {
      auto* r = new OfiRequest();  // orphaned from the start: complete() frees it
      r->n = 1;
      r->ops[0].req = r;
      r->ops[0].idx = 0;
      r->outstanding = 1;
      bool matched = false;
      {
        std::lock_guard<std::mutex> g(d->mu);
        ssize_t rc = fi_trecv(d->ep, nullptr, 0, nullptr, FI_ADDR_UNSPEC, tag, ignore, &r->ops[0].ctx);
        if (rc != 0) {
          NET_INFO("NET/epcomm: recv comm %u: cannot post a sink at close: %s", c->recvCommId, fiErr(static_cast<int>(rc)));
          delete r;
          break;
        }
      }
      d->sinkWaiting = r;
      int64_t wait = nowNs() + 20 * 1000000LL;  // queued strays match at once; none coming means we are done
      while (nowNs() < wait) {
        std::lock_guard<std::mutex> g(d->mu);
        pollCq(d);
        if (d->sinkWaiting == nullptr) {
          matched = true;
          break;
        }
      }
      if (!matched) {
        std::lock_guard<std::mutex> g(d->mu);
        fi_cancel(&d->ep->fid, &r->ops[0].ctx);  // its cancellation completion frees it
        pollCq(d);
        d->sinkWaiting = nullptr;
        break;
      }
      ++consumed;
    }
    if (consumed) NET_INFO("NET/epcomm: recv comm %u: discarded %d unmatched message(s) at close", c->recvCommId, consumed);
  }

  // libfabric's shm provider names its /dev/shm region after the pid. A process that dies without unloading
  // libfabric (killed, _exit) leaves that file behind, and a later process that gets the same pid then cannot
  // create its endpoint. A random name per endpoint cannot collide with anything a dead process left.
  static void uniqueShmName(fi_info* info) {
    if (strcmp(info->fabric_attr->prov_name, "shm") != 0 || info->addr_format != FI_ADDR_STR) return;
    char name[96];
    snprintf(name, sizeof(name), "fi_shm://epcomm-%d-%016llx", static_cast<int>(getpid()),
             static_cast<unsigned long long>(randomU64()));
    free(info->src_addr);  // fi_freeinfo frees it with free()
    info->src_addr = strdup(name);
    info->src_addrlen = info->src_addr ? strlen(name) + 1 : 0;
  }

  epResult_t openDev(int dev) {
    if (dev < 0 || dev >= devices()) NET_FAIL(epInvalidArgument, "NET/epcomm: device %d out of range", dev);
    OfiDev* d = devs_[dev].get();
    std::lock_guard<std::mutex> g(d->mu);
    if (d->ready) return epSuccess;
    if (!d->initError.empty()) return netQuietError(epSystemError, d->initError.c_str());
    int rc;
    const char* step = "fi_fabric";
    fi_cq_attr cqa{};
    fi_av_attr ava{};
    rc = gFi.fabric(d->info->fabric_attr, &d->fabric, nullptr);
    if (rc) goto fail;
    step = "fi_domain";
    rc = fi_domain(d->fabric, d->info, &d->domain, nullptr);
    if (rc) goto fail;
    step = "fi_cq_open";
    cqa.format = FI_CQ_FORMAT_TAGGED;
    cqa.size = 4096;
    rc = fi_cq_open(d->domain, &cqa, &d->cq, nullptr);
    if (rc) goto fail;
    step = "fi_av_open";
    ava.type = d->info->domain_attr->av_type != FI_AV_UNSPEC ? d->info->domain_attr->av_type : FI_AV_TABLE;
    rc = fi_av_open(d->domain, &ava, &d->av, nullptr);
    if (rc) goto fail;
    step = "fi_endpoint";
    uniqueShmName(d->info);
    rc = fi_endpoint(d->domain, d->info, &d->ep, nullptr);
    if (rc) goto fail;
    step = "fi_ep_bind(cq)";
    rc = fi_ep_bind(d->ep, &d->cq->fid, FI_SEND | FI_RECV);
    if (rc) goto fail;
    step = "fi_ep_bind(av)";
    rc = fi_ep_bind(d->ep, &d->av->fid, 0);
    if (rc) goto fail;
    step = "fi_enable";
    rc = fi_enable(d->ep);
    if (rc) goto fail;
    step = "fi_getname";
    d->epNameLen = sizeof(d->epName);
    rc = fi_getname(&d->ep->fid, d->epName, &d->epNameLen);
    if (rc) goto fail;
    d->mrMode = d->info->domain_attr->mr_mode;
    d->ready = true;
    NET_INFO("NET/epcomm: opened %s domain %s (endpoint name %zu bytes, mr_mode %#llx)",
             d->info->fabric_attr->prov_name, d->info->domain_attr->name, d->epNameLen,
             static_cast<unsigned long long>(d->mrMode));
    return epSuccess;
  fail:
    d->initError = std::string("NET/epcomm: ") + step + " on " + d->info->fabric_attr->prov_name + "/" +
                   d->info->domain_attr->name + ": " + fiErr(rc);
    NET_WARN("%s", d->initError.c_str());
    return netQuietError(epSystemError, d->initError.c_str());
  }
};

}  // namespace

NetBackend* netOfiBackend(std::string* why) {
  static std::once_flag once;
  static OfiBackend* b = nullptr;
  static std::string whyNot;
  std::call_once(once, [] {
    auto* nb = new OfiBackend();
    if (nb->init(&whyNot)) b = nb;
    else delete nb;
  });
  if (!b && why) *why = whyNot;
  return b;
}

}  // namespace epcomm::net
