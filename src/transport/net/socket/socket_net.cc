// The socket backend: epcomm's own TCP transport.
//
// A connection is one control socket plus S = NTHREADS x NSOCKS data sockets, owned by NTHREADS helper
// threads on each side, and a liveness socket (see "Stall deadline"). Every message sends a 16-byte header
// {magic, tag, size} on the control socket, in posting order; that is what makes matching ordered and lets the
// receiver bounds-check the size against the buffer it posted before a single payload byte lands. Small
// payloads (<= inline) follow the header on the control socket and are moved by the caller's thread (no
// hand-off latency). Larger ones are cut into chunks dealt round-robin over the data sockets; both sides
// compute the same plan from the size and a per-connection socket cursor, so per-socket FIFO order is all the
// framing the data sockets need. The helper threads move the chunks, except those of a lone message (nothing
// else queued, up to EPCOMM_NET_ASSIST_MAX bytes): the caller's isend/irecv/test calls move those, so that it
// does not wait for a helper to wake up; many messages in flight still spread over the helpers.
//
// Stall deadline. A receiver that is alive may leave the sockets full for any time (NCCL posts a receive when
// its rank reaches the collective), so "no byte accepted by the kernel for EPCOMM_TIMEOUT_MS" alone would fail
// live peers; so would TCP_USER_TIMEOUT, which current Linux (seen on 6.18) also applies to a window that stays
// closed, even while the peer's kernel answers every probe. Instead helper thread 0 of each side writes one
// byte every min(EPCOMM_TIMEOUT_MS / 4, 1 s) on the liveness socket and reads the peer's (as the ofi backend
// beats on its side channel): a peer that is alive keeps beating whether or not it reads or sends, one that is
// stopped, frozen or cut off does not. A request that waits fails with a timeout once, for EPCOMM_TIMEOUT_MS,
// no byte moved and no heartbeat came (a receive in the middle of a message already when no byte came). Time this
// process was stopped itself does not count (a suspended job: the peer could not beat either); helper 0 notices
// the gap in its own turns. Heartbeats get a socket of their own: closing a socket with unread bytes in its
// receive queue makes the kernel reset it, which would throw away what the closing side had handed to it and
// not yet sent.
//
// Wire (little-endian host order; both ends are the same build):
//   every socket, first: Hello {magic, version, secret, connId, index, nsocks, chunk params}
//                        (index 0 = control, 1..nsocks = data, nsocks + 1 = liveness)
//   control socket:      MsgHeader {magic, tag, size} [+ payload when size <= inline]
//   data socket k:       raw chunk bytes
//   liveness socket:     heartbeat bytes, both ways
#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
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

EP_PARAM(NetNthreads, "NET_NTHREADS", 4);           // helper threads per connection (each side)
EP_PARAM(NetNsocks, "NET_NSOCKS", 2);               // data sockets per helper thread
EP_PARAM(NetChunk, "NET_CHUNK", 512 << 10);         // largest piece of a message on one data socket
EP_PARAM(NetMinChunk, "NET_MIN_CHUNK", 64 << 10);   // a message is not cut finer than this
EP_PARAM(NetInline, "NET_INLINE", 64 << 10);        // payloads up to this go on the control socket
EP_PARAM(NetAssistMax, "NET_ASSIST_MAX", -1);       // lone messages up to this move in the caller (-1: by CPUs)

// CPUs this process may run on (its affinity mask: a container's cpuset, taskset), else the online ones.
int64_t usableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  return cpus > 0 ? cpus : 1;
}

// Helper threads per connection: EPCOMM_NET_NTHREADS, or by default 4 capped at the usable CPUs — more threads
// than cores only contend with the proxy thread and the kernel's own TCP work (measured on a 2-core VM).
int64_t helperThreads() {
  if (paramString("EPCOMM_NET_NTHREADS")) return std::clamp<int64_t>(epParamNetNthreads(), 1, 64);
  return std::clamp<int64_t>(std::min<int64_t>(epParamNetNthreads(), usableCpus()), 1, 64);
}

// Lone messages moved by the caller's thread (see planChunks): EPCOMM_NET_ASSIST_MAX when it is 0 or more, else (the
// default, -1, or a value that does not parse) 512 KiB when this process may use at most 4 CPUs, else none. With few
// cores a helper's wake-up waits for one (about 80 us per message on a 2-core VM, where the assist made 128-512 KiB
// ping-pongs 3.5-4.7x faster: cpu-net-socket-assist.log); with many, the helpers' parallel streams win: on a 16-core
// H200 host, NCCL's broadcast at 512 KiB - 8 MiB and its broadcast, all_gather, all_reduce and all_to_all at 2 MiB ran
// at 0.75-0.95x NCCL Socket with the assist, and at 1.1-2.5x without it (bench/results/h200-s9-nccl-plugin.log).
int64_t assistMax() {
  static const int64_t v = [] {
    const int64_t set = epParamNetAssistMax();
    if (set >= 0) return set;
    return usableCpus() <= 4 ? int64_t{512} << 10 : int64_t{0};
  }();
  return v;
}

constexpr uint32_t kHandleMagic = 0x45504e48;  // "EPNH"
constexpr uint32_t kHelloMagic = 0x4550484c;   // "EPHL"
constexpr uint32_t kMsgMagic = 0x45504d47;     // "EPMG"
constexpr uint32_t kVersion = 2;  // 2: the liveness socket (a version-1 peer would never beat)
constexpr int kMaxDataSocks = 64;
constexpr size_t kStage = 16 << 10;  // receiver's control-stream read-ahead (see SockComm::stage)

// Data sockets of a connection the caller makes (its Hello tells the peer): NTHREADS x NSOCKS, at most max_streams
// where that is positive (NetBackend::connectStreams). Each side then runs helpersFor(sockets) helper threads.
int dataSockets(int max_streams) {
  const int64_t T = std::clamp<int64_t>(helperThreads(), 1, kMaxDataSocks);
  int64_t S = std::clamp<int64_t>(T * std::max<int64_t>(1, epParamNetNsocks()), 1, kMaxDataSocks);
  if (max_streams > 0) S = std::min<int64_t>(S, max_streams);
  return static_cast<int>(S);
}

// Helper threads of a connection of `sockets` data sockets, on either side: NTHREADS, at most one per socket.
int helpersFor(int sockets) { return static_cast<int>(std::clamp<int64_t>(helperThreads(), 1, sockets)); }

struct SockConnectStage;

struct SocketHandle {
  uint32_t magic;
  uint32_t version;
  uint64_t secret;  // random per listen; connect must present it (DESIGN R5)
  NetAddr addr;
  uint32_t pad;
  SockConnectStage* stage;  // connect()'s progress, kept in the caller's copy of the handle
};
static_assert(sizeof(SocketHandle) <= kNetHandleSize);

struct Hello {
  uint32_t magic, version;
  uint64_t secret;
  uint64_t connId;
  uint32_t index, nsocks;
  uint32_t chunk, minChunk, inlineMax, pad;
};
static_assert(sizeof(Hello) == 48);

struct MsgHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t size;
};
static_assert(sizeof(MsgHeader) == 16);

struct SockComm;

struct SockRequest {
  SockComm* comm = nullptr;
  bool inUse = false;
  bool ctrlDone = false;
  int n = 0;
  int nMatched = 0;
  std::atomic<int> pending{0};  // chunks not yet moved
  bool assisted = false;         // a lone message: the caller moves its chunks too (planChunks)
  void* data[kNetMaxRecvs];
  size_t cap[kNetMaxRecvs];
  size_t got[kNetMaxRecvs];
  int tags[kNetMaxRecvs];
  bool matched[kNetMaxRecvs];
  MsgHeader hdr;  // send side
  // A scattered receive (irecvScatter, n == 1, data[0] null): the message's bytes land in these pieces in order;
  // seg_at[k] is where piece k starts in the message.
  std::vector<iovec> segs;
  std::vector<size_t> seg_at;
};

// Message bytes [at, at + n) of a scattered receive as at most `max` pieces of its segments; returns how many.
// A recvmsg takes at most kIov pieces (on the stack); a chunk with more is read in several, as partial reads are.
constexpr int kIov = 64;
int scatterIov(const SockRequest* r, size_t at, size_t n, iovec* iov, int max) {
  size_t k = static_cast<size_t>(std::upper_bound(r->seg_at.begin(), r->seg_at.end(), at) - r->seg_at.begin()) - 1;
  int m = 0;
  for (; k < r->segs.size() && n > 0 && m < max; ++k) {
    const size_t skip = at - r->seg_at[k], take = std::min(n, r->segs[k].iov_len - skip);
    iov[m++] = {static_cast<char*>(r->segs[k].iov_base) + skip, take};
    at += take;
    n -= take;
  }
  return m;
}

// recvSome into message bytes [at, at + n) of a scattered receive.
ssize_t recvScatter(int fd, const SockRequest* r, size_t at, size_t n, std::string* err) {
  if (n == 0) return 0;
  iovec iov[kIov];
  return recvSomeV(fd, iov, scatterIov(r, at, n, iov, kIov), err);
}

struct Chunk {
  char* ptr;  // (a scattered receive: null, its bytes start at message offset `at`)
  size_t at;
  size_t len;
  size_t done;
  SockRequest* req;
  bool assist;  // the caller's test() may move it too (a lone message, see planChunks)
};

struct DataSock {
  int fd = -1;
  int helper = 0;
  std::mutex mu;
  std::deque<Chunk> q;  // only the holder of `busy` pops; references stay valid across push_back
  std::atomic<int> queued{0};  // q.size(), readable without the lock
  std::atomic<int> assistQueued{0};  // of which the caller may move (Chunk::assist)
  // Who moves this socket's bytes now: its helper, or the thread calling test() (see moveChunks).
  std::atomic<bool> busy{false};
};

struct Helper {
  std::thread th;
  int efd = -1;
  std::vector<int> socks;
  // Set while it is about to sleep in poll() or sleeps there: only then does new work need a wake-up (an eventfd
  // write, a syscall on the thread queuing the chunks). Dekker with DataSock::queued, both sides seq_cst: the helper
  // sets it and then looks at its queues, planChunks queues and then reads it, so one of them sees the other.
  std::atomic<bool> sleeping{false};
};

struct SockPoller;

struct SockComm {
  bool isSend = false;
  std::string peer;
  int ctrlFd = -1;
  int liveFd = -1;  // heartbeats, both ways: written and read by helper 0 (read by test() too)
  std::atomic<bool> liveOpen{true};     // false once the peer closed its end
  std::atomic<int64_t> lastHeardNs{0};  // last heartbeat read
  NetTurnClock turns;                   // helper 0's (stall clocks restart after this process was stopped)
  std::vector<std::unique_ptr<DataSock>> data;
  std::vector<std::unique_ptr<Helper>> helpers;
  std::atomic<bool> stop{false};
  std::atomic<int> errCode{0};
  std::mutex errMu;
  std::string errMsg;
  std::atomic<int64_t> lastProgressNs{0};
  size_t chunk = 0, minChunk = 0, inlineMax = 0;  // the sender's, sent in Hello
  int nextSock = 0;
  // Control-socket state; touched only by the thread that calls isend/irecv/test (NCCL's proxy thread).
  std::deque<SockRequest*> ctrlQ;
  bool corked = false;  // isend queues the control bytes only (NetBackend::cork)
  MsgHeader hdr{};
  size_t hdrGot = 0;
  int inlineIdx = -1;
  size_t inlineGot = 0;
  size_t ctrlSent = 0;
  // Receiver: bytes read from the control socket ahead of need. Waiting for a header reads up to kStage bytes
  // at once, so a small message (header + inline payload), and often the next ones, costs one recv() instead
  // of two; remainders of kStage or more go straight into the posted buffer (no extra copy for big payloads).
  std::unique_ptr<char[]> stage;
  size_t stageBeg = 0, stageEnd = 0;
  // Readiness (NetBackend::watchRecv): the poller watching ctrlFd, level-triggered, or null. pollReady raises
  // ctrlReady while bytes, an end or an error wait on the socket; ctrlRead lowers it just before its recv() and
  // raises it again when that recv() filled what it asked for (more may wait: the next read of this test goes on
  // at once). A recv() that took less leaves it lowered until the next poll, which reports whatever still waits.
  // (Edge-triggered would lose an end that arrived with the last bytes: one recv() returns those bytes and takes
  // the FIN, the next would return 0, and no new edge ever comes; a dead peer would then never be noticed.)
  SockPoller* poller = nullptr;
  std::atomic<bool> ctrlReady{true};
  std::unique_ptr<SockRequest[]> pool;
  std::vector<SockRequest*> freeList;

  // First error wins; it is logged once here and reported by every later call.
  void fail(epResult_t code, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    record(code, true, msg);
  }
  // The peer closed the connection between messages, with none of the front receive's messages begun and no chunk
  // of an earlier one still to move: how every orderly end looks (the net bridge's peer closes once its goodbye is
  // through). The receives still posted fail as for any end; the log says it at INFO, not as a warning (a death
  // there reaches the caller all the same).
  void closedBetweenMessages() {
    record(epRemoteError, false,
           ("NET/epcomm: recv connection with peer " + peer + ": closed by the peer between messages").c_str());
  }
  void record(epResult_t code, bool warn, const char* msg) {
    std::lock_guard<std::mutex> g(errMu);
    if (errCode.load() != 0) return;
    errMsg = msg;
    errCode.store(code);
    if (warn) NET_WARN("%s", msg);
    else NET_INFO("%s", msg);
  }
  epResult_t error() {
    int c = errCode.load(std::memory_order_acquire);
    if (c == 0) return epSuccess;
    std::lock_guard<std::mutex> g(errMu);
    return netQuietError(static_cast<epResult_t>(c), errMsg.c_str());
  }
  const char* side() const { return isSend ? "send" : "recv"; }
};

// Reads the heartbeats that arrived; false once the peer closed its end (then there is nothing to watch).
bool drainLiveness(SockComm* c) {
  char b[64];
  for (;;) {
    ssize_t k = recv(c->liveFd, b, sizeof(b), MSG_DONTWAIT);
    if (k > 0) {
      c->lastHeardNs.store(nowNs(), std::memory_order_relaxed);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    c->liveOpen.store(false, std::memory_order_relaxed);
    return false;
  }
}

// An epoll set of receive comms' control sockets (NetBackend::openPoller).
struct SockPoller {
  int epfd = -1;
  std::atomic<int> watched{0};      // comms in the set (a poll asks for that many events at once)
  std::atomic<bool> broken{false};  // epoll_wait failed: every watched comm reads for itself again
};

// Takes c out of its poller's set: at its end (it is being destroyed) or once its control stream failed (an end or
// an error stays readable for good, and nobody reads it any more: it would be reported by every poll).
void unwatch(SockComm* c) {
  if (c->poller == nullptr) return;
  epoll_ctl(c->poller->epfd, EPOLL_CTL_DEL, c->ctrlFd, nullptr);
  c->poller->watched.fetch_sub(1, std::memory_order_relaxed);
  c->poller = nullptr;
}

// Moves the queued chunks of data socket si, front first, until the socket would block or the queue is empty
// (for the caller: until the front chunk is not a lone message's). Both the socket's helper and the thread
// calling test() do this (a lone message then moves at once, without the helper's wake-up latency, about 80 us
// per message on a 2-core VM); `busy` lets one of them at a time, so a socket's bytes stay in queue order. Returns 1 if bytes moved, 0 if
// none did (the socket would block, the queue is empty, or the other side holds it), -1 after a failure (recorded
// in c).
int moveChunks(SockComm* c, int si, bool caller) {
  DataSock& ds = *c->data[si];
  if ((caller ? ds.assistQueued : ds.queued).load(std::memory_order_acquire) == 0) return 0;
  if (ds.busy.exchange(true, std::memory_order_acquire)) return 0;
  std::string err;
  int moved = 0;
  for (;;) {
    Chunk* ch;
    {
      std::lock_guard<std::mutex> g(ds.mu);
      if (ds.q.empty() || (caller && !ds.q.front().assist)) break;
      ch = &ds.q.front();
    }
    ssize_t r = c->isSend                 ? sendSome(ds.fd, ch->ptr + ch->done, ch->len - ch->done, &err)
                : ch->req->segs.empty() ? recvSome(ds.fd, ch->ptr + ch->done, ch->len - ch->done, &err)
                                        : recvScatter(ds.fd, ch->req, ch->at + ch->done, ch->len - ch->done, &err);
    if (r < 0) {
      ds.busy.store(false, std::memory_order_release);
      c->fail(epRemoteError, "NET/epcomm: %s connection with peer %s: data socket %d: %s", c->side(),
              c->peer.c_str(), si, err.c_str());
      return -1;
    }
    if (r == 0) break;
    ch->done += r;
    moved = 1;
    // Stamped per call, not per pass: a socket that stays ready (a slow reader the sender keeps ahead of)
    // holds this thread in this loop, possibly for longer than the stall deadline.
    c->lastProgressNs.store(nowNs(), std::memory_order_relaxed);
    if (ch->done == ch->len) {
      SockRequest* req = ch->req;
      {
        std::lock_guard<std::mutex> g(ds.mu);
        if (ch->assist) ds.assistQueued.fetch_sub(1, std::memory_order_release);
        ds.q.pop_front();
        ds.queued.fetch_sub(1, std::memory_order_release);
      }
      req->pending.fetch_sub(1, std::memory_order_release);
    }
  }
  ds.busy.store(false, std::memory_order_release);
  return moved;
}

void helperLoop(SockComm* c, Helper* h) {
  nameThisThread("epcomm-sock");
  std::vector<pollfd> pfds;
  std::vector<bool> watched(h->socks.size());  // [i]: h->socks[i] has chunks queued that would block (poll() watches)
  // Helper 0 keeps the liveness socket: beats, and listens for the peer's.
  const bool live = h == c->helpers[0].get();
  const int64_t beatNs = netHeartbeatMs() * 1000000LL;
  int64_t nextBeatNs = 0;
  while (!c->stop.load(std::memory_order_acquire)) {
    bool progressed = false;
    int timeoutMs = 1000;
    pfds.clear();
    if (live) {
      int64_t now = nowNs();
      c->turns.turn(now);
      if (now >= nextBeatNs) {
        if (c->liveOpen.load(std::memory_order_relaxed)) {
          char b = 'h';
          ssize_t k = send(c->liveFd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);  // a full buffer just skips a beat
          if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            c->liveOpen.store(false, std::memory_order_relaxed);  // the peer closed: its errors come elsewhere
        }
        nextBeatNs = now + beatNs;
      }
      timeoutMs = static_cast<int>(std::clamp<int64_t>((nextBeatNs - now) / 1000000LL + 1, 1, 1000));
    }
    for (size_t i = 0; i < h->socks.size(); ++i) {
      const int si = h->socks[i];
      const int m = moveChunks(c, si, false);
      if (m < 0) return;
      if (m > 0) progressed = true;
      watched[i] = m == 0 && c->data[si]->queued.load(std::memory_order_acquire) > 0;
      if (watched[i]) pfds.push_back({c->data[si]->fd, static_cast<short>(c->isSend ? POLLOUT : POLLIN), 0});
    }
    if (progressed) continue;
    // Nothing moved: sleep until a socket is ready, new chunks are queued (eventfd) or a heartbeat is due/comes.
    // Chunks queued on an idle socket since the pass above came without a wake-up if `sleeping` was still false.
    h->sleeping.store(true, std::memory_order_seq_cst);
    bool fresh = false;
    for (size_t i = 0; i < h->socks.size() && !fresh; ++i)
      fresh = !watched[i] && c->data[h->socks[i]]->queued.load(std::memory_order_seq_cst) > 0;
    if (fresh) {
      h->sleeping.store(false, std::memory_order_relaxed);
      continue;
    }
    const bool listen = live && c->liveOpen.load(std::memory_order_relaxed);
    if (listen) pfds.push_back({c->liveFd, POLLIN, 0});
    pfds.push_back({h->efd, POLLIN, 0});
    int pr = poll(pfds.data(), pfds.size(), timeoutMs);
    h->sleeping.store(false, std::memory_order_relaxed);
    if (pr > 0 && (pfds.back().revents & POLLIN)) {
      uint64_t v;
      ssize_t rr = read(h->efd, &v, sizeof(v));
      (void)rr;
    }
    if (pr > 0 && listen && pfds[pfds.size() - 2].revents != 0) drainLiveness(c);
  }
}

void wake(Helper* h) {
  uint64_t one = 1;
  ssize_t r = write(h->efd, &one, sizeof(one));
  (void)r;
}

// Deal a message of `size` bytes at `base` over the data sockets. Identical on both sides. A lone message (no
// chunk of another one queued) of at most assistMax() bytes is the caller's to move (assist), with no helper
// woken: a helper's wake-up costs about 80 us per message on a 2-core VM. Otherwise the helpers get its
// chunks at once: they move several messages in parallel faster than the caller alone (the multi-stream gain at
// the sizes NCCL posts when it streams).
void planChunks(SockComm* c, SockRequest* req, char* base, size_t size) {
  size_t S = c->data.size();
  size_t cs = (size + S - 1) / S;
  cs = (cs + 4095) & ~size_t(4095);
  cs = std::max(cs, c->minChunk);
  cs = std::min(cs, c->chunk);
  bool lone = size <= static_cast<size_t>(assistMax());
  for (size_t i = 0; i < S && lone; ++i) lone = c->data[i]->queued.load(std::memory_order_acquire) == 0;
  req->assisted = lone;
  // Each helper is woken once per message, after its chunks are queued: it then serves all of its sockets (a wake per
  // chunk was up to 8 eventfd writes per message by the caller, the GPU proxy's thread, for 4 helpers).
  uint64_t to_wake = 0;
  for (size_t off = 0; off < size; off += cs) {
    DataSock& ds = *c->data[c->nextSock];
    c->nextSock = (c->nextSock + 1) % static_cast<int>(S);
    req->pending.fetch_add(1, std::memory_order_relaxed);
    bool wasEmpty;  // or holding only chunks the caller moves: then the helper may be asleep too
    {
      std::lock_guard<std::mutex> g(ds.mu);
      wasEmpty = ds.q.empty() || ds.assistQueued.load(std::memory_order_relaxed) > 0;
      ds.q.push_back(Chunk{base ? base + off : nullptr, off, std::min(cs, size - off), 0, req, lone});
      ds.queued.fetch_add(1, std::memory_order_seq_cst);
      if (lone) ds.assistQueued.fetch_add(1, std::memory_order_release);
    }
    if (wasEmpty && !lone) to_wake |= uint64_t{1} << ds.helper;
  }
  // Only a helper that sleeps, or is about to (Helper::sleeping), needs the wake-up; a busy one finds the chunks in
  // its next pass.
  for (; to_wake; to_wake &= to_wake - 1) {
    Helper* h = c->helpers[__builtin_ctzll(to_wake)].get();
    if (h->sleeping.load(std::memory_order_seq_cst)) wake(h);
  }
}

// The caller's share (isend, irecv and test, after the control socket's progress): moves the chunks of lone
// messages as far as the sockets take them now. Their helpers are not woken: on a busy host a woken helper costs
// the caller its core, and one that is preempted while it holds a socket stalls the message for a time slice
// (both seen on a 2-core VM: 1-3 ms for 512 KiB). What the sockets do not take at once moves on the caller's next
// call, as with NCCL's own socket transport (and a helper's own wake-ups, at least once a second, pick it up if
// the caller stops calling).
epResult_t assist(SockComm* c) {
  for (size_t si = 0; si < c->data.size(); ++si)
    if (moveChunks(c, static_cast<int>(si), true) < 0) return c->error();
  return epSuccess;
}

void destroyComm(SockComm* c) {
  c->stop.store(true, std::memory_order_release);
  unwatch(c);
  for (auto& h : c->helpers) {
    if (h->th.joinable()) {
      wake(h.get());
      h->th.join();
    }
    if (h->efd >= 0) close(h->efd);
  }
  for (auto& d : c->data)
    if (d->fd >= 0) close(d->fd);
  if (c->ctrlFd >= 0) close(c->ctrlFd);
  if (c->liveFd >= 0) close(c->liveFd);
  delete c;
}

// fds[0] = control, fds[1..S] = data sockets, fds[S + 1] = liveness. Takes ownership of the fds.
SockComm* makeComm(bool isSend, const std::vector<int>& fds, const Hello& h, const std::string& peer) {
  auto* c = new SockComm();
  c->isSend = isSend;
  c->peer = peer;
  c->ctrlFd = fds[0];
  c->liveFd = fds.back();
  c->chunk = h.chunk;
  c->minChunk = h.minChunk;
  c->inlineMax = h.inlineMax;
  int S = static_cast<int>(fds.size()) - 2;
  // No TCP_USER_TIMEOUT once connected: it would abort the connection of a live receiver that keeps its window
  // closed (has not posted its receive) for that long. Heartbeats bound the waits instead; keepalive still
  // turns an idle connection to a vanished peer into an error.
  unsigned int none = 0;
  for (int fd : fds) setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &none, sizeof(none));
  const int T = helpersFor(S);
  if (!isSend) c->stage.reset(new char[kStage]);
  c->pool.reset(new SockRequest[kNetRequestPool]);
  for (int i = kNetRequestPool - 1; i >= 0; --i) {
    c->pool[i].comm = c;
    c->freeList.push_back(&c->pool[i]);
  }
  for (int t = 0; t < T; ++t) {
    auto h2 = std::make_unique<Helper>();
    h2->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->helpers.push_back(std::move(h2));
  }
  for (int s = 0; s < S; ++s) {
    auto d = std::make_unique<DataSock>();
    d->fd = fds[s + 1];
    d->helper = s % T;
    c->helpers[d->helper]->socks.push_back(s);
    c->data.push_back(std::move(d));
  }
  c->lastProgressNs.store(nowNs());
  c->lastHeardNs.store(nowNs());
  c->turns.start(nowNs());
  for (auto& hp : c->helpers) hp->th = std::thread(helperLoop, c, hp.get());
  NET_INFO("NET/epcomm: %s comm with %s: %d data sockets, %d threads, chunk %zu (at least %zu), inline %zu",
           c->side(), peer.c_str(), S, T, c->chunk, c->minChunk, c->inlineMax);
  return c;
}

SockRequest* getRequest(SockComm* c) {
  if (c->freeList.empty()) return nullptr;
  SockRequest* r = c->freeList.back();
  c->freeList.pop_back();
  r->inUse = true;
  r->ctrlDone = false;
  r->n = 0;
  r->nMatched = 0;
  r->pending.store(0, std::memory_order_relaxed);
  r->assisted = false;
  r->segs.clear();
  r->seg_at.clear();
  return r;
}

void putRequest(SockRequest* r) {
  r->inUse = false;
  r->comm->freeList.push_back(r);
}

// A message's bytes on the control socket: its header, and its payload where that is inline.
size_t ctrlBytes(const SockComm* c, const SockRequest* r) {
  return sizeof(MsgHeader) + (r->hdr.size <= c->inlineMax ? r->hdr.size : 0);
}

// Sender: headers (and inline payloads) in posting order, as many queued messages per sendmsg as its iovec holds.
void sendCtrlProgress(SockComm* c) {
  while (!c->ctrlQ.empty()) {
    iovec iov[kIov];
    int niov = 0;
    size_t want = 0, skip = c->ctrlSent;  // skip: what the front message already sent
    for (SockRequest* r : c->ctrlQ) {
      if (niov + 2 > kIov) break;
      const size_t total = ctrlBytes(c, r);
      if (skip < sizeof(MsgHeader)) {
        iov[niov++] = {reinterpret_cast<char*>(&r->hdr) + skip, sizeof(MsgHeader) - skip};
        if (total > sizeof(MsgHeader)) iov[niov++] = {r->data[0], total - sizeof(MsgHeader)};
      } else {
        iov[niov++] = {static_cast<char*>(r->data[0]) + (skip - sizeof(MsgHeader)), total - skip};
      }
      want += total - skip;
      skip = 0;
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = niov;
    ssize_t k = sendmsg(c->ctrlFd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      c->fail(epRemoteError, "NET/epcomm: send connection with peer %s: control socket: %s", c->peer.c_str(),
              strerror(errno));
      return;
    }
    c->lastProgressNs.store(nowNs(), std::memory_order_relaxed);
    for (size_t left = static_cast<size_t>(k); left > 0;) {  // the messages the k bytes completed, in order
      SockRequest* r = c->ctrlQ.front();
      const size_t rest = ctrlBytes(c, r) - c->ctrlSent;
      if (left < rest) {
        c->ctrlSent += left;
        break;
      }
      left -= rest;
      c->ctrlSent = 0;
      r->ctrlDone = true;
      c->ctrlQ.pop_front();
    }
    if (static_cast<size_t>(k) < want) return;
  }
}

// Reads up to n bytes of the control stream into dst: staged bytes first, then the socket. Same result
// convention as recvSome (0 = nothing available now, -1 = error in *err).
ssize_t ctrlRead(SockComm* c, char* dst, size_t n, std::string* err) {
  if (c->stageBeg < c->stageEnd) {
    size_t k = std::min(n, c->stageEnd - c->stageBeg);
    memcpy(dst, c->stage.get() + c->stageBeg, k);
    c->stageBeg += k;
    return static_cast<ssize_t>(k);
  }
  const bool watched = c->poller != nullptr && !c->poller->broken.load(std::memory_order_relaxed);
  if (watched && !c->ctrlReady.exchange(false, std::memory_order_acq_rel)) return 0;  // nothing arrived since
  const size_t want = n >= kStage ? n : kStage;
  ssize_t k = recvSome(c->ctrlFd, n >= kStage ? dst : c->stage.get(), want, err);
  if (watched && k == static_cast<ssize_t>(want)) c->ctrlReady.store(true, std::memory_order_release);
  if (k < 0) unwatch(c);  // (the caller records the failure: this comm is done)
  if (n >= kStage || k <= 0) return k;
  size_t m = std::min(n, static_cast<size_t>(k));
  memcpy(dst, c->stage.get(), m);
  c->stageBeg = m;
  c->stageEnd = static_cast<size_t>(k);
  return static_cast<ssize_t>(m);
}

// Whether data-socket chunks of some message are still to move (a close then cuts a message short).
bool chunksQueued(const SockComm* c) {
  for (const auto& d : c->data)
    if (d->queued.load(std::memory_order_relaxed) > 0) return true;
  return false;
}

// Receiver: match headers to posted buffers in order; every length from the wire is checked first.
void recvCtrlProgress(SockComm* c) {
  std::string err;
  while (!c->ctrlQ.empty() && c->errCode.load(std::memory_order_relaxed) == 0) {
    SockRequest* r = c->ctrlQ.front();
    if (c->inlineIdx >= 0) {
      int i = c->inlineIdx;
      iovec v{nullptr, r->got[i] - c->inlineGot};
      if (r->segs.empty()) v.iov_base = static_cast<char*>(r->data[i]) + c->inlineGot;
      else scatterIov(r, c->inlineGot, v.iov_len, &v, 1);  // scattered: up to the end of the piece it is in
      ssize_t k = ctrlRead(c, static_cast<char*>(v.iov_base), v.iov_len, &err);
      if (k < 0) {
        c->fail(epRemoteError, "NET/epcomm: recv connection with peer %s: control socket: %s", c->peer.c_str(),
                err.c_str());
        return;
      }
      if (k == 0) return;
      c->inlineGot += k;
      c->lastProgressNs.store(nowNs(), std::memory_order_relaxed);
      if (c->inlineGot < r->got[i]) continue;
      c->inlineIdx = -1;
    } else {
      ssize_t k = ctrlRead(c, reinterpret_cast<char*>(&c->hdr) + c->hdrGot, sizeof(MsgHeader) - c->hdrGot, &err);
      if (k < 0 && c->hdrGot == 0 && r->nMatched == 0 && err == kClosedByPeer && !chunksQueued(c)) {
        c->closedBetweenMessages();
        return;
      }
      if (k < 0) {
        c->fail(epRemoteError, "NET/epcomm: recv connection with peer %s: control socket: %s", c->peer.c_str(),
                err.c_str());
        return;
      }
      if (k == 0) return;
      c->hdrGot += k;
      c->lastProgressNs.store(nowNs(), std::memory_order_relaxed);
      if (c->hdrGot < sizeof(MsgHeader)) continue;
      c->hdrGot = 0;
      if (c->hdr.magic != kMsgMagic) {
        c->fail(epRemoteError, "NET/epcomm: peer %s sent a corrupt message header (magic %#x)", c->peer.c_str(),
                c->hdr.magic);
        return;
      }
      int i = -1;
      for (int j = 0; j < r->n; ++j)
        if (!r->matched[j] && r->tags[j] == c->hdr.tag) {
          i = j;
          break;
        }
      if (i < 0) {
        c->fail(epRemoteError, "NET/epcomm: peer %s sent tag %d, which matches no posted receive", c->peer.c_str(),
                c->hdr.tag);
        return;
      }
      if (c->hdr.size > r->cap[i]) {
        c->fail(epRemoteError, "NET/epcomm: peer %s sent %llu bytes (tag %d) into a %zu-byte receive buffer",
                c->peer.c_str(), static_cast<unsigned long long>(c->hdr.size), c->hdr.tag, r->cap[i]);
        return;
      }
      r->matched[i] = true;
      r->got[i] = c->hdr.size;
      r->nMatched++;
      if (c->hdr.size <= c->inlineMax) {
        if (c->hdr.size > 0) {
          c->inlineIdx = i;
          c->inlineGot = 0;
          continue;
        }
      } else {
        planChunks(c, r, static_cast<char*>(r->data[i]), c->hdr.size);
      }
    }
    if (r->nMatched == r->n) {
      r->ctrlDone = true;
      c->ctrlQ.pop_front();
    }
  }
}

// ---- connection establishment ---------------------------------------------------------------------------------

struct SockListen {
  int fd = -1;
  int dev = 0;
  uint64_t secret = 0;
  NetAddr addr{};
  struct Pending {
    int fd;
    Hello h;
    size_t got;
    int64_t startNs;
    NetAddr from;
  };
  struct Group {
    uint64_t connId;
    Hello h;
    std::vector<int> fds;
    int count;
    int64_t startNs;
    NetAddr from;
  };
  std::vector<Pending> pend;
  std::vector<Group> groups;
};

struct SockConnectStage {
  Hello hello{};
  NetAddr peer{};
  std::vector<TcpConnector> conns;
  std::vector<size_t> sent;
};

bool constantTimeEq(uint64_t a, uint64_t b) {
  volatile uint64_t d = a ^ b;
  return d == 0;
}

// A receive request, filled, in line for the control socket's next message (irecv, irecvScatter).
epResult_t postReceive(SockComm* c, SockRequest* r, void** request) {
  c->ctrlQ.push_back(r);
  recvCtrlProgress(c);
  *request = r;
  (void)assist(c);  // a failure is recorded in c: the request's test() reports it
  return epSuccess;
}

class SocketBackend final : public NetBackend {
 public:
  const char* name() const override { return "socket"; }
  int devices() const override { return static_cast<int>(netInterfaces().size()); }

  epResult_t getProperties(int dev, NetProperties* p) override {
    const auto& ifs = netInterfaces();
    if (dev < 0 || dev >= static_cast<int>(ifs.size()))
      NET_FAIL(epInvalidArgument, "NET/epcomm: device %d out of range [0,%zu)", dev, ifs.size());
    *p = NetProperties{};
    p->name = ifs[dev].name;
    p->pciPath = ifs[dev].pciPath;
    p->guid = static_cast<uint64_t>(dev);
    p->ptrSupport = kNetPtrHost;
    p->speedMbps = ifs[dev].speedMbps;
    p->maxComms = 65536;
    p->maxRecvs = kNetMaxRecvs;
    return epSuccess;
  }

  epResult_t listen(int dev, void* handle, void** listenComm) override {
    const auto& ifs = netInterfaces();
    if (dev < 0 || dev >= static_cast<int>(ifs.size()))
      NET_FAIL(epInvalidArgument, "NET/epcomm: device %d out of range [0,%zu)", dev, ifs.size());
    auto* l = new SockListen();
    l->dev = dev;
    l->secret = randomU64();
    epResult_t r = tcpListen(ifs[dev], &l->fd, &l->addr);
    if (r != epSuccess) {
      delete l;
      return r;
    }
    memset(handle, 0, kNetHandleSize);
    auto* h = static_cast<SocketHandle*>(handle);
    h->magic = kHandleMagic;
    h->version = kVersion;
    h->secret = l->secret;
    h->addr = l->addr;
    h->stage = nullptr;
    *listenComm = l;
    NET_INFO("NET/epcomm: listening on %s (%s)", addrToString(l->addr).c_str(), ifs[dev].name.c_str());
    return epSuccess;
  }

  epResult_t connect(int dev, void* handle, void** sendComm) override {
    return connectStreams(dev, handle, StreamHints{}, sendComm);
  }

  int descriptorsPerConnection(int max_streams) const override {
    const int S = dataSockets(max_streams);
    return S + 2 + helpersFor(S);  // + control, liveness; an eventfd per helper
  }

  epResult_t connectStreams(int dev, void* handle, const StreamHints& hints, void** sendComm) override {
    (void)dev;
    *sendComm = nullptr;
    auto* h = static_cast<SocketHandle*>(handle);
    if (h->magic != kHandleMagic || h->version != kVersion)
      NET_FAIL(epInvalidArgument, "NET/epcomm: connect() got a handle that is not an epcomm socket handle");
    SockConnectStage* st = h->stage;
    if (st == nullptr) {
      st = new SockConnectStage();
      const int64_t S = dataSockets(hints.max_streams);
      const int64_t min_chunk = paramString("EPCOMM_NET_MIN_CHUNK") || hints.min_chunk == 0
                                    ? epParamNetMinChunk()
                                    : static_cast<int64_t>(std::min<size_t>(hints.min_chunk, size_t{1} << 30));
      st->hello = Hello{kHelloMagic, kVersion, h->secret, randomU64(), 0, static_cast<uint32_t>(S),
                        static_cast<uint32_t>(std::clamp<int64_t>(epParamNetChunk(), 4096, 1 << 30)),
                        static_cast<uint32_t>(std::clamp<int64_t>(min_chunk, 4096, 1 << 30)),
                        static_cast<uint32_t>(std::clamp<int64_t>(epParamNetInline(), 0, 1 << 30)), 0};
      st->peer = h->addr;
      st->conns.resize(S + 2);  // control, S data, liveness
      st->sent.assign(S + 2, 0);
      h->stage = st;
    }
    bool all = true;
    for (size_t i = 0; i < st->conns.size(); ++i) {
      TcpConnector& tc = st->conns[i];
      epResult_t r = tc.progress(st->peer);
      if (r != epSuccess) {
        abandon(h);
        return r;
      }
      if (!tc.connected) {
        all = false;
        continue;
      }
      if (st->sent[i] < sizeof(Hello)) {
        Hello hh = st->hello;
        hh.index = static_cast<uint32_t>(i);
        std::string err;
        ssize_t k = sendSome(tc.fd, reinterpret_cast<char*>(&hh) + st->sent[i], sizeof(Hello) - st->sent[i], &err);
        if (k < 0) {
          std::string peer = addrToString(st->peer);
          abandon(h);
          NET_FAIL(epRemoteError, "NET/epcomm: connect to peer %s: %s", peer.c_str(), err.c_str());
        }
        st->sent[i] += k;
        if (st->sent[i] < sizeof(Hello)) all = false;
      }
    }
    if (!all) return epSuccess;
    std::vector<int> fds;
    for (auto& tc : st->conns) fds.push_back(tc.fd);
    *sendComm = makeComm(true, fds, st->hello, addrToString(st->peer));
    delete st;
    h->stage = nullptr;
    return epSuccess;
  }

  epResult_t accept(void* listenComm, void** recvComm) override {
    *recvComm = nullptr;
    auto* l = static_cast<SockListen*>(listenComm);
    if (l == nullptr) NET_FAIL(epInvalidUsage, "NET/epcomm: accept() on a null listen comm");
    int64_t now = nowNs();
    int64_t tmoNs = netTimeoutMs() * 1000000LL;
    for (;;) {
      NetAddr from{};
      socklen_t fl = sizeof(from);
      int fd = accept4(l->fd, &from.sa, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        NET_FAIL(epSystemError, "NET/epcomm: accept on %s: %s", addrToString(l->addr).c_str(), strerror(errno));
      }
      if (l->pend.size() >= 4096) {  // a flood of strangers must not exhaust us
        close(fd);
        continue;
      }
      tuneSocket(fd);
      l->pend.push_back({fd, Hello{}, 0, now, from});
    }
    for (size_t i = 0; i < l->pend.size();) {
      auto& p = l->pend[i];
      std::string err;
      ssize_t k = recvSome(p.fd, reinterpret_cast<char*>(&p.h) + p.got, sizeof(Hello) - p.got, &err);
      const char* drop = nullptr;
      if (k < 0) drop = "closed before its hello";
      else p.got += k;
      if (!drop && p.got < sizeof(Hello)) {
        if (now - p.startNs > tmoNs) drop = "sent no hello within EPCOMM_TIMEOUT_MS";
        else {
          ++i;
          continue;
        }
      }
      if (!drop) {
        const Hello& h = p.h;
        if (h.magic != kHelloMagic || h.version != kVersion) drop = "is not an epcomm peer of this version";
        else if (!constantTimeEq(h.secret, l->secret)) drop = "presented a wrong secret";
        else if (h.nsocks < 1 || h.nsocks > kMaxDataSocks || h.index > h.nsocks + 1) drop = "sent bad socket counts";
        else if (h.chunk < 4096 || h.minChunk < 4096 || h.inlineMax > (1u << 30)) drop = "sent bad chunk sizes";
      }
      if (drop) {
        NET_WARN("NET/epcomm: dropping connection from %s on %s: it %s", addrToString(p.from).c_str(),
                 addrToString(l->addr).c_str(), drop);
        close(p.fd);
        l->pend.erase(l->pend.begin() + i);
        continue;
      }
      SockListen::Group* g = nullptr;
      for (auto& gg : l->groups)
        if (gg.connId == p.h.connId) g = &gg;
      if (g == nullptr) {
        l->groups.push_back({p.h.connId, p.h, std::vector<int>(p.h.nsocks + 2, -1), 0, now, p.from});
        g = &l->groups.back();
      }
      if (g->h.nsocks != p.h.nsocks || g->h.chunk != p.h.chunk || g->h.minChunk != p.h.minChunk ||
          g->h.inlineMax != p.h.inlineMax || g->fds[p.h.index] != -1) {
        NET_WARN("NET/epcomm: dropping connection from %s: inconsistent with its connection group",
                 addrToString(p.from).c_str());
        close(p.fd);
      } else {
        g->fds[p.h.index] = p.fd;
        g->count++;
      }
      l->pend.erase(l->pend.begin() + i);
    }
    for (size_t gi = 0; gi < l->groups.size();) {
      auto& g = l->groups[gi];
      if (g.count == static_cast<int>(g.fds.size())) {
        NetAddr peer = g.from;
        SockComm* c = makeComm(false, g.fds, g.h, addrToString(peer));
        l->groups.erase(l->groups.begin() + gi);
        *recvComm = c;
        return epSuccess;
      }
      if (now - g.startNs > tmoNs) {
        NET_WARN("NET/epcomm: dropping incomplete connection from %s (%d of %zu sockets)",
                 addrToString(g.from).c_str(), g.count, g.fds.size());
        for (int fd : g.fds)
          if (fd >= 0) close(fd);
        l->groups.erase(l->groups.begin() + gi);
        continue;
      }
      ++gi;
    }
    return epSuccess;
  }

  epResult_t regMr(void* comm, void* data, size_t size, int type, void** mhandle) override {
    (void)comm;
    (void)data;
    (void)size;
    if (type != kNetPtrHost)
      NET_FAIL(epNotSupported, "NET/epcomm: the socket backend takes host memory only (type %d)", type);
    *mhandle = reinterpret_cast<void*>(static_cast<uintptr_t>(0x5eed));  // nothing to register for TCP
    return epSuccess;
  }
  epResult_t deregMr(void*, void*) override { return epSuccess; }

  epResult_t isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request) override {
    (void)mhandle;
    *request = nullptr;
    auto* c = static_cast<SockComm*>(sendComm);
    NETCHECK(c->error());
    if (size > 0 && data == nullptr) NET_FAIL(epNullPointer, "NET/epcomm: isend of %zu bytes from NULL", size);
    SockRequest* r = getRequest(c);
    if (r == nullptr) return epSuccess;  // too many in flight: NCCL retries
    r->n = 1;
    r->data[0] = data;
    r->cap[0] = r->got[0] = size;
    r->tags[0] = tag;
    r->hdr = MsgHeader{kMsgMagic, tag, size};
    if (size > c->inlineMax) planChunks(c, r, static_cast<char*>(data), size);
    c->ctrlQ.push_back(r);
    if (!c->corked) sendCtrlProgress(c);
    *request = r;
    (void)assist(c);  // a failure is recorded in c: the request's test() reports it
    return epSuccess;
  }

  epResult_t irecv(void* recvComm, int n, void** data, const size_t* sizes, const int* tags, void** mhandles,
                   void** request) override {
    (void)mhandles;
    *request = nullptr;
    auto* c = static_cast<SockComm*>(recvComm);
    NETCHECK(c->error());
    if (n < 1 || n > kNetMaxRecvs) NET_FAIL(epInvalidArgument, "NET/epcomm: irecv of %d buffers (1..%d)", n, kNetMaxRecvs);
    SockRequest* r = getRequest(c);
    if (r == nullptr) return epSuccess;
    r->n = n;
    for (int i = 0; i < n; ++i) {
      r->data[i] = data[i];
      r->cap[i] = sizes[i];
      r->got[i] = 0;
      r->tags[i] = tags[i];
      r->matched[i] = false;
    }
    return postReceive(c, r, request);
  }

  void cork(void* sendComm, bool on) override {
    auto* c = static_cast<SockComm*>(sendComm);
    c->corked = on;
    if (!on && c->error() == epSuccess) sendCtrlProgress(c);
  }

  bool scatters() const override { return true; }
  epResult_t irecvScatter(void* recvComm, const iovec* iov, int niov, void** request) override {
    *request = nullptr;
    auto* c = static_cast<SockComm*>(recvComm);
    NETCHECK(c->error());
    if (niov < 1 || niov > kNetMaxScatter)
      NET_FAIL(epInvalidArgument, "NET/epcomm: irecvScatter of %d pieces (1..%d)", niov, kNetMaxScatter);
    SockRequest* r = getRequest(c);
    if (r == nullptr) return epSuccess;
    size_t total = 0;
    r->segs.reserve(niov);
    r->seg_at.reserve(niov);
    for (int k = 0; k < niov; ++k) {
      r->seg_at.push_back(total);
      r->segs.push_back(iov[k]);
      total += iov[k].iov_len;
    }
    r->n = 1;
    r->data[0] = nullptr;
    r->cap[0] = total;
    r->got[0] = 0;
    r->tags[0] = 0;
    r->matched[0] = false;
    return postReceive(c, r, request);
  }

  epResult_t test(void* request, int* done, size_t* sizes) override {
    *done = 0;
    auto* r = static_cast<SockRequest*>(request);
    if (r == nullptr || !r->inUse) NET_FAIL(epInvalidUsage, "NET/epcomm: test() of a request not in flight");
    SockComm* c = r->comm;
    // A request that is already complete costs no syscall (NCCL tests every outstanding request each round), and
    // is delivered even where the connection ended after it: a peer's last messages before its close (reading on
    // for a later receive may have met the end already).
    if (!(r->ctrlDone && r->pending.load(std::memory_order_acquire) == 0)) {
      NETCHECK(c->error());
      if (c->isSend) sendCtrlProgress(c);
      else recvCtrlProgress(c);
      NETCHECK(c->error());
      if (r->assisted && r->pending.load(std::memory_order_acquire) > 0) NETCHECK(assist(c));
    }
    if (r->ctrlDone && r->pending.load(std::memory_order_acquire) == 0) {
      *done = 1;
      if (sizes)
        for (int i = 0; i < r->n; ++i) sizes[i] = r->got[i];
      putRequest(r);
      return epSuccess;
    }
    // Errors are results, never hangs: a receive whose payload has started but stopped flowing fails after
    // EPCOMM_TIMEOUT_MS, and any request whose peer went silent (see "Stall deadline" at the top). An idle peer
    // is no error: NCCL may post receives long before the sender reaches the collective. Dead peers show up at
    // once as EOF/RST.
    bool midMessage = !c->isSend && (r->pending.load() > 0 || (c->inlineIdx >= 0 && c->ctrlQ.front() == r));
    if (midMessage) {
      int64_t idleMs = c->turns.quietNs(nowNs(), c->lastProgressNs.load(std::memory_order_relaxed)) / 1000000LL;
      if (idleMs > netTimeoutMs()) {
        c->fail(epTimeout, "NET/epcomm: recv connection with peer %s: no data for %lld ms in the middle of a message",
                c->peer.c_str(), static_cast<long long>(idleMs));
        return c->error();
      }
    }
    return peerSilent(c);
  }

  // A waiting request fails once, for EPCOMM_TIMEOUT_MS, no byte moved on the connection and the peer sent no
  // heartbeat.
  static epResult_t peerSilent(SockComm* c) {
    const int64_t tmo = netTimeoutMs();
    // -1 ms while this process cannot judge (stopped, helper 0 not yet had its turn since): no verdict.
    auto quietMs = [c] {
      return c->turns.quietNs(nowNs(), std::max(c->lastProgressNs.load(std::memory_order_relaxed),
                                                c->lastHeardNs.load(std::memory_order_relaxed))) / 1000000LL;
    };
    if (quietMs() <= tmo) return epSuccess;
    // Read the socket here too before deciding: a beat may be waiting that helper 0 has not read yet.
    if (c->liveOpen.load(std::memory_order_relaxed)) drainLiveness(c);
    int64_t q = quietMs();
    if (q <= tmo) return epSuccess;
    c->fail(epTimeout,
            "NET/epcomm: %s connection with peer %s: no byte %s and no heartbeat from the peer for %lld ms "
            "(EPCOMM_TIMEOUT_MS=%lld)%s: the peer is stopped, hung or cut off",
            c->side(), c->peer.c_str(), c->isSend ? "accepted" : "received", static_cast<long long>(q),
            static_cast<long long>(tmo),
            c->liveOpen.load(std::memory_order_relaxed) ? "" : ", and it closed its liveness socket");
    return c->error();
  }

  void* openPoller() override {
    const int fd = epoll_create1(EPOLL_CLOEXEC);
    if (fd < 0) {
      NET_INFO("NET/epcomm: epoll_create1: %s; every receive test reads its socket", strerror(errno));
      return nullptr;
    }
    auto* p = new SockPoller();
    p->epfd = fd;
    return p;
  }

  epResult_t watchRecv(void* poller, void* recvComm) override {
    auto* p = static_cast<SockPoller*>(poller);
    auto* c = static_cast<SockComm*>(recvComm);
    if (p == nullptr || c == nullptr || c->isSend || c->poller != nullptr)
      NET_FAIL(epInvalidUsage, "NET/epcomm: watchRecv() needs a poller and a receive comm not watched yet");
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;  // level-triggered (see SockComm::ctrlReady); errors, hang-ups always
    ev.data.ptr = c;
    if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, c->ctrlFd, &ev) != 0)
      NET_FAIL(epSystemError, "NET/epcomm: epoll_ctl(ADD) for the connection with peer %s: %s", c->peer.c_str(),
               strerror(errno));
    c->ctrlReady.store(true, std::memory_order_release);  // bytes may have come before it was watched
    c->poller = p;
    p->watched.fetch_add(1, std::memory_order_relaxed);
    return epSuccess;
  }

  // One epoll_wait asking for as many events as there are watched comms: level-triggered, a socket that stays
  // readable is reported by every call, so a loop "while the buffer came back full" would never end once that many
  // sockets wait to be read (by the caller, after this returns).
  void pollReady(void* poller) override {
    auto* p = static_cast<SockPoller*>(poller);
    if (p == nullptr || p->broken.load(std::memory_order_relaxed)) return;
    thread_local std::vector<epoll_event> ev;
    const int want = std::max(1, p->watched.load(std::memory_order_relaxed));
    if (static_cast<int>(ev.size()) < want) ev.resize(want);
    int n;
    do n = epoll_wait(p->epfd, ev.data(), want, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0) {  // not expected; never leave a byte unread for it
      NET_WARN("NET/epcomm: epoll_wait: %s; every receive test reads its socket from now on", strerror(errno));
      p->broken.store(true, std::memory_order_relaxed);
      return;
    }
    for (int i = 0; i < n; ++i)
      static_cast<SockComm*>(ev[i].data.ptr)->ctrlReady.store(true, std::memory_order_release);
  }

  void unwatchRecv(void* poller, void* recvComm) override {
    auto* c = static_cast<SockComm*>(recvComm);
    if (c != nullptr && poller != nullptr && c->poller == poller) unwatch(c);
  }

  void closePoller(void* poller) override {
    auto* p = static_cast<SockPoller*>(poller);
    if (p == nullptr) return;
    close(p->epfd);
    delete p;
  }

  epResult_t closeSend(void* comm) override {
    if (comm) destroyComm(static_cast<SockComm*>(comm));
    return epSuccess;
  }
  epResult_t closeRecv(void* comm) override {
    if (comm) destroyComm(static_cast<SockComm*>(comm));
    return epSuccess;
  }
  epResult_t closeListen(void* listenComm) override {
    auto* l = static_cast<SockListen*>(listenComm);
    if (!l) return epSuccess;
    for (auto& p : l->pend) close(p.fd);
    for (auto& g : l->groups)
      for (int fd : g.fds)
        if (fd >= 0) close(fd);
    if (l->fd >= 0) close(l->fd);
    delete l;
    return epSuccess;
  }

 private:
  static void abandon(SocketHandle* h) {
    if (h->stage) {
      for (auto& tc : h->stage->conns) tc.close();
      delete h->stage;
      h->stage = nullptr;
    }
  }
};

}  // namespace

NetBackend* netSocketBackend(std::string* why) {
  static SocketBackend* b = new SocketBackend();  // lives for the process; comms own all real resources
  if (b->devices() <= 0) {
    if (why) *why = "no usable network interface (check EPCOMM_SOCKET_IFNAME)";
    return nullptr;
  }
  return b;
}

}  // namespace epcomm::net
