#include "engine/host/host_engine.h"

#include <signal.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <cstring>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/host_id.h"
#include "common/log.h"
#include "common/param.h"
#include "common/routing.h"
#include "common/thread_name.h"
#include "common/time.h"
#include "engine/validate.h"

namespace epcomm {

EP_PARAM(QueueBytes, "QUEUE_BYTES", 1 << 20);
EP_PARAM(HostChannels, "HOST_CHANNELS", 0);
EP_PARAM(HostCma, "HOST_CMA", 1);
EP_PARAM(HtHierarchical, "HT_HIERARCHICAL", 1);

namespace {

constexpr int kMaxChannels = 8;
constexpr int64_t kLiveCheckNs = 50 * 1000000LL;



}  // namespace

const char* hostOpName(int op) {
  static const char* kNames[] = {"none", "init", "layout", "HT notify", "HT dispatch", "HT combine",
                                 "LL dispatch", "LL combine", "alltoallv", "alltoallv (device counts)",
                                 "barrier", "destroy", "set active ranks", "register", "recover"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == epNumOps, "a name for every operation");
  return (op >= 0 && op < epNumOps) ? kNames[op] : "unknown";
}

// A process of this host that has ended: gone, or a zombie its parent has not reaped yet (a parent that joins its
// children in order may leave one for long; kill(pid, 0) still succeeds on it).
bool processGone(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (!f) return false;
  char buf[512];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* q = strrchr(buf, ')');  // the state follows the command name, which may hold anything
  return q && q[1] == ' ' && (q[2] == 'Z' || q[2] == 'X');
}

uint64_t shapeSig(std::initializer_list<int64_t> values) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  }
  return h;
}

// Threads that serve channels 1..C-1 of a rank (channel 0 runs on the caller's thread). One job at a time.
class ChannelPool {
 public:
  explicit ChannelPool(int channels) : res_(channels, epSuccess), msg_(channels) {
    for (int c = 1; c < channels; ++c) threads_.emplace_back([this, c] { loop(c); });
  }
  ~ChannelPool() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  epResult_t run(const std::function<epResult_t(int)>& fn) {
    if (threads_.empty()) return fn(0);
    {
      std::lock_guard<std::mutex> l(m_);
      fn_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++gen_;
    }
    cv_.notify_all();
    res_[0] = fn(0);
    msg_[0] = threadLastError();
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [this] { return pending_ == 0; });
    fn_ = nullptr;
    for (size_t c = 0; c < res_.size(); ++c)
      if (res_[c] != epSuccess) {
        setThreadErrorText(msg_[c].c_str());  // the channel's message becomes the caller's
        return res_[c];
      }
    return epSuccess;
  }

 private:
  void loop(int c) {
    nameThisThread("epcomm-chan", c);
    uint64_t seen = 0;
    std::unique_lock<std::mutex> l(m_);
    while (true) {
      cv_.wait(l, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      const std::function<epResult_t(int)>* fn = fn_;
      l.unlock();
      clearThreadError();
      res_[c] = (*fn)(c);
      msg_[c] = threadLastError();
      l.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  const std::function<epResult_t(int)>* fn_ = nullptr;
  uint64_t gen_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<epResult_t> res_;
  std::vector<std::string> msg_;
};

epResult_t HostEngine::runChannels(const std::function<epResult_t(int)>& fn) { return pool_->run(fn); }

HostEngine::HostEngine(epComm* comm) : comm_(comm), rank_(comm->rank), nranks_(comm->nranks) {}

// Whatever this rank's last operation left in the outboxes toward other hosts still goes out (its peers may
// still be reading it) unless the communicator was aborted; masked ranks get nothing.
HostEngine::~HostEngine() {
  // An LL receive half returns with its rank's later sends possibly still queued (it must not wait for them):
  // they go out now, before the queues disappear, or a peer still in that operation would wait for them in vain.
  // (A dead or masked peer ends this at once, a stalled one at the deadline; a broken communicator skips it.)
  bool flushed = true;
  if (!comm_->aborted.load() && comm_->async_error.load() == epSuccess && !outq_.empty()) {
    cur_op_ = epOpDestroy;
    record_async_ = false;
    for (int c = 0; c < nchan_; ++c) flushed = flushSends(epPhaseData, c) == epSuccess && flushed;
  }
  // Clean, everything sent: the peers of this host may see this process exit (checkWait); otherwise it is a death.
  if (flushed && !comm_->aborted.load() && comm_->async_error.load() == epSuccess && own_.header() != nullptr)
    own_.header()->bye.store(1, std::memory_order_release);
  if (bridge_) {
    bridge_->shutdown(!comm_->aborted.load(), active_.data(), comm_->config.timeout_ms);
    EP_INFO(kSubsysNet, "rank %d sent %llu ring bytes to ranks of other hosts (HT %s)", rank_,
            static_cast<unsigned long long>(bridge_->bytesSent()), hier_ ? "hierarchical" : "flat");
  }
  pool_.reset();
}

void HostEngine::abort() {}

epResult_t HostEngine::netBytesSent(uint64_t* bytes) {
  uint64_t sum = 0;
  for (int c = 0; net_pushed_ && c < nchan_; ++c) sum += net_pushed_[c].load(std::memory_order_relaxed);
  *bytes = sum;
  return epSuccess;
}

// Raw net throughput toward the active ranks of other hosts, among barriers of all ranks (net_bridge.h,
// rawStream). Every rank has the bridge or none does (more than one host), so the barriers match.
epResult_t HostEngine::netRawBandwidth(size_t bytes_per_peer, size_t msg_bytes, int window, uint64_t* bytes_sent,
                                       double* seconds) {
  *bytes_sent = 0;
  *seconds = 0;
  if (!bridge_) return epSuccess;  // one host: nothing crosses
  std::vector<uint8_t> to(nranks_, 0);
  for (int r = 0; r < nranks_; ++r) to[r] = remote_[r] && active(r) ? 1 : 0;
  NetBridge::RawResult res;
  EPCHECK(bridge_->rawStream(to, bytes_per_peer, msg_bytes, window, comm_->config.timeout_ms,
                             [this] { return barrier(nullptr); }, &res));
  *bytes_sent = res.bytes_sent;
  *seconds = res.seconds;
  return epSuccess;
}

epResult_t HostEngine::init() {
  ring_bytes_ = comm_->config.queue_bytes ? comm_->config.queue_bytes : static_cast<size_t>(epParamQueueBytes());
  EP_REQUIRE(ring_bytes_ >= 64 * 1024 && ring_bytes_ <= (size_t{1} << 32), epInvalidArgument,
             "queue_bytes (EPCOMM_QUEUE_BYTES) = %zu is outside [64 KiB, 4 GiB]", ring_bytes_);
  Bootstrap* bs = comm_->bootstrap.get();
  active_.assign(nranks_, 1);
  accused_.assign(nranks_, 0);
  certain_.assign(nranks_, 0);
  watch_ = active_.data();
  drop_rows_.assign(nranks_, 0);
  drop_a2a_.assign(nranks_, 0);

  // Host identity: EPCOMM_HOSTID when set (virtual hosts on one machine, as epcomm-run --hosts sets it), else
  // hostname + boot id. Ranks of one host share memory; ranks of other hosts are reached over the net transport.
  struct HostInfo {
    char host[160];
    char machine[160];    // hostname + boot id even under EPCOMM_HOSTID: whose cores this rank shares
    int64_t pid;
    uint64_t ring_bytes;
    int32_t channels;     // explicit channel wish, 0 = derive from the cores
    int32_t cores;        // online cores of this rank's host
    uint64_t probe_addr;  // cross-memory attach probe: a word peers try to read with process_vm_readv
  } me{};
  hostIdentity(me.host, sizeof(me.host));
  machineIdentity(me.machine, sizeof(me.machine));
  me.pid = getpid();
  me.ring_bytes = ring_bytes_;
  std::vector<HostInfo> all(nranks_);
  // Channels (threads per rank): the config's, else EPCOMM_HOST_CHANNELS, else the cores of the rank's machine
  // shared among the ranks on that machine (at most kMaxChannels): virtual hosts of one machine (EPCOMM_HOSTID)
  // share its cores. The machine's ranks are known only after the exchange, so each rank publishes its explicit
  // wish (0: none) and its core count, and every rank derives every rank's wish from the same table; all ranks
  // then use the smallest.
  me.channels = comm_->config.num_channels > 0 ? comm_->config.num_channels
                : epParamHostChannels() > 0     ? static_cast<int>(epParamHostChannels())
                                                : 0;
  me.cores = static_cast<int32_t>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  cma_probe_ = 0x65704d4100000000ull | static_cast<uint64_t>(rank_);
  me.probe_addr = reinterpret_cast<uint64_t>(&cma_probe_);
  all[rank_] = me;
  EPCHECK(bs->allgather(all.data(), sizeof(HostInfo), comm_->config.setup_timeout_ms));
  remote_.assign(nranks_, 0);
  for (int r = 0; r < nranks_; ++r) {
    all[r].host[sizeof(all[r].host) - 1] = '\0';
    all[r].machine[sizeof(all[r].machine) - 1] = '\0';
    remote_[r] = strcmp(all[r].host, me.host) != 0;
    if (all[r].ring_bytes != ring_bytes_)
      EP_FAIL(epInvalidArgument, "queue_bytes differs between ranks (%zu here, %llu on rank %d)", ring_bytes_,
              static_cast<unsigned long long>(all[r].ring_bytes), r);
    pids_.push_back(all[r].pid);
  }
  {
    std::vector<const char*> ids(nranks_);
    for (int r = 0; r < nranks_; ++r) ids[r] = all[r].host;
    HostMap hosts = mapHosts(ids);
    host_of_ = std::move(hosts.host_of);
    local_idx_ = std::move(hosts.local_idx);
    host_ranks_ = std::move(hosts.ranks);
    nhosts_ = static_cast<int>(host_ranks_.size());
  }
  my_host_ = host_of_[rank_];
  // Hierarchical HT (ht.cc) with more than one host, unless EPCOMM_HT_HIERARCHICAL=0; a host's ranks are named
  // by the bits of one word, so at most 64 per host. Every rank derives the same answer from the same table
  // (the environment variable must agree too: it is part of the HT operations' shape signature).
  size_t widest = 0;
  for (const auto& hr : host_ranks_) widest = std::max(widest, hr.size());
  hier_ = nhosts_ > 1 && widest <= 64 && epParamHtHierarchical() != 0;
  nchan_ = kMaxChannels;
  for (int r = 0; r < nranks_; ++r) {
    int sharing = 0;  // ranks on r's machine
    for (int q = 0; q < nranks_; ++q) sharing += strcmp(all[q].machine, all[r].machine) == 0 ? 1 : 0;
    const int wish = all[r].channels > 0 ? all[r].channels : std::max(1, all[r].cores / sharing);
    nchan_ = std::min(nchan_, wish);
  }
  const int C = nchan_;
  // Cross-memory attach (process_vm_readv): HT dispatch receivers then copy rows straight out of the
  // senders' x, one copy instead of two through the queues. Used only if every rank can read every peer
  // (a seccomp profile or ptrace policy may forbid it; ranks of other hosts never can) and EPCOMM_HOST_CMA is
  // not 0; all ranks agree.
  int32_t can = epParamHostCma() != 0 && nhosts_ == 1 ? 1 : 0;
  for (int r = 0; r < nranks_ && can; ++r) {
    if (r == rank_) continue;
    uint64_t word = 0;
    iovec local{&word, sizeof(word)}, remote{reinterpret_cast<void*>(all[r].probe_addr), sizeof(word)};
    if (process_vm_readv(static_cast<pid_t>(all[r].pid), &local, 1, &remote, 1, 0) != sizeof(word) ||
        word != (0x65704d4100000000ull | static_cast<uint64_t>(r)))
      can = 0;
  }
  std::vector<int32_t> cans(nranks_);
  cans[rank_] = can;
  EPCHECK(bs->allgather(cans.data(), sizeof(int32_t), comm_->config.setup_timeout_ms));
  cma_ = true;
  for (int32_t c : cans) cma_ = cma_ && c != 0;

  EPCHECK(own_.create(shmRegionName(bs->secret(), rank_), rank_, nranks_, C, ring_bytes_));
  epResult_t res = bs->barrier(comm_->config.setup_timeout_ms);
  peers_.resize(nranks_);
  for (int r = 0; r < nranks_ && res == epSuccess; ++r) {
    if (r == rank_ || remote_[r]) continue;  // never shared memory across hosts
    peers_[r] = std::make_unique<ShmRegion>();
    res = peers_[r]->open(shmRegionName(bs->secret(), r), r, nranks_, C, ring_bytes_);
  }
  // Every rank has mapped every region (or failed): remove the names so nothing outlives the processes.
  epResult_t res2 = bs->barrier(comm_->config.setup_timeout_ms);
  own_.unlink();
  EPCHECK(res);
  EPCHECK(res2);
  // Ranks of other hosts: connections over the net transport (every rank takes part in its exchange, also
  // when all ranks share this host, so that they agree on whether it works).
  if (nhosts_ > 1) {
    // Frames only (no DATA_NEXT): on the 2-core VM it made no consistent difference here (0.55-1.8x from session to
    // session, bench/results/cpu-proxy-s18.log), and 512 KiB frames through the socket backend's helper threads
    // were slower at every shape on the 16-core H200 host (bench/results/h200-s9-host-xhost.log).
    bridge_ = std::make_unique<NetBridge>(rank_, nranks_, C, ring_bytes_, 0, remote_, &own_);
    EPCHECK(bridge_->connect(bs, comm_->config.setup_timeout_ms));
    EPCHECK(bs->barrier(comm_->config.setup_timeout_ms));
  }

  out_.assign(C, std::vector<RingEnd>(nranks_));
  in_.assign(C, std::vector<RingEnd>(nranks_));
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < nranks_; ++r) {
      if (remote_[r]) {
        out_[c][r] = bridge_->outEnd(c, r);
      } else {
        const ShmRegion& dst = (r == rank_) ? own_ : *peers_[r];
        out_[c][r] = RingEnd(dst.ringCtl(rank_, c), dst.ringData(rank_, c), ring_bytes_);
      }
      in_[c][r] = RingEnd(own_.ringCtl(r, c), own_.ringData(r, c), ring_bytes_);
    }
  outq_.assign(C, std::vector<std::deque<OutMsg>>(nranks_));
  net_pushed_ = std::make_unique<std::atomic<uint64_t>[]>(C);
  for (int c = 0; c < C; ++c) net_pushed_[c].store(0, std::memory_order_relaxed);
  chan_scratch_.resize(C);
  pool_ = std::make_unique<ChannelPool>(C);
  EP_INFO(kSubsysInit, "host engine ready: %d ranks on %d hosts, %d channels, queues of %zu bytes, %s%s%s", nranks_,
          nhosts_, C, ring_bytes_, cma_ ? "rows pulled with process_vm_readv" : "rows through the queues",
          bridge_ ? ", other hosts over net/" : "", bridge_ ? bridge_->backendName() : "");
  if (nhosts_ > 1)
    EP_INFO(kSubsysInit, "HT across hosts: %s", hier_ ? "hierarchical (once per host, then inside it)" : "flat");
  return epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// Transport
// ------------------------------------------------------------------------------------------------------

MsgHeader HostEngine::makeHeader(int op, epResult_t status, uint64_t sig) const {
  MsgHeader h{};
  h.magic = kMsgMagic;
  h.op = static_cast<uint32_t>(op);
  h.epoch = send_epoch_;
  h.status = status;
  h.src = rank_;
  h.sig = sig;
  return h;
}

void HostEngine::post(int peer, const MsgHeader& hdr, const void* extra, size_t extra_bytes,
                      std::vector<Seg> payload, int ch) {
  OutMsg m;
  MsgHeader h = hdr;
  h.extra_bytes = extra_bytes;
  h.data_bytes = 0;
  for (const Seg& s : payload) h.data_bytes += s.n;
  m.own.resize(sizeof(MsgHeader) + extra_bytes);
  memcpy(m.own.data(), &h, sizeof(h));
  if (extra_bytes) memcpy(m.own.data() + sizeof(h), extra, extra_bytes);
  m.segs.reserve(payload.size() + 1);
  m.segs.push_back({m.own.data(), m.own.size()});
  for (const Seg& s : payload)
    if (s.n) m.segs.push_back(s);
  outq_[ch][peer].push_back(std::move(m));
}

bool HostEngine::pushSends(int ch) {
  bool moved = false;
  for (int p = 0; p < nranks_; ++p) {
    auto& q = outq_[ch][p];
    while (!q.empty()) {
      OutMsg& m = q.front();
      bool full = false;
      while (m.seg < m.segs.size()) {
        const Seg& s = m.segs[m.seg];
        size_t n = out_[ch][p].push(s.p + m.off, s.n - m.off);
        if (n == 0) {
          full = true;
          break;
        }
        moved = true;
        if (remote_[p]) net_pushed_[ch].fetch_add(n, std::memory_order_relaxed);
        m.off += n;
        if (m.off == s.n) {
          ++m.seg;
          m.off = 0;
        }
      }
      if (full) break;
      q.pop_front();
    }
  }
  return moved;
}

epResult_t HostEngine::fail(epResult_t code, int peer, int phase, const char* what) {
  if (record_async_) comm_->recordAsyncError(code, cur_op_, cur_epoch_, peer, phase);
  last_fail_peer_ = peer;
  last_fail_code_ = code;
  return EP_ERROR(code, "rank %d, %s (epoch %llu): %s", rank_, hostOpName(cur_op_),
                  static_cast<unsigned long long>(cur_epoch_), what);
}

epResult_t HostEngine::checkWait(int peer, int phase, int64_t& idle_since, int64_t& last_live_check,
                                 int64_t& last_turn, int& bye_seen) {
  if (comm_->aborted.load(std::memory_order_relaxed)) return fail(epAborted, peer, phase, "communicator aborted");
  int64_t now = nowNs();
  // A wait polls every few hundred microseconds; a far longer gap means this thread did not run (its process was
  // stopped - a suspended job, a debugger - or starved). It could not see its peers meanwhile, and they may have
  // been stopped with it: that time does not count, they get a whole deadline from here (as the net transport's
  // stall check gives its peers, transport/net/sockutil.h). A peer that died meanwhile is still found below.
  if (now - last_turn > missedTurnNs(comm_->config.timeout_ms)) idle_since = now;
  last_turn = now;
  if (now - last_live_check > kLiveCheckNs) {
    last_live_check = now;
    // The peer waited on first, then every other rank the wait involves (the active ranks, or the survivors of a
    // resynchronization): any of them dead ends the operation, so that every survivor notices within one check.
    for (int i = -1; i < nranks_; ++i) {
      const int r = i < 0 ? peer : i;
      if (r < 0 || r == rank_ || (i >= 0 && r == peer) || !watch_[r]) continue;
      // A rank that destroyed its communicator cleanly had finished its operations, and what it sent is in the
      // rings: its exit is no failure of this operation, unless this wait is for that very rank and still waits at
      // the next check (a fresh step between the two: nothing more will come from it). Across hosts its goodbye
      // frame says so; on this host the word its engine sets in its region header.
      if (peerLeft(r)) {
        if (r != peer) continue;
        if (bye_seen == r) {
          char msg[200];
          snprintf(msg, sizeof(msg), "peer rank %d destroyed its communicator (epCommDestroy) while this operation "
                   "still waits for it", r);
          return fail(epRemoteError, r, phase, msg);
        }
        bye_seen = r;
        continue;
      }
      if (remote_[r]) {  // another host: its connection tells
        std::string why;
        if (!bridge_->dead(r, &why)) continue;
        char msg[400];
        snprintf(msg, sizeof(msg), "lost the connection from rank %d on another host: %s (it is not re-established: "
                 "mask that rank: epCommRecover or epCommSetActiveRanks)", r, why.c_str());
        return fail(epRemoteError, r, phase, msg);
      }
      if (processGone(pids_[r])) {
        char msg[160];
        snprintf(msg, sizeof(msg), "peer rank %d (pid %lld) has died", r, static_cast<long long>(pids_[r]));
        return fail(epRemoteError, r, phase, msg);
      }
    }
  }
  if (now - idle_since > static_cast<int64_t>(comm_->config.timeout_ms) * wait_scale_ * 1000000LL) {
    char msg[200];
    if (peer >= 0)
      snprintf(msg, sizeof(msg), "no progress from rank %d for %d ms (%sEPCOMM_TIMEOUT_MS)", peer,
               comm_->config.timeout_ms * wait_scale_, wait_scale_ > 1 ? "twice " : "");
    else
      snprintf(msg, sizeof(msg), "peers did not drain this rank's sends for %d ms (%sEPCOMM_TIMEOUT_MS)",
               comm_->config.timeout_ms * wait_scale_, wait_scale_ > 1 ? "twice " : "");
    return fail(epTimeout, peer, phase, msg);
  }
  return epSuccess;
}

// Every wait of the engine: step() either finishes (kDone), moves something (kMoved: the no-progress deadline
// restarts), or finds nothing to do (kIdle: check abort, dead peers and the deadline, then back off). step may
// name the peer it is waiting on, for the error message. Across hosts a waiting thread also moves the net bridge's
// frames itself (NetBridge::assist) instead of leaving every hop to the progress thread; what that moves is not
// progress of this wait (the deadline keeps running), it only skips the back-off.
template <typename Step>
epResult_t HostEngine::spin(int peer, int phase, Step&& step) {
  int64_t idle = nowNs(), live = idle, turn = idle;
  int bye_seen = -1;
  Backoff backoff;
  for (;;) {
    const Spin r = step(peer);
    if (r == Spin::kDone) return epSuccess;
    const bool assisted = bridge_ && bridge_->assist();
    if (r == Spin::kMoved) {
      idle = turn = nowNs();
      bye_seen = -1;
      backoff.reset();
      continue;
    }
    EPCHECK(checkWait(peer, phase, idle, live, turn, bye_seen));
    if (assisted) backoff.reset();
    else backoff.pause();
  }
}

epResult_t HostEngine::waitIn(int peer, size_t bytes, int phase, int ch) {
  if (in_[ch][peer].available() >= bytes) return epSuccess;
  size_t last_avail = 0;
  return spin(peer, phase, [&](int&) {
    const size_t avail = in_[ch][peer].available();
    if (avail >= bytes) return Spin::kDone;
    const bool moved = pushSends(ch);
    if (!moved && avail == last_avail) return Spin::kIdle;
    last_avail = avail;
    return Spin::kMoved;
  });
}

epResult_t HostEngine::recvInto(int peer, void* dst, size_t len, int phase, int ch) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  return spin(peer, phase, [&](int&) {
    if (len == 0) return Spin::kDone;
    const size_t n = in_[ch][peer].pull(d, len);
    const bool moved = pushSends(ch);
    d += n;
    len -= n;
    return n > 0 || moved ? Spin::kMoved : Spin::kIdle;
  });
}

epResult_t HostEngine::skipIn(int peer, size_t len, int phase, int ch) {
  return spin(peer, phase, [&](int&) {
    if (len == 0) return Spin::kDone;
    const size_t n = std::min(len, in_[ch][peer].available());
    if (n > 0) in_[ch][peer].release(n);
    const bool moved = pushSends(ch);
    len -= n;
    return n > 0 || moved ? Spin::kMoved : Spin::kIdle;
  });
}

epResult_t HostEngine::flushSends(int phase, int ch) {
  if (unaligned_) return epSuccess;  // the resynchronization drops what is queued (statusFromPeers)
  return spin(-1, phase, [&](int& waiting) {
    bool empty = true;
    for (auto& q : outq_[ch]) empty = empty && q.empty();
    if (empty) return Spin::kDone;
    if (pushSends(ch)) return Spin::kMoved;
    waiting = -1;
    for (int p = 0; p < nranks_; ++p)
      if (!outq_[ch][p].empty()) waiting = p;
    return Spin::kIdle;
  });
}

// The resynchronization's wait (elastic.cc): until every rank of `part` has published at least (round, phase) in
// its region header. With `adopt` (phase 1 only), a peer already in a later round is one whose earlier round this
// rank did not complete alike (a failed call): this rank takes that round's number, so the survivors meet again.
// failed_peer (given for phases 2 and 3) gets the first peer that failed this round: in phase 2 a peer whose word of
// this round has the failed bit, or that is already in a later round (no rank completes a round before every kept
// rank published its phase 3, which this one has not yet, so such a peer left this round failed: it timed out, say,
// while this rank was stopped, and retried); in phase 3, resyncPeerFailed.
epResult_t HostEngine::resyncWait(const std::vector<uint8_t>& part, uint64_t& round, int phase, bool adopt,
                                  int* failed_peer) {
  RegionHeader* me = own_.header();
  int next = 0, seen = 0;
  // Recovery, first phase: a kept rank that has not come may be one the others already hold out; the proposal is
  // given up as soon as the mask derived from what the survivors published no longer equals it.
  const bool watch_sets = recovering_ && adopt;
  uint64_t gen = watch_sets ? rc_seen_ : 0;
  resync_stale_ = false;
  const epResult_t r = spin(-1, epPhaseHeader, [&](int& peer) {
    for (; next < nranks_; ++next) {
      if (!part[next] || next == rank_) continue;
      const uint64_t w = peerHeader(next)->rs_word.load(std::memory_order_acquire);
      if (adopt && w / 8 > round) {
        round = w / 8;
        rs_round_ = round;
        me->rs_word.store(rsWord(round, phase, false), std::memory_order_release);
        next = seen = 0;
        return Spin::kMoved;
      }
      if (w < rsWord(round, phase, false)) {
        peer = next;
        const bool moved = next > seen;
        seen = next;
        if (!moved && watch_sets) {
          const uint64_t g = setsGen();
          if (g != gen) {
            gen = g;
            if (agreedKeep() != part) {
              resync_stale_ = true;
              return Spin::kDone;
            }
          }
        }
        return moved ? Spin::kMoved : Spin::kIdle;
      }
      const bool failed = phase == 3 /* kDone */ ? resyncPeerFailed(next, w, round) : (w & 1) || w / 8 > round;
      if (failed_peer && *failed_peer < 0 && failed) *failed_peer = next;
    }
    return Spin::kDone;
  });
  if (r == epSuccess && resync_stale_)
    return EP_ERROR(epRemoteError, "epCommRecover: what the survivors published no longer keeps every rank this "
                    "round proposed; proposing again");
  return r;
}

bool HostEngine::peerCompleted(const std::vector<uint8_t>& part, uint64_t round) const {
  for (int r = 0; r < nranks_; ++r)
    if (part[r] && r != rank_ &&
        (peerHeader(r)->rs_ok.load(std::memory_order_relaxed) & 0xffffffffu) == (round & 0xffffffffu))
      return true;
  return false;
}

bool HostEngine::resyncPeerFailed(int r, uint64_t w, uint64_t round) const {
  if (w / 8 == round) return (w & 1) != 0;
  // A later round: it cannot have completed one since (that needs this rank's words of it), so its last success
  // says whether it completed this one. Read after the word (acquire), which it stored after rs_ok.
  return (peerHeader(r)->rs_ok.load(std::memory_order_relaxed) & 0xffffffffu) != (round & 0xffffffffu);
}

// Reads every peer's header (and extra array), in rank order.
epResult_t HostEngine::recvHeaders(std::vector<Incoming>& in) {
  unaligned_ = false;
  in.resize(nranks_);
  for (int s = 0; s < nranks_; ++s) {
    if (!active(s)) {  // a masked rank sends nothing: an empty stand-in that agrees with this rank
      in[s] = Incoming();
      in[s].masked = true;
      in[s].h.magic = kMsgMagic;
      in[s].h.op = static_cast<uint32_t>(cur_op_);
      in[s].h.epoch = cur_epoch_;
      in[s].h.src = s;
      continue;
    }
    EPCHECK(recvInto(s, &in[s].h, sizeof(MsgHeader), epPhaseHeader));
    const MsgHeader& h = in[s].h;
    // Bounds-check what the peer claims before trusting any size in it.
    if (h.magic != kMsgMagic || h.src != s || h.extra_bytes > (size_t{64} << 20))
      return fail(epInternalError, s, epPhaseHeader, "malformed message header (stream out of sync)");
    in[s].extra.resize(h.extra_bytes);
    if (h.extra_bytes) EPCHECK(recvInto(s, in[s].extra.data(), h.extra_bytes, epPhaseHeader));
  }
  ++recv_epoch_;
  return epSuccess;
}

// Consumes the data of every message not yet consumed; rows left in a sender's memory will not be read.
epResult_t HostEngine::drainPayloads(std::vector<Incoming>& in) {
  if (unaligned_) return epSuccess;  // left to the resynchronization
  for (int s = 0; s < nranks_; ++s) {
    if (in[s].masked) continue;
    EPCHECK(skipIn(s, in[s].h.data_bytes, epPhaseData));
    if (in[s].h.flags & kMsgRowsByReference) in_[0][s].setReadDone(in[s].h.epoch);
  }
  return epSuccess;
}

epResult_t HostEngine::waitReadDone(uint64_t epoch) {
  if (unaligned_) return epSuccess;  // peers of another operation read nothing of this one (statusFromPeers)
  int p = 0;
  return spin(0, epPhaseData, [&](int& peer) {
    while (p < nranks_ && (!active(p) || out_[0][p].readDone() >= epoch)) ++p;
    if (p == nranks_) return Spin::kDone;
    peer = p;
    return pushSends() ? Spin::kMoved : Spin::kIdle;
  });
}

// Agreement check after the headers: every rank must have issued the same operation (op, epoch, shape);
// any rank's rejection fails the operation everywhere.
epResult_t HostEngine::statusFromPeers(const std::vector<Incoming>& in, epResult_t local, uint64_t sig) {
  for (int s = 0; s < nranks_; ++s) {
    const MsgHeader& h = in[s].h;
    if (in[s].masked) continue;
    if (h.op != static_cast<uint32_t>(cur_op_) || h.epoch != cur_epoch_) {
      // HT dispatch and combine post their data before the headers are compared: with either on one side, the
      // rings hold messages the other side will never read. Every rank sees the mismatch (each compares every
      // header with its own operation), so all return at once, leave the rings to a resynchronization and mark
      // the communicator broken until then.
      // Every header decides (a third rank may run HT dispatch where the first mismatch is a barrier).
      auto posts_data = [](int op) { return op == epOpHtDispatch || op == epOpHtCombine; };
      unaligned_ = posts_data(cur_op_);
      for (int q = 0; q < nranks_; ++q)
        if (!in[q].masked && (in[q].h.op != static_cast<uint32_t>(cur_op_) || in[q].h.epoch != cur_epoch_))
          unaligned_ = unaligned_ || posts_data(static_cast<int>(in[q].h.op));
      if (unaligned_) {
        if (record_async_) comm_->recordAsyncError(epInvalidUsage, cur_op_, cur_epoch_, s, epPhaseHeader);
        for (auto& ch : outq_)  // nobody will read them, and they may point into the caller's buffers
          for (auto& q : ch) q.clear();
      }
      if (local != epSuccess) return local;
      return EP_ERROR(epInvalidUsage,
                      "ranks issued different operations: rank %d issued %s (epoch %llu) while rank %d issued %s "
                      "(epoch %llu); all ranks must issue the same sequence%s",
                      s, hostOpName(static_cast<int>(h.op)), static_cast<unsigned long long>(h.epoch), rank_,
                      hostOpName(cur_op_), static_cast<unsigned long long>(cur_epoch_),
                      unaligned_ ? " (HT data of one of them is left in the transport: every rank must call "
                                   "epCommRecover, or epCommSetActiveRanks with the current mask, before the next "
                                   "operation)"
                                 : "");
    }
  }
  if (local != epSuccess) return local;
  for (int s = 0; s < nranks_; ++s) {
    const MsgHeader& h = in[s].h;
    if (in[s].masked) continue;
    if (h.status != epSuccess)
      return EP_ERROR(epRemoteError, "rank %d rejected its %s arguments (%s); the operation failed on all ranks",
                      s, hostOpName(cur_op_), epGetErrorString(static_cast<epResult_t>(h.status)));
    if (h.sig != sig)
      return EP_ERROR(epInvalidUsage,
                      "rank %d called %s with different shape arguments (hidden, top-k, experts, dtype, capacity or "
                      "layout) than rank %d",
                      s, hostOpName(cur_op_), rank_);
  }
  return epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// Layout
// ------------------------------------------------------------------------------------------------------

void HostEngine::computeLayout(const int64_t* topk_idx, int T, int K, int E, std::vector<uint8_t>& in_rank,
                               std::vector<int>& send_count, std::vector<int>& per_expert_to,
                               std::vector<int>* masked_to) const {
  const int R = nranks_, L = E / R;
  ExpertMap m{E, R, L};
  in_rank.assign(static_cast<size_t>(T) * R, 0);
  send_count.assign(R, 0);
  per_expert_to.assign(static_cast<size_t>(R) * L, 0);
  if (masked_to) masked_to->assign(R, 0);
  std::vector<uint8_t> dropped(R, 0);  // this token already counted as dropped for r
  for (int t = 0; t < T; ++t) {
    const int64_t* row = topk_idx + static_cast<size_t>(t) * K;
    std::fill(dropped.begin(), dropped.end(), 0);
    for (int k = 0; k < K; ++k) {
      int64_t e = row[k];
      if (e < 0 || isRepeatedExpert(row, k)) continue;
      int r = m.rankOf(e);
      if (!active(r)) {  // dropped: one count per (token, masked rank)
        if (masked_to && !dropped[r]) ++(*masked_to)[r];
        dropped[r] = 1;
        continue;
      }
      per_expert_to[static_cast<size_t>(r) * L + m.localOf(e)]++;
      if (!in_rank[static_cast<size_t>(t) * R + r]) {
        in_rank[static_cast<size_t>(t) * R + r] = 1;
        send_count[r]++;
      }
    }
  }
}

epResult_t HostEngine::layout(const int64_t* topk_idx, int T, int K, int E, int* per_rank, int* per_expert,
                              uint8_t* in_rank, epStream_t) {
  std::vector<uint8_t> in;
  std::vector<int> count, per_expert_to;
  computeLayout(topk_idx, T, K, E, in, count, per_expert_to);
  if (per_rank) std::copy(count.begin(), count.end(), per_rank);
  if (in_rank) std::copy(in.begin(), in.end(), in_rank);
  if (per_expert) std::copy(per_expert_to.begin(), per_expert_to.end(), per_expert);  // [R][L] == [E]
  return epSuccess;
}

// Channel data messages: after the operation's header on channel 0, every rank whose arguments were accepted
// sends each peer one message per channel (a header stating its size, then the rows of that channel's tokens).
// On failure, receivers consume those messages of the accepted peers and discard them.
epResult_t HostEngine::drainChannels(const std::vector<Incoming>& in) {
  if (unaligned_) return epSuccess;  // left to the resynchronization
  return runChannels([&](int c) -> epResult_t {
    for (int s = 0; s < nranks_; ++s) {
      if (in[s].masked || in[s].h.status != epSuccess) continue;
      MsgHeader h;
      EPCHECK(recvInto(s, &h, sizeof(h), epPhaseData, c));
      if (h.magic != in[s].h.magic || h.epoch != in[s].h.epoch)
        return fail(epInternalError, s, epPhaseData, "channel message out of sync");
      EPCHECK(skipIn(s, h.extra_bytes + h.data_bytes, epPhaseData, c));
    }
    return flushSends(epPhaseData, c);
  });
}

epResult_t HostEngine::recvChannelHeader(int s, int c, uint64_t expect_bytes) {
  MsgHeader h;
  EPCHECK(recvInto(s, &h, sizeof(h), epPhaseData, c));
  if (h.magic != kMsgMagic || h.epoch != cur_epoch_ || h.src != s || h.extra_bytes != 0 || h.data_bytes != expect_bytes)
    return fail(epInternalError, s, epPhaseData, "channel message does not match its operation header");
  return epSuccess;
}

// Copies rows `tokens` of `row` bytes at remote_base in rank src's memory to dst (contiguous): runs of
// consecutive rows as one piece, one process_vm_readv per IOV_MAX pieces; a plain copy for this rank's own rows.
epResult_t HostEngine::pullRows(int src, const std::vector<int32_t>& tokens, uint64_t remote_base, size_t row,
                                uint8_t* dst) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(remote_base));
  std::vector<iovec> runs;
  size_t bytes = 0;
  auto flush = [&]() -> epResult_t {
    if (runs.empty()) return epSuccess;
    if (src == rank_) {
      for (const iovec& v : runs) memcpy(dst, v.iov_base, v.iov_len), dst += v.iov_len;
    } else {
      EPCHECK(readPeer(src, runs.data(), runs.size(), dst, bytes));
      dst += bytes;
    }
    runs.clear();
    bytes = 0;
    return epSuccess;
  };
  for (int32_t t : tokens) {
    const uint8_t* p = base + static_cast<size_t>(t) * row;
    if (!runs.empty() && static_cast<const uint8_t*>(runs.back().iov_base) + runs.back().iov_len == p) {
      runs.back().iov_len += row;
    } else {
      if (runs.size() == 1024) EPCHECK(flush());  // IOV_MAX
      runs.push_back({const_cast<uint8_t*>(p), row});
    }
    bytes += row;
  }
  return flush();
}

// One process_vm_readv of `bytes` from rank src's memory (n remote pieces) into dst.
epResult_t HostEngine::readPeer(int src, const iovec* remote, size_t n, void* dst, size_t bytes) {
  iovec local{dst, bytes};
  ssize_t got;
  SYSCHECK_RETRY(process_vm_readv(static_cast<pid_t>(pids_[src]), &local, 1, remote, n, 0), got);
  if (got == static_cast<ssize_t>(bytes)) return epSuccess;
  // The peer exited (ESRCH) or its memory went away (EFAULT: it failed, returned and freed or exited): a
  // remote failure. Anything else is this host refusing the read.
  const int err = got < 0 ? errno : EFAULT;
  char msg[200];
  snprintf(msg, sizeof(msg), "reading %zu bytes of rank %d's rows failed (%s)", bytes, src,
           got < 0 ? strerror(err) : "short read");
  return fail(err == ESRCH || err == EFAULT ? epRemoteError : epSystemError, src, epPhaseData, msg);
}

epResult_t HostEngine::exchangeDone() {
  if (unaligned_) return epSuccess;  // nobody read anybody's rows: the operations differed
  // This rank is done reading every peer's memory for this operation; then wait until every peer is done with
  // this rank's (the counters, not messages: nothing else need sit in the rings in between).
  for (int s = 0; s < nranks_; ++s) in_[0][s].setReadDone(cur_epoch_);
  return waitReadDone(cur_epoch_);
}

epResult_t HostEngine::barrier(epStream_t) {
  cur_op_ = epOpBarrier;
  cur_epoch_ = ++send_epoch_;
  for (int p = 0; p < nranks_; ++p)
    if (active(p)) post(p, makeHeader(cur_op_, epSuccess, 0), nullptr, 0, {});
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, 0);
  EPCHECK(drainPayloads(in));
  EPCHECK(flushSends(epPhaseHeader));
  return st;
}

}  // namespace epcomm
