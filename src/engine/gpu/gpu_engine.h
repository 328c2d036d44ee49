// The GPU engine: every operation on the GPUs of one or more hosts. Within a host the ranks' communication buffers
// are shared with CUDA IPC; toward ranks of other hosts the kernels write records that a proxy thread carries
// over the net transport (proxy.h, common/gpu_remote.h). Launch planning and host-side checks only; per-operation
// state lives in device memory (common/gpu_layout.h), so nothing here runs between the kernels of captured
// operations. One file per operation family: gpu_engine.cc (creation, shared parameters, error polling), ht.cc
// (layout, HT), ll.cc (LL dispatch/combine), alltoallv.cc, elastic.cc, registry.cc; proxy.cc; kernels in kernels/.
#pragma once
#include <memory>
#include <vector>

#include "engine/comm.h"
#include "engine/engine.h"
#include "common/gpu_layout.h"
#include "engine/gpu/proxy.h"
#include "transport/ipc/ipc.h"

namespace epcomm {

int gpuDeviceCount();
epResult_t checkAligned(const void* p, const char* name);  // 16-byte alignment of a row buffer
inline cudaStream_t streamOf(epStream_t s) { return reinterpret_cast<cudaStream_t>(s); }  // CUDA devices visible to this process (0 without a driver)
std::unique_ptr<Engine> makeGpuEngine(epComm* comm);

class GpuEngine final : public Engine {
 public:
  explicit GpuEngine(epComm* comm) : comm_(comm) {}
  ~GpuEngine() override;
  epResult_t init() override;
  bool hostMemory() const override { return false; }
  size_t maxRowBytes() const override { return lay_.x_stride; }

  epResult_t handleInit(epHtHandle* h) override;
  void handleFree(epHtHandle* h) override;
  epResult_t layout(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* per_rank,
                    int* per_expert, uint8_t* in_rank, epStream_t stream) override;
  epResult_t htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                      int* per_expert_host, epStream_t stream) override;
  epResult_t htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) override;
  epResult_t llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t stream) override;
  epResult_t alltoallv(const void*, const size_t*, const size_t*, void*, const size_t*, const size_t*, size_t,
                       epResult_t local, epStream_t) override;
  epResult_t alltoallvDevice(const void*, const int64_t*, void*, size_t, int64_t*, int64_t*, size_t,
                             epResult_t local, epStream_t) override;
  epResult_t llCombineBuffer(void** y, size_t* bytes) override;
  epResult_t llDispatchBuffer(void** x, size_t* x_bytes, float** scales, size_t* scales_bytes) override;
  epResult_t htCombineBuffer(void** x, size_t* bytes) override;
  epResult_t barrier(epStream_t stream) override;
  epResult_t registerMemory(void* ptr, size_t bytes, epResult_t local, int* slot) override;
  epResult_t deregisterMemory(int slot) override;
  epResult_t setActiveRanks(const uint8_t* active, epStream_t stream) override;
  epResult_t setActiveRanksRejected(epResult_t local, epStream_t stream) override;
  bool llReceivePending() const override { return ll_sent_[0] != ll_recvd_[0] || ll_sent_[1] != ll_recvd_[1]; }
  epResult_t maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t stream) override;
  epResult_t netBytesSent(uint64_t* bytes) override;
  epResult_t netRawBandwidth(size_t bytes_per_peer, size_t msg_bytes, int window, uint64_t* bytes_sent,
                             double* seconds) override;
  void abort() override;
  void pollAsyncError() override;
  // Combines whose x the owners read in place through implicit registration (tests and diagnostics).
  uint64_t implicitCombines() const { return auto_used_; }

 private:
  HtParams baseParams(int op) const;
  LlParams llParams(int op) const;
  template <typename Args>
  LlParams llParams(int op, const Args& a) const;
  epResult_t llLaunch(int family, unsigned phases, const LlParams& p, epStream_t stream);
  bool llChain(cudaStream_t s);
  epResult_t llCheck(int family, unsigned phases, int num_experts, int hidden, int dtype, int topk) const;
  epResult_t initLl();
  HtParams dispatchParams(int op, const epHtDispatchArgs_t* a, const GpuHandleDev& h) const;
  epResult_t checkLaunch(cudaError_t e, const char* what);
  // Elastic ranks (elastic.cc): the survivors' rendezvous, and the check that a handle's layout predates no mask
  // change.
  epResult_t elasticSync(int kind, uint64_t mask, uint64_t round, cudaStream_t s, const char* what);
  cudaError_t launchSync(int kind, uint64_t mask, uint64_t publish_to, uint64_t round, bool wait, cudaStream_t s);
  epResult_t checkHandleMask(const epHtHandle* h, const char* what) const;
  epResult_t initElastic();
  // Registered memory (registry.cc): the host-side exchange among the active ranks, and the region holding
  // [x, x + bytes) of this rank (its slot and x's offset in it), or -1.
  epResult_t regExchange(const GpuRegEntry& mine, std::vector<GpuRegEntry>* all, const char* what);
  int regionOf(const void* x, size_t bytes, uint64_t* off) const;
  // Implicit registration of a plain pull combine's x (registry_implicit.cc). Never waits for a peer and never
  // fails a call: whatever goes wrong leaves the combine copying x, as without it.
  epResult_t initImplicitRegistry();
  void implicitImport();                                          // map the peers' new slots, acknowledge them
  int implicitSlot(const void* x, size_t bytes, uint64_t* off);   // x's table row once every owner maps it, or -1
  void implicitUsed(int slot, cudaStream_t s, bool launched);     // after the combine that reads slot's rows
  bool implicitWaiting() const;                                   // a slot waits for acknowledgements

  epComm* comm_;
  // Ranks of other hosts (their buffers are not mapped; the proxy carries what is meant for them), as a vector
  // and as the kernels' mask. Without any, no proxy exists.
  std::vector<uint8_t> remote_;
  uint64_t remote_mask_ = 0;
  // Hierarchical HT dispatch across hosts (HtParams::hier): on when ranks span hosts of at most kGpuHierMaxLocal
  // ranks each, unless EPCOMM_HT_HIERARCHICAL=0. Hosts numbered by their lowest rank.
  bool ht_hier_ = false;
  bool ht_fwd_spread_ = true;  // EPCOMM_GPU_HT_FWD_SPREAD: the forwarder moves with the channel
  bool ht_hier_combine_ = false;  // EPCOMM_GPU_HT_COMBINE_HIER (with ht_hier_): one partial sum per token and host
  int nhosts_ = 1, my_host_ = 0;
  std::vector<uint8_t> host_of_, local_of_;
  std::vector<uint64_t> host_ranks_;
  std::unique_ptr<GpuProxy> proxy_;
  bool aborted_ = false;
  int device_ = 0;
  int blocks_ = 24;
  GpuBufferLayout lay_{};
  IpcBuffers bufs_;
  GpuErrorRecord* err_host_ = nullptr;  // host-mapped
  GpuErrorRecord* err_dev_ = nullptr;
  GpuErrorClaims* claims_ = nullptr;   // device memory
  uint64_t violations_seen_ = 0;
  // Elastic ranks: the device-side mask and drop counters, the mask as this host last set it, how many masks
  // that masked someone new were set (HT handles filled before are stale), and the survivors' sync rounds.
  GpuElastic* el_dev_ = nullptr;
  bool ht_pull_ = true;  // HT combine pulls from the peers' buffers (EPCOMM_GPU_HT_COMBINE_PULL)
  bool ht_pull_dispatch_ = true;  // HT dispatch receivers pull from the senders' buffers (EPCOMM_GPU_HT_DISPATCH_PULL)
  uint64_t active_mask_ = 0;
  uint64_t mask_gen_ = 0;
  uint64_t elastic_round_ = 0;  // rounds of epCommSetActiveRanks: two per call on every survivor, failed or not
  uint64_t barrier_round_ = 0;  // rounds of the barrier among survivors
  int* sync_disagree_ = nullptr;       // host-mapped, and its device address
  int* sync_disagree_dev_ = nullptr;
  GpuResyncOut* resync_out_ = nullptr;  // host-mapped, and its device address
  GpuResyncOut* resync_out_dev_ = nullptr;
  // LL: a second buffer (present when config.ll_max_tokens_per_rank > 0), its fixed grid, and the halves this
  // rank issued per family (host-side call-order checks only; the kernels never read them).
  IpcBuffers ll_bufs_;
  LlLayout ll_lay_{};
  int ll_blocks_ = 0, ll_default_blocks_ = 1;
  int gpu_sharing_ = 1;  // ranks of this communicator on this rank's GPU
  bool ll_pdl_ = false, ll_fused_ = false, ll_pdl_chain_ = false;
  bool ll_stream_seen_ = false;
  cudaStream_t ll_stream_ = nullptr;  // the one stream of every LL launch so far, while chaining (llChain)
  int gpu_sms_ = 1;
  uint64_t ll_sent_[2] = {0, 0}, ll_recvd_[2] = {0, 0};
  bool ll_zero_copy_ = false;  // a zero-copy region was handed out: dispatch receives guard its reuse
  int ll_recv_zero_copy_ = 0;  // the mode of the combine whose receive half is outstanding
  int ll_recv_zd_ = 0;         // whether the dispatch whose receive half is outstanding is zero-copy
  uint8_t* zdRegion(int i) const;
  epResult_t zeroCopyDispatch(const epLlDispatchArgs_t& a, LlParams& p) const;
  // Registered memory: the device table the kernels read, this rank's part of each slot, the peer allocations
  // mapped for them (mapped[r], to close), the exchange's rounds and its stream (no wait on the caller's work).
  struct Region {
    bool used = false;
    const uint8_t* ptr = nullptr;
    size_t bytes = 0;
    uint64_t gen = 0;  // which registration holds the slot (handles name it)
    std::vector<void*> mapped;
  };
  GpuRegion* regions_dev_ = nullptr;
  Region regions_[kGpuMaxRegions];
  uint64_t reg_round_ = 0, reg_gen_ = 0;
  cudaStream_t reg_stream_ = nullptr;
  IpcMappings reg_maps_;
  // Implicit registration (EPCOMM_GPU_HT_AUTO_REGISTER): this rank's slots, the peers' slots as this rank mapped
  // them ([r * kGpuAutoRegions + j]), the host-mapped mirror the begin kernels fill, and its device address.
  struct AutoSlot {
    enum State { kFree, kPending, kReady, kRefused } state = kFree;
    uint64_t gen = 0;
    cudaIpcMemHandle_t handle{};
    const uint8_t* base = nullptr;
    size_t bytes = 0;
    uint64_t acked = 0;      // owners whose acknowledgement of gen this rank saw
    uint64_t last_use = 0;   // call count, for least-recently-used replacement
    cudaEvent_t done = nullptr;  // recorded after the last combine that read the slot
    bool pinned = false;         // a combine's end or that record failed: never replaced
  };
  struct AutoImport {
    uint64_t gen = 0;
    void* mapped = nullptr;
  };
  bool auto_reg_ = false;
  AutoSlot auto_slots_[kGpuAutoRegions];
  std::vector<AutoImport> auto_imports_;
  std::vector<uint64_t> auto_latest_;      // [r]: the latest gen of rank r's table this rank handled
  std::vector<GpuAutoTable> auto_table_;   // two host copies of a peer's table (compared: a torn read differs)
  GpuAutoMirror* auto_mirror_ = nullptr;
  GpuAutoMirror* auto_mirror_dev_ = nullptr;
  uint64_t auto_gen_ = 0, auto_calls_ = 0, auto_used_ = 0, auto_replaced_ = 0;
};

}  // namespace epcomm
