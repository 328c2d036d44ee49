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
#include "common/log.h"
#include "common/param.h"
#include "common/time.h"
#include "engine/routing.h"
#include "engine/validate.h"

namespace epcomm {

EP_PARAM(QueueBytes, "QUEUE_BYTES", 1 << 20);
EP_PARAM(HostChannels, "HOST_CHANNELS", 0);
EP_PARAM(HostCma, "HOST_CMA", 1);

namespace {

constexpr uint32_t kMsgMagic = 0x65704d31u;  // "epM1"
constexpr int kMaxChannels = 8;
constexpr int64_t kLiveCheckNs = 50 * 1000000LL;

const char* opName(int op) {
  static const char* kNames[] = {"none", "init", "layout", "HT notify", "HT dispatch", "HT combine",
                                 "LL dispatch", "LL combine", "alltoallv", "alltoallv (device counts)",
                                 "barrier", "destroy"};
  return (op >= 0 && op < epNumOps) ? kNames[op] : "unknown";
}

// acc[j] += w * float(src[j]) (or += float(src[j]) without a weight), one loop per type so that the
// compiler vectorizes it; fp-contract is off, so the product and the sum round separately, as in the kernels.
template <typename Load>
void accumulate(float* acc, int H, const Load& load, float w, bool weighted) {
  if (weighted)
    for (int j = 0; j < H; ++j) {
      float prod = w * load(j);
      acc[j] = acc[j] + prod;
    }
  else
    for (int j = 0; j < H; ++j) acc[j] = acc[j] + load(j);
}

void accumulateRowImpl(float* acc, const uint8_t* src, int H, int dt, float w, bool weighted) {
  const uint16_t* h16 = reinterpret_cast<const uint16_t*>(src);
  const float* f32 = reinterpret_cast<const float*>(src);
  switch (dt) {
    case epBfloat16: accumulate(acc, H, [&](int j) { return bf16ToFloat(h16[j]); }, w, weighted); break;
    case epFloat16: accumulate(acc, H, [&](int j) { return fp16ToFloat(h16[j]); }, w, weighted); break;
    default: accumulate(acc, H, [&](int j) { return f32[j]; }, w, weighted); break;
  }
}
void accumulateRow(float* acc, const uint8_t* src, int H, int dt) { accumulateRowImpl(acc, src, H, dt, 1.0f, false); }
void accumulateRowWeighted(float* acc, const uint8_t* src, int H, int dt, float w) {
  accumulateRowImpl(acc, src, H, dt, w, true);
}

void storeRow(uint8_t* dst, const float* acc, int H, int dt) {
  uint16_t* h16 = reinterpret_cast<uint16_t*>(dst);
  switch (dt) {
    case epBfloat16: for (int j = 0; j < H; ++j) h16[j] = floatToBf16(acc[j]); break;
    case epFloat16: for (int j = 0; j < H; ++j) h16[j] = floatToFp16(acc[j]); break;
    default: memcpy(dst, acc, sizeof(float) * H); break;
  }
}

}  // namespace

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

HostEngine::~HostEngine() = default;

epResult_t HostEngine::init() {
  ring_bytes_ = comm_->config.queue_bytes ? comm_->config.queue_bytes : static_cast<size_t>(epParamQueueBytes());
  EP_REQUIRE(ring_bytes_ >= 64 * 1024 && ring_bytes_ <= (size_t{1} << 32), epInvalidArgument,
             "queue_bytes (EPCOMM_QUEUE_BYTES) = %zu is outside [64 KiB, 4 GiB]", ring_bytes_);
  Bootstrap* bs = comm_->bootstrap.get();

  // All ranks must share memory: check host identity (hostname + EPCOMM_HOSTID) first.
  struct HostInfo {
    char host[128];
    int64_t pid;
    uint64_t ring_bytes;
    int32_t channels;
    uint64_t probe_addr;  // cross-memory attach probe: a word peers try to read with process_vm_readv
  } me{};
  gethostname(me.host, 64);
  if (const char* hid = paramString("EPCOMM_HOSTID")) {
    size_t l = strlen(me.host);
    snprintf(me.host + l, sizeof(me.host) - l, "/%s", hid);
  }
  me.pid = getpid();
  me.ring_bytes = ring_bytes_;
  // Channels (threads per rank): the config's, else EPCOMM_HOST_CHANNELS, else the cores of the host shared
  // among its ranks (at most kMaxChannels); all ranks then use the smallest wish.
  me.channels = comm_->config.num_channels > 0 ? comm_->config.num_channels
                : epParamHostChannels() > 0     ? static_cast<int>(epParamHostChannels())
                                                : static_cast<int>(std::max<long>(1, std::min<long>(kMaxChannels, sysconf(_SC_NPROCESSORS_ONLN) /
                                                                                          nranks_)));
  me.channels = std::min(me.channels, kMaxChannels);
  cma_probe_ = 0x65704d4100000000ull | static_cast<uint64_t>(rank_);
  me.probe_addr = reinterpret_cast<uint64_t>(&cma_probe_);
  std::vector<HostInfo> all(nranks_);
  all[rank_] = me;
  EPCHECK(bs->allgather(all.data(), sizeof(HostInfo), comm_->config.timeout_ms));
  for (int r = 0; r < nranks_; ++r) {
    if (strncmp(all[r].host, me.host, sizeof(me.host)) != 0)
      EP_FAIL(epNotSupported,
              "rank %d is on host '%s' and rank %d on host '%s': the host engine needs all ranks on one host "
              "(the inter-host net transport is not in this release)",
              rank_, me.host, r, all[r].host);
    if (all[r].ring_bytes != ring_bytes_)
      EP_FAIL(epInvalidArgument, "queue_bytes differs between ranks (%zu here, %llu on rank %d)", ring_bytes_,
              static_cast<unsigned long long>(all[r].ring_bytes), r);
    pids_.push_back(all[r].pid);
  }
  nchan_ = me.channels;
  for (const HostInfo& i : all) nchan_ = std::min(nchan_, static_cast<int>(i.channels));
  const int C = nchan_;
  // Cross-memory attach (process_vm_readv): HT dispatch receivers then copy rows straight out of the
  // senders' x, one copy instead of two through the queues. Used only if every rank can read every peer
  // (a seccomp profile or ptrace policy may forbid it) and EPCOMM_HOST_CMA is not 0; all ranks agree.
  int32_t can = epParamHostCma() != 0 ? 1 : 0;
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
  EPCHECK(bs->allgather(cans.data(), sizeof(int32_t), comm_->config.timeout_ms));
  cma_ = true;
  for (int32_t c : cans) cma_ = cma_ && c != 0;

  EPCHECK(own_.create(shmRegionName(bs->secret(), rank_), rank_, nranks_, C, ring_bytes_));
  epResult_t res = bs->barrier(comm_->config.timeout_ms);
  peers_.resize(nranks_);
  for (int r = 0; r < nranks_ && res == epSuccess; ++r) {
    if (r == rank_) continue;
    peers_[r] = std::make_unique<ShmRegion>();
    res = peers_[r]->open(shmRegionName(bs->secret(), r), r, nranks_, C, ring_bytes_);
  }
  // Every rank has mapped every region (or failed): remove the names so nothing outlives the processes.
  epResult_t res2 = bs->barrier(comm_->config.timeout_ms);
  own_.unlink();
  EPCHECK(res);
  EPCHECK(res2);

  out_.assign(C, std::vector<RingEnd>(nranks_));
  in_.assign(C, std::vector<RingEnd>(nranks_));
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < nranks_; ++r) {
      const ShmRegion& dst = (r == rank_) ? own_ : *peers_[r];
      out_[c][r] = RingEnd(dst.ringCtl(rank_, c), dst.ringData(rank_, c), ring_bytes_);
      in_[c][r] = RingEnd(own_.ringCtl(r, c), own_.ringData(r, c), ring_bytes_);
    }
  outq_.assign(C, std::vector<std::deque<OutMsg>>(nranks_));
  pool_ = std::make_unique<ChannelPool>(C);
  EP_INFO(kSubsysInit, "host engine ready: %d ranks, %d channels, queues of %zu bytes, %s", nranks_, C,
          ring_bytes_, cma_ ? "rows pulled with process_vm_readv" : "rows through the queues");
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
  comm_->recordAsyncError(code, cur_op_, cur_epoch_, peer, phase);
  return EP_ERROR(code, "rank %d, %s (epoch %llu): %s", rank_, opName(cur_op_),
                  static_cast<unsigned long long>(cur_epoch_), what);
}

epResult_t HostEngine::checkWait(int peer, int phase, int64_t& idle_since, int64_t& last_live_check) {
  if (comm_->aborted.load(std::memory_order_relaxed)) return fail(epAborted, peer, phase, "communicator aborted");
  int64_t now = nowNs();
  if (now - last_live_check > kLiveCheckNs) {
    last_live_check = now;
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_ || (peer >= 0 && r != peer)) continue;
      if (kill(static_cast<pid_t>(pids_[r]), 0) != 0 && errno == ESRCH) {
        char msg[160];
        snprintf(msg, sizeof(msg), "peer rank %d (pid %lld) has died", r, static_cast<long long>(pids_[r]));
        return fail(epRemoteError, r, phase, msg);
      }
    }
  }
  if (now - idle_since > static_cast<int64_t>(comm_->config.timeout_ms) * 1000000LL) {
    char msg[200];
    if (peer >= 0)
      snprintf(msg, sizeof(msg), "no progress from rank %d for %d ms (EPCOMM_TIMEOUT_MS)", peer,
               comm_->config.timeout_ms);
    else
      snprintf(msg, sizeof(msg), "peers did not drain this rank's sends for %d ms (EPCOMM_TIMEOUT_MS)",
               comm_->config.timeout_ms);
    return fail(epTimeout, peer, phase, msg);
  }
  return epSuccess;
}

// Every wait of the engine: step() either finishes (kDone), moves something (kMoved: the no-progress deadline
// restarts), or finds nothing to do (kIdle: check abort, dead peers and the deadline, then back off). step may
// name the peer it is waiting on, for the error message.
template <typename Step>
epResult_t HostEngine::spin(int peer, int phase, Step&& step) {
  int64_t idle = nowNs(), live = idle;
  Backoff backoff;
  for (;;) {
    const Spin r = step(peer);
    if (r == Spin::kDone) return epSuccess;
    if (r == Spin::kMoved) {
      idle = nowNs();
      backoff.reset();
      continue;
    }
    EPCHECK(checkWait(peer, phase, idle, live));
    backoff.pause();
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

// Reads every peer's header (and extra array), in rank order.
epResult_t HostEngine::recvHeaders(std::vector<Incoming>& in) {
  in.resize(nranks_);
  for (int s = 0; s < nranks_; ++s) {
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
  for (int s = 0; s < nranks_; ++s) {
    EPCHECK(skipIn(s, in[s].h.data_bytes, epPhaseData));
    if (in[s].h.flags & kMsgRowsByReference) in_[0][s].setReadDone(in[s].h.epoch);
  }
  return epSuccess;
}

epResult_t HostEngine::waitReadDone(uint64_t epoch) {
  int p = 0;
  return spin(0, epPhaseData, [&](int& peer) {
    while (p < nranks_ && out_[0][p].readDone() >= epoch) ++p;
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
    if (h.op != static_cast<uint32_t>(cur_op_) || h.epoch != cur_epoch_) {
      if (local != epSuccess) return local;
      return EP_ERROR(epInvalidUsage,
                      "ranks issued different operations: rank %d issued %s (epoch %llu) while rank %d issued %s "
                      "(epoch %llu); all ranks must issue the same sequence",
                      s, opName(static_cast<int>(h.op)), static_cast<unsigned long long>(h.epoch), rank_,
                      opName(cur_op_), static_cast<unsigned long long>(cur_epoch_));
    }
  }
  if (local != epSuccess) return local;
  for (int s = 0; s < nranks_; ++s) {
    const MsgHeader& h = in[s].h;
    if (h.status != epSuccess)
      return EP_ERROR(epRemoteError, "rank %d rejected its %s arguments (%s); the operation failed on all ranks",
                      s, opName(cur_op_), epGetErrorString(static_cast<epResult_t>(h.status)));
    if (h.sig != sig)
      return EP_ERROR(epInvalidUsage,
                      "rank %d called %s with different shape arguments (hidden, top-k, experts, dtype, capacity or "
                      "layout) than rank %d",
                      s, opName(cur_op_), rank_);
  }
  return epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// Layout
// ------------------------------------------------------------------------------------------------------

void HostEngine::computeLayout(const int64_t* topk_idx, int T, int K, int E, std::vector<uint8_t>& in_rank,
                               std::vector<int>& send_count, std::vector<int>& per_expert_to) const {
  const int R = nranks_, L = E / R;
  ExpertMap m{E, R, L};
  in_rank.assign(static_cast<size_t>(T) * R, 0);
  send_count.assign(R, 0);
  per_expert_to.assign(static_cast<size_t>(R) * L, 0);
  for (int t = 0; t < T; ++t) {
    const int64_t* row = topk_idx + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k) {
      int64_t e = row[k];
      if (e < 0 || isRepeatedExpert(row, k)) continue;
      int r = m.rankOf(e);
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

// ------------------------------------------------------------------------------------------------------
// HT notify / dispatch / combine
// ------------------------------------------------------------------------------------------------------

// Per-channel counts of the tokens this rank sends to p: channel c carries tokens [chanBegin(c), chanBegin(c+1)).
static void chanCountsTo(const uint8_t* in_rank, int T, int R, int C, int p, int* out) {
  for (int c = 0; c < C; ++c) {
    const int b = static_cast<int>(static_cast<int64_t>(T) * c / C), e = static_cast<int>(static_cast<int64_t>(T) * (c + 1) / C);
    int n = 0;
    for (int t = b; t < e; ++t) n += in_rank[static_cast<size_t>(t) * R + p];
    out[c] = n;
  }
}

// The HT count message to p: [per local expert of p (L)] [per channel (C)], and the rows in v[0].
static std::vector<int> countMessage(const std::vector<uint8_t>& in_rank, const std::vector<int>& per_expert_to,
                                     int T, int R, int L, int C, int p) {
  std::vector<int> m(L + C, 0);
  if (!per_expert_to.empty()) std::copy_n(per_expert_to.begin() + static_cast<size_t>(p) * L, L, m.begin());
  chanCountsTo(in_rank.data(), T, R, C, p, m.data() + L);
  return m;
}

// Fills the handle's receive side from the peers' count messages; false if a message is malformed.
static bool readCounts(const std::vector<int64_t>& rows, const std::vector<const int*>& msgs, int R, int L, int C,
                       bool with_experts, epHtHandle* h) {
  h->recv_count.assign(R, 0);
  h->recv_prefix.assign(R + 1, 0);
  h->recv_chan_count.assign(static_cast<size_t>(R) * C, 0);
  if (with_experts) h->recv_per_expert.assign(L, 0);
  for (int s = 0; s < R; ++s) {
    if (rows[s] < 0 || rows[s] > INT32_MAX / R) return false;
    int64_t sum = 0;
    for (int c = 0; c < C; ++c) {
      const int v = msgs[s][L + c];
      if (v < 0) return false;
      h->recv_chan_count[static_cast<size_t>(s) * C + c] = v;
      sum += v;
    }
    if (sum != rows[s]) return false;
    h->recv_count[s] = static_cast<int>(rows[s]);
    h->recv_prefix[s + 1] = h->recv_prefix[s] + h->recv_count[s];
    if (with_experts)
      for (int e = 0; e < L; ++e) h->recv_per_expert[e] += msgs[s][e];
  }
  h->num_recv = h->recv_prefix[R];
  return true;
}

epResult_t HostEngine::htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                                int* per_expert_host, epStream_t) {
  cur_op_ = epOpHtNotify;
  cur_epoch_ = ++send_epoch_;
  if (h && local == epSuccess) h->valid = false;
  const int R = nranks_, C = nchan_;
  const int E = local == epSuccess ? a->num_experts : 0;
  const int L = local == epSuccess ? E / R : 0;
  const uint64_t sig = shapeSig({E});
  std::vector<uint8_t> in_rank;
  std::vector<int> send_count, per_expert_to;
  if (local == epSuccess) computeLayout(a->topk_idx, a->num_tokens, a->topk, E, in_rank, send_count, per_expert_to);
  for (int p = 0; p < R; ++p) {
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (local == epSuccess) {
      hdr.v[0] = send_count[p];
      std::vector<int> m = countMessage(in_rank, per_expert_to, a->num_tokens, R, L, C, p);
      post(p, hdr, m.data(), sizeof(int) * m.size(), {});
    } else {
      post(p, hdr, nullptr, 0, {});
    }
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  EPCHECK(drainPayloads(in));
  EPCHECK(flushSends(epPhaseHeader));
  if (st != epSuccess) return st;
  std::vector<int64_t> rows(R);
  std::vector<const int*> msgs(R);
  for (int s = 0; s < R; ++s) {
    if (in[s].extra.size() != sizeof(int) * (L + C))
      return fail(epInternalError, s, epPhaseHeader, "notify message has a bad count array");
    rows[s] = in[s].h.v[0];
    msgs[s] = reinterpret_cast<const int*>(in[s].extra.data());
  }
  epHtHandle fresh;  // the handle changes only once the counts are whole
  if (!readCounts(rows, msgs, R, L, C, true, &fresh))
    return fail(epInternalError, -1, epPhaseHeader, "notify counts are inconsistent");
  h->recv_count = std::move(fresh.recv_count);
  h->recv_prefix = std::move(fresh.recv_prefix);
  h->recv_chan_count = std::move(fresh.recv_chan_count);
  h->recv_per_expert = std::move(fresh.recv_per_expert);
  h->num_recv = fresh.num_recv;
  h->num_tokens = a->num_tokens;
  h->num_experts = E;
  h->in_rank = std::move(in_rank);
  h->send_count = std::move(send_count);
  h->recv_rows = h->num_recv;
  h->valid = true;
  if (num_recv_host) *num_recv_host = h->num_recv;
  if (per_expert_host)
    for (int e = 0; e < L; ++e) per_expert_host[e] = h->recv_per_expert[e];
  return epSuccess;
}

// Channel data messages: after the operation's header on channel 0, every rank whose arguments were accepted
// sends each peer one message per channel (a header stating its size, then the rows of that channel's tokens).
// On failure, receivers consume those messages of the accepted peers and discard them.
epResult_t HostEngine::drainChannels(const std::vector<Incoming>& in) {
  return runChannels([&](int c) -> epResult_t {
    for (int s = 0; s < nranks_; ++s) {
      if (in[s].h.status != epSuccess) continue;
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
  // This rank is done reading every peer's memory for this operation; then wait until every peer is done with
  // this rank's (the counters, not messages: nothing else need sit in the rings in between).
  for (int s = 0; s < nranks_; ++s) in_[0][s].setReadDone(cur_epoch_);
  return waitReadDone(cur_epoch_);
}

epResult_t HostEngine::htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t) {
  cur_op_ = epOpHtDispatch;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_, C = nchan_;
  const bool ok = local == epSuccess;
  const bool cached = ok && (a->num_worst_tokens == 0 || (a->flags & EP_HT_USE_HANDLE_LAYOUT));
  const int T = ok ? a->num_tokens : 0, H = ok ? a->hidden : 0, K = ok ? a->topk : 0;
  const int E = ok ? a->num_experts : 0, L = ok ? E / R : 0;
  const bool fp8 = ok && a->dtype == epFloat8E4M3;
  const size_t xrow = ok ? H * dtypeSize(a->dtype) : 0;
  const size_t srow = fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
  // A rank without tokens may pass NULL arrays (the zero-size NULL rule): it still sends its (empty) routing.
  const bool send_idx = ok && (a->topk_idx != nullptr || T == 0);
  const bool send_w = send_idx && (a->topk_weights != nullptr || T == 0);
  const uint64_t sig = ok ? shapeSig({E, H, K, a->dtype}) : 0;
  ExpertMap m{E, R, L > 0 ? L : 1};

  // Layout: from the handle (cached / exact mode) or from topk_idx.
  std::vector<uint8_t> in_rank_new;
  std::vector<int> send_count_new, per_expert_to;
  const std::vector<uint8_t>* in_rank = &in_rank_new;
  const int* send_count = nullptr;
  if (ok) {
    if (cached) {
      in_rank = &h->in_rank;
      send_count = h->send_count.data();
      if (send_idx) {  // per-expert counts travel again so that the receiver can check its cached copy
        std::vector<uint8_t> tmp;
        std::vector<int> tmp_count;
        computeLayout(a->topk_idx, T, K, E, tmp, tmp_count, per_expert_to);
      }
    } else {
      computeLayout(a->topk_idx, T, K, E, in_rank_new, send_count_new, per_expert_to);
      send_count = send_count_new.data();
    }
  }

  // Channel 0: the counts. Channel c: the rows of tokens [chanBegin(c), chanBegin(c+1)), field-major (x rows,
  // scale rows, topk_idx rows as local ids, topk_weights rows). With cross-memory attach the x and scale rows
  // stay here and the message carries their token indices instead: the receiver pulls them.
  std::vector<std::vector<int64_t>> idx_out(ok ? R * C : 0);
  std::vector<std::vector<float>> w_out(ok ? R * C : 0);
  std::vector<std::vector<int32_t>> tok_out(ok && cma_ ? R * C : 0);
  for (int p = 0; p < R; ++p) {
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    hdr.v[0] = send_count[p];
    hdr.v[1] = (send_idx ? 1 : 0) | (send_w ? 2 : 0);
    hdr.v[2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a->x));
    hdr.v[3] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a->x_scales));
    std::vector<int> cm = countMessage(*in_rank, per_expert_to, T, R, L, C, p);
    post(p, hdr, cm.data(), sizeof(int) * cm.size(), {});
    for (int c = 0; c < C; ++c) {
      const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
      std::vector<Seg> segs;
      const uint8_t* x = static_cast<const uint8_t*>(a->x);
      auto in = [&](int t) { return (*in_rank)[static_cast<size_t>(t) * R + p] != 0; };
      if (cma_) {
        auto& to = tok_out[static_cast<size_t>(p) * C + c];
        for (int t = tb; t < te; ++t)
          if (in(t)) to.push_back(t);
        segs.push_back({reinterpret_cast<const uint8_t*>(to.data()), to.size() * sizeof(int32_t)});
      } else {
        for (int t = tb; t < te; ++t)
          if (in(t)) segs.push_back({x + t * xrow, xrow});
      }
      if (fp8 && !cma_) {
        const uint8_t* sc = reinterpret_cast<const uint8_t*>(a->x_scales);
        for (int t = tb; t < te; ++t)
          if (in(t)) segs.push_back({sc + t * srow, srow});
      }
      if (send_idx) {
        auto& io = idx_out[static_cast<size_t>(p) * C + c];
        auto& wo = w_out[static_cast<size_t>(p) * C + c];
        for (int t = tb; t < te; ++t) {
          if (!in(t)) continue;
          for (int k = 0; k < K; ++k) {
            int64_t e = a->topk_idx[static_cast<size_t>(t) * K + k];
            bool here = e >= 0 && m.rankOf(e) == p;
            io.push_back(here ? m.localOf(e) : -1);
            if (send_w) wo.push_back(here ? a->topk_weights[static_cast<size_t>(t) * K + k] : 0.0f);
          }
        }
        segs.push_back({reinterpret_cast<const uint8_t*>(io.data()), io.size() * sizeof(int64_t)});
        if (send_w) segs.push_back({reinterpret_cast<const uint8_t*>(wo.data()), wo.size() * sizeof(float)});
      }
      post(p, makeHeader(cur_op_, local, sig), nullptr, 0, std::move(segs), c);
    }
  }
  pushSends();

  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  // Receive-side checks of what peers announced.
  epHtHandle fresh;
  epHtHandle* lay = cached ? h : &fresh;
  std::vector<int> per_expert(L, 0);
  bool have_counts = true;
  if (st == epSuccess) {
    std::vector<int64_t> rows(R);
    std::vector<const int*> msgs(R);
    for (int s = 0; s < R && st == epSuccess; ++s) {
      if (in[s].extra.size() != sizeof(int) * (L + C) || in[s].h.data_bytes != 0)
        st = fail(epInternalError, s, epPhaseHeader, "dispatch count message does not match its header");
      rows[s] = in[s].h.v[0];
      msgs[s] = reinterpret_cast<const int*>(in[s].extra.data());
      have_counts = have_counts && (in[s].h.v[1] & 1);
    }
    if (st == epSuccess) {
      epHtHandle check;
      if (!readCounts(rows, msgs, R, L, C, have_counts, &check))
        st = fail(epInternalError, -1, epPhaseHeader, "dispatch counts are inconsistent");
      else if (cached && (check.recv_count != h->recv_count || check.recv_chan_count != h->recv_chan_count))
        st = EP_ERROR(epInvalidUsage,
                      "the handle's cached layout does not match what the ranks sent: the routing changed since "
                      "the handle was filled (notify again, or dispatch without EP_HT_USE_HANDLE_LAYOUT)");
      else if (!cached)
        fresh = std::move(check);
      per_expert = have_counts ? (cached ? check.recv_per_expert : fresh.recv_per_expert) : h->recv_per_expert;
    }
    if (st == epSuccess && a->num_worst_tokens > 0 && lay->num_recv > a->num_worst_tokens)
      st = EP_ERROR(epCapacityExceeded,
                    "HT dispatch received %d rows but num_worst_tokens is %d; nothing was written past the "
                    "capacity",
                    lay->num_recv, a->num_worst_tokens);
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(drainChannels(in));
    if (cma_) EPCHECK(exchangeDone());
    if (ok && !cached) h->valid = false;
    return st;
  }

  // Data: each channel places its rows of every source contiguously at their final rows.
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x);
  EPCHECK(runChannels([&](int c) -> epResult_t {
    for (int s = 0; s < R; ++s) {
      int b = lay->recv_prefix[s];
      for (int cc = 0; cc < c; ++cc) b += lay->recv_chan_count[static_cast<size_t>(s) * C + cc];
      const int n = lay->recv_chan_count[static_cast<size_t>(s) * C + c];
      const bool has_idx = in[s].h.v[1] & 1, has_w = in[s].h.v[1] & 2;
      if (cma_) {
        EPCHECK(recvChannelHeader(s, c, n * (sizeof(int32_t) + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
        std::vector<int32_t> tokens(n);
        EPCHECK(recvInto(s, tokens.data(), n * sizeof(int32_t), epPhaseData, c));
        EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(in[s].h.v[2]), xrow, rx + b * xrow));
        if (fp8)
          EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(in[s].h.v[3]), srow,
                           reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow));
      } else {
        EPCHECK(recvChannelHeader(s, c, n * (xrow + srow + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
        EPCHECK(recvInto(s, rx + b * xrow, n * xrow, epPhaseData, c));
        if (fp8)
          EPCHECK(recvInto(s, reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow, n * srow, epPhaseData, c));
      }
      if (has_idx) {
        if (a->recv_topk_idx)
          EPCHECK(recvInto(s, a->recv_topk_idx + static_cast<size_t>(b) * K, sizeof(int64_t) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(s, sizeof(int64_t) * n * K, epPhaseData, c));
      }
      if (has_w) {
        if (a->recv_topk_weights)
          EPCHECK(recvInto(s, a->recv_topk_weights + static_cast<size_t>(b) * K, sizeof(float) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(s, sizeof(float) * n * K, epPhaseData, c));
      }
    }
    return flushSends(epPhaseData, c);
  }));
  // The senders' x must stay put until every receiver has pulled its rows.
  if (cma_) EPCHECK(exchangeDone());

  const int num_recv = lay->num_recv;
  if (a->num_worst_tokens > 0) {
    for (int r = num_recv; r < a->num_worst_tokens; ++r)
      for (int k = 0; k < K; ++k) {
        if (a->recv_topk_idx) a->recv_topk_idx[static_cast<size_t>(r) * K + k] = -1;
        if (a->recv_topk_weights) a->recv_topk_weights[static_cast<size_t>(r) * K + k] = 0.0f;
      }
  }
  if (a->num_recv_tokens) a->num_recv_tokens[0] = num_recv;
  if (a->recv_tokens_per_expert)
    for (int e = 0; e < L; ++e) a->recv_tokens_per_expert[e] = per_expert[e];
  if (!cached) {
    h->num_tokens = T;
    h->num_experts = E;
    h->in_rank = std::move(in_rank_new);
    h->send_count = std::move(send_count_new);
    h->recv_count = std::move(fresh.recv_count);
    h->recv_prefix = std::move(fresh.recv_prefix);
    h->recv_chan_count = std::move(fresh.recv_chan_count);
    h->recv_per_expert = per_expert;
    h->num_recv = num_recv;
    h->recv_rows = num_recv;
    h->valid = true;
  }
  return epSuccess;
}

epResult_t HostEngine::htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t) {
  cur_op_ = epOpHtCombine;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_, C = nchan_;
  const bool ok = local == epSuccess;
  const int H = ok ? a->hidden : 0;
  const size_t es = ok ? dtypeSize(a->dtype) : 0, row = H * es;
  const uint64_t sig = ok ? shapeSig({H, a->dtype}) : 0;
  // Channel 0: the row count and where p's rows start in x; channel c: the rows of source p's tokens in p's
  // channel c, which are contiguous in this rank's receive order. With cross-memory attach there are no channel
  // messages: p pulls its rows straight out of x.
  for (int p = 0; p < R; ++p) {
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    const uint8_t* x = static_cast<const uint8_t*>(a->x) + h->recv_prefix[p] * row;
    hdr.v[0] = h->recv_count[p];
    hdr.v[1] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x));
    post(p, hdr, nullptr, 0, {});
    if (cma_) continue;
    for (int c = 0; c < C; ++c) {
      const int n = h->recv_chan_count[static_cast<size_t>(p) * C + c];
      post(p, makeHeader(cur_op_, local, sig), nullptr, 0, {{x, n * row}}, c);
      x += n * row;
    }
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s) {
    if (in[s].h.v[0] != h->send_count[s] || in[s].h.data_bytes != 0)
      st = EP_ERROR(epInvalidUsage,
                    "rank %d returns %lld rows in HT combine but this rank's handle sent it %d tokens: the handles "
                    "of the ranks come from different dispatches",
                    s, static_cast<long long>(in[s].h.v[0]), h->send_count[s]);
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    if (cma_) EPCHECK(exchangeDone());
    else EPCHECK(drainChannels(in));
    return st;
  }
  // Token by token, ranks ascending: fp32 accumulation in the order the design fixes, rounded once. Each
  // channel reduces its own tokens.
  const int T = a->num_tokens;
  uint8_t* out = static_cast<uint8_t*>(a->combined_x);
  if (cma_) {
    st = runChannels([&](int c) -> epResult_t { return htCombinePulled(a, h, in, c); });
    // The peers' x must stay put until every rank has pulled its rows.
    EPCHECK(exchangeDone());
    return st;
  }
  return runChannels([&](int c) -> epResult_t {
    const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
    std::vector<int> cnt(R, 0);
    for (int t = tb; t < te; ++t)
      for (int r = 0; r < R; ++r) cnt[r] += h->in_rank[static_cast<size_t>(t) * R + r];
    for (int r = 0; r < R; ++r) EPCHECK(recvChannelHeader(r, c, cnt[r] * row));
    std::vector<float> acc(H);
    std::vector<uint8_t> tmp(row);
    for (int t = tb; t < te; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        if (!h->in_rank[static_cast<size_t>(t) * R + r]) continue;
        EPCHECK(waitIn(r, row, epPhaseData, c));
        const uint8_t* src = in_[c][r].peek(row);
        if (src == nullptr) {
          in_[c][r].copyOut(tmp.data(), 0, row);
          src = tmp.data();
        }
        accumulateRow(acc.data(), src, H, a->dtype);
        in_[c][r].release(row);
      }
      storeRow(out + t * row, acc.data(), H, a->dtype);
    }
    return flushSends(epPhaseData, c);
  });
}

// HT combine with cross-memory attach, channel c: the rows this rank's channel-c tokens got back from rank r
// are contiguous in r's x (r received them in token order), so they come over in blocks, one
// process_vm_readv per peer and block, into a staging buffer small enough to stay in cache for the reduction.
epResult_t HostEngine::htCombinePulled(const epHtCombineArgs_t* a, const epHtHandle* h, const std::vector<Incoming>& in,
                                       int c) {
  const int R = nranks_, C = nchan_, H = a->hidden;
  const size_t row = static_cast<size_t>(H) * dtypeSize(a->dtype);
  const int T = a->num_tokens, tb = chanBegin(T, c), te = chanBegin(T, c + 1);
  const uint8_t* in_rank = h->in_rank.data();
  // Where channel c's rows start in each peer's x: after the rows of this rank's earlier channels.
  std::vector<const uint8_t*> next(R);
  std::vector<int> per_chan(C);
  for (int r = 0; r < R; ++r) {
    chanCountsTo(in_rank, T, R, C, r, per_chan.data());
    size_t off = 0;
    for (int cc = 0; cc < c; ++cc) off += per_chan[cc];
    next[r] = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(in[r].h.v[1])) + off * row;
  }
  const int block = static_cast<int>(std::clamp<size_t>((256u << 10) / std::max<size_t>(row, 1), 1, 1024));
  std::vector<uint8_t> stage(static_cast<size_t>(R) * block * row);
  std::vector<const uint8_t*> cur(R);
  std::vector<float> acc(H);
  uint8_t* out = static_cast<uint8_t*>(a->combined_x);
  for (int t0 = tb; t0 < te; t0 += block) {
    const int t1 = std::min(te, t0 + block);
    for (int r = 0; r < R; ++r) {
      size_t n = 0;
      for (int t = t0; t < t1; ++t) n += in_rank[static_cast<size_t>(t) * R + r];
      if (r == rank_ || n == 0) {  // this rank's own rows are read in place
        cur[r] = next[r];
      } else {
        uint8_t* dst = stage.data() + static_cast<size_t>(r) * block * row;
        iovec remote{const_cast<uint8_t*>(next[r]), n * row};
        EPCHECK(readPeer(r, &remote, 1, dst, n * row));
        cur[r] = dst;
      }
      next[r] += n * row;
    }
    for (int t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        if (!in_rank[static_cast<size_t>(t) * R + r]) continue;
        accumulateRow(acc.data(), cur[r], H, a->dtype);
        cur[r] += row;
      }
      storeRow(out + static_cast<size_t>(t) * row, acc.data(), H, a->dtype);
    }
  }
  return epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// LL dispatch / combine
// ------------------------------------------------------------------------------------------------------

bool HostEngine::llPending(int op) const {
  for (const Pending& p : pending_)
    if (p.op == op) return true;
  return false;
}

epResult_t HostEngine::llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t) {
  const bool ok = local == epSuccess;
  const int R = nranks_;
  const uint64_t sig = ok ? shapeSig({a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype,
                                      a->use_fp8, a->layout})
                          : 0;
  auto send = [&]() -> epResult_t {
    const int T = a->num_tokens, H = a->hidden, K = a->topk, E = a->num_experts, L = E / R;
    // The previous dispatch's staged sends must be out before the staging is reused.
    EPCHECK(flushSends(epPhaseData));
    ExpertMap m{E, R, L};
    const size_t es = dtypeSize(a->dtype);
    const size_t out_row = a->use_fp8 ? static_cast<size_t>(H) : H * es;
    const size_t srow = a->use_fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
    const size_t meta = sizeof(int32_t) * (1 + K);
    // Count tokens per destination.
    std::vector<int> n_to(R, 0), per_expert_to(static_cast<size_t>(R) * L, 0);
    std::vector<uint8_t> in_rank;
    computeLayout(a->topk_idx, T, K, E, in_rank, n_to, per_expert_to);
    size_t total = 0;
    for (int p = 0; p < R; ++p) total += n_to[p] * (meta + out_row + srow);
    ll_dispatch_stage_.resize(total);
    // Quantize (fp8) once per token, then copy into each destination's block.
    std::vector<uint8_t> qrow(out_row);
    std::vector<float> qscale(H / EP_FP8_BLOCK + 1);
    size_t off = 0;
    std::vector<size_t> base(R);
    for (int p = 0; p < R; ++p) {
      base[p] = off;
      off += n_to[p] * (meta + out_row + srow);
    }
    std::vector<int> cursor(R, 0);
    for (int t = 0; t < T; ++t) {
      const int64_t* row = a->topk_idx + static_cast<size_t>(t) * K;
      const uint8_t* xr = static_cast<const uint8_t*>(a->x) + t * H * es;
      bool quantized = false;
      for (int p = 0; p < R; ++p) {
        if (!in_rank[static_cast<size_t>(t) * R + p]) continue;
        if (a->use_fp8 && !quantized) {
          for (int b = 0; b < H / EP_FP8_BLOCK; ++b) {
            float amax = 0.0f;
            for (int j = b * EP_FP8_BLOCK; j < (b + 1) * EP_FP8_BLOCK; ++j)
              amax = std::max(amax, std::fabs(loadAsFloat(xr, j, a->dtype)));
            qscale[b] = fp8BlockScale(amax);
            float inv = fp8BlockScaleInv(amax);
            for (int j = b * EP_FP8_BLOCK; j < (b + 1) * EP_FP8_BLOCK; ++j)
              qrow[j] = floatToFp8(loadAsFloat(xr, j, a->dtype) * inv);
          }
          quantized = true;
        }
        const int i = cursor[p]++;
        const int n = n_to[p];
        uint8_t* blk = ll_dispatch_stage_.data() + base[p];
        int32_t* md = reinterpret_cast<int32_t*>(blk + i * meta);
        md[0] = t;
        for (int k = 0; k < K; ++k) md[1 + k] = (row[k] >= 0 && m.rankOf(row[k]) == p) ? m.localOf(row[k]) : -1;
        uint8_t* xo = blk + n * meta + i * out_row;
        memcpy(xo, a->use_fp8 ? qrow.data() : xr, out_row);
        if (srow) memcpy(blk + n * (meta + out_row) + i * srow, qscale.data(), srow);
      }
    }
    for (int p = 0; p < R; ++p) {
      MsgHeader hdr = makeHeader(cur_op_, local, sig);
      hdr.v[0] = n_to[p];
      hdr.v[1] = T;
      post(p, hdr, per_expert_to.data() + static_cast<size_t>(p) * L, sizeof(int) * L,
           {{ll_dispatch_stage_.data() + base[p], n_to[p] * (meta + out_row + srow)}});
    }
    return epSuccess;
  };
  return llOp(epOpLlDispatch, llCallPhases(a), local, sig, send,
              [&](const Pending& p) { return llDispatchRecv(a, p); });
}

epResult_t HostEngine::llDispatchRecv(const epLlDispatchArgs_t* a, const Pending& pend) {
  cur_op_ = pend.op;
  cur_epoch_ = pend.epoch;
  const int R = nranks_, H = a->hidden, K = a->topk, L = a->num_experts / R, M = a->max_tokens_per_rank;
  const size_t es = dtypeSize(a->dtype);
  const size_t out_row = a->use_fp8 ? static_cast<size_t>(H) : H * es;
  const size_t srow = a->use_fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
  const size_t meta = sizeof(int32_t) * (1 + K);
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, pend.sig);
  for (int s = 0; s < R && st == epSuccess; ++s) {
    const MsgHeader& h = in[s].h;
    if (h.v[0] < 0 || h.v[0] > M || h.v[1] < 0 || h.v[1] > M || in[s].extra.size() != sizeof(int) * L ||
        h.data_bytes != static_cast<uint64_t>(h.v[0]) * (meta + out_row + srow))
      st = fail(epInternalError, s, epPhaseHeader, "LL dispatch message sizes do not match its header");
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    return st;
  }
  const bool expert_major = a->layout == EP_LL_EXPERT_MAJOR;
  // Expert-major placement: rows of expert e from rank s start at the sum of lower ranks' counts.
  std::vector<int> begin(static_cast<size_t>(L) * R, 0), cursor(static_cast<size_t>(L) * R, 0);
  if (expert_major) {
    for (int e = 0; e < L; ++e) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        int c = reinterpret_cast<const int*>(in[s].extra.data())[e];
        begin[static_cast<size_t>(e) * R + s] = acc;
        a->recv_layout_range[static_cast<size_t>(e) * R + s] = packLayoutRange(c, acc);
        acc += c;
      }
      a->recv_count[e] = acc;
    }
  } else {
    for (size_t i = 0; i < static_cast<size_t>(R) * M * K; ++i) a->recv_topk_idx[i] = -1;
    for (int s = 0; s < R; ++s) a->recv_count[s] = static_cast<int>(in[s].h.v[1]);
  }
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x);
  std::vector<int32_t> md;
  for (int s = 0; s < R; ++s) {
    const int n = static_cast<int>(in[s].h.v[0]);
    md.resize(static_cast<size_t>(n) * (1 + K));
    EPCHECK(recvInto(s, md.data(), n * meta, epPhaseData));
    for (int i = 0; i < n; ++i) {  // bounds-check the peer's metadata before using it as indices
      const int32_t* mi = md.data() + static_cast<size_t>(i) * (1 + K);
      bool bad = mi[0] < 0 || mi[0] >= M;
      for (int k = 0; k < K; ++k) bad = bad || mi[1 + k] < -1 || mi[1 + k] >= L;
      if (bad) return fail(epInternalError, s, epPhaseData, "LL dispatch metadata out of range");
    }
    // Rows then scales, each placed at every destination the token has here.
    for (int pass = 0; pass < (srow ? 2 : 1); ++pass) {
      const size_t rb = pass == 0 ? out_row : srow;
      uint8_t* dst_base = pass == 0 ? rx : reinterpret_cast<uint8_t*>(a->recv_x_scales);
      if (expert_major)
        for (int e = 0; e < L; ++e) cursor[static_cast<size_t>(e) * R + s] = begin[static_cast<size_t>(e) * R + s];
      for (int i = 0; i < n; ++i) {
        const int32_t* mi = md.data() + static_cast<size_t>(i) * (1 + K);
        EPCHECK(waitIn(s, rb, epPhaseData));
        auto place = [&](size_t dst_row) { in_[0][s].copyOut(dst_base + dst_row * rb, 0, rb); };
        if (expert_major) {
          for (int k = 0; k < K; ++k) {
            int e = mi[1 + k];
            bool dup = false;
            for (int j = 0; j < k; ++j) dup = dup || mi[1 + j] == e;
            if (e < 0 || dup) continue;
            int row = cursor[static_cast<size_t>(e) * R + s]++;
            place(static_cast<size_t>(e) * R * M + row);
            if (pass == 0) a->recv_src_info[static_cast<size_t>(e) * R * M + row] = mi[0];
          }
        } else {
          place(static_cast<size_t>(s) * M + mi[0]);
          if (pass == 0)
            for (int k = 0; k < K; ++k)
              a->recv_topk_idx[(static_cast<size_t>(s) * M + mi[0]) * K + k] = mi[1 + k];
        }
        in_[0][s].release(rb);
      }
    }
  }
  return epSuccess;
}

epResult_t HostEngine::llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t) {
  const bool ok = local == epSuccess;
  const int R = nranks_;
  const uint64_t sig =
      ok ? shapeSig({a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype, a->layout}) : 0;
  auto send = [&]() -> epResult_t {
    const int H = a->hidden, K = a->topk, L = a->num_experts / R, M = a->max_tokens_per_rank;
    EPCHECK(flushSends(epPhaseData));
    const size_t row = H * dtypeSize(a->dtype);
    const uint8_t* y = static_cast<const uint8_t*>(a->y);
    // Rows back to source s in (local expert ascending, token ascending) order; a send half on its own stages
    // them, so that it returns at once and y may be reused.
    std::vector<std::vector<size_t>> rows_to(R);  // y row indices
    for (int e = 0; e < L; ++e) {
      for (int s = 0; s < R; ++s) {
        if (a->layout == EP_LL_EXPERT_MAJOR) {
          int64_t lr = a->recv_layout_range[static_cast<size_t>(e) * R + s];
          int c = layoutRangeCount(lr), b = layoutRangeBegin(lr);
          for (int i = 0; i < c; ++i) rows_to[s].push_back(static_cast<size_t>(e) * R * M + b + i);
        } else {
          for (int t = 0; t < a->recv_count[s]; ++t) {
            const int64_t* li = a->recv_topk_idx + (static_cast<size_t>(s) * M + t) * K;
            for (int k = 0; k < K; ++k)
              if (li[k] == e) {
                rows_to[s].push_back(static_cast<size_t>(e) * R * M + static_cast<size_t>(s) * M + t);
                break;
              }
          }
        }
      }
    }
    // With the receive half in the same call, y stays valid until the call returns. With cross-memory attach
    // the rows stay in y and each peer reads its own (the message lists their y rows); this call returns once
    // every peer is done with them.
    if ((a->phases & EP_LL_RECV) && cma_) {
      std::vector<int32_t>& idx = ll_combine_rows_;
      idx.clear();
      for (int s = 0; s < R; ++s)
        for (size_t yr : rows_to[s]) idx.push_back(static_cast<int32_t>(yr));
      size_t off = 0;
      for (int s = 0; s < R; ++s) {
        MsgHeader hdr = makeHeader(cur_op_, local, sig);
        hdr.flags = kMsgRowsByReference;
        hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
        hdr.v[2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(y));
        post(s, hdr, nullptr, 0, {{reinterpret_cast<const uint8_t*>(idx.data() + off), rows_to[s].size() * 4}});
        off += rows_to[s].size();
      }
      return epSuccess;
    }
    // Otherwise, in a call with both halves, the rows go out of y directly (the receive half flushes the sends
    // before returning), runs of consecutive rows as one piece.
    if (a->phases & EP_LL_RECV) {
      for (int s = 0; s < R; ++s) {
        std::vector<Seg> segs;
        for (size_t yr : rows_to[s]) {
          const uint8_t* p = y + yr * row;
          if (!segs.empty() && segs.back().p + segs.back().n == p) segs.back().n += row;
          else segs.push_back({p, row});
        }
        MsgHeader hdr = makeHeader(cur_op_, local, sig);
        hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
        post(s, hdr, nullptr, 0, std::move(segs));
      }
      return epSuccess;
    }
    size_t total = 0;
    for (int s = 0; s < R; ++s) total += rows_to[s].size() * row;
    ll_combine_stage_.resize(total);
    size_t off = 0;
    for (int s = 0; s < R; ++s) {
      size_t b = off;
      for (size_t yr : rows_to[s]) {
        memcpy(ll_combine_stage_.data() + off, y + yr * row, row);
        off += row;
      }
      MsgHeader hdr = makeHeader(cur_op_, local, sig);
      hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
      post(s, hdr, nullptr, 0, {{ll_combine_stage_.data() + b, off - b}});
    }
    return epSuccess;
  };
  return llOp(epOpLlCombine, llCallPhases(a), local, sig, send,
              [&](const Pending& p) { return llCombineRecv(a, p); });
}

// The two halves of an LL operation. `phases` are the call's, or 0 for a rejected call whose phases cannot be
// read: it then stands for what the engine's state allows: the receive half when this operation's send half is
// outstanding, else a send half when the other operation's receive is outstanding, else both halves.
// Call order (decided from local state, the same on every rank, so nothing is exchanged): a send half needs no
// send half of this operation outstanding, a receive half needs this operation's to be the oldest outstanding
// one, and a call with both halves needs none outstanding. A call out of order posts nothing.
// A rejected send half posts a header carrying its code (the peers' receive returns epRemoteError) and returns
// at once; a rejected receive half posts nothing and stays outstanding, so that a valid retry completes it; a
// rejected call with both halves does both, its receive half only draining the peers' messages.
epResult_t HostEngine::llOp(int op, unsigned phases, epResult_t local, uint64_t sig,
                            const std::function<epResult_t()>& send,
                            const std::function<epResult_t(const Pending&)>& recv) {
  const bool ok = local == epSuccess;
  if (phases == 0) phases = llPending(op) ? EP_LL_RECV : pending_.empty() ? EP_LL_SEND_RECV : EP_LL_SEND;
  const char* order = nullptr;
  if ((phases & EP_LL_SEND) && llPending(op))
    order = "send half called while the receive half (EP_LL_RECV) of its previous send half is outstanding";
  else if (phases == EP_LL_SEND_RECV && !pending_.empty())
    order = "call with both halves made while an LL receive half (EP_LL_RECV) is outstanding; complete it first";
  else if (phases == EP_LL_RECV && !llPending(op))
    order = "receive half (EP_LL_RECV) called with no matching send half outstanding";
  else if (phases == EP_LL_RECV && pending_.front().op != op)
    order = "receive half (EP_LL_RECV) called before the older outstanding receive half; complete that first";
  if (order != nullptr) return ok ? EP_ERROR(epInvalidUsage, "%s %s", opName(op), order) : local;
  if (!ok && phases == EP_LL_RECV) return local;
  if (phases & EP_LL_SEND) {
    cur_op_ = op;
    cur_epoch_ = ++send_epoch_;
    if (ok) {
      EPCHECK(send());
    } else {
      for (int p = 0; p < nranks_; ++p) post(p, makeHeader(op, local, sig), nullptr, 0, {});
    }
    pushSends();
    pending_.push_back({op, cur_epoch_, sig, local});
  }
  if (!(phases & EP_LL_RECV)) return local;
  Pending p = pending_.front();
  pending_.pop_front();
  cur_op_ = p.op;
  cur_epoch_ = p.epoch;
  if (ok && p.status == epSuccess) return recv(p);
  // The receive of a rejected send half, or a rejected call with both halves: consume the peers' messages.
  epResult_t st = local;
  if (ok)
    st = EP_ERROR(p.status,
                  "the send half of this %s (epoch %llu) was rejected (%s); its receive half completes without output",
                  opName(op), static_cast<unsigned long long>(p.epoch), epGetErrorString(p.status));
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  st = statusFromPeers(in, st, p.sig);
  EPCHECK(drainPayloads(in));
  return st;
}

epResult_t HostEngine::llCombineRecv(const epLlCombineArgs_t* a, const Pending& pend) {
  cur_op_ = pend.op;
  cur_epoch_ = pend.epoch;
  const int R = nranks_, H = a->hidden, K = a->topk, E = a->num_experts, L = E / R, T = a->num_tokens;
  const size_t row = H * dtypeSize(a->dtype);
  ExpertMap m{E, R, L};
  // Where each (token, k) row lands in the staging: per source rank r, rows come in (local expert, token)
  // order, which this rank derives from its own routing.
  std::vector<int> expect(R, 0);
  std::vector<std::vector<std::pair<int, int>>> by_expert(E);  // expert -> (token, -) in token order
  for (int t = 0; t < T; ++t) {
    const int64_t* r = a->topk_idx + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k)
      if (r[k] >= 0 && !isRepeatedExpert(r, k)) by_expert[r[k]].push_back({t, k});
  }
  std::vector<int> slot(static_cast<size_t>(T) * K, -1);
  std::vector<int> prefix(R + 1, 0);
  int next = 0;
  for (int e = 0; e < E; ++e) {
    for (auto& tk : by_expert[e]) slot[static_cast<size_t>(tk.first) * K + tk.second] = next++;
    expect[m.rankOf(e)] += static_cast<int>(by_expert[e].size());
  }
  for (int r = 0; r < R; ++r) prefix[r + 1] = prefix[r] + expect[r];
  // Repeated experts share the slot of their first occurrence.
  for (int t = 0; t < T; ++t) {
    const int64_t* r = a->topk_idx + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k)
      if (r[k] >= 0 && isRepeatedExpert(r, k))
        for (int j = 0; j < k; ++j)
          if (r[j] == r[k]) {
            slot[static_cast<size_t>(t) * K + k] = slot[static_cast<size_t>(t) * K + j];
            break;
          }
  }
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, pend.sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (in[s].h.v[0] != expect[s] ||
        in[s].h.data_bytes != static_cast<uint64_t>(expect[s]) *
                                  ((in[s].h.flags & kMsgRowsByReference) ? sizeof(int32_t) : row))
      st = EP_ERROR(epInvalidUsage,
                    "rank %d returns %lld rows in LL combine but this rank's routing names %d (token, expert) pairs "
                    "on it: topk_idx or the dispatch outputs passed to combine differ from those of the dispatch",
                    s, static_cast<long long>(in[s].h.v[0]), expect[s]);
  // A call with both halves that reached here sent successfully, and with cross-memory attach left its rows in y.
  const bool left_in_y = (a->phases & EP_LL_SEND) && cma_;
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    if (left_in_y) EPCHECK(waitReadDone(pend.epoch));
    return st;
  }
  scratch_.resize(static_cast<size_t>(next) * row);
  for (int s = 0; s < R; ++s) {
    uint8_t* dst = scratch_.data() + prefix[s] * row;
    if (!(in[s].h.flags & kMsgRowsByReference)) {
      EPCHECK(recvInto(s, dst, expect[s] * row, epPhaseData));
      continue;
    }
    // Rows left in rank s's y: the message lists their y rows.
    std::vector<int32_t> yrows(expect[s]);
    EPCHECK(recvInto(s, yrows.data(), yrows.size() * sizeof(int32_t), epPhaseData));
    EPCHECK(pullRows(s, yrows, static_cast<uint64_t>(in[s].h.v[2]), row, dst));
    in_[0][s].setReadDone(pend.epoch);
  }
  // The rows from rank s occupy [prefix[s], prefix[s+1]); slot numbering above runs over experts in
  // ascending order, which is also ascending rank order, so slot == staging row.
  acc_.resize(H);
  uint8_t* out = static_cast<uint8_t*>(a->out);
  for (int t = 0; t < T; ++t) {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      int sl = slot[static_cast<size_t>(t) * K + k];
      if (sl < 0) continue;
      const float w = a->topk_weights[static_cast<size_t>(t) * K + k];
      accumulateRowWeighted(acc_.data(), scratch_.data() + static_cast<size_t>(sl) * row, H, a->dtype, w);
    }
    storeRow(out + t * row, acc_.data(), H, a->dtype);
  }
  // In a call with both halves this rank's rows were sent straight from y, or are read from it by the peers:
  // either way they must be out before it returns. (A receive half on its own must not wait here: a later
  // send half's staged messages may be queued too.)
  if (!(a->phases & EP_LL_SEND)) return epSuccess;
  EPCHECK(flushSends(epPhaseData));
  return left_in_y ? waitReadDone(pend.epoch) : epSuccess;
}

// ------------------------------------------------------------------------------------------------------
// alltoallv and barrier
// ------------------------------------------------------------------------------------------------------

// Two rounds, so that counts are compared before any data moves: first every rank sends every peer its whole
// count table (send_counts and recv_counts), so that every rank checks every pair and all decide alike (the
// two ranks of a disagreeing pair return epInvalidUsage, the others epRemoteError); then the data.
epResult_t HostEngine::alltoallv(const void* sendbuf, const size_t* send_counts, const size_t* send_displs,
                                 void* recvbuf, const size_t* recv_counts, const size_t* recv_displs, size_t es,
                                 epResult_t local, epStream_t) {
  cur_op_ = epOpAlltoallv;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_;
  const bool ok = local == epSuccess;
  const uint64_t sig = shapeSig({static_cast<int64_t>(es)});
  std::vector<int64_t> table;  // [send_counts (R), recv_counts (R)]
  if (ok)
    for (const size_t* c : {send_counts, recv_counts})
      for (int p = 0; p < R; ++p) table.push_back(static_cast<int64_t>(c[p]));
  for (int p = 0; p < R; ++p)
    post(p, makeHeader(cur_op_, local, sig), table.data(), sizeof(int64_t) * table.size(), {});
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (in[s].extra.size() != sizeof(int64_t) * 2 * R)
      st = fail(epInternalError, s, epPhaseHeader, "alltoallv count table does not match its header");
  if (st == epSuccess) {
    auto sends = [&](int a, int b) { return reinterpret_cast<const int64_t*>(in[a].extra.data())[b]; };
    auto expects = [&](int b, int a) { return reinterpret_cast<const int64_t*>(in[b].extra.data())[R + a]; };
    int bad_a = -1, bad_b = -1;  // the first disagreeing pair, preferring one this rank is in
    bool mine = false;
    for (int a = 0; a < R; ++a)
      for (int b = 0; b < R; ++b) {
        const bool m = a == rank_ || b == rank_;
        if (sends(a, b) != expects(b, a) && (bad_a < 0 || (m && !mine))) bad_a = a, bad_b = b, mine = m;
      }
    if (bad_a >= 0)
      st = EP_ERROR(mine ? epInvalidUsage : epRemoteError,
                    "alltoallv: rank %d sends %lld elements to rank %d (send_counts[%d]) but rank %d expects %lld "
                    "(recv_counts[%d]); no data moved",
                    bad_a, static_cast<long long>(sends(bad_a, bad_b)), bad_b, bad_b, bad_b,
                    static_cast<long long>(expects(bad_b, bad_a)), bad_a);
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseHeader));
    return st;
  }
  for (int p = 0; p < R; ++p)
    post(p, makeHeader(cur_op_, local, sig), nullptr, 0,
         {{static_cast<const uint8_t*>(sendbuf) + send_displs[p] * es, send_counts[p] * es}});
  pushSends();
  for (int s = 0; s < R; ++s) {
    EPCHECK(recvChannelHeader(s, 0, recv_counts[s] * es));
    EPCHECK(recvInto(s, static_cast<uint8_t*>(recvbuf) + recv_displs[s] * es, recv_counts[s] * es, epPhaseData));
  }
  return flushSends(epPhaseData);
}

epResult_t HostEngine::alltoallvDevice(const void* sendbuf, const int64_t* send_counts, void* recvbuf,
                                       size_t recv_capacity, int64_t* recv_counts, int64_t* num_dropped, size_t es,
                                       epResult_t local, epStream_t) {
  cur_op_ = epOpAlltoallvDevice;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_;
  const bool ok = local == epSuccess;
  const uint64_t sig = shapeSig({static_cast<int64_t>(es)});
  size_t off = 0;
  for (int p = 0; p < R; ++p) {
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    hdr.v[0] = send_counts[p];
    post(p, hdr, nullptr, 0, {{static_cast<const uint8_t*>(sendbuf) + off * es, send_counts[p] * es}});
    off += send_counts[p];
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (in[s].h.v[0] < 0 || in[s].h.data_bytes != static_cast<uint64_t>(in[s].h.v[0]) * es)
      st = fail(epInternalError, s, epPhaseHeader, "alltoallv message sizes do not match its header");
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    return st;
  }
  size_t pos = 0;
  int64_t dropped = 0;
  for (int s = 0; s < R; ++s) {
    size_t n = static_cast<size_t>(in[s].h.v[0]);
    size_t fit = pos < recv_capacity ? std::min(n, recv_capacity - pos) : 0;
    EPCHECK(recvInto(s, static_cast<uint8_t*>(recvbuf) + pos * es, fit * es, epPhaseData));
    EPCHECK(skipIn(s, (n - fit) * es, epPhaseData));
    pos += fit;
    dropped += static_cast<int64_t>(n - fit);
    recv_counts[s] = static_cast<int64_t>(n);
  }
  EPCHECK(flushSends(epPhaseData));
  if (num_dropped) *num_dropped = dropped;
  if (dropped > 0)
    return EP_ERROR(epCapacityExceeded,
                    "alltoallv (device counts) received %lld elements more than recv_capacity = %zu; they were "
                    "dropped and counted in num_dropped",
                    static_cast<long long>(dropped), recv_capacity);
  return epSuccess;
}

epResult_t HostEngine::barrier(epStream_t) {
  cur_op_ = epOpBarrier;
  cur_epoch_ = ++send_epoch_;
  for (int p = 0; p < nranks_; ++p) post(p, makeHeader(cur_op_, epSuccess, 0), nullptr, 0, {});
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, 0);
  EPCHECK(drainPayloads(in));
  EPCHECK(flushSends(epPhaseHeader));
  return st;
}

}  // namespace epcomm
