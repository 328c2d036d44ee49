// Host engine across hosts: rings and region-header words kept in step over the net transport (net_bridge.h).
#include "transport/bridge/net_bridge.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/log.h"
#include "common/param.h"
#include "common/thread_name.h"
#include "common/time.h"
#include "transport/net/net.h"
#include "transport/net/sockutil.h"

namespace epcomm {

namespace {

constexpr uint32_t kFrameMagic = 0x65704e42u;  // "epNB"
constexpr uint16_t kHello = 1, kData = 2, kCredit = 3, kReadDone = 4, kCtrl = 5, kBye = 6, kByeAck = 7, kDataNext = 8,
                   kOut = 9, kDataPlaced = 10;
constexpr int kSendSlots = 16;  // frames in flight per peer
constexpr int kRecvSlots = 8;   // frames received and not yet applied, per peer
// Message tags: frames, and DATA_NEXT payloads over a backend that matches by tag (NetBackend::matchesByTag; else
// payloads are tag 0 too, and the receiver's posting order alone tells them apart).
constexpr int kFrameTag = 0, kPayloadTag = 1;
constexpr size_t kMaxSendsInFlight = 32;  // frames and payloads, per peer

// A message on a connection is a frame (this header, then `len` payload bytes, DATA only) or the payload that a
// DATA_NEXT frame announces, which follows it at once.
struct FrameHdr {
  uint32_t magic;
  uint16_t type;
  uint16_t ch;
  uint32_t len;
  int32_t src;
  uint64_t v[4];  // DATA, DATA_NEXT, DATA_PLACED: stream offset (DATA_NEXT, DATA_PLACED: payload bytes in v[1]);
                  // CREDIT: consumer head;
                  // READDONE: epoch; CTRL: rs word, hash, epoch, status; HELLO: secret, gen, ring bytes;
                  // OUT: set (0 rc_accused, 1 rc_masked) << 32 | word index, the word's bits
};
static_assert(sizeof(FrameHdr) == 48, "frame header size is part of the wire format");
// A DATA_PLACED frame's bytes: one of these per placed piece of its payload, in order (Placement).
struct PlacedSeg {
  uint32_t off;  // in the payload
  uint32_t len;
  uint64_t key;  // the receiver's Placement::place says where it goes
};
static_assert(sizeof(PlacedSeg) == 16, "part of the wire format");
// Outbox bytes up to this go inside a DATA frame (copied into the frame, then out of it into the inbox); frames of
// 64 KiB go whole on the socket backend's control socket (its inline size). Where the bridge's user allows them
// (max_payload), more go as a DATA_NEXT frame and a message of their own, sent straight from the outbox and received
// straight into the inbox, no copy by this process.
constexpr size_t kFramePayload = (64u << 10) - sizeof(FrameHdr);
constexpr size_t kFrameBytes = sizeof(FrameHdr) + kFramePayload;
// Shorter runs go in frames even where DATA_NEXT is allowed: a payload message costs the socket backend a hand-off
// to its helper threads, which only long runs repay.
constexpr size_t kMinPayloadMsg = 256u << 10;
// Most placed pieces in one payload (a DATA_PLACED frame's bytes; a piece and the inbox bytes before it are two of
// the scattered receive's pieces).
constexpr size_t kMaxPlacedSegs = std::min<size_t>(kFramePayload / sizeof(PlacedSeg), net::kNetMaxScatter / 2 - 1);

// Parallel data streams per direction over all of a bridge's connections (NetBackend::connectStreams), spread evenly:
// a rank that reaches hundreds of ranks of other hosts would otherwise open the socket backend's default of 8 data
// sockets and 4 helper threads per connection and direction for each (about 7000 descriptors and 2000 threads per
// process at 248 peers). 64 leaves that default alone up to 8 peers; 0 or less: no cap.
EP_PARAM(NetStreamBudget, "NET_STREAM_BUDGET", 64);
// The smallest piece of a message the bridge's connections cut for their streams (NetBackend::StreamHints; the
// socket backend's own default is 64 KiB, EPCOMM_NET_MIN_CHUNK overrides both). The GPU proxy's payload messages are
// 100 KiB - 1 MiB (mean about 220 KiB in HT at -n 4 across 2 hosts): at 64 KiB each went over about 4 data sockets,
// a helper woken per piece on each side, and the proxy's thread spent 6-11 us per isend (H100, 16 cores, 4 ranks:
// 64 helper threads). At 256 KiB: 3.3-4.5 us, and HT dispatch 16.1-16.7 against 14.0-14.8 GB/s across hosts in
// three alternating pairs (LL dispatch +6 %; the raw reference 32.1-32.8 against 27.2-30.0 GB/s: its 1 MiB messages
// gain too); with this hint against EPCOMM_NET_MIN_CHUNK=65536, two more pairs: HT dispatch 16.7/18.7 against
// 15.4/17.3, LL dispatch 10.0/10.2 against 9.3/9.6, the combines within noise (bench/results/h100-s39.log). Frames
// (at most 64 KiB) are not cut either way.
constexpr size_t kBridgeMinChunk = 256u << 10;
// Every pass tests each peer's posted receives. Where a rank reaches at least this many ranks of other hosts, a pass
// polls readiness once first (NetBackend::openPoller), so that a peer with nothing new costs no syscall: an idle
// socket receive's test is a recv() of 0.6-0.8 us, a pass over 248 peers about 0.15 ms of them. With few peers
// whose streams are busy the poll is one syscall more per pass and a byte that lands just after it waits a pass:
// at 2 peers HT dispatch ran 9 % slower with it (H100, s38), at 7 peers the host engine's LL 20-25 % faster (the
// 2-core VM). 0: never.
EP_PARAM(NetReadiness, "NET_READINESS", 4);

}  // namespace

struct NetBridge::Peer {
  int rank = -1;
  uint8_t handle[net::kNetHandleSize] = {};  // the peer's listen handle as exchanged (establish connects with a copy)
  void* send = nullptr;
  void* recv = nullptr;
  // Outboxes toward this peer, one per channel: the producer ends the engine pushes into (bridge memory, or the
  // caller's, see useOutboxMemory).
  std::unique_ptr<RingCtl[]> out_ctl;
  std::vector<std::vector<uint8_t>> out_own;
  std::vector<uint8_t*> out_data;  // [ch]
  std::vector<uint64_t> sent;      // [ch] outbox bytes already framed
  std::vector<uint64_t> credited;  // [ch] inbox head last reported to the peer
  std::vector<uint64_t> rd_sent;   // [ch] inbox read_done last reported
  uint64_t ctrl_sent[4] = {~0ull, 0, 0, 0};
  uint64_t rc_gen_sent = 0;                                 // the region header's rc_gen last framed
  uint64_t rc_sent[2][RegionHeader::kRankWords] = {};       // its rc_accused / rc_masked words last framed
  std::vector<void*> out_mh, in_mh;  // [ch] the outboxes registered with `send`, the inboxes with `recv`
  // Frames to send, in order.
  struct Desc {
    uint16_t type, ch;
    uint64_t v[4];
    uint32_t len;
    bool hdr_posted;  // DATA_NEXT, DATA_PLACED: the frame is out, its payload not yet
    std::vector<uint8_t> body;  // DATA_PLACED: the frame's bytes (PlacedSeg each)
  };
  std::deque<Desc> q;
  // Posted messages, in posting order: the send slot (-1: a payload) and, for DATA and DATA_NEXT payloads, the
  // channel (else -1) and the stream offset where the outbox bytes they carry end.
  struct Sent {
    void* req;
    int slot, ch;
    uint64_t end;
    int64_t t_ns;  // when it was posted (watch)
  };
  std::deque<Sent> inflight;
  std::unique_ptr<std::atomic<uint64_t>[]> out_read;  // [ch] outbox bytes whose sends completed (see outRead)
  std::vector<std::vector<uint8_t>> send_buf;
  std::vector<void*> send_mh;
  std::vector<int> free_send;
  std::vector<std::vector<uint8_t>> recv_buf;
  std::vector<void*> recv_mh;
  std::vector<int> free_recv;
  // Receives in stream order: frames into recv_buf slots, payloads straight into the inbox (slot -1). Entries are
  // applied front first. What follows a frame (another frame, or the payload a DATA_NEXT announces) is known once the
  // frame is in: where the backend takes one posting order for every message, at most one frame receive is posted
  // at a time then (the last entry until it completes); where it matches by tag, frame receives stay posted ahead
  // and a payload's entry goes in right after its frame, posted in turn (pumpRecvs).
  struct Rx {
    void* req;  // null: a payload receive not posted yet (framesAhead)
    int slot;
    uint16_t ch;
    uint32_t len;  // payload: bytes announced
    bool done;
    size_t got;
    int64_t t_ns;  // when it was posted (watch)
    uint64_t off = 0;  // payload: its stream offset (where it lands in the inbox)
  };
  std::deque<Rx> rx;
  int frames_posted = 0;  // frame receives not yet complete
  bool payload_due = false;  // a DATA_NEXT or DATA_PLACED is in: its payload receive (below) is the next one to post
  uint16_t payload_ch = 0;
  uint64_t payload_off = 0;
  uint32_t payload_len = 0;
  std::vector<iovec> payload_iov;  // DATA_PLACED: where its bytes land, in order (else all in the inbox)
  std::vector<uint64_t> rx_expect;  // [ch] stream offset the next DATA must start at (all before it announced)
  bool bye_in = false;  // a BYE or BYE_ACK frame came in (applied or not): nothing follows it
  bool send_failed = false, recv_failed = false, bye = false, bye_queued = false, bye_acked = false;
  bool ended = false;  // a BYE or BYE_ACK frame was applied: nothing more is read from this peer
  std::atomic<bool> dead{false};
  std::atomic<bool> said_bye{false};  // `bye`, for other threads (saidGoodbye)
  // stopSending(): asked by the caller; done once the send connection is closed (nothing reads the outbox then).
  std::atomic<bool> stop_send{false}, send_closed{false};
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
  bool stuck_said = false;  // watch() reported a late request, and some request has stayed late since
};

NetBridge::NetBridge(int rank, int nranks, int nchannels, size_t ring_bytes, size_t max_payload,
                     std::vector<uint8_t> remote, ShmRegion* own)
    : rank_(rank), nranks_(nranks), nchan_(nchannels), ring_bytes_(ring_bytes),
      max_payload_(std::min(max_payload, ring_bytes / 8)), remote_(std::move(remote)),
      own_(own) {
  peers_.resize(nranks_);
  mirrors_.resize(nranks_);
  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    auto p = std::make_unique<Peer>();
    p->rank = r;
    p->out_ctl.reset(new RingCtl[nchan_]);
    p->out_read.reset(new std::atomic<uint64_t>[nchan_]);
    for (int c = 0; c < nchan_; ++c) {
      p->out_ctl[c].tail.store(0);
      p->out_ctl[c].head.store(0);
      p->out_ctl[c].read_done.store(0);
      p->out_read[c].store(0);
    }
    p->out_own.resize(nchan_);  // allocated by connect() where useOutboxMemory gave none
    p->out_data.assign(nchan_, nullptr);
    p->sent.assign(nchan_, 0);
    p->rx_expect.assign(nchan_, 0);
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
    m->rs_ok.store(0);
    m->rc_gen.store(0);
    for (int i = 0; i < RegionHeader::kRankWords; ++i) {
      m->rc_accused[i].store(0);
      m->rc_masked[i].store(0);
    }
    mirrors_[r] = std::move(m);
  }
}

NetBridge::~NetBridge() { shutdown(false, nullptr, 0); }

const char* NetBridge::backendName() const { return backend_ ? backend_->name() : "none"; }

RingEnd NetBridge::outEnd(int ch, int p) const {
  Peer& q = *peers_[p];
  return RingEnd(&q.out_ctl[ch], q.out_data[ch], ring_bytes_);
}

RingCtl* NetBridge::outCtl(int ch, int p) const { return &peers_[p]->out_ctl[ch]; }

void NetBridge::stopSending(int p) { peers_[p]->stop_send.store(true, std::memory_order_release); }

bool NetBridge::sendingStopped(int p) const { return peers_[p]->send_closed.load(std::memory_order_acquire); }

uint64_t NetBridge::outRead(int ch, int p) const { return peers_[p]->out_read[ch].load(std::memory_order_acquire); }

void NetBridge::useOutboxMemory(int ch, int p, uint8_t* data) { peers_[p]->out_data[ch] = data; }

void NetBridge::usePlacement(Placement* hook) { placement_ = hook; }

bool NetBridge::dead(int p, std::string* why) const {
  const Peer* q = peers_[p].get();
  if (q == nullptr || !q->dead.load(std::memory_order_acquire)) return false;
  if (why) {
    std::lock_guard<std::mutex> l(q->why_m);
    *why = q->why;
  }
  return true;
}

bool NetBridge::saidGoodbye(int p) const {
  const Peer* q = peers_[p].get();
  return q != nullptr && q->said_bye.load(std::memory_order_acquire);
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

epResult_t NetBridge::connect(Bootstrap* bs, int timeout_ms, Progress progress) {
  memcpy(secret_, bs->secret(), kSecretBytes);
  stuck_ns_ = net::netTimeoutMs() * 500000LL;  // half of EPCOMM_TIMEOUT_MS (watch)
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

  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    Peer& p = *peers_[r];
    memcpy(p.handle, all[r].handle, net::kNetHandleSize);
    for (int c = 0; c < nchan_; ++c)
      if (!p.out_data[c]) {
        p.out_own[c].assign(ring_bytes_, 0);
        p.out_data[c] = p.out_own[c].data();
      }
  }
  std::vector<void*> send, recv;
  EPCHECK(establish(remote_, 0, send, recv, timeout_ms));
  for (auto& pp : peers_) {
    if (!pp) continue;
    pp->send = send[pp->rank];
    pp->recv = recv[pp->rank];
    EPCHECK(regSlots(pp->send, pp->send_buf, pp->send_mh, pp->free_send, kSendSlots));
    EPCHECK(regSlots(pp->recv, pp->recv_buf, pp->recv_mh, pp->free_recv, kRecvSlots));
    // Payloads go out of the outboxes and into the inboxes directly.
    pp->out_mh.assign(nchan_, nullptr);
    pp->in_mh.assign(nchan_, nullptr);
    for (int c = 0; c < nchan_; ++c)
      if (backend_->regMr(pp->send, pp->out_data[c], ring_bytes_, net::kNetPtrHost, &pp->out_mh[c]) != epSuccess ||
          backend_->regMr(pp->recv, own_->ringData(pp->rank, c), ring_bytes_, net::kNetPtrHost, &pp->in_mh[c]) !=
              epSuccess)
        EP_FAIL(epSystemError, "registering the net bridge's rings with the net transport: %s", net::netLastError());
  }
  const int64_t readiness = epParamNetReadiness();
  if (readiness > 0 && nremote >= readiness && (poller_ = backend_->openPoller()) != nullptr)
    for (auto& pp : peers_)
      if (pp && backend_->watchRecv(poller_, pp->recv) != epSuccess)  // (an unwatched comm reads on every test)
        EP_WARN("rank %d: the connection from rank %d is tested without the readiness poll: %s", rank_, pp->rank,
                net::netLastError());
  // Nobody sends data before every rank is connected (the creation barrier after this), so the receives
  // posted by the progress thread (or the owner's first assist) are in place before the first frame; the backends
  // queue early ones anyway.
  if (progress == Progress::kOwnThread) thread_ = std::thread([this] { progressLoop(); });
  driven_ = true;
  closed_.store(false, std::memory_order_release);
  EP_INFO(kSubsysInit, "net bridge: rank %d reaches %d ranks of other hosts over net/%s%s", rank_, nremote,
          backend_->name(), poller_ ? " (readiness poll)" : "");
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
  const int64_t budget = epParamNetStreamBudget();
  const int streams = budget > 0 ? static_cast<int>(std::max<int64_t>(1, budget / std::max(nremote, 1))) : 0;
  // Room for both ends of every connection under RLIMIT_NOFILE, checked before the first socket.
  char what[96];
  snprintf(what, sizeof(what), "rank %d's net connections to and from %d ranks of other hosts", rank_, nremote);
  if (net::ensureDescriptors(size_t{2} * nremote * backend_->descriptorsPerConnection(streams), what) != epSuccess)
    return EP_ERROR(epSystemError, "%s", net::netLastError());
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
        if (backend_->connectStreams(0, handle[r].data(), {streams, kBridgeMinChunk}, &send[r]) != epSuccess) {
          res = EP_ERROR(epRemoteError, "rank %d: connecting to rank %d over the net transport: %s", rank_, r,
                         net::netLastError());
          break;
        }
        if (!send[r]) continue;
        moved = true;
        FrameHdr& h = hello[r];
        h = FrameHdr{kFrameMagic, kHello, 0, 0, rank_, {0, 0, gen, ring_bytes_}};
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
      if (h.v[3] != ring_bytes_) {  // DATA_NEXT payloads land where they stand in the sender's ring
        res = EP_ERROR(epInvalidUsage, "rank %d has %llu-byte net bridge rings, rank %d %zu: ranks must agree "
                       "(EPCOMM_QUEUE_BYTES, config.queue_bytes; EPCOMM_GPU_PROXY_RING_BYTES)", h.src,
                       static_cast<unsigned long long>(h.v[3]), rank_, ring_bytes_);
        backend_->closeRecv(a.comm);
        backend_->deregMr(a.comm, a.mh);
        a.comm = nullptr;
        break;
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

void NetBridge::queueFrame(Peer& p, uint16_t type, uint16_t ch, const uint64_t* v, uint32_t len,
                           std::vector<uint8_t>* body) {
  Peer::Desc d{type, ch, {0, 0, 0, 0}, len, false, {}};
  if (v) memcpy(d.v, v, sizeof(d.v));
  if (body) d.body.swap(*body);
  p.q.push_back(std::move(d));
}

// Posts queued frames in order and completes sends from the front. A DATA frame's payload is copied out of the
// outbox into the frame; a DATA_NEXT's goes as the next message straight from the outbox, which keeps it until the
// send completes (the bridge's own outbox until the peer credits it, which it cannot before receiving it; a caller's
// until outRead passes it).
bool NetBridge::pumpSends(Peer& p) {
  bool moved = false;
  while (!p.send_failed && !p.inflight.empty()) {
    int done = 0;
    const epResult_t r = timed(kCallTestSend, [&] { return backend_->test(p.inflight.front().req, &done, nullptr); });
    if (r != epSuccess) {
      p.send_failed = true;  // the peer closed its end, or stopped taking frames: nothing more goes to it
      if (r == epTimeout) markDead(p, net::netLastError());  // stalled (the backend's deadline), if still open
      break;
    }
    if (!done) break;
    const Peer::Sent& s = p.inflight.front();
    if (s.slot >= 0) p.free_send.push_back(s.slot);
    else flown(0, s.t_ns);  // a payload (frames have slots)
    if (s.ch >= 0) p.out_read[s.ch].store(s.end, std::memory_order_release);
    p.inflight.pop_front();
    moved = true;
  }
  auto post = [&](void* buf, size_t n, void* mh, int slot, int ch, uint64_t end, int tag) -> bool {
    void* req = nullptr;
    const epResult_t r = timed(kCallIsend, [&] { return backend_->isend(p.send, buf, n, tag, mh, &req); });
    if (r != epSuccess) {
      p.send_failed = true;
      if (r == epTimeout) markDead(p, net::netLastError());
      return false;
    }
    if (!req) return false;
    p.inflight.push_back(Peer::Sent{req, slot, ch, end, nowNs()});
    moved = true;
    return true;
  };
  // What this pass posts goes out together (a frame and the header of the payload after it, credits): one syscall.
  const bool cork = !p.send_failed && p.send != nullptr && !p.q.empty();
  if (cork) backend_->cork(p.send, true);
  while (!p.send_failed && !p.q.empty() && p.inflight.size() < kMaxSendsInFlight) {
    Peer::Desc& d = p.q.front();
    if (!d.hdr_posted) {
      if (p.free_send.empty()) break;
      const int slot = p.free_send.back();
      uint8_t* buf = p.send_buf[slot].data();
      FrameHdr h{kFrameMagic, d.type, d.ch, d.len, rank_, {d.v[0], d.v[1], d.v[2], d.v[3]}};
      memcpy(buf, &h, sizeof(h));
      if (d.type == kData) {
        const uint8_t* ring = p.out_data[d.ch];
        const size_t off = d.v[0] % ring_bytes_, first = std::min<size_t>(d.len, ring_bytes_ - off);
        memcpy(buf + sizeof(h), ring + off, first);
        if (first < d.len) memcpy(buf + sizeof(h) + first, ring, d.len - first);
      } else if (d.type == kDataPlaced) {
        memcpy(buf + sizeof(h), d.body.data(), d.len);
      }
      const bool data = d.type == kData;
      if (!post(buf, sizeof(h) + d.len, p.send_mh[slot], slot, data ? d.ch : -1, data ? d.v[0] + d.len : 0,
                kFrameTag))
        break;
      p.free_send.pop_back();
      if (d.type != kDataNext && d.type != kDataPlaced) {
        p.q.pop_front();
        continue;
      }
      d.hdr_posted = true;  // its payload must be the very next message
      if (p.inflight.size() >= kMaxSendsInFlight) break;
    }
    // (A DATA_PLACED payload is received by irecvScatter, which takes no tag: tag 0.)
    const int tag = d.type == kDataNext && backend_->matchesByTag() ? kPayloadTag : kFrameTag;
    if (!post(p.out_data[d.ch] + d.v[0] % ring_bytes_, d.v[1], p.out_mh[d.ch], -1, d.ch, d.v[0] + d.v[1], tag)) break;
    p.q.pop_front();
  }
  if (cork) backend_->cork(p.send, false);
  return moved;
}

// Whether a peer may send messages other than frames (DATA_NEXT or DATA_PLACED payloads). A peer sends DATA_NEXT
// payloads of at least kMinPayloadMsg and at most an eighth of the ring (both ends' rings are of one size), and
// DATA_PLACED only over a backend that scatters.
bool NetBridge::payloadsIn() const {
  return max_payload_ > 0 && (ring_bytes_ / 8 >= kMinPayloadMsg || (placement_ != nullptr && backend_->scatters()));
}

// Whether frame receives stay posted ahead of the payloads that come between them: over a backend that matches by
// tag, payloads (kPayloadTag) do not take the frames' receives (kFrameTag). Else, with payloads coming, the receiver
// posts one frame receive at a time, and over ofi (libfabric 1.17, tcp;ofi_rxm) nearly every message then arrives
// before its receive is posted. That is the setting every stall of a stream over ofi in CI had in common (20 s
// without progress, both processes alive; not reproduced locally, the cause inside the provider not found): rings
// under 2 MiB in s33 and s35, when frames alone also went one at a time (none since they stay posted kRecvSlots deep,
// 3be447d), and 4 MiB rings, with payloads, in s43's CI.
bool NetBridge::framesAhead() const { return payloadsIn() && backend_->matchesByTag() && !backend_->scatters(); }

// Receives frames and payloads in stream order (see Peer::rx): the front completes and is applied first. By what
// may come: frames only, kRecvSlots frame receives stay posted (a backend such as ofi then has a buffer for each as
// it comes); payloads over a backend that matches by tag (framesAhead), the same, and a DATA_NEXT's payload receive
// goes in right after its frame as that is checked (frames are checked in order, so payload receives are posted in
// the order their tag's sequence expects); payloads otherwise, one frame receive at a time, completed early, at the
// back, so that the payload it announces is posted while earlier ones still land.
bool NetBridge::pumpRecvs(Peer& p) {
  bool moved = false;
  const bool ahead = framesAhead();
  const bool one_frame = payloadsIn() && !ahead;
  // -1: failed (recorded), 0: not yet, 1: complete.
  auto test = [&](Peer::Rx& e) -> int {
    int done = 0;
    size_t got = 0;
    if (timed(kCallTestRecv, [&] { return backend_->test(e.req, &done, &got); }) != epSuccess) {
      // A frame receive after a goodbye: nothing was to come there (frames complete in order, so those before the
      // goodbye are in). Anything else, a payload included, is lost: the peer is dead.
      if (p.bye_in && e.slot >= 0) p.recv_failed = true;
      else markDead(p, net::netLastError());
      return -1;
    }
    if (!done) return 0;
    e.done = true;
    e.got = got;
    moved = true;
    if (e.slot >= 0) {
      --p.frames_posted;
      checkFrame(p, p.recv_buf[e.slot].data(), got);
    } else if (got != e.len) {
      markDead(p, "a payload of another size than its frame announced");
    } else {
      flown(1, e.t_ns);
    }
    return 1;
  };
  // A payload's receive into the inbox (its pieces elsewhere too where iov is given: DATA_PLACED); false: the peer
  // is dead (recorded); *req null: retry later.
  auto postPayload = [&](uint16_t ch, uint64_t off, uint32_t len, const std::vector<iovec>& iov, void** req) {
    void* data = own_->ringData(p.rank, ch) + off % ring_bytes_;
    size_t size = len;
    int tag = backend_->matchesByTag() ? kPayloadTag : kFrameTag;
    *req = nullptr;
    const epResult_t res = timed(kCallIrecv, [&] {
      return iov.empty() ? backend_->irecv(p.recv, 1, &data, &size, &tag, &p.in_mh[ch], req)
                         : backend_->irecvScatter(p.recv, iov.data(), static_cast<int>(iov.size()), req);
    });
    if (res != epSuccess) markDead(p, net::netLastError());
    return res == epSuccess;
  };
  // framesAhead: the payload that the frame at i (checked just now) announced, right after it.
  auto settle = [&](size_t i) {
    if (!ahead || !p.payload_due) return;
    p.rx.insert(p.rx.begin() + static_cast<std::ptrdiff_t>(i + 1),
                Peer::Rx{nullptr, -1, p.payload_ch, p.payload_len, false, 0, nowNs(), p.payload_off});
    p.payload_due = false;
  };
  for (;;) {
    if (p.recv_failed || p.ended) return moved;  // after a goodbye (or its acknowledgement) nothing more will come
    bool step = false;
    // The front, in order (and no further test once a goodbye is applied: receives posted after it may fail).
    while (!p.rx.empty() && !p.ended) {
      if (!p.rx.front().done) {
        if (p.rx.front().req == nullptr || test(p.rx.front()) <= 0) break;  // (null: its payload is not posted yet)
        settle(0);
      }
      if (p.recv_failed) return moved;
      Peer::Rx& e = p.rx.front();
      if (e.slot >= 0) {
        applyFrame(p, p.recv_buf[e.slot].data(), e.got);
        p.free_recv.push_back(e.slot);
      } else {
        RingCtl* ctl = own_->ringCtl(p.rank, e.ch);
        ctl->tail.store(ctl->tail.load(std::memory_order_relaxed) + e.len, std::memory_order_release);
      }
      p.rx.pop_front();
      step = true;
    }
    if (p.recv_failed) return moved;
    if (ahead) {
      // The frames past the front, in order (none past a goodbye), so that the payloads they announce are posted
      // while earlier ones still land.
      for (size_t i = 0; i < p.rx.size() && !p.bye_in; ++i) {
        if (p.rx[i].done || p.rx[i].slot < 0) continue;
        const int t = test(p.rx[i]);
        if (t < 0 || p.recv_failed) return moved;
        if (t == 0) break;
        settle(i);
        step = true;
      }
      // The payload receives they announced, in stream order.
      for (Peer::Rx& e : p.rx) {
        if (e.slot >= 0 || e.req != nullptr) continue;
        void* req = nullptr;
        if (!postPayload(e.ch, e.off, e.len, {}, &req)) return moved;
        if (!req) break;
        e.req = req;
        e.t_ns = nowNs();
        step = true;
      }
    } else if (one_frame && p.frames_posted > 0 && p.rx.size() > 1 && !p.rx.back().done) {
      // The frame receive at the back (unless it is the front, tested just now).
      const int t = test(p.rx.back());
      if (t < 0 || p.recv_failed) return moved;
      if (t > 0) step = true;
    }
    // Post what comes next: the announced payload (one posting order), then frames.
    if (p.payload_due) {
      void* req = nullptr;
      if (!postPayload(p.payload_ch, p.payload_off, p.payload_len, p.payload_iov, &req)) return moved;
      if (req) {
        p.rx.push_back(Peer::Rx{req, -1, p.payload_ch, p.payload_len, false, 0, nowNs()});
        p.payload_due = false;
        step = true;
      }
    }
    while (!p.payload_due && !(one_frame && p.frames_posted > 0) && !p.bye_in && !p.free_recv.empty()) {
      const int slot = p.free_recv.back();
      void* data = p.recv_buf[slot].data();
      size_t size = kFrameBytes;
      int tag = kFrameTag;
      void* req = nullptr;
      if (timed(kCallIrecv, [&] { return backend_->irecv(p.recv, 1, &data, &size, &tag, &p.recv_mh[slot], &req); }) !=
          epSuccess) {
        markDead(p, net::netLastError());
        return moved;
      }
      if (!req) break;
      p.free_recv.pop_back();
      p.rx.push_back(Peer::Rx{req, slot, 0, 0, false, 0, nowNs()});
      ++p.frames_posted;
      step = true;
    }
    if (!step) return moved;
    moved = true;
  }
}

// A frame from peer p as it comes in, before anything later is posted: everything in it is checked before use, a
// violation ends the connection (R5). DATA and DATA_NEXT must continue the stream and fit the inbox's free room
// (the consumer's head only grows, so they still fit when applied); a DATA_NEXT's payload receive is due next.
void NetBridge::checkFrame(Peer& p, const uint8_t* buf, size_t n) {
  FrameHdr h;
  if (n < sizeof(h)) return markDead(p, "a frame shorter than its header");
  memcpy(&h, buf, sizeof(h));
  if (h.magic != kFrameMagic || h.src != p.rank || h.len != n - sizeof(h) ||
      (h.type != kData && h.type != kDataPlaced && h.len != 0) || h.ch >= nchan_)
    return markDead(p, "a malformed frame (stream out of sync)");
  if (h.type == kBye || h.type == kByeAck) p.bye_in = true;
  if (h.type == kCredit) {
    // Applied as it comes in, not in stream order: it concerns only the stream toward the peer, and in order it
    // would wait for every payload from the peer posted before it (up to an inbox's credit of them) to land.
    RingCtl& ctl = p.out_ctl[h.ch];
    if (h.v[0] < ctl.head.load(std::memory_order_relaxed) || h.v[0] > p.sent[h.ch])
      return markDead(p, "a credit for bytes never sent");
    ctl.head.store(h.v[0], std::memory_order_release);
    return;
  }
  if (h.type != kData && h.type != kDataNext && h.type != kDataPlaced) return;
  if (h.type != kData && !payloadsIn())  // its payload would land in the frame receives posted ahead
    return markDead(p, "a DATA_NEXT or DATA_PLACED frame on a connection that takes none");
  if (h.type == kDataPlaced && (placement_ == nullptr || !backend_->scatters()))
    return markDead(p, "a DATA_PLACED frame to a rank that places nothing");
  const uint64_t len = h.type == kData ? h.len : h.v[1];
  const uint64_t head = own_->ringCtl(p.rank, h.ch)->head.load(std::memory_order_acquire);
  if (h.v[0] != p.rx_expect[h.ch] || len == 0 || (h.type != kData && len > ring_bytes_ / 8) ||
      h.v[0] + len - head > ring_bytes_)
    return markDead(p, "a data frame beyond its credit or out of order");
  p.rx_expect[h.ch] += len;
  if (h.type == kData) return;
  if (h.v[0] % ring_bytes_ + len > ring_bytes_) return markDead(p, "a data payload across the end of the ring");
  p.payload_iov.clear();
  if (h.type == kDataPlaced && !placeIov(p, h.ch, h.v[0], len, buf + sizeof(h), h.len)) return;
  p.payload_due = true;
  p.payload_ch = h.ch;
  p.payload_off = h.v[0];
  p.payload_len = static_cast<uint32_t>(len);
}

// A DATA_PLACED frame's pieces (`bytes` of PlacedSeg for the payload of `len` bytes at stream offset `off` of
// channel ch), checked, into p.payload_iov: the payload's bytes in order, each piece where Placement::place says and
// the bytes between them in the inbox where they stand in the ring, and a Receipt where each placed piece would
// stand there. A piece place() refuses lands there too: the owner's checks of the stream, in order, refuse it after
// everything before it (as for any record it finds bad).
// False (the connection ended) for a malformed frame.
bool NetBridge::placeIov(Peer& p, int ch, uint64_t off, uint64_t len, const uint8_t* segs, size_t bytes) {
  const size_t nseg = bytes / sizeof(PlacedSeg);
  if (bytes % sizeof(PlacedSeg) != 0 || nseg == 0 || nseg > kMaxPlacedSegs) {
    markDead(p, "a DATA_PLACED frame of a malformed size");
    return false;
  }
  uint8_t* inbox = own_->ringData(p.rank, ch) + off % ring_bytes_;
  uint64_t at = 0;  // payload bytes given a place so far
  for (size_t i = 0; i < nseg; ++i) {
    PlacedSeg sg;
    memcpy(&sg, segs + i * sizeof(sg), sizeof(sg));
    if (sg.off < at || sg.off >= len || sg.len == 0 || sg.len > len - sg.off) {
      markDead(p, "a DATA_PLACED piece out of order or past its payload");
      p.payload_iov.clear();
      return false;
    }
    if (sg.off > at) p.payload_iov.push_back(iovec{inbox + at, sg.off - at});
    uint8_t* dst = placement_->place(p.rank, sg.key, sg.len);
    p.payload_iov.push_back(iovec{dst ? dst : inbox + sg.off, sg.len});
    if (dst != nullptr && sg.len >= sizeof(Placement::Receipt)) {  // the piece's inbox bytes stay free: say so there
      const Placement::Receipt rc{sg.key, sg.len, Placement::Receipt::kMagic};
      memcpy(inbox + sg.off, &rc, sizeof(rc));
    }
    at = static_cast<uint64_t>(sg.off) + sg.len;
  }
  if (at < len) p.payload_iov.push_back(iovec{inbox + at, len - at});
  return true;
}

// A frame from peer p, in stream order (checkFrame passed it when it came in).
void NetBridge::applyFrame(Peer& p, const uint8_t* buf, size_t n) {
  if (p.recv_failed || p.ended) return;
  FrameHdr h;
  memcpy(&h, buf, sizeof(h));
  (void)n;
  switch (h.type) {
    case kData: {
      RingCtl* ctl = own_->ringCtl(p.rank, h.ch);
      uint8_t* ring = own_->ringData(p.rank, h.ch);
      const uint64_t tail = ctl->tail.load(std::memory_order_relaxed);
      const size_t off = tail % ring_bytes_, first = std::min<size_t>(h.len, ring_bytes_ - off);
      memcpy(ring + off, buf + sizeof(h), first);
      if (first < h.len) memcpy(ring, buf + sizeof(h) + first, h.len - first);
      ctl->tail.store(tail + h.len, std::memory_order_release);
      return;
    }
    case kDataNext:
    case kDataPlaced: return;  // its payload, next in line, moves the tail
    case kCredit: return;  // applied as it came in (checkFrame)
    case kReadDone: p.out_ctl[h.ch].read_done.store(h.v[0], std::memory_order_release); return;
    case kCtrl: {
      RegionHeader* m = mirrors_[p.rank].get();
      m->rs_hash.store(h.v[1], std::memory_order_relaxed);
      m->rs_epoch.store(h.v[2], std::memory_order_relaxed);
      m->rs_status.store(static_cast<int32_t>(static_cast<uint32_t>(h.v[3])), std::memory_order_relaxed);
      m->rs_ok.store(h.v[3] >> 32, std::memory_order_relaxed);
      m->rs_word.store(h.v[0], std::memory_order_release);
      return;
    }
    case kOut: {  // a word of the peer's recovery sets: bits only get set, so OR them in
      const uint64_t set = h.v[0] >> 32, idx = h.v[0] & 0xffffffffu;
      if (set > 1 || idx >= static_cast<uint64_t>((nranks_ + 63) / 64)) return markDead(p, "a malformed OUT frame");
      RegionHeader* m = mirrors_[p.rank].get();
      (set == 0 ? m->rc_accused : m->rc_masked)[idx].fetch_or(h.v[1], std::memory_order_relaxed);
      m->rc_gen.fetch_add(1, std::memory_order_release);
      return;
    }
    case kBye:  // everything it sent is in; the acknowledgement tells it that it may close
      p.bye = p.ended = true;
      // Nothing more is read from it; its end, once it closes, would be reported by every poll.
      if (poller_ != nullptr && p.recv != nullptr) backend_->unwatchRecv(poller_, p.recv);
      p.said_bye.store(true, std::memory_order_release);
      // (Not needed when this rank said goodbye too: that ends the peer's wait as well.)
      if (!p.send_failed && !p.bye_queued) queueFrame(p, kByeAck, 0, nullptr, 0);
      return;
    case kByeAck:  // its last frame too (it frames nothing after another's goodbye), and it may close now
      p.bye_acked = p.ended = true;
      if (poller_ != nullptr && p.recv != nullptr) backend_->unwatchRecv(poller_, p.recv);
      return;
    default: return markDead(p, "a frame of an unknown type");
  }
}

NetBridge::CallStats NetBridge::callStats() const {
  CallStats st{};
  for (int k = 0; k < kNetCalls; ++k) {
    st.calls[k] = call_n_[k].load(std::memory_order_relaxed);
    st.ns[k] = call_ns_[k].load(std::memory_order_relaxed);
  }
  return st;
}

NetBridge::FlightStats NetBridge::flightStats() const {
  FlightStats st{};
  for (int d = 0; d < 2; ++d) {
    st.done[d] = flight_n_[d].load(std::memory_order_relaxed);
    st.ns[d] = flight_ns_[d].load(std::memory_order_relaxed);
  }
  return st;
}

uint64_t NetBridge::bytesSent() const {
  uint64_t n = 0;
  for (const auto& b : sent_bytes_) n += b.load(std::memory_order_relaxed);
  return n;
}

NetBridge::SendStats NetBridge::sendStats() const {
  SendStats st{};
  for (int k = 0; k < kSendKinds; ++k) {
    st.msgs[k] = sent_msgs_[k].load(std::memory_order_relaxed);
    st.bytes[k] = sent_bytes_[k].load(std::memory_order_relaxed);
    st.small[k] = sent_small_[k].load(std::memory_order_relaxed);
    st.small_bytes[k] = sent_small_bytes_[k].load(std::memory_order_relaxed);
  }
  return st;
}

// Frames what changed since the last pass: outbox bytes, the inbox's consumption (credit), read_done, and this
// rank's resynchronization words (read by the caller BEFORE the outboxes, see net_bridge.h "Order").
bool NetBridge::progressPeer(Peer& p, uint64_t word, const uint64_t* words) {
  bool moved = false;
  if (p.stop_send.load(std::memory_order_acquire) && !p.send_closed.load(std::memory_order_relaxed)) {
    // Closing cancels what is in flight and returns once the backend no longer reads the outboxes (net.h).
    if (p.send) backend_->closeSend(p.send);
    p.send = nullptr;
    p.send_failed = true;
    p.q.clear();
    p.inflight.clear();
    p.send_closed.store(true, std::memory_order_release);
    moved = true;
  }
  if (!p.send_failed && !p.bye) {  // a peer that said goodbye needs nothing more (but its acknowledgement)
    for (int c = 0; c < nchan_; ++c) {
      const uint64_t tail = p.out_ctl[c].tail.load(std::memory_order_acquire);
      // Placement (channel 0 only, over a backend that scatters): the owner's shortest run worth placing, 0 for none.
      const size_t min_run = placement_ && c == 0 && backend_->scatters() ? placement_->minRunBytes() : 0;
      while (p.sent[c] < tail) {
        // A DATA_NEXT payload is contiguous in the ring (and lands at the same place in the peer's).
        const size_t contiguous = ring_bytes_ - p.sent[c] % ring_bytes_;
        const size_t ready = std::min<uint64_t>(tail - p.sent[c], contiguous);
        const bool next = ready >= kMinPayloadMsg && max_payload_ >= kMinPayloadMsg;
        size_t n = next ? std::min(ready, max_payload_) : std::min<uint64_t>(tail - p.sent[c], kFramePayload);
        // A run of at least the owner's minRunBytes() that holds pieces it places goes as one message too
        // (DATA_PLACED: the receiver's backend scatters it as it lands), up to max_payload_.
        std::vector<uint8_t> segs;
        if (min_run > 0 && max_payload_ > 0 && ready >= min_run) {
          const size_t pn = std::min(ready, max_payload_);
          uint64_t from = p.sent[c], at = 0, key = 0;
          uint32_t plen = 0;
          while (segs.size() < kMaxPlacedSegs * sizeof(PlacedSeg) &&
                 placement_->nextPayload(p.rank, from, p.sent[c] + pn, &at, &plen, &key)) {
            const PlacedSeg sg{static_cast<uint32_t>(at - p.sent[c]), plen, key};
            segs.insert(segs.end(), reinterpret_cast<const uint8_t*>(&sg),
                        reinterpret_cast<const uint8_t*>(&sg) + sizeof(sg));
            from = at + plen;
          }
          if (!segs.empty()) n = pn;
        }
        const uint64_t v[4] = {p.sent[c], n, 0, 0};
        const int kind = !segs.empty() ? kSendPlaced : next ? kSendNext : kSendFrame;
        if (!segs.empty())
          queueFrame(p, kDataPlaced, static_cast<uint16_t>(c), v, static_cast<uint32_t>(segs.size()), &segs);
        else
          queueFrame(p, next ? kDataNext : kData, static_cast<uint16_t>(c), v, next ? 0 : static_cast<uint32_t>(n));
        p.sent[c] += n;
        if (min_run > 0) placement_->framed(p.rank, p.sent[c]);
        sent_msgs_[kind].fetch_add(1, std::memory_order_relaxed);
        sent_bytes_[kind].fetch_add(n, std::memory_order_relaxed);
        if (n <= kFramePayload) {
          sent_small_[kind].fetch_add(1, std::memory_order_relaxed);
          sent_small_bytes_[kind].fetch_add(n, std::memory_order_relaxed);
        }
        moved = true;
      }
      RingCtl* in = own_->ringCtl(p.rank, c);
      const uint64_t head = in->head.load(std::memory_order_acquire);
      const uint64_t in_tail = in->tail.load(std::memory_order_relaxed);
      // Credit in steps of 1/8 ring, or all of it once the inbox is empty: the producer never sees less room
      // than 7/8 of what the consumer has freed, which keeps every wait for a row (<= half a ring) live.
      if (head != p.credited[c] && (head - p.credited[c] >= ring_bytes_ / 8 || head == in_tail)) {
        const uint64_t v[4] = {head, 0, 0, 0};
        queueFrame(p, kCredit, static_cast<uint16_t>(c), v, 0);
        p.credited[c] = head;
        moved = true;
      }
      const uint64_t rd = in->read_done.load(std::memory_order_acquire);
      if (rd != p.rd_sent[c]) {
        const uint64_t v[4] = {rd, 0, 0, 0};
        queueFrame(p, kReadDone, static_cast<uint16_t>(c), v, 0);
        p.rd_sent[c] = rd;
        moved = true;
      }
    }
    // The recovery sets before the word (read after it, so they hold at least what was set before it was
    // published): a peer that sees this rank's word has its sets too.
    if (words[3] != p.rc_gen_sent) {
      const RegionHeader* me = own_->header();
      for (uint64_t set = 0; set < 2; ++set)
        for (int i = 0; i < (nranks_ + 63) / 64; ++i) {
          const uint64_t b = (set == 0 ? me->rc_accused : me->rc_masked)[i].load(std::memory_order_relaxed);
          if (b == p.rc_sent[set][i]) continue;
          const uint64_t v[4] = {set << 32 | static_cast<uint64_t>(i), b, 0, 0};
          queueFrame(p, kOut, 0, v, 0);
          p.rc_sent[set][i] = b;
        }
      p.rc_gen_sent = words[3];
      moved = true;
    }
    if (word != p.ctrl_sent[0] || words[0] != p.ctrl_sent[1] || words[1] != p.ctrl_sent[2] ||
        words[2] != p.ctrl_sent[3]) {
      const uint64_t v[4] = {word, words[0], words[1], words[2]};
      queueFrame(p, kCtrl, 0, v, 0);
      memcpy(p.ctrl_sent, v, sizeof(v));
      moved = true;
    }
  }
  moved = pumpSends(p) || moved;
  moved = pumpRecvs(p) || moved;
  if (!moved) watch(p);
  return moved;
}

// The backend's stall deadline fires only on a peer that shows no sign of life; a request that never completes while
// the peer's heartbeats still come (a lost completion, a provider that stopped making progress) would leave only the
// engine's deadline, with no cause. A send, or a payload receive (its frame is in, so its bytes are on their way),
// still pending after half of EPCOMM_TIMEOUT_MS is reported, with the peer's state: once until no request is late.
void NetBridge::watch(Peer& p) {
  if (p.dead.load(std::memory_order_relaxed) || p.send_failed || p.recv_failed) return;
  const int64_t now = nowNs();
  const char* what = nullptr;
  int64_t t = 0;
  if (!p.inflight.empty() && now - p.inflight.front().t_ns > stuck_ns_) {
    what = "a send to";
    t = p.inflight.front().t_ns;
  } else {
    for (const Peer::Rx& e : p.rx)
      if (e.slot < 0 && !e.done && now - e.t_ns > stuck_ns_) {
        what = "a payload receive from";
        t = e.t_ns;
        break;
      }
  }
  if (!what) {
    p.stuck_said = false;  // nothing is late (any more): the next stall is reported again
    return;
  }
  if (p.stuck_said) return;
  p.stuck_said = true;
  // (A peer that died shows the same until the backend's stall deadline, EPCOMM_TIMEOUT_MS, says so.)
  EP_WARN("rank %d: %s rank %d over net/%s has not completed in %.1f s, and the connection has not failed: %s", rank_,
          what, p.rank, backend_->name(), (now - t) / 1e9, describeLocked(p).c_str());
}

// The caller makes p's net calls (or holds its lock).
std::string NetBridge::describeLocked(const Peer& p) const {
  const int64_t now = nowNs();
  std::string s;
  char b[256];
  for (int c = 0; c < nchan_; ++c) {
    const RingCtl* in = own_->ringCtl(p.rank, c);
    snprintf(b, sizeof(b), "ch %d out tail %llu head %llu framed %llu read %llu; in tail %llu head %llu expect %llu "
             "credited %llu; ", c, static_cast<unsigned long long>(p.out_ctl[c].tail.load()),
             static_cast<unsigned long long>(p.out_ctl[c].head.load()), static_cast<unsigned long long>(p.sent[c]),
             static_cast<unsigned long long>(p.out_read[c].load()), static_cast<unsigned long long>(in->tail.load()),
             static_cast<unsigned long long>(in->head.load()), static_cast<unsigned long long>(p.rx_expect[c]),
             static_cast<unsigned long long>(p.credited[c]));
    s += b;
  }
  const double send_age = p.inflight.empty() ? 0 : (now - p.inflight.front().t_ns) / 1e6;
  const double recv_age = p.rx.empty() ? 0 : (now - p.rx.front().t_ns) / 1e6;
  snprintf(b, sizeof(b), "frames queued %zu%s, sends in flight %zu (oldest %.0f ms), receives posted %zu (oldest "
           "%.0f ms, %s), payload due %d; failed send %d recv %d, goodbye in %d", p.q.size(),
           !p.q.empty() && p.q.front().hdr_posted ? " (a payload next)" : "", p.inflight.size(), send_age, p.rx.size(),
           recv_age, p.rx.empty() ? "-" : p.rx.front().slot < 0 ? "a payload" : "a frame", p.payload_due ? 1 : 0,
           p.send_failed ? 1 : 0, p.recv_failed ? 1 : 0, p.bye_in ? 1 : 0);
  s += b;
  return s;
}

std::string NetBridge::describe(int r) {
  if (r < 0 || r >= nranks_ || !peers_[r]) return "not a rank of another host";
  Peer& p = *peers_[r];
  // Bounded: the thread making p's calls may be the one that is stuck (inside the backend).
  const int64_t until = nowNs() + 200 * 1000000LL;
  while (!p.tryLock()) {
    if (nowNs() > until)
      return "its net calls have been held by another thread for 200 ms or more (stuck in the backend?)";
    std::this_thread::yield();
  }
  std::string s = describeLocked(p);
  p.unlock();
  return s;
}

void NetBridge::readWords(uint64_t* word, uint64_t* words) const {
  RegionHeader* me = own_->header();
  *word = me->rs_word.load(std::memory_order_acquire);
  words[0] = me->rs_hash.load(std::memory_order_relaxed);
  words[1] = me->rs_epoch.load(std::memory_order_relaxed);
  // Status in the low half, the last round completed successfully (low 32 bits) in the high half.
  words[2] = static_cast<uint64_t>(static_cast<uint32_t>(me->rs_status.load(std::memory_order_relaxed))) |
             (me->rs_ok.load(std::memory_order_relaxed) << 32);
  words[3] = me->rc_gen.load(std::memory_order_acquire);
}

bool NetBridge::assist() {
  if (closed_.load(std::memory_order_acquire)) return false;
  return pass(false);
}

bool NetBridge::pass(bool after_close) {
  bool moved = false;
  bool polled = poller_ == nullptr;
  // A peer another thread is serving right now is skipped, not waited for (it is being moved).
  for (auto& pp : peers_) {
    if (!pp || !pp->tryLock()) continue;
    const bool serve = after_close || !closed_.load(std::memory_order_acquire);
    // Readiness once per pass, under the first peer lock this thread takes: shutdown waits for every such lock
    // before it closes the comms and the poller, and a thread that serves no peer has nothing to poll for.
    if (!polled && serve) {
      timed(kCallPoll, [&] {
        backend_->pollReady(poller_);
        return epSuccess;
      });
      polled = true;
    }
    // The words before the peer's outboxes (see "Order"), and under its lock: words read before another thread
    // framed newer ones would otherwise go out after them, and the peer's mirror would step back.
    uint64_t word, words[4];
    readWords(&word, words);
    if (serve) moved = progressPeer(*pp, word, words) || moved;
    pp->unlock();
  }
  return moved;
}

void NetBridge::progressLoop() {
  nameThisThread("epcomm-bridge");
  Backoff backoff;
  for (;;) {
    bool moved = pass(true);
    if (stop_.load(std::memory_order_acquire)) {
      // Every engine thread is out of assist() by now (shutdown took every peer's lock after closed_), so this
      // thread (the progress thread, or shutdown's caller where the owner drives the bridge) alone touches the
      // peers.
      if (!flush_.load(std::memory_order_relaxed)) break;
      // Flushing: once a live peer's outboxes are framed and its queue is empty, say goodbye; done with it when it
      // has acknowledged that (or its connection ended), or once it said goodbye itself and what this rank still
      // had queued for it (the acknowledgement) is out: a peer that said goodbye is sent nothing more (progressPeer),
      // so outboxes left unframed then would keep this rank's goodbye back for good. Closing earlier could cost the
      // peer frames: a backend may report the end of a connection instead of messages that arrived just before it.
      auto flushed = [](const Peer& p) {
        if (!p.q.empty() || !p.inflight.empty()) return false;
        return p.bye || (p.bye_queued && (p.bye_acked || p.recv_failed));
      };
      const bool late = nowNs() > flush_deadline_ns_;
      bool all = true;
      for (auto& pp : peers_) {
        if (!pp || pp->send_failed || pp->dead.load() || !flush_live_[pp->rank]) continue;
        if (!pp->bye_queued && !pp->bye && pp->q.empty()) {
          bool framed = true;
          for (int c = 0; c < nchan_; ++c) framed = framed && pp->sent[c] == pp->out_ctl[c].tail.load();
          if (framed) {
            queueFrame(*pp, kBye, 0, nullptr, 0);
            pp->bye_queued = true;
            moved = true;
          }
        }
        if (flushed(*pp)) continue;
        all = false;
        if (late && flush_deadline_ns_ > flush_start_ns_)  // (none when the caller's flush used up the time: it warned)
          EP_WARN("net bridge: rank %d closes its connections with rank %d before their goodbyes completed "
                  "(%d ms): %s", rank_, pp->rank, static_cast<int>((flush_deadline_ns_ - flush_start_ns_) / 1000000),
                  describeLocked(*pp).c_str());
      }
      if (all || late) break;
    }
    if (moved) backoff.reset();
    else backoff.pause();
  }
}

void NetBridge::shutdown(bool flush, const uint8_t* live, int timeout_ms) {
  if (driven_) {
    driven_ = false;
    // No engine thread starts serving a peer from here on; wait for those that are serving one now.
    closed_.store(true, std::memory_order_release);
    for (auto& pp : peers_)
      if (pp) {
        pp->lock();
        pp->unlock();
      }
    flush_live_.assign(nranks_, 0);
    if (live) std::copy(live, live + nranks_, flush_live_.begin());
    flush_start_ns_ = nowNs();
    flush_deadline_ns_ = flush_start_ns_ + static_cast<int64_t>(timeout_ms) * 1000000LL;
    flush_.store(flush && live != nullptr, std::memory_order_relaxed);
    stop_.store(true, std::memory_order_release);
    // Progress::kCaller: nobody else drives the peers any more, so this thread makes the last pass and the flush
    // (progressLoop ends as it does in the progress thread: at once without a flush, else when every live peer
    // acknowledged the goodbye or the deadline passed).
    if (thread_.joinable()) thread_.join();
    else progressLoop();
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
    pp->inflight.clear();
    pp->rx.clear();
  }
  for (auto& pp : peers_) {
    if (!pp) continue;
    for (void* mh : pp->send_mh)
      if (mh) backend_->deregMr(pp->send, mh);
    for (void* mh : pp->recv_mh)
      if (mh) backend_->deregMr(pp->recv, mh);
    for (void* mh : pp->out_mh)
      if (mh) backend_->deregMr(pp->send, mh);
    for (void* mh : pp->in_mh)
      if (mh) backend_->deregMr(pp->recv, mh);
    pp->out_mh.clear();
    pp->in_mh.clear();
    pp->send = nullptr;
    pp->recv = nullptr;
    pp->send_mh.clear();
    pp->recv_mh.clear();
  }
  if (listen_) backend_->closeListen(listen_);
  listen_ = nullptr;
  if (poller_) backend_->closePoller(poller_);  // after the comms it watched (net.h)
  poller_ = nullptr;
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
