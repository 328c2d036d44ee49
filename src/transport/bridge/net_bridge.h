// Rings between hosts: the shm ring protocol carried over the net transport. The host engine's traffic to ranks of
// other hosts goes through it, and so does the GPU engine's proxy (src/engine/gpu/proxy.h), which uses one
// channel and the rings alone.
//
// The host engine talks to every peer through single-producer/single-consumer byte rings (RingEnd) and, for
// elastic resynchronization, reads words each peer publishes in its region header. Within a host those live in
// shared memory. Toward a rank on another host (another host id, DESIGN.md "host") nothing is shared; the bridge
// gives the engine the very same objects, backed by private memory and kept in step over `net`:
//
//   producer (this rank)                                          consumer (rank p, another host)
//   engine --push--> outbox ring  --DATA frames-->  progress thread --copy--> inbox ring (p's own region,
//                    (private)                      of p                      ring of source = this rank)
//                                 --DATA_NEXT frame, then the payload as a message of its own, sent from the
//                                   outbox and received into the inbox where it belongs (no copy in either process)
//                                 --DATA_PLACED frame (the pieces of the payload the owner places), then the payload,
//                                   scattered as it lands: those pieces where the owner says (the GPU proxy's far
//                                   copies), the rest into the inbox; the inbox tail steps over the placed pieces
//   outbox head  <--CREDIT frames (p's consumed bytes)----------------------- engine pulls / releases
//   outbox read_done <--READDONE frames (p's RingEnd::setReadDone)----------- engine
//   own region header rs_* --CTRL frames--> mirror header of this rank in p (what peerHeader(this) returns)
//   own region header rc_* --OUT frames (changed words, sent before the CTRL frame)--> the same mirror
//
// Outbox bytes go inside DATA frames of up to 64 KiB (the socket backend's inline size: its caller moves them on the
// control socket). Where the user allows it (max_payload; the GPU proxy, 1 MiB by default), a contiguous run of
// 256 KiB or more goes as DATA_NEXT instead, in one message of up to max_payload that the socket backend spreads
// over its data sockets and helper threads. Such a receiver posts one frame receive at a time (what follows a frame
// is known once it is in) and, as a DATA_NEXT comes in, the payload receive into the inbox, then the next frame's:
// payloads land while the frames after them are read. Over a backend that matches by tag (ofi), payloads carry a tag
// of their own, so frame receives stay posted ahead there, and each payload receive is posted as its frame is
// checked. A payload never crosses the ring's end and lands at the
// sender's ring offset, so both ends have rings of one size (checked at connection: the greeting carries it). The
// host engine sends frames only, and keeps several frame receives posted.
//
// Credit. The outbox's head is not where the local progress thread has read to but the consumer's head as last
// reported: RingEnd::push then admits only bytes the remote inbox has room for, so the progress thread can send
// whatever the outbox holds at once, and the stream position in the outbox equals the one in the inbox (both
// counters start at 0 and are monotonic, like shm's). A CREDIT frame takes effect as it comes in, ahead of the payloads
// from the peer still landing before it in the stream: in order, a full stream each way held every credit back by
// up to a ring of the other direction's payloads.
//
// Order. One connection per direction and peer carries every frame in posting order, and the progress thread
// reads the region header's resynchronization word before it scans the outboxes: a CTRL frame always follows
// every DATA frame the engine pushed before publishing that word. So when a survivor sees a peer at
// "stopped" (elastic.cc), everything that peer pushed toward it is already in its inbox, and discarding the inbox
// (head = tail) drops exactly what the shm version drops.
//
// Failures. A connection error on the receive side (EOF, reset, the backend's stall deadline) makes the peer
// dead for the engine's liveness checks, unless the peer said goodbye first (BYE: it destroyed its communicator
// after sending everything). A send-side error stops sending: the peer closed its end, or, when it is the
// backend's stall deadline (a peer that took no frame and showed no sign of life for EPCOMM_TIMEOUT_MS), the peer
// is dead as well. Every length, channel and stream offset received is checked before use (R5); a violation
// counts as a dead peer.
//
// Threads. Setup (connect) runs on the creating thread; afterwards the net calls of a peer's connections are made
// by one thread at a time: the progress thread, or an engine thread that waits and lends a hand (assist()); or,
// where the owner asks for no progress thread (Progress::kCaller: the GPU proxy), the owner's thread alone. Each
// peer has a lock that the one making its calls holds, so the engine's waiting threads move frames the moment
// there is something to move instead of handing every step to the progress thread (a wake-up, and on a loaded
// machine a scheduling turn, per hop), and threads waiting on different peers move them at once. Otherwise the
// engine touches only ring ends and mirror headers (atomics), and dead(). Where a rank reaches many ranks of other
// hosts (EPCOMM_NET_READINESS, 4 by default), a pass polls the backend's readiness first (NetBackend::openPoller):
// tests of a peer with nothing new then cost no syscall, which at hundreds of peers is most of a pass.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "common/time.h"
#include "epcomm/epcomm.h"
#include "transport/shm/shm.h"

namespace epcomm {

namespace net {
class NetBackend;
}

class NetBridge {
 public:
  // remote[r] != 0: rank r is on another host. own: this rank's region (the inboxes of remote sources live there
  // as for local ones). max_payload: 0, frames only (every rank of the communicator the same); else DATA_NEXT
  // payloads of up to max_payload (and an eighth of the ring) go out, and come in from peers (any size up to an
  // eighth of the ring).
  NetBridge(int rank, int nranks, int nchannels, size_t ring_bytes, size_t max_payload, std::vector<uint8_t> remote,
            ShmRegion* own);
  ~NetBridge();
  NetBridge(const NetBridge&) = delete;
  NetBridge& operator=(const NetBridge&) = delete;

  // Who makes the peers' net calls between operations: the bridge's own progress thread (the host engine: its
  // channel threads only lend a hand while they wait), or the owner alone, through assist() (the GPU proxy, whose
  // thread polls anyway: a second polling thread per rank only took cores from the transport's helpers). With
  // kCaller nothing moves unless the owner calls assist() (until shutdown, which then makes the last pass and the
  // flush on its caller's thread); liveness (dead()) is noticed in those calls too.
  enum class Progress { kOwnThread, kCaller };
  // Listens, exchanges handles through the bootstrap, connects to and accepts every remote peer (each presents
  // the communicator's secret and its rank), then starts the progress thread (kOwnThread).
  epResult_t connect(Bootstrap* bs, int timeout_ms, Progress progress = Progress::kOwnThread);
  // Producer end toward remote rank p on channel ch.
  RingEnd outEnd(int ch, int p) const;
  // Makes `data` (ring bytes, the caller's) the outbox toward p on channel ch instead of the bridge's own; call
  // before connect(). The caller then writes it and moves its tail itself (outCtl), as RingEnd::push would: the
  // GPU proxy's record ring, sent from where the kernels wrote it.
  void useOutboxMemory(int ch, int p, uint8_t* data);
  // Placed payloads: stream bytes that go straight from the sender's outbox into memory of the receiver's choosing
  // instead of into its inbox (the GPU proxy: record payloads into the far copies, with no copy by this process on
  // either side). A run of at least minRunBytes() (up to max_payload) that holds pieces to place goes as one
  // message announced by a DATA_PLACED frame, which lists the pieces; the receiver's backend scatters the message as
  // it lands (NetBackend::irecvScatter; over a backend without it nothing is placed). The sender's owner names the
  // pieces (nextPayload, called by the thread framing the outbox toward `peer`, in stream order), the receiver's
  // owner says where each goes (place); the inbox tail steps over them unwritten once the message is in. Both ends
  // need the hook (a DATA_PLACED frame to a bridge without one ends the connection). Call before connect().
  class Placement {
   public:
    virtual ~Placement() = default;
    // Sender: the first piece to place within stream bytes [from, to) of the outbox toward `peer` (channel 0):
    // true with its stream offset (*at >= from, *at + *len <= to), its size and a key for the receiver.
    virtual bool nextPayload(int peer, uint64_t from, uint64_t to, uint64_t* at, uint32_t* len, uint64_t* key) = 0;
    // Sender: the shortest run worth a message of its own for its pieces (0: this end places nothing, and neither
    // nextPayload nor framed is called).
    virtual size_t minRunBytes() const = 0;
    // Sender: every stream byte toward `peer` before `to` is framed (called after each step of framing, placed or
    // not, so that the owner never has to look at outbox bytes that may have been sent and written over since).
    virtual void framed(int peer, uint64_t to) = 0;
    // Receiver: where `len` bytes with `key` from `peer` go, or nullptr: refused, and they land in the inbox like
    // any stream bytes, for the owner's checks to refuse in stream order (R5). Called as the frame comes in, before
    // the owner has checked the stream bytes ahead of it.
    virtual uint8_t* place(int peer, uint64_t key, uint32_t len) = 0;
    // What the receiving bridge writes into the inbox bytes of a piece it placed (one of Receipt's size or more;
    // nothing else writes them) before the message lands, so that the owner can match what the stream says was
    // placed against what was (R5): a header that claims a placed payload where the bytes came into the inbox
    // (sent unplaced, or refused by place()) finds no receipt of its key and size.
    struct Receipt {
      static constexpr uint32_t kMagic = 0x45505243;  // "EPRC"
      uint64_t key;
      uint32_t len;
      uint32_t magic;
    };
  };
  void usePlacement(Placement* hook);
  RingCtl* outCtl(int ch, int p) const;
  // Outbox bytes toward p on channel ch that the bridge has finished reading (their sends completed), a stream
  // offset: memory of the caller's outbox below it may be written again even before the peer credits it, as long
  // as the tail stays within the credit (head + ring bytes).
  uint64_t outRead(int ch, int p) const;
  // Sends nothing more to p: the progress thread closes the send connection (cancelling what is in flight), after
  // which sendingStopped(p) is true and the outboxes toward p are the caller's again (a dead peer's ring may then
  // be reused without its stale bytes going out).
  void stopSending(int p);
  bool sendingStopped(int p) const;
  // What remote rank p last published in its region header (elastic resynchronization words).
  RegionHeader* mirror(int p) const { return mirrors_[p].get(); }
  // Whether remote rank p is gone (its connection failed without a goodbye); why says how.
  bool dead(int p, std::string* why = nullptr) const;
  // Whether remote rank p said goodbye (it destroyed its communicator): everything it sent is in its inboxes here.
  bool saidGoodbye(int p) const;
  // Stops the progress thread (kCaller: call it once the owner no longer calls assist()). With flush, it first sends
  // what the outboxes toward the ranks `live` names still hold, and a goodbye, for at most timeout_ms; then every
  // connection is closed.
  void shutdown(bool flush, const uint8_t* live, int timeout_ms);
  const char* backendName() const;
  // One pass of progress over the peers whose lock is free (the ones another thread is serving are skipped), from
  // a thread that would otherwise only wait: frames what the outboxes hold and what the inboxes freed, completes
  // and posts sends and receives, applies what arrived. Never waits. True if anything moved. Safe to call from
  // any number of threads at once, until shutdown (then it does nothing).
  bool assist();
  // The state of the connections with remote rank r, one line (sent, framed, credited and read stream offsets per
  // channel, frames queued, requests in flight and the age of the oldest): for a caller whose wait failed. Waits at
  // most 200 ms for the thread making r's net calls, and says so if it is held longer.
  std::string describe(int r);
  // Ring bytes this rank has sent to ranks of other hosts (DATA frame payloads, not frame headers or credits): the
  // sum of sendStats().bytes.
  uint64_t bytesSent() const;
  // How the outbox bytes went out so far, by message kind (diagnostics: EPCOMM_GPU_PROXY_TRACE prints them): DATA
  // frames (payload inside the frame, moved on the control stream by the thread making the net calls), DATA_NEXT and
  // DATA_PLACED payload messages; for each, messages, bytes, and the messages (and their bytes) of at most a frame's
  // payload (64 KiB), which the socket backend also moves on the control stream.
  enum SendKind { kSendFrame, kSendNext, kSendPlaced, kSendKinds };
  struct SendStats {
    uint64_t msgs[kSendKinds], bytes[kSendKinds], small[kSendKinds], small_bytes[kSendKinds];
  };
  SendStats sendStats() const;
  // Time in the backend's calls of the passes, by kind (diagnostics, off until enableCallTiming: a clock read around
  // each call): sends posted, send tests, receives posted (frames and payloads), receive tests, readiness polls.
  enum NetCall { kCallIsend, kCallTestSend, kCallIrecv, kCallTestRecv, kCallPoll, kNetCalls };
  struct CallStats {
    uint64_t calls[kNetCalls];
    int64_t ns[kNetCalls];
  };
  void enableCallTiming() { timing_ = true; }
  CallStats callStats() const;
  // Payload messages (DATA_NEXT, DATA_PLACED), while call timing is on: how many completed and their summed time
  // from posting to the pass that saw them complete, sends [0] and receives [1]. Over an interval, the time summed
  // over the interval is the mean number in flight (Little's law): one, and the transport waits for this side;
  // many, each slow, and this side waits for the transport.
  struct FlightStats {
    uint64_t done[2];
    int64_t ns[2];
  };
  FlightStats flightStats() const;

  // Raw throughput of the net transport toward the ranks r with to[r] (epCommNetRawBandwidth), for benchmarks:
  // collective among those ranks, from the thread that runs the engine's operations, none in flight. Runs `sync`
  // (a barrier of all ranks: every rank has finished its operations), opens connections of its own, set up like
  // the engine's (establish: this rank's listener, the handles exchanged at creation, the secret), registers
  // `window` buffers of msg_bytes per peer and direction, posts the receives, runs `sync` again, then streams
  // bytes_per_peer to every such rank at once in messages of msg_bytes, `window` in flight per peer and direction,
  // this thread driving every send and receive as the progress thread drives the engine's frames; `sync` a third
  // time, then the connections are closed. seconds: from the second sync's return until this rank's last send
  // and last receive completed.
  struct RawResult {
    uint64_t bytes_sent = 0;
    double seconds = 0;
  };
  epResult_t rawStream(const std::vector<uint8_t>& to, size_t bytes_per_peer, size_t msg_bytes, int window,
                       int timeout_ms, const std::function<epResult_t()>& sync, RawResult* out);

 private:
  struct Peer;
  // Connects to and accepts from every rank r with to[r], each connection greeted with the secret and `gen`;
  // send[r]/recv[r] get the comms (on failure all are closed and null).
  epResult_t establish(const std::vector<uint8_t>& to, uint64_t gen, std::vector<void*>& send,
                       std::vector<void*>& recv, int timeout_ms);
  void progressLoop();
  // One pass over the peers whose lock is free (assist(), progressLoop()); after_close: also once shutdown has begun
  // (the progress thread's last pass and flush).
  bool pass(bool after_close);
  // The resynchronization words of this rank's region header, in the order net_bridge.h "Order" needs.
  void readWords(uint64_t* word, uint64_t* words) const;  // words: rs hash, epoch, status|ok, rc_gen
  bool progressPeer(Peer& p, uint64_t word, const uint64_t* words);
  bool pumpSends(Peer& p);
  bool pumpRecvs(Peer& p);
  bool payloadsIn() const;  // a peer may send DATA_NEXT or DATA_PLACED payloads
  bool framesAhead() const;  // ... and frame receives stay posted ahead of them all the same (pumpRecvs)
  void checkFrame(Peer& p, const uint8_t* buf, size_t n);
  void applyFrame(Peer& p, const uint8_t* buf, size_t n);
  void queueFrame(Peer& p, uint16_t type, uint16_t ch, const uint64_t* v, uint32_t len,
                  std::vector<uint8_t>* body = nullptr);
  bool placeIov(Peer& p, int ch, uint64_t off, uint64_t len, const uint8_t* segs, size_t bytes);
  void markDead(Peer& p, const char* what);
  void watch(Peer& p);  // reports a request pending for half of EPCOMM_TIMEOUT_MS on a connection not failed
  std::string describeLocked(const Peer& p) const;

  int rank_, nranks_, nchan_;
  size_t ring_bytes_;
  size_t max_payload_;  // largest DATA_NEXT payload this rank sends; 0: frames only, both ways
  Placement* placement_ = nullptr;  // see usePlacement
  std::vector<uint8_t> remote_;
  ShmRegion* own_;
  net::NetBackend* backend_ = nullptr;
  void* listen_ = nullptr;
  void* poller_ = nullptr;  // readiness of the peers' receive comms (NET_READINESS), or null
  uint8_t secret_[kSecretBytes] = {};
  std::vector<std::unique_ptr<Peer>> peers_;         // [R], null for ranks of this host
  std::vector<std::unique_ptr<RegionHeader>> mirrors_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> flush_{false};
  std::atomic<bool> closed_{true};  // not connected yet, or shutdown has begun: assist() does nothing
  bool driven_ = false;             // connected, not yet shut down (the progress thread runs, or the owner drives)
  bool timing_ = false;  // enableCallTiming
  std::atomic<uint64_t> call_n_[kNetCalls] = {};
  std::atomic<int64_t> call_ns_[kNetCalls] = {};
  std::atomic<uint64_t> flight_n_[2] = {};  // flightStats
  std::atomic<int64_t> flight_ns_[2] = {};
  void flown(int dir, int64_t posted_ns) {  // a payload send (0) or receive (1) posted at posted_ns completed
    if (!timing_) return;
    flight_ns_[dir].fetch_add(nowNs() - posted_ns, std::memory_order_relaxed);
    flight_n_[dir].fetch_add(1, std::memory_order_relaxed);
  }
  // f() (a backend call of kind k), timed where enableCallTiming asked for it.
  template <class F>
  epResult_t timed(NetCall k, F&& f) {
    if (!timing_) return f();
    const int64_t t0 = nowNs();
    const epResult_t r = f();
    call_ns_[k].fetch_add(nowNs() - t0, std::memory_order_relaxed);
    call_n_[k].fetch_add(1, std::memory_order_relaxed);
    return r;
  }
  std::atomic<uint64_t> sent_msgs_[kSendKinds] = {}, sent_bytes_[kSendKinds] = {}, sent_small_[kSendKinds] = {},
                        sent_small_bytes_[kSendKinds] = {};
  std::vector<uint8_t> flush_live_;
  int64_t flush_start_ns_ = 0, flush_deadline_ns_ = 0;
  int64_t stuck_ns_ = 15000000000LL;  // watch(): half of EPCOMM_TIMEOUT_MS
  uint64_t raw_gen_ = 0;  // rawStream calls (the greeting of its connections carries it)
};

}  // namespace epcomm
