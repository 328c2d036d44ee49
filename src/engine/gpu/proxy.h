// The GPU engine's proxy: what this rank's kernels write for ranks of other hosts, carried over the net transport,
// and what those ranks' kernels wrote for this one, stored into this rank's buffers (common/gpu_remote.h has the
// record format and the rules the kernels keep).
//
//   out: ring[r] (pinned host memory the kernels write), which is the NetBridge's outbox toward r: the proxy moves
//        its tail over whole records in order (within r's credit), the bridge sends from it, and the kernels get
//        ring room back (`consumed`) as those sends complete (NetBridge::outRead), so no byte is copied on this
//        side and the ring and r's inbox are two stages of the pipeline
//   in:  NetBridge inbox from q (host memory, the bridge receives into it) --records in order--> the far copy of
//        the record's buffer (pinned host memory, mapped: the kernels read there every word a rank of another
//        host writes). With EPCOMM_GPU_PROXY_PLACE (4096 by default), DATA payloads of 2 KiB or more skip the
//        inbox: the sending proxy names them to its bridge (NetBridge::Placement), which sends their run as one
//        message that the receiving net transport scatters as it lands, those payloads straight into the far copy
//        at offsets the receiving proxy checked; their headers (PLACED) still pass through the inbox in order, so
//        the FLAGs after them keep their meaning, and each must find the bridge's receipt of its placement where
//        its payload would stand in the inbox (a PLACED header whose payload was not placed ends the stream)
//
// Placed payloads are stored as they land, ahead of the in-order checks of the records before them: a record the
// proxy refuses ends what is placed from that rank after it only from the runs that arrive once it has refused it
// (place() then says no), so a payload placed in the same run may already be in the far copy. place() checks every
// piece's bounds, so nothing lands outside a buffer; a rank whose stream is refused is broken, and its kernels'
// waits end at their deadline. Placed bytes may also still land after the proxy stopped storing (stop(), or a peer
// the bridge found dead with a receive posted): the connections close before the far copies are freed.
//
// Storing is a copy with streaming stores (DATA not placed: common/stream_copy.h, the far copies are never read by
// this CPU; fenced before the next FLAG) or a release store (FLAG) by this thread, in stream order: the proxy makes
// no CUDA call while kernels run. One would block behind the application's own, e.g. a kernel's first launch under lazy
// module loading (CUDA_MODULE_LOADING=LAZY, the default), which waits for the running kernels, which may be
// waiting for this very thread; copy engines also store a batch's copies in any order. The far copies cost pinned
// host memory as large as the HT and LL buffers, on ranks that have peers on other hosts only.
//
// One thread per communicator does both, and, where the rank reaches few ranks of other hosts, makes the bridge's
// net calls too (NetBridge::Progress::kCaller: no progress thread of the bridge's own; EPCOMM_GPU_PROXY_NET_THREAD).
// There a second polling thread per rank only took cores from the net transport's helper threads (on a 16-core
// host, one peer: 10.3 against 12.5 GB/s, 0.80 against 0.58 ns of CPU time per byte); with 7 peers one thread was
// slower (bench/results/cpu-proxy-s19.log). It keeps no per-operation state: only how far it has read each ring and
// each inbox, so captured graphs replay across hosts. Every record received is checked before use (R5): a type it
// does not know, a buffer this rank lacks, a range past the buffer's end, or a size past the limit end the stream
// from that rank (logged); the kernels waiting for it then end at their deadline. Records toward a rank the bridge
// found dead are dropped, so that the rings never stall on it (elastic ranks mask it): the bridge first closes the
// connection toward it, so that none of the ring's bytes go out once the kernels may write them again.
//
// The proxy itself touches no CUDA API: what it needs from the GPU (pinned memory the device can reach, device
// memory, set up before the thread starts) comes through ProxyDevice, so that the CPU tests run the very same
// proxy over host memory (hostProxyDevice) and CI checks the protocol without a GPU.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "common/gpu_remote.h"
#include "epcomm/epcomm.h"
#include "transport/bridge/net_bridge.h"
#include "transport/shm/shm.h"

namespace epcomm {

class ProxyDevice {
 public:
  virtual ~ProxyDevice() = default;
  // Host memory the device reads and writes (pinned, mapped), zeroed; *dev is its device address.
  virtual epResult_t allocMapped(size_t bytes, void** host, void** dev) = 0;
  virtual void freeMapped(void* host) = 0;
  // Device memory, zeroed.
  virtual epResult_t allocDevice(size_t bytes, void** dev) = 0;
  virtual void freeDevice(void* dev) = 0;
  virtual epResult_t upload(void* dev, const void* src, size_t bytes) = 0;
  virtual epResult_t download(void* dst, const void* dev, size_t bytes) = 0;
};
// The GPU engine's (proxy_cuda.cc); nullptr in a build without CUDA.
std::unique_ptr<ProxyDevice> cudaProxyDevice(int device);
// Plain host memory for both sides: the CPU tests' device.
std::unique_ptr<ProxyDevice> hostProxyDevice();

// The rings' and inboxes' size where EPCOMM_GPU_PROXY_RING_BYTES is unset: 8 MiB up to 64 ranks, then halved as
// the communicator doubles, down to 1 MiB (4 MiB at 128 ranks, 2 MiB at 256). A rank holds a ring (pinned) and an
// inbox per rank of another host: at 256 ranks 8 MiB each would be about 4 GiB of host memory per rank, half of it
// pinned, 32 GiB on an 8-GPU host; 2 MiB makes it about 1 GiB. Every rank derives the same size (the bridge refuses
// rings of different sizes).
size_t gpuProxyDefaultRingBytes(int nranks);

class GpuProxy final : private NetBridge::Placement {
 public:
  // remote[r] != 0: rank r is on another host.
  GpuProxy(int rank, int nranks, std::vector<uint8_t> remote, std::unique_ptr<ProxyDevice> device);
  ~GpuProxy();
  GpuProxy(const GpuProxy&) = delete;
  GpuProxy& operator=(const GpuProxy&) = delete;

  // Allocates the rings, the far copies and the device table, connects to every remote rank through the bootstrap
  // (collective: every rank of the communicator calls it) and starts the thread. bytes: the size of this rank's
  // buffers by GpuRemoteBuffer (0 for one it lacks).
  epResult_t start(Bootstrap* bs, const size_t bytes[kRemoteNumBuffers], int timeout_ms);
  const GpuRemote* table() const { return table_dev_; }  // device memory, for the kernels' parameters
  // The far copy of buffer b (device address; host address with host=true): where what ranks of other hosts write
  // into b lands, at the same offsets. nullptr for a buffer this rank lacks.
  uint8_t* farCopy(GpuRemoteBuffer b, bool host = false) const { return host ? far_host_[b] : far_dev_[b]; }
  // Stops the thread. With flush, it first forwards what the rings hold and lets the bridge send it, for at most
  // timeout_ms (call after this rank's kernels have ended); live[r] names the ranks still worth sending to.
  void stop(bool flush, const uint8_t* live, int timeout_ms);
  // Why the stream from or to rank r ended, or false while it flows.
  bool failed(int r, std::string* why) const;
  // The state of the stream with remote rank r (this proxy's and the bridge's), one line: for a caller whose wait
  // failed.
  std::string describe(int r);
  size_t ringBytes() const { return ring_bytes_; }
  // Payload bytes from ranks of other hosts that the net transport placed into the far copies (EPCOMM_GPU_PROXY_PLACE).
  uint64_t placedBytes() const { return placed_.load(std::memory_order_relaxed); }
  // How this rank's records went out so far: frames, DATA_NEXT and DATA_PLACED payload messages (net_bridge.h).
  NetBridge::SendStats sendStats() const { return bridge_->sendStats(); }
  // Bytes of records forwarded to the net transport so far (epCommGetNetBytes; header and padding included, SKIPs
  // not). Waits first, at most wait_ms, until the proxy has taken every record the kernels reserved: called after
  // the operations' streams completed, the count then includes them.
  epResult_t bytesForwarded(uint64_t* bytes, int wait_ms);
  // The bridge's raw stream (net_bridge.h rawStream) toward the ranks in `to`; sync is a barrier of all ranks.
  epResult_t rawStream(const std::vector<uint8_t>& to, size_t bytes_per_peer, size_t msg_bytes, int window,
                       int timeout_ms, const std::function<epResult_t()>& sync, uint64_t* bytes_sent, double* seconds);

 private:
  struct Out {
    uint8_t* ring = nullptr;  // host address of the ring, which is also the bridge's outbox toward the rank
    uint64_t pos = 0;         // taken so far: the whole records before it are the outbox's (atomic access)
    uint64_t scan = 0;        // the first record not yet framed whole (nextPayload, framed: the framing thread's)
    bool broken = false;      // a malformed record (a bug): nothing more is forwarded
    bool dropping = false;    // the rank is dead: records are dropped once the bridge stopped sending to it
  };
  // Per source rank: a record failed its checks, nothing more is stored from it (set by the thread that stores
  // the inboxes, read by place() on the thread that receives).
  std::unique_ptr<std::atomic<bool>[]> in_bad_;
  void loop();
  // NetBridge::Placement: DATA payloads of kMinPlacedBytes or more go straight from the ring into the receiver's far
  // copy (EPCOMM_GPU_PROXY_PLACE).
  bool nextPayload(int peer, uint64_t from, uint64_t to, uint64_t* at, uint32_t* len, uint64_t* key) override;
  uint8_t* place(int peer, uint64_t key, uint32_t len) override;
  size_t minRunBytes() const override { return place_min_run_; }
  void framed(int peer, uint64_t to) override;
  // Consumer end of the bridge's inbox from rank q (channel 0), as bridge_->outEnd(0, r) is the outbox's.
  RingEnd inEnd(int q) const { return RingEnd(inbox_.ringCtl(q, 0), inbox_.ringData(q, 0), inbox_bytes_); }
  bool pumpOut(int r);
  bool storeIn(int q, size_t* budget);
  // storeIn over the inboxes in turn (the first one rotates per call), until `budget` bytes of records are stored.
  bool storeInboxes(size_t budget);
  void refuse(int q, const char* what);
  void noteFailure(int r, const char* what);  // the first reason the stream with r ended (failed() reports it)

  int rank_, nranks_;
  std::vector<uint8_t> remote_;
  std::unique_ptr<ProxyDevice> dev_;
  size_t ring_bytes_ = 0, inbox_bytes_ = 0;
  bool stream_stores_ = true;  // DATA goes into the far copies with streaming stores (EPCOMM_GPU_PROXY_STREAM_STORES)
  size_t place_min_run_ = 0;   // runs this long or longer place their DATA payloads (EPCOMM_GPU_PROXY_PLACE; 0: off)
  size_t buf_bytes_[kRemoteNumBuffers] = {};
  uint8_t* far_host_[kRemoteNumBuffers] = {};  // far copies (pinned, mapped), see farCopy()
  uint8_t* far_dev_[kRemoteNumBuffers] = {};
  std::vector<Out> out_;
  int in_first_ = 0;  // the inbox a turn of the loop stores from first (each turn the next: fair under the budget)
  bool drives_bridge_ = false;  // this proxy's thread makes the bridge's net calls (no bridge thread)
  uint64_t* consumed_ = nullptr;  // [R] host-mapped: what the proxy took from each ring
  unsigned long long* reserved_dev_ = nullptr;  // [2R] device memory: the kernels' reservations, then the largest
                                                // consumed counts they read (GpuRemoteRing::seen)
  GpuRemote* table_dev_ = nullptr;
  ShmRegion inbox_;                  // the bridge's inboxes (private to this process)
  std::unique_ptr<NetBridge> bridge_;
  // What moved (EPCOMM_GPU_PROXY_TRACE prints it while the proxy runs).
  uint64_t recs_out_ = 0, recs_in_ = 0;
  int64_t busy_ns_[3] = {}, busy_since_ = 0;  // time in turns that moved: rings, net calls, inboxes (this thread's)
  std::atomic<uint64_t> forwarded_{0};  // record bytes pushed into the bridge's outboxes
  std::atomic<uint64_t> placed_{0};     // see placedBytes()
  NetBridge::CallStats calls_seen_{};  // the bridge's call times at the last trace line
  NetBridge::FlightStats flights_seen_{};  // and its payloads' times in flight
  // Per rank of another host, sampled once a turn while tracing: outbox bytes taken and not yet credited by the
  // receiver (the credit loop's window in use), turns it was within an eighth of full, inbox bytes landed and not
  // yet stored (this side's backlog).
  struct Occupancy {
    uint64_t turns = 0, near_full = 0;
    double out_used = 0, in_avail = 0;
  };
  std::vector<Occupancy> occ_;
  void sampleOccupancy();
  void trace();
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::vector<std::string> why_;  // per rank: why its stream was refused (guarded by a mutex in proxy.cc)
};

}  // namespace epcomm
