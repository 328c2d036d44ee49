// Host engine across hosts: rings and region-header words kept in step over the net transport (net_bridge.h).
#include "transport/bridge/net_bridge.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/log.h"
#include "common/time.h"
#include "transport/net/net.h"

namespace epcomm {

namespace {

constexpr uint32_t kFrameMagic = 0x65704e42u;  // "epNB"
constexpr uint16_t kHello = 1, kData = 2, kCredit = 3, kReadDone = 4, kCtrl = 5, kBye = 6, kByeAck = 7;
constexpr int kSendSlots = 16;  // frames in flight per peer
constexpr int kRecvSlots = 8;   // receives posted per peer

// Every message on a connection is one frame: this header, then `len` payload bytes (DATA only).
struct FrameHdr {
  uint32_t magic;
  uint16_t type;
  uint16_t ch;
  uint32_t len;
  int32_t src;
  uint64_t v[4];  // DATA: stream offset; CREDIT: consumer head; READDONE: epoch; CTRL: rs word, hash, epoch, status
};
static_assert(sizeof(FrameHdr) == 48, "frame header size is part of the wire format");
// Payload per frame: frames of 64 KiB go whole on the socket backend's control socket (its inline size).
constexpr size_t kFramePayload = (64u << 10) - sizeof(FrameHdr);
constexpr size_t kFrameBytes = sizeof(FrameHdr) + kFramePayload;

}  // namespace

struct NetBridge::Peer {
  int rank = -1;
  uint8_t handle[net::kNetHandleSize] = {};  // the peer's listen handle as exchanged (establish connects with a copy)
  void* send = nullptr;
  void* recv = nullptr;
  // Outboxes toward this peer, one per channel: the producer ends the engine pushes into.
  std::unique_ptr<RingCtl[]> out_ctl;
  std::vector<std::vector<uint8_t>> out_data;
  std::vector<uint64_t> sent;      // [ch] outbox bytes already framed
  std::vector<uint64_t> credited;  // [ch] inbox head last reported to the peer
  std::vector<uint64_t> rd_sent;   // [ch] inbox read_done last reported
  uint64_t ctrl_sent[4] = {~0ull, 0, 0, 0};
  // Frames to send, in order; the first `posted` are in flight in slots[slot_of[i]].
  struct Desc {
    uint16_t type, ch;
    uint64_t v[4];
    uint32_t len;
  };
  std::deque<Desc> q;
  std::deque<int> inflight_slots;  // slot of each posted frame, in posting order
  std::deque<void*> inflight_reqs;
  std::vector<std::vector<uint8_t>> send_buf;
  std::vector<void*> send_mh;
  std::vector<int> free_send;
  std::vector<std::vector<uint8_t>> recv_buf;
  std::vector<void*> recv_mh;
  std::vector<int> free_recv;
  std::deque<int> rx_slots;
  std::deque<void*> rx_reqs;
  bool send_failed = false, recv_failed = false, bye = false, bye_queued = false, bye_acked = false;
  std::atomic<bool> dead{false};
  // Held by the thread making this peer's net calls (everything above but `rank` and `handle` is its state).
  std::atomic<bool> busy{false};
  bool tryLock() { return !busy.load(std::memory_order_relaxed) && !busy.exchange(true, std::memory_order_acquire); }
  void lock() {
    for (int n = 0; !tryLock(); ++n)
      if (n > 64) std::this_thread::yield();
  }
  void unlock() { busy.store(false, std::memory_order_release); }
  mutable std::mutex why_m;
  std::string why;
};

NetBridge::NetBridge(int rank, int nranks, int nchannels, size_t ring_bytes, std::vector<uint8_t> remote,
                     ShmRegion* own)
    : rank_(rank), nranks_(nranks), nchan_(nchannels), ring_bytes_(ring_bytes), remote_(std::move(remote)),
      own_(own) {
  peers_.resize(nranks_);
  mirrors_.resize(nranks_);
  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->out_ctl.reset(new RingCtl[nchan_]);
    for (int c = 0; c < nchan_; ++c) {
      p->out_ctl[c].tail.store(0);
      p->out_ctl[c].head.store(0);
      p->out_ctl[c].read_done.store(0);
    }
    p->out_data.assign(nchan_, std::vector<uint8_t>(ring_bytes_));
    p->sent.assign(nchan_, 0);
    p->credited.assign(nchan_, 0);
    p->rd_sent.assign(nchan_, 0);
    peers_[r] = std::move(p);
    auto m = std::make_unique<RegionHeader>();
    m->rank = r;
    m->nranks = nranks_;
    m->rs_word.store(0);
    m->rs_hash.store(0);
    m->rs_epoch.store(0);
    m->rs_status.store(0);
    mirrors_[r] = std::move(m);
  }
}

NetBridge::~NetBridge() { shutdown(false, nullptr, 0); }

const char* NetBridge::backendName() const { return backend_ ? backend_->name() : "none"; }

RingEnd NetBridge::outEnd(int ch, int p) const {
  Peer& q = *peers_[p];
  return RingEnd(&q.out_ctl[ch], q.out_data[ch].data(), ring_bytes_);
}

bool NetBridge::dead(int p, std::string* why) const {
  const Peer* q = peers_[p].get();
  if (q == nullptr || !q->dead.load(std::memory_order_acquire)) return false;
  if (why) {
    std::lock_guard<std::mutex> l(q->why_m);
    *why = q->why;
  }
  return true;
}

void NetBridge::markDead(Peer& p, const char* what) {
  {
    std::lock_guard<std::mutex> l(p.why_m);
    if (p.why.empty()) p.why = what;
  }
  p.recv_failed = true;
  p.dead.store(true, std::memory_order_release);
  EP_INFO(kSubsysNet, "net bridge: rank %d lost its connection from rank %d: %s", rank_, p.rank, what);
}

// ------------------------------------------------------------------------------------------------------
// Setup
// ------------------------------------------------------------------------------------------------------

epResult_t NetBridge::connect(Bootstrap* bs, int timeout_ms) {
  memcpy(secret_, bs->secret(), kSecretBytes);
  int nremote = 0;
  for (int r = 0; r < nranks_; ++r) nremote += remote_[r] ? 1 : 0;
  std::string why;
  backend_ = net::netBackend(&why);
  // Every rank takes part in the exchange, so that a rank without the backend fails the others at once.
  struct Slot {
    int32_t ok;
    uint8_t handle[net::kNetHandleSize];
  };
  std::vector<Slot> all(nranks_);
  Slot& me = all[rank_];
  me.ok = 0;
  if (backend_ == nullptr) {
    EP_WARN("the net transport is not available: %s", why.c_str());
  } else if (nremote > 0) {
    if (backend_->listen(0, me.handle, &listen_) == epSuccess) me.ok = 1;
    else why = net::netLastError();
  } else {
    me.ok = 1;
  }
  EPCHECK(bs->allgather(all.data(), sizeof(Slot), timeout_ms));
  if (!me.ok)
    EP_FAIL(epNotSupported, "rank %d cannot use the net transport (EPCOMM_NET) that ranks on other hosts need: %s",
            rank_, why.c_str());
  for (int r = 0; r < nranks_; ++r)
    if (remote_[r] && !all[r].ok)
      EP_FAIL(epRemoteError, "rank %d (on another host) cannot use the net transport (EPCOMM_NET)", r);
  if (nremote == 0) return epSuccess;

  auto regSlots = [&](void* comm, std::vector<std::vector<uint8_t>>& bufs, std::vector<void*>& mh,
                      std::vector<int>& free_list, int n) -> epResult_t {
    bufs.assign(n, std::vector<uint8_t>(kFrameBytes));
    mh.assign(n, nullptr);
    for (int i = 0; i < n; ++i) {
      if (backend_->regMr(comm, bufs[i].data(), kFrameBytes, net::kNetPtrHost, &mh[i]) != epSuccess)
        EP_FAIL(epSystemError, "registering host engine frame buffers with the net transport: %s",
                net::netLastError());
      free_list.push_back(i);
    }
    return epSuccess;
  };

  for (int r = 0; r < nranks_; ++r)
    if (remote_[r]) memcpy(peers_[r]->handle, all[r].handle, net::kNetHandleSize);
  std::vector<void*> send, recv;
  EPCHECK(establish(remote_, 0, send, recv, timeout_ms));
  for (auto& pp : peers_) {
    if (!pp) continue;
    pp->send = send[pp->rank];
    pp->recv = recv[pp->rank];
    EPCHECK(regSlots(pp->send, pp->send_buf, pp->send_mh, pp->free_send, kSendSlots));
    EPCHECK(regSlots(pp->recv, pp->recv_buf, pp->recv_mh, pp->free_recv, kRecvSlots));
  }
  // Nobody sends data before every rank is connected (the creation barrier after this), so the receives
  // posted by the progress thread are in place before the first frame; the backends queue early ones anyway.
  thread_ = std::thread([this] { progressLoop(); });
  closed_.store(false, std::memory_order_release);
  EP_INFO(kSubsysInit, "net bridge: rank %d reaches %d ranks of other hosts over net/%s", rank_, nremote,
          backend_->name());
  return epSuccess;
}

// Connects to the listener of every rank r with to[r] (the handles exchanged at creation) and accepts one
// connection from each on this rank's listener. The first message on a connection is a HELLO naming the sender's
// rank and presenting the communicator's secret and `gen` (0 for the engine's own connections, rawStream's call
// count for its), so that a stranger or a stale connection is dropped without disturbing the others (R5).
epResult_t NetBridge::establish(const std::vector<uint8_t>& to, uint64_t gen, std::vector<void*>& send,
                                std::vector<void*>& recv, int timeout_ms) {
  int nremote = 0;
  for (int r = 0; r < nranks_; ++r) {
    if (to[r] && !peers_[r]) return EP_ERROR(epInternalError, "rank %d is not on another host", r);
    nremote += to[r] ? 1 : 0;
  }
  send.assign(nranks_, nullptr);
  recv.assign(nranks_, nullptr);
  // connect() keeps its progress in the caller's copy of the handle: a fresh copy for every call.
  std::vector<std::array<uint8_t, net::kNetHandleSize>> handle(nranks_);
  for (int r = 0; r < nranks_; ++r)
    if (to[r]) memcpy(handle[r].data(), peers_[r]->handle, net::kNetHandleSize);
  std::vector<FrameHdr> hello(nranks_);  // registered with send[r] while the greeting is out
  std::vector<void*> hello_mh(nranks_, nullptr), hello_req(nranks_, nullptr);
  std::vector<uint8_t> hello_sent(nranks_, 0);
  std::vector<std::vector<uint8_t>> greet_buf(nranks_);  // the greeting received on recv[r], and its registration
  std::vector<void*> greet_mh(nranks_, nullptr);
  struct Accepted {
    void* comm;
    void* mh;
    void* req;
    std::vector<uint8_t> buf;
  };
  std::vector<Accepted> accepted;
  int connected = 0, identified = 0;
  const int64_t deadline = nowNs() + static_cast<int64_t>(timeout_ms) * 1000000LL;
  Backoff backoff;
  epResult_t res = epSuccess;
  while (res == epSuccess && (connected < nremote || identified < nremote)) {
    bool moved = false;
    for (int r = 0; r < nranks_ && res == epSuccess; ++r) {
      if (!to[r]) continue;
      if (!send[r]) {
        if (backend_->connect(0, handle[r].data(), &send[r]) != epSuccess) {
          res = EP_ERROR(epRemoteError, "rank %d: connecting to rank %d over the net transport: %s", rank_, r,
                         net::netLastError());
          break;
        }
        if (!send[r]) continue;
        moved = true;
        FrameHdr& h = hello[r];
        h = FrameHdr{kFrameMagic, kHello, 0, 0, rank_, {0, 0, gen, 0}};
        memcpy(h.v, secret_, kSecretBytes);
        if (backend_->regMr(send[r], &h, sizeof(h), net::kNetPtrHost, &hello_mh[r]) != epSuccess) {
          res = EP_ERROR(epSystemError, "registering a greeting with the net transport: %s", net::netLastError());
          break;
        }
      }
      if (!hello_sent[r]) {
        if (!hello_req[r]) {
          if (backend_->isend(send[r], &hello[r], sizeof(FrameHdr), 0, hello_mh[r], &hello_req[r]) != epSuccess) {
            res = EP_ERROR(epRemoteError, "rank %d: greeting rank %d over the net transport: %s", rank_, r,
                           net::netLastError());
            break;
          }
          if (!hello_req[r]) continue;
          moved = true;
        }
        int done = 0;
        if (backend_->test(hello_req[r], &done, nullptr) != epSuccess) {
          res = EP_ERROR(epRemoteError, "rank %d: greeting rank %d over the net transport: %s", rank_, r,
                         net::netLastError());
          break;
        }
        if (done) {
          hello_sent[r] = 1;
          hello_req[r] = nullptr;
          ++connected;
          moved = true;
        }
      }
    }
    if (res != epSuccess) break;
    if (static_cast<int>(accepted.size()) < nremote) {
      void* rc = nullptr;
      if (backend_->accept(listen_, &rc) != epSuccess) {
        res = EP_ERROR(epSystemError, "rank %d: accepting net connections: %s", rank_, net::netLastError());
        break;
      }
      if (rc) {
        Accepted a{rc, nullptr, nullptr, std::vector<uint8_t>(kFrameBytes)};
        if (backend_->regMr(rc, a.buf.data(), kFrameBytes, net::kNetPtrHost, &a.mh) != epSuccess) {
          res = EP_ERROR(epSystemError, "registering a receive buffer: %s", net::netLastError());
          backend_->closeRecv(rc);
          break;
        }
        accepted.push_back(std::move(a));
        moved = true;
      }
    }
    for (Accepted& a : accepted) {
      if (!a.comm) continue;
      if (!a.req) {
        void* data = a.buf.data();
        size_t size = kFrameBytes;
        int tag = 0;
        if (backend_->irecv(a.comm, 1, &data, &size, &tag, &a.mh, &a.req) != epSuccess) {
          res = EP_ERROR(epRemoteError, "rank %d: receiving a greeting: %s", rank_, net::netLastError());
          break;
        }
        if (!a.req) continue;
      }
      int done = 0;
      size_t got = 0;
      if (backend_->test(a.req, &done, &got) != epSuccess) {
        res = EP_ERROR(epRemoteError, "rank %d: receiving a greeting: %s", rank_, net::netLastError());
        break;
      }
      if (!done) continue;
      a.req = nullptr;
      moved = true;
      FrameHdr h{};
      if (got == sizeof(h)) memcpy(&h, a.buf.data(), sizeof(h));
      const bool good = got == sizeof(h) && h.magic == kFrameMagic && h.type == kHello && h.src >= 0 &&
                        h.src < nranks_ && to[h.src] && recv[h.src] == nullptr &&
                        memcmp(h.v, secret_, kSecretBytes) == 0 && h.v[2] == gen;
      if (!good) {  // a stranger, a peer of another communicator or of an earlier set-up: dropped (R5)
        EP_WARN("rank %d: dropping a net connection that did not present this communicator's secret, a rank of "
                "another host and the current set-up", rank_);
        backend_->closeRecv(a.comm);
        backend_->deregMr(a.comm, a.mh);
        a.comm = nullptr;
        continue;
      }
      recv[h.src] = a.comm;
      greet_buf[h.src] = std::move(a.buf);
      greet_mh[h.src] = a.mh;
      a.comm = nullptr;
      ++identified;
    }
    accepted.erase(std::remove_if(accepted.begin(), accepted.end(), [](const Accepted& a) { return !a.comm; }),
                   accepted.end());
    if (res != epSuccess) break;
    if (moved) {
      backoff.reset();
      continue;
    }
    if (nowNs() > deadline) {
      res = EP_ERROR(epTimeout,
                     "rank %d: net connections to the ranks of other hosts not complete after %d ms (%d of %d "
                     "connected, %d of %d accepted)",
                     rank_, timeout_ms, connected, nremote, identified, nremote);
      break;
    }
    backoff.pause();
  }
  // Close before deregistering (net.h): a failed set-up may leave greetings in flight.
  for (Accepted& a : accepted) {
    backend_->closeRecv(a.comm);
    if (a.mh) backend_->deregMr(a.comm, a.mh);
  }
  if (res != epSuccess)
    for (int r = 0; r < nranks_; ++r) {
      if (send[r]) backend_->closeSend(send[r]);
      if (recv[r]) backend_->closeRecv(recv[r]);
    }
  for (int r = 0; r < nranks_; ++r) {
    if (hello_mh[r]) backend_->deregMr(send[r], hello_mh[r]);
    if (greet_mh[r]) backend_->deregMr(recv[r], greet_mh[r]);
  }
  if (res != epSuccess) {
    send.assign(nranks_, nullptr);
    recv.assign(nranks_, nullptr);
  }
  return res;
}

// ------------------------------------------------------------------------------------------------------
// Progress
// ------------------------------------------------------------------------------------------------------

void NetBridge::queueFrame(Peer& p, uint16_t type, uint16_t ch, const uint64_t* v, const uint8_t*, size_t len,
                           const uint8_t*, size_t) {
  Peer::Desc d{type, ch, {0, 0, 0, 0}, static_cast<uint32_t>(len)};
  if (v) memcpy(d.v, v, sizeof(d.v));
  p.q.push_back(d);
}

// Posts queued frames in order (DATA payload copied out of the outbox at post time: it stays there until the
// peer credits it, which it cannot before receiving it) and completes sends from the front.
bool NetBridge::pumpSends(Peer& p) {
  bool moved = false;
  while (!p.send_failed && !p.inflight_reqs.empty()) {
    int done = 0;
    const epResult_t r = backend_->test(p.inflight_reqs.front(), &done, nullptr);
    if (r != epSuccess) {
      p.send_failed = true;  // the peer closed its end, or stopped taking frames: nothing more goes to it
      if (r == epTimeout) markDead(p, net::netLastError());  // stalled (the backend's deadline), if still open
      break;
    }
    if (!done) break;
    p.free_send.push_back(p.inflight_slots.front());
    p.inflight_slots.pop_front();
    p.inflight_reqs.pop_front();
    moved = true;
  }
  while (!p.send_failed && !p.q.empty() && !p.free_send.empty()) {
    const Peer::Desc& d = p.q.front();
    const int slot = p.free_send.back();
    uint8_t* buf = p.send_buf[slot].data();
    FrameHdr h{kFrameMagic, d.type, d.ch, d.len, rank_, {d.v[0], d.v[1], d.v[2], d.v[3]}};
    memcpy(buf, &h, sizeof(h));
    if (d.type == kData) {
      const uint8_t* ring = p.out_data[d.ch].data();
      const size_t off = d.v[0] % ring_bytes_, first = std::min<size_t>(d.len, ring_bytes_ - off);
      memcpy(buf + sizeof(h), ring + off, first);
      if (first < d.len) memcpy(buf + sizeof(h) + first, ring, d.len - first);
    }
    void* req = nullptr;
    const epResult_t r = backend_->isend(p.send, buf, sizeof(h) + d.len, 0, p.send_mh[slot], &req);
    if (r != epSuccess) {
      p.send_failed = true;
      if (r == epTimeout) markDead(p, net::netLastError());
      break;
    }
    if (!req) break;
    p.free_send.pop_back();
    p.inflight_slots.push_back(slot);
    p.inflight_reqs.push_back(req);
    p.q.pop_front();
    moved = true;
  }
  return moved;
}

bool NetBridge::pumpRecvs(Peer& p) {
  bool moved = false;
  while (!p.recv_failed && !p.bye && !p.rx_reqs.empty()) {  // after a goodbye nothing more will come
    int done = 0;
    size_t got = 0;
    if (backend_->test(p.rx_reqs.front(), &done, &got) != epSuccess) {
      if (p.bye) p.recv_failed = true;  // it said goodbye: everything it sent is in
      else markDead(p, net::netLastError());
      break;
    }
    if (!done) break;
    const int slot = p.rx_slots.front();
    p.rx_slots.pop_front();
    p.rx_reqs.pop_front();
    applyFrame(p, p.recv_buf[slot].data(), got);
    p.free_recv.push_back(slot);
    moved = true;
  }
  while (!p.recv_failed && !p.bye && !p.free_recv.empty()) {
    const int slot = p.free_recv.back();
    void* data = p.recv_buf[slot].data();
    size_t size = kFrameBytes;
    int tag = 0;
    void* req = nullptr;
    if (backend_->irecv(p.recv, 1, &data, &size, &tag, &p.recv_mh[slot], &req) != epSuccess) {
      if (!p.bye) markDead(p, net::netLastError());
      break;
    }
    if (!req) break;
    p.free_recv.pop_back();
    p.rx_slots.push_back(slot);
    p.rx_reqs.push_back(req);
    moved = true;
  }
  return moved;
}

// One frame from peer p. Everything in it is checked before use; a violation ends the connection (R5).
void NetBridge::applyFrame(Peer& p, const uint8_t* buf, size_t n) {
  if (p.recv_failed || p.bye) return;
  FrameHdr h;
  if (n < sizeof(h)) return markDead(p, "a frame shorter than its header");
  memcpy(&h, buf, sizeof(h));
  if (h.magic != kFrameMagic || h.src != p.rank || h.len != n - sizeof(h) || (h.type != kData && h.len != 0) ||
      h.ch >= nchan_)
    return markDead(p, "a malformed frame (stream out of sync)");
  switch (h.type) {
    case kData: {
      RingCtl* ctl = own_->ringCtl(p.rank, h.ch);
      uint8_t* ring = own_->ringData(p.rank, h.ch);
      const uint64_t tail = ctl->tail.load(std::memory_order_relaxed);
      const uint64_t head = ctl->head.load(std::memory_order_acquire);
      if (h.v[0] != tail || h.len > kFramePayload || tail + h.len - head > ring_bytes_)
        return markDead(p, "a data frame beyond its credit or out of order");
      const size_t off = tail % ring_bytes_, first = std::min<size_t>(h.len, ring_bytes_ - off);
      memcpy(ring + off, buf + sizeof(h), first);
      if (first < h.len) memcpy(ring, buf + sizeof(h) + first, h.len - first);
      ctl->tail.store(tail + h.len, std::memory_order_release);
      return;
    }
    case kCredit: {
      RingCtl& ctl = p.out_ctl[h.ch];
      const uint64_t head = ctl.head.load(std::memory_order_relaxed);
      if (h.v[0] < head || h.v[0] > p.sent[h.ch]) return markDead(p, "a credit for bytes never sent");
      ctl.head.store(h.v[0], std::memory_order_release);
      return;
    }
    case kReadDone: p.out_ctl[h.ch].read_done.store(h.v[0], std::memory_order_release); return;
    case kCtrl: {
      RegionHeader* m = mirrors_[p.rank].get();
      m->rs_hash.store(h.v[1], std::memory_order_relaxed);
      m->rs_epoch.store(h.v[2], std::memory_order_relaxed);
      m->rs_status.store(static_cast<int32_t>(h.v[3]), std::memory_order_relaxed);
      m->rs_word.store(h.v[0], std::memory_order_release);
      return;
    }
    case kBye:  // everything it sent is in; the acknowledgement tells it that it may close
      p.bye = true;
      // (Not needed when this rank said goodbye too: that ends the peer's wait as well.)
      if (!p.send_failed && !p.bye_queued) queueFrame(p, kByeAck, 0, nullptr, nullptr, 0);
      return;
    case kByeAck: p.bye_acked = true; return;
    default: return markDead(p, "a frame of an unknown type");
  }
}

// Frames what changed since the last pass: outbox bytes, the inbox's consumption (credit), read_done, and this
// rank's resynchronization words (read by the caller BEFORE the outboxes, see net_bridge.h "Order").
bool NetBridge::progressPeer(Peer& p, uint64_t word, const uint64_t* words) {
  bool moved = false;
  if (!p.send_failed && !p.bye) {  // a peer that said goodbye needs nothing more (but its acknowledgement)
    for (int c = 0; c < nchan_; ++c) {
      const uint64_t tail = p.out_ctl[c].tail.load(std::memory_order_acquire);
      while (p.sent[c] < tail) {
        const size_t n = std::min<uint64_t>(tail - p.sent[c], kFramePayload);
        const uint64_t v[4] = {p.sent[c], 0, 0, 0};
        queueFrame(p, kData, static_cast<uint16_t>(c), v, nullptr, n);
        p.sent[c] += n;
        data_sent_.fetch_add(n, std::memory_order_relaxed);
        moved = true;
      }
      RingCtl* in = own_->ringCtl(p.rank, c);
      const uint64_t head = in->head.load(std::memory_order_acquire);
      const uint64_t in_tail = in->tail.load(std::memory_order_relaxed);
      // Credit in steps of 1/8 ring, or all of it once the inbox is empty: the producer never sees less room
      // than 7/8 of what the consumer has freed, which keeps every wait for a row (<= half a ring) live.
      if (head != p.credited[c] && (head - p.credited[c] >= ring_bytes_ / 8 || head == in_tail)) {
        const uint64_t v[4] = {head, 0, 0, 0};
        queueFrame(p, kCredit, static_cast<uint16_t>(c), v, nullptr, 0);
        p.credited[c] = head;
        moved = true;
      }
      const uint64_t rd = in->read_done.load(std::memory_order_acquire);
      if (rd != p.rd_sent[c]) {
        const uint64_t v[4] = {rd, 0, 0, 0};
        queueFrame(p, kReadDone, static_cast<uint16_t>(c), v, nullptr, 0);
        p.rd_sent[c] = rd;
        moved = true;
      }
    }
    if (word != p.ctrl_sent[0] || words[0] != p.ctrl_sent[1] || words[1] != p.ctrl_sent[2] ||
        words[2] != p.ctrl_sent[3]) {
      const uint64_t v[4] = {word, words[0], words[1], words[2]};
      queueFrame(p, kCtrl, 0, v, nullptr, 0);
      memcpy(p.ctrl_sent, v, sizeof(v));
      moved = true;
    }
  }
  moved = pumpSends(p) || moved;
  moved = pumpRecvs(p) || moved;
  return moved;
}

void NetBridge::readWords(uint64_t* word, uint64_t* words) const {
  RegionHeader* me = own_->header();
  *word = me->rs_word.load(std::memory_order_acquire);
  words[0] = me->rs_hash.load(std::memory_order_relaxed);
  words[1] = me->rs_epoch.load(std::memory_order_relaxed);
  words[2] = static_cast<uint64_t>(static_cast<uint32_t>(me->rs_status.load(std::memory_order_relaxed)));
}

bool NetBridge::assist() {
  if (closed_.load(std::memory_order_acquire)) return false;
  bool moved = false;
  // The words before any outbox (see "Order"): read once, then each free peer served.
  uint64_t word, words[3];
  readWords(&word, words);
  for (auto& pp : peers_) {
    if (!pp || !pp->tryLock()) continue;
    if (!closed_.load(std::memory_order_acquire)) moved = progressPeer(*pp, word, words) || moved;
    pp->unlock();
  }
  return moved;
}

void NetBridge::progressLoop() {
  Backoff backoff;
  for (;;) {
    bool moved = false;
    uint64_t word, words[3];
    readWords(&word, words);
    // A peer an engine thread is serving right now is skipped, not waited for (it is being moved).
    for (auto& pp : peers_) {
      if (!pp || !pp->tryLock()) continue;
      moved = progressPeer(*pp, word, words) || moved;
      pp->unlock();
    }
    if (stop_.load(std::memory_order_acquire)) {
      // Every engine thread is out of assist() by now (shutdown took every peer's lock after closed_), so this
      // thread alone touches the peers.
      if (!flush_.load(std::memory_order_relaxed) || nowNs() > flush_deadline_ns_) break;
      // Flushing: once a live peer's outboxes are framed and its queue is empty, say goodbye; done when every
      // such peer has acknowledged it (or said goodbye itself). Closing earlier could cost the peer frames: a
      // backend may report the end of a connection instead of messages that arrived just before it.
      bool all = true;
      for (auto& pp : peers_) {
        if (!pp || pp->send_failed || pp->dead.load() || !flush_live_[pp->rank]) continue;
        if (!pp->bye_queued && pp->q.empty()) {
          bool framed = true;
          for (int c = 0; c < nchan_; ++c) framed = framed && pp->sent[c] == pp->out_ctl[c].tail.load();
          if (framed) {
            queueFrame(*pp, kBye, 0, nullptr, nullptr, 0);
            pp->bye_queued = true;
            moved = true;
          }
        }
        if (!pp->bye_queued || !pp->q.empty() || !pp->inflight_reqs.empty() ||
            !(pp->bye || pp->bye_acked || pp->recv_failed))
          all = false;
      }
      if (all) break;
    }
    if (moved) backoff.reset();
    else backoff.pause();
  }
}

void NetBridge::shutdown(bool flush, const uint8_t* live, int timeout_ms) {
  if (thread_.joinable()) {
    // No engine thread starts serving a peer from here on; wait for those that are serving one now.
    closed_.store(true, std::memory_order_release);
    for (auto& pp : peers_)
      if (pp) {
        pp->lock();
        pp->unlock();
      }
    flush_live_.assign(nranks_, 0);
    if (live) std::copy(live, live + nranks_, flush_live_.begin());
    flush_deadline_ns_ = nowNs() + static_cast<int64_t>(timeout_ms) * 1000000LL;
    flush_.store(flush && live != nullptr, std::memory_order_relaxed);
    stop_.store(true, std::memory_order_release);
    thread_.join();
  }
  if (!backend_) return;
  // Close first, then deregister. A connection may still have receives posted (always: the progress thread keeps
  // some waiting for the next frame) and, after a flush that ran out of time or a failed peer, sends in flight.
  // Deregistering a region an operation still references is undefined for the providers that register memory
  // (verbs, efa): close cancels every operation of the connection and drains its completions (net.h), and only
  // then are the frame buffers' regions released. A handle's deregistration does not need its connection open.
  for (auto& pp : peers_) {
    if (!pp) continue;
    if (pp->send) backend_->closeSend(pp->send);
    if (pp->recv) backend_->closeRecv(pp->recv);
    // The requests belonged to the closed connections (freed by close).
    pp->inflight_reqs.clear();
    pp->inflight_slots.clear();
    pp->rx_reqs.clear();
    pp->rx_slots.clear();
  }
  for (auto& pp : peers_) {
    if (!pp) continue;
    for (void* mh : pp->send_mh)
      if (mh) backend_->deregMr(pp->send, mh);
    for (void* mh : pp->recv_mh)
      if (mh) backend_->deregMr(pp->recv, mh);
    pp->send = nullptr;
    pp->recv = nullptr;
    pp->send_mh.clear();
    pp->recv_mh.clear();
  }
  if (listen_) backend_->closeListen(listen_);
  listen_ = nullptr;
}

// ------------------------------------------------------------------------------------------------------
// Raw throughput (epCommNetRawBandwidth)
// ------------------------------------------------------------------------------------------------------

epResult_t NetBridge::rawStream(const std::vector<uint8_t>& to, size_t bytes_per_peer, size_t msg_bytes,
                                int window, int timeout_ms, const std::function<epResult_t()>& sync,
                                RawResult* out) {
  *out = RawResult{};
  EP_REQUIRE(backend_ != nullptr && listen_ != nullptr, epInvalidUsage,
             "rank %d has no net connections to measure (every rank on one host?)", rank_);
  EP_REQUIRE(bytes_per_peer > 0 && msg_bytes > 0 && window > 0, epInvalidArgument,
             "bytes_per_peer, msg_bytes and window must be positive");
  const uint64_t gen = ++raw_gen_;
  // Every rank first finishes what it has in flight: a peer still completing its last operation may need this
  // rank's calls to progress, and a rank waiting in establish() makes none (a 4 x 1 run timed out that way, the
  // peers in an LL combine's receive half, this rank accepting connections they never made).
  EPCHECK(sync());
  std::vector<void*> send, recv;
  EPCHECK(establish(to, gen, send, recv, timeout_ms));
  // One direction toward (tx) or from (rx) one peer: `window` buffers of msg_bytes, message i in buffer
  // i % window (at most `window` in flight, completed in posting order, so that buffer is free again).
  struct Dir {
    void* comm = nullptr;
    std::vector<std::vector<uint8_t>> buf;
    std::vector<void*> mh;
    std::deque<void*> reqs;
    size_t posted = 0, done = 0;
  };
  std::vector<Dir> tx(nranks_), rx(nranks_);
  const size_t n = (bytes_per_peer + msg_bytes - 1) / msg_bytes;
  auto sizeOf = [&](size_t i) { return i + 1 < n ? msg_bytes : bytes_per_peer - (n - 1) * msg_bytes; };
  const size_t W = static_cast<size_t>(window);
  epResult_t res = epSuccess;
  for (int r = 0; r < nranks_ && res == epSuccess; ++r) {
    if (!to[r]) continue;
    tx[r].comm = send[r];
    rx[r].comm = recv[r];
    for (Dir* d : {&tx[r], &rx[r]}) {
      d->buf.assign(std::min(W, n), std::vector<uint8_t>(msg_bytes, d == &tx[r] ? 0x5a : 0));
      d->mh.assign(d->buf.size(), nullptr);
      for (size_t i = 0; i < d->buf.size() && res == epSuccess; ++i)
        if (backend_->regMr(d->comm, d->buf[i].data(), msg_bytes, net::kNetPtrHost, &d->mh[i]) != epSuccess)
          res = EP_ERROR(epSystemError, "registering raw stream buffers with the net transport: %s",
                         net::netLastError());
    }
  }
  bool moved = false;
  // Posts receives (up to `window`) from peer r; then completes sends and receives, oldest first, and posts sends.
  auto postRecvs = [&](int r) -> epResult_t {
    Dir& d = rx[r];
    while (d.posted < n && d.reqs.size() < W) {
      void* data = d.buf[d.posted % W].data();
      size_t size = msg_bytes;
      int tag = 0;
      void* req = nullptr;
      if (backend_->irecv(d.comm, 1, &data, &size, &tag, &d.mh[d.posted % W], &req) != epSuccess)
        return EP_ERROR(epRemoteError, "rank %d: raw stream receive from rank %d: %s", rank_, r, net::netLastError());
      if (!req) break;
      d.reqs.push_back(req);
      ++d.posted;
      moved = true;
    }
    return epSuccess;
  };
  auto progress = [&](int r) -> epResult_t {
    Dir& s = tx[r];
    while (!s.reqs.empty()) {
      int done = 0;
      if (backend_->test(s.reqs.front(), &done, nullptr) != epSuccess)
        return EP_ERROR(epRemoteError, "rank %d: raw stream send to rank %d: %s", rank_, r, net::netLastError());
      if (!done) break;
      s.reqs.pop_front();
      out->bytes_sent += sizeOf(s.done++);
      moved = true;
    }
    while (s.posted < n && s.reqs.size() < W) {
      void* req = nullptr;
      if (backend_->isend(s.comm, s.buf[s.posted % W].data(), sizeOf(s.posted), 0, s.mh[s.posted % W], &req) !=
          epSuccess)
        return EP_ERROR(epRemoteError, "rank %d: raw stream send to rank %d: %s", rank_, r, net::netLastError());
      if (!req) break;
      s.reqs.push_back(req);
      ++s.posted;
      moved = true;
    }
    Dir& d = rx[r];
    while (!d.reqs.empty()) {
      int done = 0;
      size_t got = 0;
      if (backend_->test(d.reqs.front(), &done, &got) != epSuccess)
        return EP_ERROR(epRemoteError, "rank %d: raw stream receive from rank %d: %s", rank_, r, net::netLastError());
      if (!done) break;
      if (got != sizeOf(d.done))
        return EP_ERROR(epRemoteError, "rank %d: raw stream message %zu from rank %d has %zu bytes, not %zu", rank_,
                        d.done, r, got, sizeOf(d.done));
      d.reqs.pop_front();
      ++d.done;
      moved = true;
    }
    return postRecvs(r);
  };
  // Receives in place before anyone starts; then every rank starts together (sync) and streams to all at once.
  for (int r = 0; r < nranks_ && res == epSuccess; ++r)
    if (to[r]) res = postRecvs(r);
  if (res == epSuccess) res = sync();
  const int64_t t0 = nowNs();
  int64_t t1 = t0, last = t0;
  Backoff backoff;
  while (res == epSuccess) {
    moved = false;
    bool all = true;
    for (int r = 0; r < nranks_ && res == epSuccess; ++r) {
      if (!to[r]) continue;
      res = progress(r);
      all = all && tx[r].done == n && rx[r].done == n;
    }
    if (res != epSuccess) break;
    const int64_t now = nowNs();
    if (all) {
      t1 = now;
      break;
    }
    if (moved) {
      last = now;
      backoff.reset();
    } else if (now - last > static_cast<int64_t>(timeout_ms) * 1000000LL) {
      res = EP_ERROR(epTimeout, "rank %d: raw stream over the net transport made no progress for %d ms", rank_,
                     timeout_ms);
    } else {
      backoff.pause();
    }
  }
  out->seconds = static_cast<double>(t1 - t0) * 1e-9;
  // Nobody closes before every rank has everything: a backend may report a closed connection instead of the
  // messages that arrived just before it.
  if (res == epSuccess) res = sync();
  // Close first (cancels what is still posted after a failure), then deregister (net.h).
  for (int r = 0; r < nranks_; ++r) {
    if (tx[r].comm) backend_->closeSend(tx[r].comm);
    if (rx[r].comm) backend_->closeRecv(rx[r].comm);
  }
  for (int r = 0; r < nranks_; ++r)
    for (Dir* d : {&tx[r], &rx[r]})
      for (void* mh : d->mh)
        if (mh) backend_->deregMr(d->comm, mh);
  return res;
}

}  // namespace epcomm
