// The host engine: every operation of the C API on host memory, for the ranks (processes) of one host.
//
// Protocol. Each operation sends exactly one message to every rank (itself included) over the shm rings:
// a fixed header {op, epoch, status, shape signature, payload size, counts} plus a payload. Because every
// message states its own size, a receiver can always consume it, so a rank whose arguments were rejected
// (it sends only a header carrying its error code), a shape mismatch between ranks, or a receiver-side
// capacity overflow leave every ring aligned and the communicator usable; every rank returns an error.
// Sends are queued and pushed as ring space allows; every wait keeps pushing, so ranks never deadlock on
// bounded rings. A wait that sees no progress for timeout_ms, a dead peer process, or an abort ends the
// operation with an error recorded as the communicator's asynchronous error.
//
// Rows by reference. When every rank may read every other's memory (process_vm_readv, EPCOMM_HOST_CMA), the
// large rows of HT dispatch, HT combine and one-call LL combine stay where they are: the message names them
// and the receiver reads them straight into place. The owner keeps them untouched until every reader is done:
// readers raise the read_done counter (to the operation's epoch) of the ring they received the message on,
// and the owner waits for those counters. A counter rather than a message, because a peer with split LL
// halves may already have queued later messages on that ring. A rank's own rows stay where they are in more
// cases (HT dispatch always; HT combine with cross-memory attach or hierarchically across hosts; LL calls with
// both halves, dispatch without fp8): it copies them once into place instead of twice through its own queue. The
// message to itself still goes, carrying indices or nothing, so the order of every ring is the same.
//
// Across hosts. Ranks with the same host identity (hostname + boot id, or EPCOMM_HOSTID) share memory; toward a
// rank of another host the rings and region-header words are carried over the net transport by a NetBridge
// (net_bridge.h), so the protocol above is the same everywhere. Rows by reference need every pair to share a
// host: with more than one host every row travels through the queues. HT dispatch and combine then run
// hierarchically (ht.cc: a token row crosses once per destination host, to a forwarding rank that fans it out
// inside its host; combine reduces inside the host and sends one partial per token and host back) unless
// EPCOMM_HT_HIERARCHICAL=0; every other operation is flat (a token goes to each destination rank separately).
//
// Elastic ranks. "Every rank" above means every active rank: masked ranks (epCommSetActiveRanks) get no message,
// none is read from them (recvHeaders hands the operation an empty stand-in), and no wait involves them. How the
// survivors get back in step after a failure is in elastic.cc.
#pragma once
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "engine/comm.h"
#include "engine/engine.h"
#include "transport/bridge/net_bridge.h"
#include "transport/shm/shm.h"

namespace epcomm {

constexpr uint32_t kMsgMagic = 0x65704d31u;  // "epM1"

struct MsgHeader {
  uint32_t magic;
  uint32_t op;
  uint64_t epoch;
  int32_t status;       // the sender's epResult_t for this operation
  int32_t src;          // sender rank
  uint64_t sig;         // hash of the shape arguments all ranks must agree on
  uint64_t extra_bytes; // op-specific array following the header
  uint64_t data_bytes;  // data following the extra array
  int64_t v[4];         // op-specific scalars
  uint32_t flags;       // kMsgRowsByReference, ...
  uint8_t pad[12];
};
// The message carries row indices, not rows: the receiver reads the rows from the sender's memory
// (process_vm_readv, base address in v[2]; a plain copy when the sender is the receiver itself) and then signals
// RingEnd::setReadDone(epoch) on that sender's ring.
constexpr uint32_t kMsgRowsByReference = 1;
// The message carries no rows: they stay in the sender's memory, where the receiver knows them (only between a rank
// and itself: its own hierarchical HT combine rows, the message then empty, read in place out of x; its own LL
// dispatch rows in a call with both halves, the message then only their metadata, read out of x by token).
constexpr uint32_t kMsgRowsInPlace = 2;
static_assert(sizeof(MsgHeader) == 96, "message header size is part of the wire format");

// Per-channel scratch memory for what an operation posts from buffers of its own (the forwarded rows of a
// hierarchical HT dispatch, the partial sums of its combine, the pulled combine's staging): handed out uninitialized
// and kept from one operation to the next, so that an operation neither zero-fills megabytes it overwrites at
// once nor faults fresh pages in every time. reset() at the start of a channel's part of an operation; what get()
// returned stays valid until then (so until the channel's sends are flushed, which every such part ends with).
class ScratchArena {
 public:
  void reset() { next_ = 0; }
  uint8_t* get(size_t n) {
    if (next_ == bufs_.size()) {
      bufs_.emplace_back();
      caps_.push_back(0);
    }
    if (caps_[next_] < n) {
      bufs_[next_].reset(new uint8_t[n]);  // no value-initialization
      caps_[next_] = n;
    }
    return bufs_[next_++].get();
  }

 private:
  std::vector<std::unique_ptr<uint8_t[]>> bufs_;
  std::vector<size_t> caps_;
  size_t next_ = 0;
};

class HostEngine final : public Engine {
 public:
  explicit HostEngine(epComm* comm);
  ~HostEngine() override;
  epResult_t init() override;
  bool hostMemory() const override { return true; }
  epResult_t handleInit(epHtHandle*) override { return epSuccess; }
  void handleFree(epHtHandle*) override {}
  epResult_t layout(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* per_rank,
                    int* per_expert, uint8_t* in_rank, epStream_t stream) override;

  // `local` is the result of this rank's argument validation: when it is not epSuccess the rank still takes
  // part in the exchange (sending only its error) and returns `local`.
  epResult_t htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                      int* per_expert_host, epStream_t stream) override;
  epResult_t htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t alltoallv(const void* sendbuf, const size_t* send_counts, const size_t* send_displs, void* recvbuf,
                       const size_t* recv_counts, const size_t* recv_displs, size_t elem_bytes, epResult_t local,
                       epStream_t stream) override;
  epResult_t alltoallvDevice(const void* sendbuf, const int64_t* send_counts, void* recvbuf, size_t recv_capacity,
                             int64_t* recv_counts, int64_t* num_dropped, size_t elem_bytes, epResult_t local,
                             epStream_t stream) override;
  epResult_t llCombineBuffer(void** y, size_t* bytes) override;
  epResult_t llDispatchBuffer(void** x, size_t* x_bytes, float** scales, size_t* scales_bytes) override;
  epResult_t htCombineBuffer(void** x, size_t* bytes) override;
  epResult_t barrier(epStream_t stream) override;
  void abort() override;
  epResult_t setActiveRanks(const uint8_t* active, epStream_t stream) override;
  epResult_t setActiveRanksRejected(epResult_t local, epStream_t stream) override;
  bool canRecover() const override { return true; }
  epResult_t recover(uint8_t* kept, epStream_t stream) override;
  epResult_t maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t stream) override;
  epResult_t netBytesSent(uint64_t* bytes) override;
  epResult_t netRawBandwidth(size_t bytes_per_peer, size_t msg_bytes, int window, uint64_t* bytes_sent,
                             double* seconds) override;

  // Operation kinds that may sit between an EP_LL_SEND and its EP_LL_RECV.
  bool llPending(int op) const;
  bool anyPending() const override { return !pending_.empty(); }
  size_t maxRowBytes() const override { return ring_bytes_ / 2; }

 private:
  struct Seg {
    const uint8_t* p;
    size_t n;
  };
  struct OutMsg {
    std::vector<uint8_t> own;  // header + extra
    std::vector<Seg> segs;     // own first, then payload pieces
    size_t seg = 0, off = 0;
  };
  struct Pending {           // an LL operation whose receive half is outstanding
    int op;
    uint64_t epoch;
    uint64_t sig;
    epResult_t status;       // this rank's result of the send half
  };
  struct Incoming {          // what one peer's message said
    MsgHeader h;
    bool masked = false;     // a masked rank: no message was read; h is an empty stand-in
    std::vector<uint8_t> extra;
  };

  // ---- transport ----
  // Channel `ch` (default 0, the operation headers' channel) is served by one thread at a time.
  void post(int peer, const MsgHeader& h, const void* extra, size_t extra_bytes, std::vector<Seg> payload,
            int ch = 0);
  bool pushSends(int ch = 0);  // pushes what fits; true if anything moved
  epResult_t waitIn(int peer, size_t bytes, int phase, int ch = 0);  // until `bytes` are readable from peer
  epResult_t recvInto(int peer, void* dst, size_t len, int phase, int ch = 0);
  epResult_t skipIn(int peer, size_t len, int phase, int ch = 0);
  epResult_t flushSends(int phase, int ch = 0);
  enum class Spin { kDone, kMoved, kIdle };
  template <typename Step>  // Spin step(int& peer)
  epResult_t spin(int peer, int phase, Step&& step);
  // Runs fn(c) for every channel c at once (c = 0 on the calling thread, the others on the channel threads)
  // and returns the first failure, with its message.
  epResult_t runChannels(const std::function<epResult_t(int)>& fn);
  // Tokens [begin, end) of channel c.
  int chanBegin(int T, int c) const { return static_cast<int>(static_cast<int64_t>(T) * c / nchan_); }
  // bye_seen: the waited-on peer found to have destroyed its communicator at the previous liveness check (-1: none).
  epResult_t checkWait(int peer, int phase, int64_t& idle_since, int64_t& last_live_check, int64_t& last_turn,
                       int& bye_seen);
  epResult_t recvHeaders(std::vector<Incoming>& in);
  epResult_t drainChannels(const std::vector<Incoming>& in);
  epResult_t recvChannelHeader(int src, int ch, uint64_t expect_bytes);
  epResult_t pullRows(int src, const std::vector<int32_t>& tokens, uint64_t remote_base, size_t row, uint8_t* dst);
  // Whether HT dispatch rows toward rank p stay in the sender's x, the message naming them (cross-memory attach,
  // and always this rank's own rows).
  bool rowsByRef(int p) const { return cma_ || p == rank_; }
  // Such a channel message from s (header `h` from channel 0): its token indices, then the x (and scale) rows
  // pulled into recv rows [b, b + n); its topk_idx and weights follow in the ring as in any other.
  epResult_t pullDispatchRows(const epHtDispatchArgs_t* a, const MsgHeader& h, int s, int c, int b, int n,
                              bool has_idx, bool has_w);
  epResult_t readPeer(int src, const iovec* remote, size_t n, void* dst, size_t bytes);
  epResult_t htCombinePulled(const epHtCombineArgs_t* a, const epHtHandle* h, const std::vector<Incoming>& in, int c);
  epResult_t exchangeDone();  // every rank tells every peer it has finished reading its memory, and waits for theirs
  epResult_t waitReadDone(uint64_t epoch);  // until every peer has finished reading this rank's memory for epoch
  epResult_t drainPayloads(std::vector<Incoming>& in);
  epResult_t statusFromPeers(const std::vector<Incoming>& in, epResult_t local, uint64_t sig);
  MsgHeader makeHeader(int op, epResult_t status, uint64_t sig) const;
  epResult_t fail(epResult_t code, int peer, int phase, const char* what);

  // ---- elastic ranks (elastic.cc) ----
  bool active(int r) const { return active_[r] != 0; }
  // Rank r's published resynchronization words: its region header, or for a rank of another host the bridge's
  // mirror of what it last sent.
  const RegionHeader* peerHeader(int r) const { return remote_[r] ? bridge_->mirror(r) : peers_[r]->header(); }
  // Whether rank r destroyed its communicator cleanly (its goodbye frame across hosts; its header's word here).
  bool peerLeft(int r) const {
    return remote_[r] ? bridge_->saidGoodbye(r) : peers_[r]->header()->bye.load(std::memory_order_acquire) != 0;
  }
  // The resynchronization among the ranks `proposed` keeps (the current mask for a rejected call, local != 0).
  epResult_t resync(const uint8_t* proposed, epResult_t local);
  epResult_t resyncWait(const std::vector<uint8_t>& part, uint64_t& round, int phase, bool adopt, int* failed_peer);
  // Whether kept rank r, whose word w is at least (round, kDone) during this rank's phase-3 wait, failed that round:
  // its failed bit, or, moved on to a later round, a last successful round other than this one (elastic.cc).
  bool resyncPeerFailed(int r, uint64_t w, uint64_t round) const;
  // Whether a rank of `part` completed round `round` successfully (its rs_ok; low 32 bits, as CTRL frames carry).
  bool peerCompleted(const std::vector<uint8_t>& part, uint64_t round) const;
  // Recovery (epCommRecover): adds to accused_ the kept ranks this rank finds dead, disconnected or gone; publishes
  // accused_ and the committed mask in its region header (rc_*); the mask every survivor derives alike from what
  // all of them published; a sum of the generations of the sets agreedKeep reads (every active rank's), to notice
  // news cheaply.
  void noteLosses();
  void publishSets();
  std::vector<uint8_t> agreedKeep() const;
  uint64_t setsGen() const;
  // A handle's layout predates a mask change: cached dispatch and combine refuse it.
  epResult_t checkHandleMask(const epHtHandle* h, const char* what) const;

  // ---- hierarchical HT across hosts (ht.cc) ----
  // Rank that forwards source s's rows inside host hh: among the active ranks of hh, the one at index
  // (s's index on its host) mod (their number), as DeepEP forwards to the rank of the same local index;
  // -1 if hh has no active rank.
  int forwarder(int s, int hh) const;
  epResult_t htForwardDispatch(const std::vector<Incoming>& in, int c, std::vector<std::vector<uint64_t>>& masks,
                               ScratchArena& keep);
  // Channel c of a hierarchical HT dispatch: forwards, then receives every source's rows (lay != null) or
  // discards them (the operation failed).
  epResult_t htDispatchRecvHier(const epHtDispatchArgs_t* a, const epHtHandle* lay, const std::vector<Incoming>& in,
                                int c);
  // Channel c's rows of source s that this rank forwarded to itself (fwd_self_), placed as its queue would.
  epResult_t placeSelfForward(const epHtDispatchArgs_t* a, const epHtHandle* lay, int s, int c, bool has_idx,
                              bool has_w);
  epResult_t htCombineHier(const epHtCombineArgs_t* a, const epHtHandle* h, const std::vector<Incoming>& in, bool ok,
                           bool st_ok, int c, std::atomic<bool>* forward_failed);

  // ---- op helpers ----
  // Pairs on masked ranks are left out; masked_to[r] (when given) counts the tokens not sent to masked r.
  void computeLayout(const int64_t* topk_idx, int T, int K, int E, std::vector<uint8_t>& in_rank,
                     std::vector<int>& send_count, std::vector<int>& per_expert_to /*[R][L]*/,
                     std::vector<int>* masked_to = nullptr) const;
  epResult_t llOp(int op, unsigned phases, epResult_t local, uint64_t sig, const std::function<epResult_t()>& send,
                  const std::function<epResult_t(const Pending&)>& recv);
  epResult_t llDispatchRecv(const epLlDispatchArgs_t* a, const Pending& p);
  epResult_t llCombineRecv(const epLlCombineArgs_t* a, const Pending& p);

  epComm* comm_;
  int rank_, nranks_;
  size_t ring_bytes_ = 0;
  ShmRegion own_;
  std::vector<std::unique_ptr<ShmRegion>> peers_;
  int nchan_ = 1;
  bool cma_ = false;             // HT dispatch/combine and joined LL combine rows are pulled (process_vm_readv)
  uint64_t cma_probe_ = 0;
  std::vector<std::vector<RingEnd>> out_, in_;          // [channel][peer]
  std::vector<int64_t> pids_;
  std::vector<uint8_t> remote_;   // [R] 1: rank r is on another host (reached through bridge_)
  int nhosts_ = 1;
  bool hier_ = false;                       // HT dispatch/combine across hosts run hierarchically
  int my_host_ = 0;
  std::vector<int> host_of_;                // [R] host index (hosts numbered in the order of their lowest rank)
  std::vector<int> local_idx_;              // [R] index of the rank among the ranks of its host
  std::vector<std::vector<int>> host_ranks_;  // [hosts] ranks, ascending
  std::unique_ptr<NetBridge> bridge_;
  // [channel] bytes pushed into the outboxes toward other hosts (epCommGetNetBytes); one writer per channel.
  std::unique_ptr<std::atomic<uint64_t>[]> net_pushed_;
  std::vector<std::vector<std::deque<OutMsg>>> outq_;  // [channel][peer]
  std::unique_ptr<class ChannelPool> pool_;
  uint64_t send_epoch_ = 0;  // operations this rank has sent
  uint64_t recv_epoch_ = 0;  // operations this rank has received
  int cur_op_ = epOpNone;
  uint64_t cur_epoch_ = 0;
  std::deque<Pending> pending_;
  // Reused scratch: staging of LL sends (kept until pushed) and receive-side row buffers.
  std::vector<uint8_t> ll_dispatch_stage_, ll_combine_stage_, scratch_;
  std::vector<int32_t> ll_combine_rows_;
  // What a hierarchical HT dispatch forwards to this rank itself, per (source, channel): kept here instead of
  // going through its own queue (htForwardDispatch fills it, htDispatchRecvHier reads it, on channel c's thread).
  struct SelfForward {
    bool set = false;
    std::vector<int64_t> rows;  // rows of the source's message, ascending
    const uint8_t* xs = nullptr;
    const uint8_t* ss = nullptr;
    uint64_t xrow = 0, srow = 0, K = 0;
    bool has_idx = false, has_w = false;  // whether the source sent topk_idx and weights
    const int64_t* idx = nullptr;         // [rows * K] local ids
    const float* w = nullptr;             // [rows * K]
  };
  std::vector<SelfForward> fwd_self_;  // [R * C]
  std::vector<std::vector<uint64_t>> fwd_scratch_;  // [R * C] the forward masks of the HT dispatch in progress
  std::vector<float> acc_;
  std::vector<ScratchArena> chan_scratch_;  // [channel]
  // Elastic ranks: the mask read at operation start, its generation (bumped when someone new is masked), the
  // ranks whose liveness waits check, the drop counters, and the resynchronization round.
  std::vector<uint8_t> active_;
  uint64_t mask_gen_ = 0;
  const uint8_t* watch_ = nullptr;
  std::vector<int64_t> drop_rows_, drop_a2a_;
  uint64_t rs_round_ = 0;
  bool record_async_ = true;  // false while a rejected epCommSetActiveRanks takes part: its failures break nothing
  // Recovery: ranks this rank holds out for good (accused_) and those of them it knows gone for certain (a process
  // gone from this host, or a goodbye); while recovering_, resync's waits give twice the deadline and its first
  // phase gives up as soon as the agreed mask moves away from the proposal (resync_stale_); the last failure's
  // peer and code, and whether a survivor's call was rejected (which ends the recovery, decided alike).
  std::vector<uint8_t> accused_, certain_;
  bool recovering_ = false, resync_stale_ = false, rs_rejected_ = false;
  int rs_stage_ = 0;      // the phase whose wait the last resync ended in (a timeout there names whom it blames)
  uint64_t rc_seen_ = 0;  // setsGen of the round's proposal, taken before it was derived
  int wait_scale_ = 1;
  int last_fail_peer_ = -1;
  epResult_t last_fail_code_ = epSuccess;
  // This operation's peers issued another operation where one of the two is HT dispatch or combine, whose data
  // messages go out before the headers are compared: the rings hold what neither side will read, so nothing is
  // drained, flushed or waited for, and the communicator needs a resynchronization (statusFromPeers), which clears it.
  bool unaligned_ = false;
};

uint64_t shapeSig(std::initializer_list<int64_t> values);
bool processGone(int64_t pid);  // a process of this host that has ended (gone, or a zombie not yet reaped)
// A rank's published resynchronization progress (RegionHeader::rs_word): later rounds and phases compare
// greater; bit 0 says its call failed.
inline uint64_t rsWord(uint64_t round, int phase, bool failed) {
  return round * 8 + static_cast<uint64_t>(phase) * 2 + (failed ? 1 : 0);
}
const char* hostOpName(int op);  // an epOp_t as the engine's messages name it

}  // namespace epcomm
