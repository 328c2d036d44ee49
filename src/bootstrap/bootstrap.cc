// Bootstrap: unique ids, the rendezvous root thread, the socket star and the callback path.
// Wire formats are described in bootstrap/proto.h.
#include "bootstrap/bootstrap.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "bootstrap/proto.h"
#include "bootstrap/socket.h"
#include "common/checks.h"
#include "common/log.h"
#include "common/param.h"
#include "common/time.h"

namespace epcomm {

// How long the rendezvous root waits for all ranks, counted from the first rank's arrival (and at most twice
// this from epGetUniqueId). Afterwards the waiting ranks get epTimeout naming the ranks that never came.
EP_PARAM(BootstrapRootTimeoutMs, "BOOTSTRAP_ROOT_TIMEOUT_MS", 600000);

using bsproto::FrameHeader;
using bsproto::kHeaderBytes;
using bsproto::kMaxText;
using sock::AddrStr;
using sock::ErrStr;
using sock::Io;

namespace {

constexpr int kMaxRanks = 1 << 20;
constexpr int kHandshakeReadTimeoutMs = 2000;  // a connection must present its hello within this
constexpr size_t kMaxPending = 1024;           // unidentified connections held at once
constexpr int kProgressIntervalMs = 200;       // root -> waiting ranks: who is still missing
constexpr int kRootSendTimeoutMs = 1000;
constexpr int kNotifyTimeoutMs = 200;  // rank 0 telling the others about a failure, best effort
constexpr uint32_t kCallbackMagic = 0x42435045u;  // "EPCB"

bsproto::StarListenHook gStarListenHook = nullptr;

// "1,3-5,9" for the ranks r with have[r] == 0; truncated with ",..." to fit.
void formatMissing(const std::vector<uint8_t>& have, char* buf, size_t n) {
  size_t used = 0;
  buf[0] = '\0';
  const int count = static_cast<int>(have.size());
  for (int r = 0; r < count;) {
    if (have[r]) {
      ++r;
      continue;
    }
    int e = r;
    while (e + 1 < count && !have[e + 1]) ++e;
    char item[40];
    if (e == r)
      snprintf(item, sizeof(item), "%d", r);
    else if (e == r + 1)
      snprintf(item, sizeof(item), "%d,%d", r, e);
    else
      snprintf(item, sizeof(item), "%d-%d", r, e);
    size_t need = strlen(item) + (used ? 1 : 0);
    if (used + need + 5 > n) {
      if (used + 5 <= n) snprintf(buf + used, n - used, "%s", ",...");
      break;
    }
    snprintf(buf + used, n - used, "%s%s", used ? "," : "", item);
    used += need;
    r = e + 1;
  }
}

epResult_t randomBytes(uint8_t* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      EP_FAIL(epSystemError, "getrandom failed while making the bootstrap secret: %s", ErrStr(e).str);
    }
    got += static_cast<size_t>(r);
  }
  return epSuccess;
}

// Sends FIN and drains what the peer sent before closing, so that close() does not reset the connection
// (which can discard our last frames at the peer before it reads them).
void closeGracefully(int* fd) {
  if (*fd < 0) return;
  shutdown(*fd, SHUT_WR);
  char sink[4096];
  for (int i = 0; i < 256; ++i)
    if (recv(*fd, sink, sizeof(sink), MSG_DONTWAIT) <= 0) break;
  sock::closeFd(fd);
}

// One frame (header + payload) in a contiguous buffer.
std::vector<uint8_t> makeFrame(uint16_t type, uint32_t seq, const void* payload, size_t len) {
  std::vector<uint8_t> f(kHeaderBytes + len);
  FrameHeader h;
  h.type = type;
  h.seq = seq;
  h.len = len;
  bsproto::encodeHeader(h, f.data());
  if (len) memcpy(f.data() + kHeaderBytes, payload, len);
  return f;
}

// {i32 code, text} payload of kRootError / kError.
std::vector<uint8_t> makeStatusFrame(uint16_t type, uint32_t seq, epResult_t code, const char* msg) {
  size_t tl = strnlen(msg, kMaxText);
  std::vector<uint8_t> p(4 + tl);
  bsproto::put32(p.data(), static_cast<uint32_t>(code));
  memcpy(p.data() + 4, msg, tl);
  return makeFrame(type, seq, p.data(), p.size());
}

epResult_t statusCode(uint32_t raw) {
  if (raw == 0 || raw >= static_cast<uint32_t>(epNumResults)) return epRemoteError;
  return static_cast<epResult_t>(raw);
}

// Copies a received text into a NUL-terminated buffer, replacing non-printable bytes.
void copyText(const uint8_t* p, size_t n, char* out, size_t out_n) {
  size_t k = std::min(n, out_n - 1);
  for (size_t i = 0; i < k; ++i) out[i] = (p[i] >= 32 && p[i] < 127) ? static_cast<char>(p[i]) : '?';
  out[k] = '\0';
}

// A connection whose handshake frame is not complete yet.
struct Pending {
  int fd = -1;
  int64_t t0_ns = 0;
  sock::Addr peer;
  size_t got = 0;
  uint8_t buf[kHeaderBytes + bsproto::kHelloBytes];
};
static_assert(bsproto::kHelloBytes >= bsproto::kStarHelloBytes);

enum class ReadStatus { kMore, kDone, kDrop };

// Reads what is available of a handshake frame of `type` with exactly `payload` bytes.
ReadStatus readHandshake(Pending& p, uint16_t type, size_t payload, char* why, size_t why_n) {
  for (;;) {
    size_t need = p.got < kHeaderBytes ? kHeaderBytes : kHeaderBytes + payload;
    if (p.got == need) return ReadStatus::kDone;
    ssize_t r = recv(p.fd, p.buf + p.got, need - p.got, MSG_DONTWAIT);
    if (r == 0) {
      snprintf(why, why_n, "closed the connection after %zu of %zu bytes (a short or empty message)", p.got,
               kHeaderBytes + payload);
      return ReadStatus::kDrop;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadStatus::kMore;
      int e = errno;
      snprintf(why, why_n, "receive failed: %s", ErrStr(e).str);
      return ReadStatus::kDrop;
    }
    p.got += static_cast<size_t>(r);
    if (p.got == kHeaderBytes) {
      FrameHeader h = bsproto::decodeHeader(p.buf);
      if (h.magic != bsproto::kFrameMagic) {
        snprintf(why, why_n, "sent garbage (frame magic 0x%08x, expected 0x%08x)", h.magic, bsproto::kFrameMagic);
        return ReadStatus::kDrop;
      }
      if (h.type != type) {
        snprintf(why, why_n, "sent message type %u where a handshake (type %u) was expected", h.type, type);
        return ReadStatus::kDrop;
      }
      if (h.len != payload) {
        snprintf(why, why_n, "announced a %llu-byte handshake, expected exactly %zu bytes",
                 static_cast<unsigned long long>(h.len), payload);
        return ReadStatus::kDrop;
      }
    }
  }
}

bool sendFrameBounded(int fd, const std::vector<uint8_t>& frame, int timeout_ms) {
  int err = 0;
  return sock::sendAll(fd, frame.data(), frame.size(), Deadline::afterMs(timeout_ms), -1, &err) == Io::kOk;
}

// The secrets of this process's unique ids whose rendezvous has served its creation or closed: such an id is
// stale, and this process knows it without connecting (other processes only see a refused connection).
class StaleIds {
 public:
  void add(const uint8_t* secret) {
    std::lock_guard<std::mutex> l(m_);
    ids_.emplace_back(secret, secret + kSecretBytes);
  }
  bool has(const uint8_t* secret) {
    std::lock_guard<std::mutex> l(m_);
    for (const auto& s : ids_)
      if (memcmp(s.data(), secret, kSecretBytes) == 0) return true;
    return false;
  }

 private:
  std::mutex m_;
  std::vector<std::vector<uint8_t>> ids_;
};
StaleIds& staleIds() {
  static StaleIds* s = new StaleIds;  // never destroyed: a root thread may outlive static destruction
  return *s;
}

// A process may fork while a rendezvous thread runs (launchers and tests fork their ranks right after
// epGetUniqueId). The child must not inherit an allocator lock such a thread held: allocators without fork
// handlers (AddressSanitizer's among them) would deadlock the child's first allocation. So fork waits until
// every root thread is quiet: started (thread start-up allocates), blocked in poll (a root thread holds
// forkMutex except there), or gone (one whose work is done is joined, so that its exit is over too).
struct RootThread {
  std::thread t;
  std::atomic<bool> started{false}, done{false};
};
struct RootThreads {
  std::mutex fork;  // held by root threads except while blocked in poll
  std::mutex list_mutex;
  std::vector<std::unique_ptr<RootThread>> list;

  void joinDone() {  // list_mutex held
    for (size_t i = list.size(); i-- > 0;)
      if (list[i]->done.load()) {
        list[i]->t.join();
        list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
      }
  }
  void prepareFork() {
    list_mutex.lock();
    joinDone();
    for (auto& r : list)
      while (!r->started.load()) std::this_thread::yield();
    fork.lock();
  }
  void afterForkParent() {
    fork.unlock();
    list_mutex.unlock();
  }
  void afterForkChild() {  // the threads are the parent's: forget them without joining (nor terminate)
    new std::vector<std::unique_ptr<RootThread>>(std::move(list));
    list.clear();
    fork.unlock();
    list_mutex.unlock();
  }
};
RootThreads& rootThreads() {
  static RootThreads* r = [] {
    auto* p = new RootThreads;  // never destroyed: root threads may outlive static destruction
    pthread_atfork([] { rootThreads().prepareFork(); }, [] { rootThreads().afterForkParent(); },
                   [] { rootThreads().afterForkChild(); });
    return p;
  }();
  return *r;
}

// ------------------------------------------------------------------------------------------------------
// The rendezvous root: a detached thread serving one communicator creation.
// ------------------------------------------------------------------------------------------------------
class Root {
 public:
  Root(int lfd, const sock::Addr& addr, const uint8_t* secret, int64_t timeout_ms)
      : lfd_(lfd), timeout_ms_(timeout_ms), create_ns_(nowNs()) {
    addr.format(addr_str_, sizeof(addr_str_));
    memcpy(secret_, secret, kSecretBytes);
  }
  ~Root() {
    staleIds().add(secret_);  // before the listener closes: no connection can see it closed while the id looks fresh
    sock::closeFd(&lfd_);
    for (Pending& p : pending_) sock::closeFd(&p.fd);
    for (Member& m : members_) sock::closeFd(&m.fd);
  }

  // `fork_lock` holds rootThreads().fork; it is let go only while blocked in poll.
  void run(std::unique_lock<std::mutex>& fork_lock) {
    std::vector<pollfd> pfds;
    while (!done_) {
      const int64_t now = nowNs();
      int64_t end = create_ns_ + 2 * timeout_ms_ * 1000000LL;
      if (first_ns_ != 0) end = std::min<int64_t>(end, first_ns_ + timeout_ms_ * 1000000LL);
      if (now >= end) {
        if (failed_) break;
        if (!members_.empty()) {
          finishTimeout(now);
        } else {
          EP_WARN("bootstrap root at %s: no rank arrived within %lld ms; closing the rendezvous", addr_str_,
                  static_cast<long long>((now - create_ns_) / 1000000));
        }
        break;
      }
      int64_t wake = end;
      if (progress_dirty_ && !failed_) {
        int64_t due = last_progress_ns_ + kProgressIntervalMs * 1000000LL;
        if (now >= due) {
          broadcastProgress();
          continue;
        }
        wake = std::min(wake, due);
      }
      for (const Pending& p : pending_) wake = std::min<int64_t>(wake, p.t0_ns + kHandshakeReadTimeoutMs * 1000000LL);

      pfds.clear();
      pfds.push_back({lfd_, POLLIN, 0});
      for (const Pending& p : pending_) pfds.push_back({p.fd, POLLIN, 0});
      for (const Member& m : members_) pfds.push_back({m.fd, POLLIN, 0});
      int ms = static_cast<int>(std::clamp<int64_t>((wake - now + 999999) / 1000000, 0, 1000));
      fork_lock.unlock();
      int pr = poll(pfds.data(), pfds.size(), ms);
      const int poll_errno = errno;
      fork_lock.lock();
      if (pr < 0) {
        if (poll_errno == EINTR) continue;
        int e = poll_errno;
        EP_WARN("bootstrap root at %s: poll failed: %s; closing the rendezvous", addr_str_, ErrStr(e).str);
        if (!failed_ && !members_.empty()) fail(epSystemError, "bootstrap root at %s: poll failed", addr_str_);
        break;
      }
      const size_t np = pending_.size();
      const size_t nm = members_.size();
      std::vector<short> prev(np), mrev(nm);
      for (size_t i = 0; i < np; ++i) prev[i] = pfds[1 + i].revents;
      for (size_t i = 0; i < nm; ++i) mrev[i] = pfds[1 + np + i].revents;
      const bool listener_ready = pfds[0].revents != 0;

      // Members: a rank sends nothing after its hello, so readable means it left (or misbehaves).
      for (size_t i = nm; i-- > 0;) {
        if (mrev[i] == 0 || i >= members_.size()) continue;
        char c;
        ssize_t r = recv(members_[i].fd, &c, 1, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        dropMember(i, r > 0 ? "sent unexpected data after its hello" : "closed its connection (it gave up)");
      }
      // Pending handshakes.
      const int64_t t = nowNs();
      for (size_t i = np; i-- > 0;) {
        if (done_) break;
        Pending& p = pending_[i];
        char why[256] = "";
        ReadStatus st = ReadStatus::kMore;
        if (prev[i] != 0) st = readHandshake(p, bsproto::kHello, bsproto::kHelloBytes, why, sizeof(why));
        if (st == ReadStatus::kMore && t - p.t0_ns > kHandshakeReadTimeoutMs * 1000000LL) {
          snprintf(why, sizeof(why), "sent %zu of %zu hello bytes within %d ms", p.got,
                   kHeaderBytes + bsproto::kHelloBytes, kHandshakeReadTimeoutMs);
          st = ReadStatus::kDrop;
        }
        if (st == ReadStatus::kMore) continue;
        Pending done = p;
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
        if (st == ReadStatus::kDrop) {
          EP_WARN("bootstrap root at %s: dropped a connection from %s: %s", addr_str_, AddrStr(done.peer).s, why);
          sock::closeFd(&done.fd);
        } else {
          onHello(done);
        }
      }
      if (done_) break;
      if (listener_ready) acceptAll();
    }
  }

 private:
  struct Member {
    int fd = -1;
    int rank = 0;
    int nranks = 0;
    uint32_t pid = 0;
    sock::Addr peer;
    sock::Addr listen;
  };

  void acceptAll() {
    for (int i = 0; i < 64; ++i) {
      sock::Addr peer;
      int fd = sock::acceptOne(lfd_, &peer);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
          int e = errno;
          EP_WARN("bootstrap root at %s: accept failed: %s", addr_str_, ErrStr(e).str);
        }
        return;
      }
      if (pending_.size() >= kMaxPending) {
        EP_WARN("bootstrap root at %s: dropped a connection from %s: %zu connections are already waiting to "
                "present a hello", addr_str_, AddrStr(peer).s, pending_.size());
        close(fd);
        continue;
      }
      Pending p;
      p.fd = fd;
      p.t0_ns = nowNs();
      p.peer = peer;
      pending_.push_back(p);
    }
  }

  void onHello(Pending& p) {
    bsproto::Hello h;
    if (!bsproto::decodeHello(p.buf + kHeaderBytes, &h)) {
      EP_WARN("bootstrap root at %s: dropped a connection from %s: its hello carries an unknown address family",
              addr_str_, AddrStr(p.peer).s);
      sock::closeFd(&p.fd);
      return;
    }
    if (!bsproto::secretEqual(h.secret, secret_)) {
      EP_WARN("bootstrap root at %s: dropped a connection from %s: wrong secret (a stranger, or a rank of "
              "another communicator)", addr_str_, AddrStr(p.peer).s);
      sock::closeFd(&p.fd);
      return;
    }
    if (h.nranks >= 1 && h.nranks <= kMaxRanks) max_nranks_ = std::max(max_nranks_, h.nranks);
    if (failed_) {
      sendFrameBounded(p.fd, makeStatusFrame(bsproto::kRootError, 0, fail_code_, fail_msg_), kRootSendTimeoutMs);
      sock::closeFd(&p.fd);
      ++answered_;
      if (answered_ >= max_nranks_) done_ = true;
      return;
    }
    Member m;
    m.fd = p.fd;
    p.fd = -1;
    m.rank = h.rank;
    m.nranks = h.nranks;
    m.pid = h.pid;
    m.peer = p.peer;
    m.listen = h.listen;
    members_.push_back(m);
    AddrStr from(m.peer);
    if (first_ns_ == 0) {
      first_ns_ = nowNs();
      first_rank_ = h.rank;
      if (h.nranks >= 1 && h.nranks <= kMaxRanks) {
        nranks_ = h.nranks;
        present_.assign(static_cast<size_t>(nranks_), 0);
      }
    }
    if (h.nranks < 1 || h.nranks > kMaxRanks) {
      fail(epRankMismatch, "rank %d (pid %u at %s) announced nranks=%d, outside [1, %d]", h.rank, h.pid, from.s,
           h.nranks, kMaxRanks);
      return;
    }
    if (h.nranks != nranks_) {
      fail(epRankMismatch,
           "ranks disagree on the rank count: rank %d (pid %u at %s) says nranks=%d but rank %d (the first to "
           "arrive) says nranks=%d",
           h.rank, h.pid, from.s, h.nranks, first_rank_, nranks_);
      return;
    }
    if (h.rank < 0 || h.rank >= nranks_) {
      fail(epRankMismatch, "rank %d (pid %u at %s) is out of range for nranks=%d", h.rank, h.pid, from.s,
           nranks_);
      return;
    }
    if (present_[static_cast<size_t>(h.rank)]) {
      const Member* other = nullptr;
      for (const Member& o : members_)
        if (o.rank == h.rank && o.fd != m.fd) other = &o;
      fail(epRankMismatch, "rank %d arrived twice (pid %u at %s and pid %u at %s): two processes were given the "
           "same rank", h.rank, other ? other->pid : 0, other ? AddrStr(other->peer).s : "?", h.pid, from.s);
      return;
    }
    if (h.rank == 0 && h.listen.len == 0) {
      fail(epInternalError, "rank 0 (pid %u at %s) sent no listener address", h.pid, from.s);
      return;
    }
    present_[static_cast<size_t>(h.rank)] = 1;
    progress_dirty_ = true;
    EP_INFO(kSubsysBootstrap, "bootstrap root at %s: rank %d of %d arrived (pid %u at %s), %zu present",
            addr_str_, h.rank, nranks_, h.pid, from.s, members_.size());
    if (static_cast<int>(members_.size()) == nranks_) finishOk();
  }

  void fail(epResult_t code, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fail_msg_, sizeof(fail_msg_), fmt, ap);
    va_end(ap);
    failed_ = true;
    fail_code_ = code;
    EP_WARN("bootstrap root at %s: %s", addr_str_, fail_msg_);
    auto frame = makeStatusFrame(bsproto::kRootError, 0, code, fail_msg_);
    for (Member& m : members_) {
      sendFrameBounded(m.fd, frame, kRootSendTimeoutMs);
      sock::closeFd(&m.fd);
      ++answered_;
    }
    members_.clear();
    if (answered_ >= max_nranks_) done_ = true;
  }

  void dropMember(size_t i, const char* why) {
    Member m = members_[i];
    members_.erase(members_.begin() + static_cast<std::ptrdiff_t>(i));
    EP_WARN("bootstrap root at %s: rank %d (pid %u at %s) %s; waiting for it again", addr_str_, m.rank, m.pid,
            AddrStr(m.peer).s, why);
    if (!failed_ && m.rank >= 0 && m.rank < nranks_) present_[static_cast<size_t>(m.rank)] = 0;
    sock::closeFd(&m.fd);
    progress_dirty_ = true;
  }

  void broadcastProgress() {
    progress_dirty_ = false;
    last_progress_ns_ = nowNs();
    char missing[kMaxText - 64];
    formatMissing(present_, missing, sizeof(missing));
    size_t tl = strlen(missing);
    std::vector<uint8_t> payload(8 + tl);
    bsproto::put32(payload.data(), static_cast<uint32_t>(members_.size()));
    bsproto::put32(payload.data() + 4, static_cast<uint32_t>(nranks_));
    memcpy(payload.data() + 8, missing, tl);
    auto frame = makeFrame(bsproto::kProgress, 0, payload.data(), payload.size());
    for (size_t i = members_.size(); i-- > 0;)
      if (!sendFrameBounded(members_[i].fd, frame, 500)) dropMember(i, "stopped reading progress reports");
  }

  void finishOk() {
    staleIds().add(secret_);  // before any rank returns: a creation that completed makes the id stale at once
    const Member* root = nullptr;
    for (const Member& m : members_)
      if (m.rank == 0) root = &m;
    uint8_t payload[bsproto::kWireAddrBytes];
    bsproto::encodeAddr(root->listen, payload);
    auto frame = makeFrame(bsproto::kRootOk, 0, payload, sizeof(payload));
    for (Member& m : members_) {
      if (!sendFrameBounded(m.fd, frame, kRootSendTimeoutMs))
        EP_WARN("bootstrap root at %s: could not send the rendezvous reply to rank %d", addr_str_, m.rank);
    }
    EP_INFO(kSubsysBootstrap, "bootstrap root at %s: all %d ranks arrived; rank 0 listens at %s", addr_str_,
            nranks_, AddrStr(root->listen).s);
    done_ = true;
  }

  void finishTimeout(int64_t now) {
    char missing[kMaxText - 256];
    formatMissing(present_, missing, sizeof(missing));
    fail(epTimeout,
         "bootstrap rendezvous at %s timed out after %lld ms (EPCOMM_BOOTSTRAP_ROOT_TIMEOUT_MS=%lld): ranks %s "
         "never arrived (%zu of %d arrived)",
         addr_str_, static_cast<long long>((now - first_ns_) / 1000000), static_cast<long long>(timeout_ms_),
         missing, members_.size(), nranks_);
    done_ = true;
  }

  int lfd_;
  char addr_str_[INET6_ADDRSTRLEN + 32];
  uint8_t secret_[kSecretBytes];
  int64_t timeout_ms_;
  int64_t create_ns_;
  int64_t first_ns_ = 0;
  int first_rank_ = -1;
  int nranks_ = 0;
  std::vector<Pending> pending_;
  std::vector<Member> members_;
  std::vector<uint8_t> present_;
  bool failed_ = false;
  epResult_t fail_code_ = epSuccess;
  char fail_msg_[kMaxText] = "";
  int answered_ = 0;
  int max_nranks_ = 0;
  bool progress_dirty_ = false;
  int64_t last_progress_ns_ = 0;
  bool done_ = false;
};

// ------------------------------------------------------------------------------------------------------
// The socket star: rank 0 holds one connection to every other rank.
// ------------------------------------------------------------------------------------------------------
class SocketBootstrap final : public Bootstrap {
 public:
  SocketBootstrap(int rank, int nranks, const uint8_t* secret, std::vector<int> fds, int efd)
      : fds_(std::move(fds)), efd_(efd), tx_partial_(static_cast<size_t>(nranks), 0) {
    rank_ = rank;
    nranks_ = nranks;
    memcpy(secret_, secret, kSecretBytes);
  }

  ~SocketBootstrap() override {
    for (int& fd : fds_) closeGracefully(&fd);
    sock::closeFd(&efd_);
  }

  epResult_t allgather(void* buf, size_t bytes_per_rank, int timeout_ms) override {
    if (aborted_.load()) EP_FAIL(epAborted, "rank %d: bootstrap allgather called after abort", rank_);
    if (broken_)
      EP_FAIL(broken_code_, "rank %d: the bootstrap is unusable after an earlier failure: %s", rank_, broken_msg_);
    if (timeout_ms <= 0) EP_FAIL(epInvalidArgument, "bootstrap allgather: timeout_ms=%d must be positive", timeout_ms);
    if (buf == nullptr && bytes_per_rank > 0)
      EP_FAIL(epNullPointer, "bootstrap allgather: buf is NULL with bytes_per_rank=%zu", bytes_per_rank);
    if (bytes_per_rank > (SIZE_MAX - kHeaderBytes) / static_cast<size_t>(nranks_))
      EP_FAIL(epInvalidArgument, "bootstrap allgather: bytes_per_rank=%zu times nranks=%d overflows", bytes_per_rank,
              nranks_);
    return allgatherUntil(static_cast<uint8_t*>(buf), bytes_per_rank, Deadline::afterMs(timeout_ms), timeout_ms);
  }

  void abort() override {
    aborted_.store(true);
    uint64_t one = 1;
    ssize_t w = write(efd_, &one, sizeof(one));
    (void)w;
    // shutdown (not close) so that a wait in progress on another thread never sees a reused descriptor; the
    // destructor closes them.
    for (int fd : fds_)
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
  }

  epResult_t allgatherUntil(uint8_t* buf, size_t bytes, const Deadline& dl, int timeout_ms) {
    if (aborted_.load()) EP_FAIL(epAborted, "rank %d: bootstrap allgather called after abort", rank_);
    ++seq_;
    if (nranks_ == 1) return epSuccess;
    return rank_ == 0 ? gatherRoot(buf, bytes, dl, timeout_ms) : gatherLeaf(buf, bytes, dl, timeout_ms);
  }

  // Rank 0 during init: tells the connected ranks why the bootstrap failed.
  void notifyPeers(epResult_t code, const char* msg) {
    auto frame = makeStatusFrame(bsproto::kError, seq_, code, msg);
    Deadline d = Deadline::afterMs(kNotifyTimeoutMs);
    for (int r = 1; r < nranks_; ++r) {
      int fd = fds_[static_cast<size_t>(r)];
      if (fd < 0) continue;
      int err = 0;
      if (!tx_partial_[static_cast<size_t>(r)]) sock::sendAll(fd, frame.data(), frame.size(), d, efd_, &err);
      shutdown(fd, SHUT_WR);
    }
  }

 private:
  epResult_t breakWith(epResult_t code, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(broken_msg_, sizeof(broken_msg_), fmt, ap);
    va_end(ap);
    broken_ = true;
    broken_code_ = code;
    if (rank_ == 0 && code != epAborted) notifyPeers(code, broken_msg_);
    return setError(code, __FILE__, __LINE__, "%s", broken_msg_);
  }

  epResult_t abortedError(const char* what) {
    return breakWith(epAborted, "rank %d: bootstrap allgather aborted while %s", rank_, what);
  }

  epResult_t gatherRoot(uint8_t* buf, size_t bytes, const Deadline& dl, int timeout_ms) {
    const int n = nranks_;
    const uint32_t seq = seq_;
    const uint64_t total = static_cast<uint64_t>(n) * bytes;
    struct Rx {
      uint8_t hdr[kHeaderBytes];
      size_t hgot = 0;
      size_t got = 0;
    };
    std::vector<Rx> rx(static_cast<size_t>(n));
    std::vector<uint8_t> have(static_cast<size_t>(n), 0);
    have[0] = 1;
    int left = n - 1;
    std::vector<pollfd> pfds;
    std::vector<int> who;
    // Phase 1: one data frame from every rank, all at once.
    while (left > 0) {
      pfds.assign(1, pollfd{efd_, POLLIN, 0});
      who.assign(1, -1);
      for (int r = 1; r < n; ++r)
        if (!have[static_cast<size_t>(r)]) {
          pfds.push_back({fds_[static_cast<size_t>(r)], POLLIN, 0});
          who.push_back(r);
        }
      int pr = poll(pfds.data(), pfds.size(), sock::pollMs(dl));
      if (pr < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return breakWith(epSystemError, "rank 0: poll failed in the bootstrap allgather: %s", ErrStr(e).str);
      }
      if (pfds[0].revents != 0 || aborted_.load()) return abortedError("gathering the ranks' data");
      for (size_t i = 1; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        const int r = who[i];
        Rx& x = rx[static_cast<size_t>(r)];
        const int fd = fds_[static_cast<size_t>(r)];
        for (;;) {
          ssize_t got;
          const bool in_header = x.hgot < kHeaderBytes;
          if (in_header)
            got = recv(fd, x.hdr + x.hgot, kHeaderBytes - x.hgot, MSG_DONTWAIT);
          else
            got = recv(fd, buf + static_cast<size_t>(r) * bytes + x.got, bytes - x.got, MSG_DONTWAIT);
          if (got < 0 && errno == EINTR) continue;
          if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (got == 0 || (got < 0 && (errno == ECONNRESET || errno == ENOTCONN))) {
            if (aborted_.load()) return abortedError("gathering the ranks' data");
            return breakWith(epRemoteError,
                             "rank %d closed its bootstrap connection (rank 0 was waiting for its allgather data, "
                             "collective #%u)", r, seq);
          }
          if (got < 0) {
            int e = errno;
            return breakWith(epSystemError, "rank 0: receive from rank %d failed: %s", r, ErrStr(e).str);
          }
          if (in_header) {
            x.hgot += static_cast<size_t>(got);
            if (x.hgot < kHeaderBytes) continue;
            FrameHeader h = bsproto::decodeHeader(x.hdr);
            if (h.magic != bsproto::kFrameMagic || h.type != bsproto::kData)
              return breakWith(epRemoteError, "rank 0: protocol error from rank %d (frame magic 0x%08x, type %u)", r,
                               h.magic, h.type);
            if (h.seq != seq)
              return breakWith(epInvalidUsage,
                               "rank %d is at bootstrap collective #%u but rank 0 is at #%u: the ranks issued "
                               "different setup collectives", r, h.seq, seq);
            if (h.len != bytes)
              return breakWith(epInvalidUsage,
                               "rank %d called the bootstrap allgather with %llu bytes per rank but rank 0 with %zu",
                               r, static_cast<unsigned long long>(h.len), bytes);
          } else {
            x.got += static_cast<size_t>(got);
          }
          if (x.hgot == kHeaderBytes && x.got == bytes) {
            have[static_cast<size_t>(r)] = 1;
            --left;
            break;
          }
        }
      }
      if (left > 0 && dl.expired()) {
        char missing[512];
        formatMissing(have, missing, sizeof(missing));
        return breakWith(epTimeout,
                         "rank 0: bootstrap allgather timed out after %d ms waiting for rank(s) %s (%d of %d ranks "
                         "delivered, collective #%u)", timeout_ms, missing, n - left, n, seq);
      }
    }
    // Phase 2: the whole buffer back to every rank, all at once.
    uint8_t hdr[kHeaderBytes];
    FrameHeader h;
    h.type = bsproto::kData;
    h.seq = seq;
    h.len = total;
    bsproto::encodeHeader(h, hdr);
    const uint64_t frame = kHeaderBytes + total;
    std::vector<uint64_t> off(static_cast<size_t>(n), 0);
    std::vector<uint8_t> sent(static_cast<size_t>(n), 0);
    sent[0] = 1;
    left = n - 1;
    while (left > 0) {
      pfds.assign(1, pollfd{efd_, POLLIN, 0});
      who.assign(1, -1);
      for (int r = 1; r < n; ++r)
        if (!sent[static_cast<size_t>(r)]) {
          pfds.push_back({fds_[static_cast<size_t>(r)], POLLOUT, 0});
          who.push_back(r);
        }
      int pr = poll(pfds.data(), pfds.size(), sock::pollMs(dl));
      if (pr < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return breakWith(epSystemError, "rank 0: poll failed in the bootstrap allgather: %s", ErrStr(e).str);
      }
      if (pfds[0].revents != 0 || aborted_.load()) return abortedError("sending the allgather result");
      for (size_t i = 1; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        const int r = who[i];
        const int fd = fds_[static_cast<size_t>(r)];
        uint64_t& o = off[static_cast<size_t>(r)];
        for (;;) {
          iovec iov[2];
          int niov;
          if (o < kHeaderBytes) {
            iov[0] = {hdr + o, kHeaderBytes - o};
            iov[1] = {buf, static_cast<size_t>(total)};
            niov = 2;
          } else {
            iov[0] = {buf + (o - kHeaderBytes), static_cast<size_t>(frame - o)};
            niov = 1;
          }
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = static_cast<size_t>(niov);
          ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (w < 0 && errno == EINTR) continue;
          if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (w < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)) {
            if (aborted_.load()) return abortedError("sending the allgather result");
            tx_partial_[static_cast<size_t>(r)] = o > 0;
            return breakWith(epRemoteError,
                             "rank %d closed its bootstrap connection (rank 0 was sending it the allgather result, "
                             "collective #%u)", r, seq);
          }
          if (w < 0) {
            int e = errno;
            tx_partial_[static_cast<size_t>(r)] = o > 0;
            return breakWith(epSystemError, "rank 0: send to rank %d failed: %s", r, ErrStr(e).str);
          }
          o += static_cast<uint64_t>(w);
          tx_partial_[static_cast<size_t>(r)] = o < frame;
          if (o == frame) {
            sent[static_cast<size_t>(r)] = 1;
            --left;
            break;
          }
        }
      }
      if (left > 0 && dl.expired()) {
        char missing[512];
        formatMissing(sent, missing, sizeof(missing));
        return breakWith(epTimeout,
                         "rank 0: bootstrap allgather timed out after %d ms sending the result to rank(s) %s (they "
                         "stopped reading, collective #%u)", timeout_ms, missing, seq);
      }
    }
    return epSuccess;
  }

  epResult_t leafIoError(Io io, int err, int timeout_ms, const char* what) {
    switch (io) {
      case Io::kAborted:
        return abortedError(what);
      case Io::kClosed:
        if (aborted_.load()) return abortedError(what);
        return breakWith(epRemoteError, "rank 0 closed its bootstrap connection (rank %d was %s, collective #%u)",
                         rank_, what, seq_);
      case Io::kTimeout:
        return breakWith(epTimeout,
                         "rank %d: bootstrap allgather timed out after %d ms %s (rank 0 gathers every rank's data; "
                         "rank 0 or another rank may be late or gone; collective #%u)", rank_, timeout_ms, what, seq_);
      default:
        return breakWith(epSystemError, "rank %d: bootstrap connection to rank 0 failed while %s: %s", rank_, what,
                         ErrStr(err).str);
    }
  }

  epResult_t gatherLeaf(uint8_t* buf, size_t bytes, const Deadline& dl, int timeout_ms) {
    const int fd = fds_[0];
    const uint32_t seq = seq_;
    const uint64_t total = static_cast<uint64_t>(nranks_) * bytes;
    uint8_t hdr[kHeaderBytes];
    FrameHeader h;
    h.type = bsproto::kData;
    h.seq = seq;
    h.len = bytes;
    bsproto::encodeHeader(h, hdr);
    uint8_t* slot = buf + static_cast<size_t>(rank_) * bytes;
    const uint64_t frame = kHeaderBytes + bytes;
    uint64_t off = 0;
    bool early = false;  // rank 0 sent something before taking all our data: an error report or a close
    // Phase 1: our slot to rank 0, watching for an early word from it.
    while (off < frame) {
      pollfd p[2] = {{fd, POLLOUT | POLLIN, 0}, {efd_, POLLIN, 0}};
      int pr = poll(p, 2, sock::pollMs(dl));
      if (pr < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return breakWith(epSystemError, "rank %d: poll failed in the bootstrap allgather: %s", rank_, ErrStr(e).str);
      }
      if (p[1].revents != 0 || aborted_.load()) return abortedError("sending its allgather data to rank 0");
      if (p[0].revents & POLLIN) {
        early = true;
        break;
      }
      if (p[0].revents != 0) {
        for (;;) {
          iovec iov[2];
          int niov;
          if (off < kHeaderBytes) {
            iov[0] = {hdr + off, kHeaderBytes - off};
            iov[1] = {slot, bytes};
            niov = 2;
          } else {
            iov[0] = {slot + (off - kHeaderBytes), static_cast<size_t>(frame - off)};
            niov = 1;
          }
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = static_cast<size_t>(niov);
          ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
          if (w < 0 && errno == EINTR) continue;
          if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (w < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN))
            return leafIoError(Io::kClosed, 0, timeout_ms, "sending its allgather data to rank 0");
          if (w < 0) return leafIoError(Io::kError, errno, timeout_ms, "sending its allgather data to rank 0");
          off += static_cast<uint64_t>(w);
          if (off == frame) break;
        }
      }
      if (off < frame && dl.expired())
        return leafIoError(Io::kTimeout, 0, timeout_ms, "sending its allgather data to rank 0");
    }
    // Phase 2: the result (or rank 0's error report).
    const char* waiting = "waiting for the allgather result from rank 0";
    uint8_t rh[kHeaderBytes];
    int err = 0;
    Io io = sock::recvAll(fd, rh, kHeaderBytes, dl, efd_, &err);
    if (io != Io::kOk) return leafIoError(io, err, timeout_ms, waiting);
    FrameHeader in = bsproto::decodeHeader(rh);
    if (in.magic != bsproto::kFrameMagic)
      return breakWith(epRemoteError, "rank %d: protocol error from rank 0 (frame magic 0x%08x)", rank_, in.magic);
    if (in.type == bsproto::kError) {
      if (in.len < 4 || in.len > 4 + kMaxText)
        return breakWith(epRemoteError, "rank %d: protocol error from rank 0 (an error report of %llu bytes)", rank_,
                         static_cast<unsigned long long>(in.len));
      uint8_t payload[4 + kMaxText];
      io = sock::recvAll(fd, payload, static_cast<size_t>(in.len), dl, efd_, &err);
      if (io != Io::kOk) return leafIoError(io, err, timeout_ms, waiting);
      char text[kMaxText + 1];
      copyText(payload + 4, static_cast<size_t>(in.len) - 4, text, sizeof(text));
      return breakWith(statusCode(bsproto::get32(payload)), "rank %d: rank 0 reported: %s", rank_, text);
    }
    if (in.type != bsproto::kData || early)
      return breakWith(epRemoteError, "rank %d: protocol error from rank 0 (frame type %u%s)", rank_, in.type,
                       early ? " before it took this rank's data" : "");
    if (in.seq != seq)
      return breakWith(epInvalidUsage,
                       "rank %d is at bootstrap collective #%u but rank 0 sent the result of #%u: the ranks issued "
                       "different setup collectives", rank_, seq, in.seq);
    if (in.len != total)
      return breakWith(epInvalidUsage,
                       "rank %d: rank 0 sent %llu bytes for the bootstrap allgather, this rank expected %llu (nranks=%d x "
                       "%zu bytes): the ranks called allgather with different sizes",
                       rank_, static_cast<unsigned long long>(in.len), static_cast<unsigned long long>(total), nranks_,
                       bytes);
    io = sock::recvAll(fd, buf, static_cast<size_t>(total), dl, efd_, &err);
    if (io != Io::kOk) return leafIoError(io, err, timeout_ms, waiting);
    return epSuccess;
  }

  std::vector<int> fds_;  // by rank: rank 0 holds fds_[1..n-1], the others fds_[0]
  int efd_;               // eventfd: readable once aborted
  std::atomic<bool> aborted_{false};
  bool broken_ = false;
  epResult_t broken_code_ = epSuccess;
  char broken_msg_[kMaxText] = "";
  uint32_t seq_ = 0;
  std::vector<uint8_t> tx_partial_;  // rank 0: a data frame to this rank is partly sent
};

// Closes the descriptors it holds (gracefully) unless released.
struct FdGuard {
  std::vector<int> fds;
  ~FdGuard() {
    for (int& fd : fds) closeGracefully(&fd);
  }
};

// Rank 0: accepts the star connections of ranks 1..n-1, dropping strangers.
epResult_t acceptStar(int lfd, const sock::Addr& listen, const uint8_t* secret, int nranks, const Deadline& dl,
                      int timeout_ms, std::vector<int>* fds) {
  AddrStr at(listen);
  std::vector<Pending> pending;
  auto closePending = [&]() {
    for (Pending& p : pending) sock::closeFd(&p.fd);
    pending.clear();
  };
  std::vector<uint8_t> have(static_cast<size_t>(nranks), 0);
  have[0] = 1;
  int left = nranks - 1;
  std::vector<pollfd> pfds;
  while (left > 0) {
    const int64_t now = nowNs();
    if (dl.expired()) {
      closePending();
      char missing[512];
      formatMissing(have, missing, sizeof(missing));
      char msg[kMaxText];
      snprintf(msg, sizeof(msg),
               "rank 0: timed out after %d ms waiting for rank(s) %s to connect to its bootstrap listener at %s (%d "
               "of %d connected)", timeout_ms, missing, at.s, nranks - left, nranks);
      auto frame = makeStatusFrame(bsproto::kError, 1, epTimeout, msg);
      Deadline d = Deadline::afterMs(kNotifyTimeoutMs);
      for (int fd : *fds) {
        if (fd < 0) continue;
        int err = 0;
        sock::sendAll(fd, frame.data(), frame.size(), d, -1, &err);
        shutdown(fd, SHUT_WR);
      }
      EP_FAIL(epTimeout, "%s", msg);
    }
    int64_t wake = dl.endNs();
    for (const Pending& p : pending) wake = std::min<int64_t>(wake, p.t0_ns + kHandshakeReadTimeoutMs * 1000000LL);
    pfds.assign(1, pollfd{lfd, POLLIN, 0});
    for (const Pending& p : pending) pfds.push_back({p.fd, POLLIN, 0});
    int ms = static_cast<int>(std::clamp<int64_t>((wake - now + 999999) / 1000000, 0, 1000));
    int pr = poll(pfds.data(), pfds.size(), ms);
    if (pr < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      closePending();
      EP_FAIL(epSystemError, "rank 0: poll on the bootstrap listener failed: %s", ErrStr(e).str);
    }
    const int64_t t = nowNs();
    for (size_t i = pending.size(); i-- > 0;) {
      Pending& p = pending[i];
      char why[256] = "";
      ReadStatus st = ReadStatus::kMore;
      if (pfds[1 + i].revents != 0)
        st = readHandshake(p, bsproto::kStarHello, bsproto::kStarHelloBytes, why, sizeof(why));
      if (st == ReadStatus::kMore && t - p.t0_ns > kHandshakeReadTimeoutMs * 1000000LL) {
        snprintf(why, sizeof(why), "sent %zu of %zu handshake bytes within %d ms", p.got,
                 kHeaderBytes + bsproto::kStarHelloBytes, kHandshakeReadTimeoutMs);
        st = ReadStatus::kDrop;
      }
      if (st == ReadStatus::kDone) {
        const uint8_t* q = p.buf + kHeaderBytes;
        int32_t r = static_cast<int32_t>(bsproto::get32(q + kSecretBytes));
        int32_t n = static_cast<int32_t>(bsproto::get32(q + kSecretBytes + 4));
        if (!bsproto::secretEqual(q, secret)) {
          snprintf(why, sizeof(why), "wrong secret (a stranger, or a rank of another communicator)");
          st = ReadStatus::kDrop;
        } else if (n != nranks || r < 1 || r >= nranks) {
          snprintf(why, sizeof(why), "claims rank %d of %d, expected a rank in [1, %d) of %d", r, n, nranks, nranks);
          st = ReadStatus::kDrop;
        } else if (have[static_cast<size_t>(r)]) {
          snprintf(why, sizeof(why), "claims rank %d, which is already connected", r);
          st = ReadStatus::kDrop;
        } else {
          (*fds)[static_cast<size_t>(r)] = p.fd;
          p.fd = -1;
          have[static_cast<size_t>(r)] = 1;
          --left;
        }
      }
      if (st == ReadStatus::kMore) continue;
      if (st == ReadStatus::kDrop) {
        EP_WARN("rank 0: dropped a connection to the bootstrap listener at %s from %s: %s", at.s,
                AddrStr(p.peer).s, why);
        sock::closeFd(&p.fd);
      }
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (pfds[0].revents != 0) {
      for (int k = 0; k < 64; ++k) {
        sock::Addr peer;
        int fd = sock::acceptOne(lfd, &peer);
        if (fd < 0) break;
        if (pending.size() >= kMaxPending) {
          EP_WARN("rank 0: dropped a connection to the bootstrap listener from %s: too many pending connections",
                  AddrStr(peer).s);
          close(fd);
          continue;
        }
        Pending p;
        p.fd = fd;
        p.t0_ns = nowNs();
        p.peer = peer;
        pending.push_back(p);
      }
    }
  }
  closePending();
  return epSuccess;
}

// The rank side of the rendezvous: connect, present the hello, wait for rank 0's address.
epResult_t rendezvous(const bsproto::IdInfo& info, int rank, int nranks, int timeout_ms, const Deadline& dl,
                      int* root_fd, int* listen_fd, sock::Addr* rank0) {
  AddrStr root_str(info.root);
  int err = 0;
  Io io = sock::connectRetry(info.root, dl, -1, root_fd, &err);
  if (io == Io::kTimeout)
    EP_FAIL(epTimeout,
            "rank %d: could not reach the bootstrap root at %s within %d ms (last error: %s); is the process that "
            "called epGetUniqueId still running, and is the address reachable from here?",
            rank, root_str.s, timeout_ms, err ? ErrStr(err).str : "none");
  if (io != Io::kOk)
    EP_FAIL(epSystemError, "rank %d: connecting to the bootstrap root at %s failed: %s", rank, root_str.s,
            ErrStr(err).str);

  bsproto::Hello hello;
  memcpy(hello.secret, info.secret, kSecretBytes);
  hello.rank = rank;
  hello.nranks = nranks;
  hello.pid = static_cast<uint32_t>(getpid());
  if (rank == 0) {
    sock::Addr local;
    char ifname[64] = "";
    if (paramString("EPCOMM_SOCKET_IFNAME") != nullptr) {
      EPCHECK(sock::chooseInterface(info.root.family(), &local, ifname, sizeof(ifname)));
    } else if (!sock::localAddr(*root_fd, &local)) {
      int e = errno;
      EP_FAIL(epSystemError, "rank 0: getsockname on the connection to the root failed: %s", ErrStr(e).str);
    }
    local.setPort(0);
    EPCHECK(sock::listenOn(local, false, "rank 0 bootstrap listener", listen_fd, &hello.listen));
    if (gStarListenHook != nullptr) gStarListenHook(hello.listen);
  }
  uint8_t payload[bsproto::kHelloBytes];
  bsproto::encodeHello(hello, payload);
  auto frame = makeFrame(bsproto::kHello, 0, payload, sizeof(payload));
  io = sock::sendAll(*root_fd, frame.data(), frame.size(), dl, -1, &err);
  if (io == Io::kClosed)
    EP_FAIL(epRemoteError, "rank %d: the bootstrap root at %s closed the connection before taking the hello", rank,
            root_str.s);
  if (io == Io::kTimeout)
    EP_FAIL(epTimeout, "rank %d: rendezvous timed out after %d ms sending the hello to the root at %s", rank,
            timeout_ms, root_str.s);
  if (io != Io::kOk)
    EP_FAIL(epSystemError, "rank %d: sending the hello to the root at %s failed: %s", rank, root_str.s,
            ErrStr(err).str);

  char missing[kMaxText + 1] = "";
  int arrived = -1;
  for (;;) {
    uint8_t rh[kHeaderBytes];
    io = sock::recvAll(*root_fd, rh, kHeaderBytes, dl, -1, &err);
    FrameHeader h;
    uint8_t body[8 + kMaxText];
    if (io == Io::kOk) {
      h = bsproto::decodeHeader(rh);
      size_t lo = 0, hi = 0;
      switch (h.type) {
        case bsproto::kProgress: lo = 8; hi = 8 + kMaxText; break;
        case bsproto::kRootOk: lo = hi = bsproto::kWireAddrBytes; break;
        case bsproto::kRootError: lo = 4; hi = 4 + kMaxText; break;
        default: break;
      }
      if (h.magic != bsproto::kFrameMagic || hi == 0 || h.len < lo || h.len > hi)
        EP_FAIL(epRemoteError,
                "rank %d: protocol error from the bootstrap root at %s (frame magic 0x%08x, type %u, %llu bytes)",
                rank, root_str.s, h.magic, h.type, static_cast<unsigned long long>(h.len));
      io = sock::recvAll(*root_fd, body, static_cast<size_t>(h.len), dl, -1, &err);
    }
    if (io == Io::kTimeout) {
      if (arrived >= 0)
        EP_FAIL(epTimeout,
                "rank %d: rendezvous timed out after %d ms waiting for ranks %s (%d of %d arrived at the root at %s)",
                rank, timeout_ms, missing, arrived, nranks, root_str.s);
      EP_FAIL(epTimeout, "rank %d: rendezvous timed out after %d ms waiting for ranks (no report from the root at %s)",
              rank, timeout_ms, root_str.s);
    }
    if (io == Io::kClosed)
      EP_FAIL(epRemoteError,
              "rank %d: the bootstrap root at %s closed the connection before the rendezvous completed (it may have "
              "failed or timed out, or already served a communicator creation with this id)", rank, root_str.s);
    if (io != Io::kOk)
      EP_FAIL(epSystemError, "rank %d: receiving from the bootstrap root at %s failed: %s", rank, root_str.s,
              ErrStr(err).str);
    if (h.type == bsproto::kProgress) {
      arrived = static_cast<int>(bsproto::get32(body));
      copyText(body + 8, static_cast<size_t>(h.len) - 8, missing, sizeof(missing));
      continue;
    }
    if (h.type == bsproto::kRootError) {
      char text[kMaxText + 1];
      copyText(body + 4, static_cast<size_t>(h.len) - 4, text, sizeof(text));
      EP_FAIL(statusCode(bsproto::get32(body)), "rank %d: the bootstrap root at %s reported: %s", rank, root_str.s,
              text);
    }
    // kRootOk
    if (!bsproto::decodeAddr(body, rank0) || rank0->len == 0 || rank0->port() == 0)
      EP_FAIL(epRemoteError, "rank %d: the bootstrap root at %s sent an invalid address for rank 0", rank,
              root_str.s);
    return epSuccess;
  }
}

epResult_t initSocket(const epUniqueId* id, int rank, int nranks, int timeout_ms, std::unique_ptr<Bootstrap>* out) {
  EP_REQUIRE(out != nullptr, epNullPointer, "bootstrapInitSocket: out is NULL");
  out->reset();
  EP_REQUIRE(id != nullptr, epNullPointer, "bootstrapInitSocket: id is NULL");
  EP_REQUIRE(nranks >= 1 && nranks <= kMaxRanks, epInvalidArgument, "bootstrapInitSocket: nranks=%d outside [1, %d]",
             nranks, kMaxRanks);
  EP_REQUIRE(rank >= 0 && rank < nranks, epRankMismatch, "bootstrapInitSocket: rank=%d outside [0, nranks=%d)", rank,
             nranks);
  EP_REQUIRE(timeout_ms > 0, epInvalidArgument, "bootstrapInitSocket: timeout_ms=%d must be positive", timeout_ms);
  bsproto::IdInfo info;
  EPCHECK(bsproto::decodeUniqueId(id, &info));
  EP_REQUIRE(!staleIds().has(info.secret), epInvalidUniqueId,
             "rank %d: this unique id is stale: its rendezvous already served a communicator creation (or closed); "
             "call epGetUniqueId for every creation", rank);
  const Deadline dl = Deadline::afterMs(timeout_ms);

  FdGuard guard;  // [0] root connection, [1] rank 0's listener, [2] eventfd, [3 + r] star connections
  guard.fds.assign(3 + static_cast<size_t>(nranks), -1);
  sock::Addr rank0;
  EPCHECK(rendezvous(info, rank, nranks, timeout_ms, dl, &guard.fds[0], &guard.fds[1], &rank0));
  sock::closeFd(&guard.fds[0]);

  std::vector<int> star(static_cast<size_t>(nranks), -1);
  epResult_t res = epSuccess;
  if (rank == 0) {
    sock::Addr listen;
    sock::localAddr(guard.fds[1], &listen);
    res = acceptStar(guard.fds[1], listen, info.secret, nranks, dl, timeout_ms, &star);
    sock::closeFd(&guard.fds[1]);
  } else {
    AddrStr r0(rank0);
    int fd = -1, err = 0;
    Io io = sock::connectRetry(rank0, dl, -1, &fd, &err);
    if (io == Io::kTimeout) {
      res = EP_ERROR(epTimeout, "rank %d: could not connect to rank 0 at %s within %d ms (last error: %s)", rank, r0.s,
                     timeout_ms, err ? ErrStr(err).str : "none");
    } else if (io != Io::kOk) {
      res = EP_ERROR(epSystemError, "rank %d: connecting to rank 0 at %s failed: %s", rank, r0.s, ErrStr(err).str);
    } else {
      star[0] = fd;
      uint8_t payload[bsproto::kStarHelloBytes];
      memcpy(payload, info.secret, kSecretBytes);
      bsproto::put32(payload + kSecretBytes, static_cast<uint32_t>(rank));
      bsproto::put32(payload + kSecretBytes + 4, static_cast<uint32_t>(nranks));
      auto frame = makeFrame(bsproto::kStarHello, 0, payload, sizeof(payload));
      io = sock::sendAll(fd, frame.data(), frame.size(), dl, -1, &err);
      if (io == Io::kClosed)
        res = EP_ERROR(epRemoteError, "rank 0 closed its bootstrap connection (rank %d was presenting itself)", rank);
      else if (io == Io::kTimeout)
        res = EP_ERROR(epTimeout, "rank %d: timed out after %d ms presenting itself to rank 0 at %s", rank, timeout_ms,
                       r0.s);
      else if (io != Io::kOk)
        res = EP_ERROR(epSystemError, "rank %d: sending to rank 0 at %s failed: %s", rank, r0.s, ErrStr(err).str);
    }
  }
  for (size_t r = 0; r < star.size(); ++r) guard.fds[3 + r] = star[r];
  if (res != epSuccess) return res;

  int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) {
    int e = errno;
    EP_FAIL(epSystemError, "rank %d: eventfd failed: %s", rank, ErrStr(e).str);
  }
  for (size_t r = 0; r < star.size(); ++r) guard.fds[3 + r] = -1;  // the bootstrap owns them now
  auto bs = std::make_unique<SocketBootstrap>(rank, nranks, info.secret, std::move(star), efd);
  // The closing barrier makes creation collective: every rank is connected when any rank returns.
  std::vector<uint8_t> bar(static_cast<size_t>(nranks), 0);
  EPCHECK(bs->allgatherUntil(bar.data(), 1, dl, timeout_ms));
  EP_INFO(kSubsysBootstrap, "rank %d of %d: bootstrap connected (root %s, rank 0 at %s)", rank, nranks,
          AddrStr(info.root).s, AddrStr(rank0).s);
  *out = std::move(bs);
  return epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// The callback path.
// ------------------------------------------------------------------------------------------------------
class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(epAllgatherFn_t fn, void* ctx, int rank, int nranks) : fn_(fn), ctx_(ctx) {
    rank_ = rank;
    nranks_ = nranks;
  }

  epResult_t allgather(void* buf, size_t bytes_per_rank, int timeout_ms) override {
    (void)timeout_ms;  // the caller's all-gather keeps its own time
    if (aborted_.load()) EP_FAIL(epAborted, "rank %d: bootstrap allgather called after abort", rank_);
    if (created_)
      EP_FAIL(epInternalError, "rank %d: the caller's all-gather was needed after creation, which its contract "
              "forbids (epcomm bug)", rank_);
    if (buf == nullptr && bytes_per_rank > 0)
      EP_FAIL(epNullPointer, "bootstrap allgather: buf is NULL with bytes_per_rank=%zu", bytes_per_rank);
    if (bytes_per_rank > SIZE_MAX / static_cast<size_t>(nranks_))
      EP_FAIL(epInvalidArgument, "bootstrap allgather: bytes_per_rank=%zu times nranks=%d overflows", bytes_per_rank,
              nranks_);
    uint8_t* b = static_cast<uint8_t*>(buf);
    // The callback may not support sendbuf inside recvbuf: send from a copy.
    std::vector<uint8_t> mine(b ? b + static_cast<size_t>(rank_) * bytes_per_rank : nullptr,
                              b ? b + static_cast<size_t>(rank_ + 1) * bytes_per_rank : nullptr);
    int rc;
    try {
      rc = fn_(ctx_, mine.data(), buf, bytes_per_rank);
    } catch (...) {
      rc = -1;
    }
    if (aborted_.load()) EP_FAIL(epAborted, "rank %d: bootstrap aborted during the external allgather", rank_);
    if (rc != 0)
      EP_FAIL(epRemoteError, "rank %d: external allgather failed (the callback returned %d, %zu bytes per rank)",
              rank_, rc, bytes_per_rank);
    return epSuccess;
  }

  void abort() override { aborted_.store(true); }
  void creationDone() override { created_ = true; }
  void setSecret(const uint8_t* s) { memcpy(secret_, s, kSecretBytes); }

 private:
  epAllgatherFn_t fn_;
  void* ctx_;
  std::atomic<bool> aborted_{false};
  bool created_ = false;
};

epResult_t initCallback(epAllgatherFn_t fn, void* ctx, int rank, int nranks, std::unique_ptr<Bootstrap>* out) {
  EP_REQUIRE(out != nullptr, epNullPointer, "bootstrapInitCallback: out is NULL");
  out->reset();
  EP_REQUIRE(fn != nullptr, epNullPointer, "bootstrapInitCallback: the allgather function is NULL");
  EP_REQUIRE(nranks >= 1 && nranks <= kMaxRanks, epInvalidArgument, "bootstrapInitCallback: nranks=%d outside [1, %d]",
             nranks, kMaxRanks);
  EP_REQUIRE(rank >= 0 && rank < nranks, epRankMismatch, "bootstrapInitCallback: rank=%d outside [0, nranks=%d)",
             rank, nranks);
  auto bs = std::make_unique<CallbackBootstrap>(fn, ctx, rank, nranks);
  // Slot: {u32 magic, u32 version, i32 rank, i32 nranks, secret[16]}; everyone takes rank 0's secret.
  constexpr size_t kSlot = 16 + kSecretBytes;
  std::vector<uint8_t> all(kSlot * static_cast<size_t>(nranks), 0);
  uint8_t* mine = all.data() + kSlot * static_cast<size_t>(rank);
  bsproto::put32(mine, kCallbackMagic);
  bsproto::put32(mine + 4, EPCOMM_VERSION_CODE);
  bsproto::put32(mine + 8, static_cast<uint32_t>(rank));
  bsproto::put32(mine + 12, static_cast<uint32_t>(nranks));
  EPCHECK(randomBytes(mine + 16, kSecretBytes));
  EPCHECK(bs->allgather(all.data(), kSlot, INT_MAX));
  for (int r = 0; r < nranks; ++r) {
    const uint8_t* s = all.data() + kSlot * static_cast<size_t>(r);
    uint32_t magic = bsproto::get32(s);
    uint32_t version = bsproto::get32(s + 4);
    int32_t srank = static_cast<int32_t>(bsproto::get32(s + 8));
    int32_t sn = static_cast<int32_t>(bsproto::get32(s + 12));
    if (magic != kCallbackMagic)
      EP_FAIL(epRemoteError,
              "rank %d: the external allgather returned garbage in slot %d (magic 0x%08x): it must place rank r's "
              "bytes at recvbuf + r * bytes_per_rank", rank, r, magic);
    if (version != EPCOMM_VERSION_CODE)
      EP_FAIL(epInvalidUsage, "rank %d: rank %d runs epcomm version code %u, this rank %d", rank, r, version,
              EPCOMM_VERSION_CODE);
    if (sn != nranks)
      EP_FAIL(epRankMismatch, "rank %d: ranks disagree on the rank count: rank %d says nranks=%d, this rank says %d",
              rank, r, sn, nranks);
    if (srank != r)
      EP_FAIL(epRankMismatch,
              "rank %d: slot %d of the external allgather holds rank %d: two processes were given the same rank, or "
              "the callback misplaces slots", rank, r, srank);
  }
  bs->setSecret(all.data() + 16);
  *out = std::move(bs);
  return epSuccess;
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// Wire helpers and the unique id.
// ------------------------------------------------------------------------------------------------------
namespace bsproto {

void encodeAddr(const sock::Addr& a, uint8_t* out) {
  memset(out, 0, kWireAddrBytes);
  if (a.family() == AF_INET) {
    const auto* in4 = reinterpret_cast<const sockaddr_in*>(&a.ss);
    out[0] = 4;
    put16(out + 2, static_cast<uint16_t>(a.port()));
    memcpy(out + 8, &in4->sin_addr, 4);
  } else if (a.family() == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a.ss);
    out[0] = 6;
    put16(out + 2, static_cast<uint16_t>(a.port()));
    put32(out + 4, in6->sin6_scope_id);
    memcpy(out + 8, &in6->sin6_addr, 16);
  }
}

bool decodeAddr(const uint8_t* in, sock::Addr* out) {
  *out = sock::Addr();
  if (in[0] == 0) return true;
  if (in[0] == 4) {
    auto* in4 = reinterpret_cast<sockaddr_in*>(&out->ss);
    in4->sin_family = AF_INET;
    memcpy(&in4->sin_addr, in + 8, 4);
    out->len = sizeof(sockaddr_in);
  } else if (in[0] == 6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&out->ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_scope_id = get32(in + 4);
    memcpy(&in6->sin6_addr, in + 8, 16);
    out->len = sizeof(sockaddr_in6);
  } else {
    return false;
  }
  out->setPort(get16(in + 2));
  return true;
}

void encodeHello(const Hello& h, uint8_t* out) {
  memcpy(out, h.secret, kSecretBytes);
  put32(out + kSecretBytes, static_cast<uint32_t>(h.rank));
  put32(out + kSecretBytes + 4, static_cast<uint32_t>(h.nranks));
  put32(out + kSecretBytes + 8, h.pid);
  encodeAddr(h.listen, out + kSecretBytes + 12);
}

bool decodeHello(const uint8_t* in, Hello* h) {
  memcpy(h->secret, in, kSecretBytes);
  h->rank = static_cast<int32_t>(get32(in + kSecretBytes));
  h->nranks = static_cast<int32_t>(get32(in + kSecretBytes + 4));
  h->pid = get32(in + kSecretBytes + 8);
  return decodeAddr(in + kSecretBytes + 12, &h->listen);
}

epResult_t decodeUniqueId(const epUniqueId* id, IdInfo* info) {
  EPCHECK(bootstrapCheckUniqueId(id));
  const uint8_t* p = reinterpret_cast<const uint8_t*>(id->internal);
  memcpy(info->secret, p + 8, kSecretBytes);
  decodeAddr(p + 24, &info->root);
  return epSuccess;
}

void setStarListenHookForTest(StarListenHook hook) { gStarListenHook = hook; }

}  // namespace bsproto

epResult_t bootstrapCheckUniqueId(const epUniqueId* id) {
  EP_REQUIRE(id != nullptr, epNullPointer, "unique id is NULL");
  const uint8_t* p = reinterpret_cast<const uint8_t*>(id->internal);
  uint32_t magic = bsproto::get32(p);
  if (magic != bsproto::kIdMagic)
    EP_FAIL(epInvalidUniqueId, "unique id has a bad magic 0x%08x (expected 0x%08x): not an epcomm unique id, or garbled",
            magic, bsproto::kIdMagic);
  uint32_t version = bsproto::get32(p + 4);
  if (version != EPCOMM_VERSION_CODE)
    EP_FAIL(epInvalidUniqueId,
            "unique id version mismatch: made by epcomm version code %u, this library is %d; all ranks must run the "
            "same epcomm version", version, EPCOMM_VERSION_CODE);
  uint64_t stored = bsproto::get64(p + bsproto::kIdChecksumOffset);
  uint64_t computed = bsproto::fnv1a64(p, bsproto::kIdChecksumOffset);
  if (stored != computed)
    EP_FAIL(epInvalidUniqueId,
            "unique id checksum mismatch (stored 0x%016llx, computed 0x%016llx): the id was garbled or truncated in "
            "transit", static_cast<unsigned long long>(stored), static_cast<unsigned long long>(computed));
  sock::Addr a;
  if (!bsproto::decodeAddr(p + 24, &a) || a.len == 0 || a.port() == 0)
    EP_FAIL(epInvalidUniqueId, "unique id carries no valid rendezvous address (family byte %u, port %u)", p[24],
            bsproto::get16(p + 26));
  return epSuccess;
}

epResult_t uniqueIdToString(const epUniqueId* id, char* buf, size_t buf_bytes) {
  EP_REQUIRE(id != nullptr, epNullPointer, "uniqueIdToString: id is NULL");
  EP_REQUIRE(buf != nullptr, epNullPointer, "uniqueIdToString: buf is NULL");
  EP_REQUIRE(buf_bytes >= EP_UNIQUE_ID_STRING_BYTES, epBufferTooSmall,
             "uniqueIdToString: buf_bytes=%zu, the text needs %d bytes (EP_UNIQUE_ID_STRING_BYTES)", buf_bytes,
             EP_UNIQUE_ID_STRING_BYTES);
  static const char kHex[] = "0123456789abcdef";
  const uint8_t* p = reinterpret_cast<const uint8_t*>(id->internal);
  for (size_t i = 0; i < EP_UNIQUE_ID_BYTES; ++i) {
    buf[2 * i] = kHex[p[i] >> 4];
    buf[2 * i + 1] = kHex[p[i] & 15];
  }
  buf[2 * EP_UNIQUE_ID_BYTES] = '\0';
  return epSuccess;
}

epResult_t uniqueIdFromString(const char* s, epUniqueId* id) {
  EP_REQUIRE(s != nullptr, epNullPointer, "uniqueIdFromString: the string is NULL");
  EP_REQUIRE(id != nullptr, epNullPointer, "uniqueIdFromString: id is NULL");
  size_t len = strnlen(s, 2 * EP_UNIQUE_ID_BYTES + 1);
  if (len != 2 * EP_UNIQUE_ID_BYTES)
    EP_FAIL(epInvalidUniqueId, "unique id text has %s%zu characters, expected exactly %d hex digits",
            len > 2 * EP_UNIQUE_ID_BYTES ? "more than " : "", len > 2 * EP_UNIQUE_ID_BYTES ? len - 1 : len,
            2 * EP_UNIQUE_ID_BYTES);
  epUniqueId tmp;
  for (size_t i = 0; i < 2 * EP_UNIQUE_ID_BYTES; ++i) {
    char c = s[i];
    int v = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
    if (v < 0)
      EP_FAIL(epInvalidUniqueId, "unique id text has a non-hex character (code %d) at position %zu",
              static_cast<int>(static_cast<unsigned char>(c)), i);
    uint8_t& b = reinterpret_cast<uint8_t&>(tmp.internal[i / 2]);
    b = (i % 2 == 0) ? static_cast<uint8_t>(v << 4) : static_cast<uint8_t>(b | v);
  }
  EPCHECK(bootstrapCheckUniqueId(&tmp));
  *id = tmp;
  return epSuccess;
}

epResult_t bootstrapGetUniqueId(epUniqueId* id) {
  EP_REQUIRE(id != nullptr, epNullPointer, "epGetUniqueId: id is NULL");
  try {
    sock::Addr addr;
    char ifname[64] = "";
    const char* fixed = paramString("EPCOMM_BOOTSTRAP_ADDR");
    if (fixed != nullptr) {
      EPCHECK(sock::parseIp(fixed, "EPCOMM_BOOTSTRAP_ADDR", &addr));
    } else {
      EPCHECK(sock::chooseInterface(AF_UNSPEC, &addr, ifname, sizeof(ifname)));
    }
    // Read on every call (not cached like EP_PARAM): the port may differ between creations. Default 0 =
    // ephemeral.
    const int64_t port = paramLoad("EPCOMM_BOOTSTRAP_PORT", 0);
    if (port < 0 || port > 65535)
      EP_FAIL(epInvalidArgument, "EPCOMM_BOOTSTRAP_PORT=%lld is outside [0, 65535]", static_cast<long long>(port));
    addr.setPort(static_cast<int>(port));
    int lfd = -1;
    sock::Addr bound;
    EPCHECK(sock::listenOn(addr, port != 0,
                           port != 0 ? "bootstrap rendezvous listener (EPCOMM_BOOTSTRAP_PORT)"
                                     : "bootstrap rendezvous listener",
                           &lfd, &bound));
    uint8_t secret[kSecretBytes];
    if (epResult_t r = randomBytes(secret, sizeof(secret)); r != epSuccess) {
      close(lfd);
      return r;
    }
    int64_t root_timeout = epParamBootstrapRootTimeoutMs();
    if (root_timeout <= 0) root_timeout = 600000;
    auto root = std::make_unique<Root>(lfd, bound, secret, root_timeout);
    Root* raw = root.get();
    try {
      RootThreads& rt = rootThreads();
      auto entry = std::make_unique<RootThread>();
      RootThread* self = entry.get();
      {
        std::lock_guard<std::mutex> l(rt.list_mutex);
        rt.joinDone();
        self->t = std::thread([raw, self, &rt]() {
          {
            std::unique_lock<std::mutex> fork_lock(rt.fork);
            self->started.store(true);
            std::unique_ptr<Root> own(raw);
            pthread_setname_np(pthread_self(), "epcomm-bsroot");
            try {
              own->run(fork_lock);
            } catch (const std::exception& e) {
              EP_WARN("bootstrap root: stopped by an exception: %s", e.what());
            } catch (...) {
              EP_WARN("bootstrap root: stopped by an exception");
            }
          }
          self->done.store(true);
        });
        root.release();
        rt.list.push_back(std::move(entry));
      }
      while (!self->started.load()) std::this_thread::yield();  // start-up is over before anyone can fork
    } catch (const std::exception& e) {
      EP_FAIL(epSystemError, "epGetUniqueId: could not start the bootstrap root thread: %s", e.what());
    }

    uint8_t* p = reinterpret_cast<uint8_t*>(id->internal);
    memset(p, 0, EP_UNIQUE_ID_BYTES);
    bsproto::put32(p, bsproto::kIdMagic);
    bsproto::put32(p + 4, EPCOMM_VERSION_CODE);
    memcpy(p + 8, secret, kSecretBytes);
    bsproto::encodeAddr(bound, p + 24);
    bsproto::put64(p + bsproto::kIdChecksumOffset, bsproto::fnv1a64(p, bsproto::kIdChecksumOffset));
    EP_INFO(kSubsysBootstrap, "bootstrap root listening at %s%s%s%s", AddrStr(bound).s, ifname[0] ? " (" : "", ifname,
            ifname[0] ? ")" : "");
    return epSuccess;
  } catch (const std::bad_alloc&) {
    EP_FAIL(epSystemError, "epGetUniqueId: out of memory");
  } catch (const std::exception& e) {
    EP_FAIL(epInternalError, "epGetUniqueId: unexpected exception: %s", e.what());
  }
}

epResult_t bootstrapInitSocket(const epUniqueId* id, int rank, int nranks, int timeout_ms,
                               std::unique_ptr<Bootstrap>* out) {
  try {
    return initSocket(id, rank, nranks, timeout_ms, out);
  } catch (const std::bad_alloc&) {
    EP_FAIL(epSystemError, "bootstrap: out of memory (rank %d of %d)", rank, nranks);
  } catch (const std::exception& e) {
    EP_FAIL(epInternalError, "bootstrap: unexpected exception: %s", e.what());
  }
}

epResult_t bootstrapInitCallback(epAllgatherFn_t fn, void* ctx, int rank, int nranks,
                                 std::unique_ptr<Bootstrap>* out) {
  try {
    return initCallback(fn, ctx, rank, nranks, out);
  } catch (const std::bad_alloc&) {
    EP_FAIL(epSystemError, "bootstrap: out of memory (rank %d of %d)", rank, nranks);
  } catch (const std::exception& e) {
    EP_FAIL(epInternalError, "bootstrap: unexpected exception: %s", e.what());
  }
}

epResult_t Bootstrap::barrier(int timeout_ms) {
  try {
    std::vector<uint8_t> buf(static_cast<size_t>(nranks_ > 0 ? nranks_ : 1), 0);
    return allgather(buf.data(), 1, timeout_ms);
  } catch (const std::bad_alloc&) {
    EP_FAIL(epSystemError, "bootstrap barrier: out of memory");
  }
}

}  // namespace epcomm
