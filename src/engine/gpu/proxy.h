// The GPU engine's proxy: what this rank's kernels write for ranks of other hosts, carried over the net transport,
// and what those ranks' kernels wrote for this one, stored into this rank's buffers (common/gpu_remote.h has the
// record format and the rules the kernels keep).
//
//   out: ring[r] (pinned host memory the kernels write) --records in order--> NetBridge outbox toward r
//   in:  NetBridge inbox from q (host memory) --> LL buffer: stored by this thread into the buffer's far copy
//        (pinned host memory the kernels read for every word a rank of another host writes; no CUDA call)
//                                             --> HT buffer: payloads into pinned staging, then the apply step
//        (copy engines: the DATA copies of a batch, then its FLAG words, on the proxy's stream)
//
// The far copy is why LL across hosts does not depend on the CUDA driver while kernels wait: a CUDA call of this
// thread can block behind the application's own, e.g. a kernel's first launch under lazy module loading
// (CUDA_MODULE_LOADING=LAZY, the default), which waits for the running kernels, which wait for this thread.
// Records are applied in stream order across both buffers (a FLAG in one may cover DATA in the other).
//
// One thread per communicator does both. It keeps no per-operation state: only how far it has read each ring and
// each inbox, so captured graphs replay across hosts. Every record received is checked before use (R5): a type it
// does not know, a buffer this rank lacks, a range past the buffer's end, or a size past the limit end the
// stream from that rank (logged); the kernels waiting for it then end at their deadline. Records toward a rank the
// bridge found dead are dropped, so that the rings never stall on it (elastic ranks mask it).
//
// The proxy itself touches no CUDA API: what it needs from the GPU (pinned memory the device can reach, device
// memory, the apply step) comes through ProxyDevice, so that the CPU tests run the very same proxy over host memory
// (hostProxyDevice) and CI checks the protocol without a GPU.
#pragma once
#include <atomic>
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
  // Before any operation, on the creating thread: what the apply step needs (its stream).
  virtual epResult_t prepare() = 0;
  // The proxy thread's first call (device selection, capture mode).
  virtual void threadStart() = 0;
  // Stores a batch (host arrays: copies from pinned host memory, then flags; a flag is seen only after every copy
  // of its batch and of earlier ones); complete when it returns.
  virtual epResult_t apply(const ProxyCopy* copies, int ncopies, const ProxyFlag* flags, int nflags) = 0;
};
// The GPU engine's (proxy_cuda.cc); nullptr in a build without CUDA.
std::unique_ptr<ProxyDevice> cudaProxyDevice(int device);
// Plain host memory for both sides, memcpy and release stores for apply: the CPU tests' device.
std::unique_ptr<ProxyDevice> hostProxyDevice();

class GpuProxy {
 public:
  // remote[r] != 0: rank r is on another host.
  GpuProxy(int rank, int nranks, std::vector<uint8_t> remote, std::unique_ptr<ProxyDevice> device);
  ~GpuProxy();
  GpuProxy(const GpuProxy&) = delete;
  GpuProxy& operator=(const GpuProxy&) = delete;

  // Allocates the rings and the device table, connects to every remote rank through the bootstrap (collective:
  // every rank of the communicator calls it) and starts the thread. bufs: this rank's buffers by GpuRemoteBuffer
  // (nullptr / 0 for one it lacks).
  epResult_t start(Bootstrap* bs, uint8_t* const bufs[kRemoteNumBuffers], const size_t bytes[kRemoteNumBuffers],
                   int timeout_ms);
  const GpuRemote* table() const { return table_dev_; }  // device memory, for the kernels' parameters
  // The far copy of buffer b (device address; host address with host=true): where what ranks of other hosts write
  // into b lands, at the same offsets. nullptr for a buffer stored in place (the HT buffer).
  uint8_t* farCopy(GpuRemoteBuffer b, bool host = false) const { return host ? far_host_[b] : far_dev_[b]; }
  // Stops the thread. With flush, it first forwards what the rings hold and lets the bridge send it, for at most
  // timeout_ms (call after this rank's kernels have ended); live[r] names the ranks still worth sending to.
  void stop(bool flush, const uint8_t* live, int timeout_ms);
  // Why the stream from or to rank r ended, or false while it flows.
  bool failed(int r, std::string* why) const;
  size_t ringBytes() const { return ring_bytes_; }

 private:
  struct Out {
    uint8_t* ring = nullptr;  // host address of the ring
    uint64_t pos = 0;         // consumed so far (== *consumed)
    uint64_t pushed = 0;      // bytes of the record at pos already in the outbox
    bool broken = false;      // a malformed record (a bug): nothing more is forwarded
  };
  struct In {
    uint64_t parsed = 0;  // bytes past the inbox's head already stored or turned into copies of the batch
    bool bad = false;     // a record failed its checks: nothing more is applied from this rank
  };
  void loop();
  bool pumpOut(int r);
  bool gatherIn(int q);
  bool applyBatch();
  void refuse(int q, const char* what);
  void noteFailure(int r, const char* what);  // the first reason the stream with r ended (failed() reports it)

  int rank_, nranks_;
  std::vector<uint8_t> remote_;
  std::unique_ptr<ProxyDevice> dev_;
  size_t ring_bytes_ = 0, inbox_bytes_ = 0;
  uint8_t* bufs_[kRemoteNumBuffers] = {};
  size_t buf_bytes_[kRemoteNumBuffers] = {};
  uint8_t* far_host_[kRemoteNumBuffers] = {};  // far copies (pinned, mapped), see farCopy()
  uint8_t* far_dev_[kRemoteNumBuffers] = {};
  std::vector<Out> out_;
  std::vector<In> in_;
  uint64_t* consumed_ = nullptr;  // [R] host-mapped: what the proxy took from each ring
  unsigned long long* reserved_dev_ = nullptr;  // [R] device memory: the kernels' reservations
  GpuRemote* table_dev_ = nullptr;
  ShmRegion inbox_;                  // the bridge's inboxes (private to this process)
  std::unique_ptr<NetBridge> bridge_;
  // A batch: copies and flags for the apply step, and the payloads they copy (pinned).
  ProxyCopy* copies_ = nullptr;
  ProxyFlag* flags_ = nullptr;
  uint8_t* staging_ = nullptr;
  // What moved (EPCOMM_GPU_PROXY_TRACE prints it while the proxy runs).
  uint64_t recs_out_ = 0, recs_in_ = 0, batches_ = 0;
  void trace();
  size_t staging_bytes_ = 0, staged_ = 0;
  int ncopies_ = 0, nflags_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::vector<std::string> why_;  // per rank: why its stream was refused (guarded by a mutex in proxy.cc)
};

}  // namespace epcomm
