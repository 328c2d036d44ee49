// GPU engine, elastic ranks: the active-ranks mask in device memory (every kernel reads it when it runs, so a
// captured graph replays under the newest mask), the drop counters, and epCommSetActiveRanks' resynchronization
// of the survivors (kernels/elastic.cu).
#include <cstring>

#include "common/checks.h"
#include "engine/gpu/gpu_engine.h"
#include "kernels/elastic.h"

namespace epcomm {
namespace {

// These calls synchronize the device and launch on it: make it this communicator's device for their duration
// (a process may drive several GPUs, e.g. a torch backend with one communicator per device).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

}  // namespace

epResult_t GpuEngine::initElastic() {
  const int R = comm_->nranks;
  active_mask_ = R >= 64 ? ~0ull : (1ull << R) - 1;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&el_dev_), sizeof(GpuElastic));
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaMalloc of the elastic state: %s", cudaGetErrorString(e));
  GpuElastic init{};
  init.active = active_mask_;
  e = cudaMemcpy(el_dev_, &init, sizeof(init), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "initializing the elastic state: %s", cudaGetErrorString(e));
  e = cudaHostAlloc(reinterpret_cast<void**>(&sync_disagree_), sizeof(int), cudaHostAllocMapped);
  if (e == cudaSuccess) e = cudaHostAlloc(reinterpret_cast<void**>(&resync_out_), sizeof(GpuResyncOut), cudaHostAllocMapped);
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&sync_disagree_dev_), sync_disagree_, 0);
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&resync_out_dev_), resync_out_, 0);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostAlloc: %s", cudaGetErrorString(e));
  *sync_disagree_ = 0;
  memset(resync_out_, 0, sizeof(GpuResyncOut));
  return epSuccess;
}

epResult_t GpuEngine::checkHandleMask(const epHtHandle* h, const char* what) const {
  EP_REQUIRE(h->mask_gen == mask_gen_, epInvalidUsage,
             "%s: the handle's layout was computed before epCommSetActiveRanks masked a rank; dispatch again "
             "without EP_HT_USE_HANDLE_LAYOUT (or notify again) to refill it",
             what);
  return epSuccess;
}

// The sync kernel with this rank's buffers: publishes to publish_to, then (wait) waits for the ranks in mask.
cudaError_t GpuEngine::launchSync(int kind, uint64_t mask, uint64_t publish_to, uint64_t round, bool wait,
                                  cudaStream_t s) {
  // Twice the deadline: a survivor may come up to one deadline late (its failed kernels end at theirs).
  HtParams p = baseParams(epOpBarrier);
  p.timeout_ns *= 2;
  const LlCtrl* ll_ctrl = ll_lay_.total > 0 ? static_cast<const LlCtrl*>(ll_bufs_.local()) : nullptr;
  return launchElasticSync(p, ll_ctrl, kind, mask, publish_to, round, wait, sync_disagree_dev_, s);
}

// One rendezvous of the ranks in `mask` on the device (entries of `kind`, round `round`); every one of them must
// come within the deadline and hold the same mask.
epResult_t GpuEngine::elasticSync(int kind, uint64_t mask, uint64_t round, cudaStream_t s, const char* what) {
  *reinterpret_cast<volatile int*>(sync_disagree_) = 0;
  EPCHECK(checkLaunch(launchSync(kind, mask, mask, round, true, s), "the elastic sync kernel"));
  cudaError_t e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "%s: %s", what, cudaGetErrorString(e));
  volatile GpuErrorRecord* er = err_host_;
  if (er->code != 0)
    EP_FAIL(static_cast<epResult_t>(er->code), "%s: rank %d, which the mask keeps, did not take part within %d ms",
            what, er->peer, 2 * comm_->config.timeout_ms);
  const int d = *reinterpret_cast<volatile int*>(sync_disagree_);
  EP_REQUIRE(d == 0, epInvalidUsage, "%s: rank %d holds a different active-ranks mask than this rank (or rejected "
             "the call)", what, d - 1);
  return epSuccess;
}

epResult_t GpuEngine::barrier(epStream_t stream) {
  DeviceScope scope(device_);
  cudaError_t e = cudaStreamSynchronize(streamOf(stream));
  if (e != cudaSuccess) EP_FAIL(epCudaError, "barrier: %s", cudaGetErrorString(e));
  // The active ranks meet on the device, never through the bootstrap: it would need every rank (a masked one
  // does not come), and a communicator made with the caller's all-gather may not call it after creation.
  return elasticSync(kSyncBarrier, active_mask_, ++barrier_round_, streamOf(stream), "epCommBarrier");
}

epResult_t GpuEngine::setActiveRanks(const uint8_t* active, epStream_t stream) {
  DeviceScope scope(device_);
  const int R = comm_->nranks;
  uint64_t mask = 0;
  for (int r = 0; r < R; ++r)
    if (active[r]) mask |= 1ull << r;
  // Two rounds per call on every survivor, whatever happens in it, so that the next call's rounds agree.
  const uint64_t round = elastic_round_ + 1;
  elastic_round_ += 2;
  // Every kernel of this rank has ended (a failed operation's end at their deadline, or at once once an error is
  // recorded); then the error record is cleared so that the waits below and later ones do not give up at once.
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "epCommSetActiveRanks: %s", cudaGetErrorString(e));
  pollAsyncError();
  {
    volatile GpuErrorRecord* er = err_host_;
    er->code = 0;
    er->op = 0;
    er->epoch = 0;
    er->peer = -1;
    er->phase = 0;
  }
  cudaStream_t s = streamOf(stream);
  e = cudaMemsetAsync(&claims_->error, 0, sizeof(int), s);  // the next failure may be recorded again
  if (e != cudaSuccess) EP_FAIL(epCudaError, "epCommSetActiveRanks: %s", cudaGetErrorString(e));
  // 1. Every survivor has stopped (its kernels ended), holds the same mask, and published its epochs.
  EPCHECK(elasticSync(kSyncElastic, mask, round, s, "epCommSetActiveRanks"));
  // 2. The new mask, then the reset of what a failed operation left behind (no kernel of any survivor runs now).
  e = cudaMemcpyAsync(&el_dev_->active, &mask, sizeof(mask), cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "epCommSetActiveRanks: %s", cudaGetErrorString(e));
  HtParams hp = baseParams(epOpBarrier);
  LlParams lp{};
  const bool has_ll = ll_lay_.total > 0;
  if (has_ll) lp = llParams(epOpBarrier);
  EPCHECK(checkLaunch(launchElasticResync(hp, has_ll ? &lp : nullptr, mask, round, resync_out_dev_, s),
                      "the elastic resync kernel"));
  // 3. No survivor starts the next operation before every other one is clean.
  epResult_t r = elasticSync(kSyncElastic, mask, round + 1, s, "epCommSetActiveRanks");
  if (r != epSuccess) {
    // The host keeps the old mask (the communicator stays broken): so does the device.
    cudaMemcpy(&el_dev_->active, &active_mask_, sizeof(active_mask_), cudaMemcpyHostToDevice);
    return r;
  }
  if ((active_mask_ & ~mask) != 0) ++mask_gen_;  // someone new is masked: HT handles filled before are stale
  active_mask_ = mask;
  // LL halves continue from the epochs the survivors settled on (an outstanding receive half was discarded).
  volatile GpuResyncOut* o = resync_out_;
  for (int f = 0; f < 2; ++f) ll_sent_[f] = ll_recvd_[f] = o->ll_epoch[f];
  return epSuccess;
}

// A call the API layer rejected still takes its part in the round, with mask 0, so that the other survivors
// fail at once (a different mask) instead of at their deadline, and every rank's rounds stay aligned.
epResult_t GpuEngine::setActiveRanksRejected(epResult_t local, epStream_t stream) {
  DeviceScope scope(device_);
  const uint64_t round = elastic_round_ + 1;
  elastic_round_ += 2;
  cudaError_t e = cudaDeviceSynchronize();
  const uint64_t others = active_mask_ & ~(1ull << comm_->rank);
  if (e == cudaSuccess) e = launchSync(kSyncElastic, 0, others, round, false, streamOf(stream));
  if (e == cudaSuccess) e = cudaStreamSynchronize(streamOf(stream));
  if (e != cudaSuccess) EP_WARN("telling the other survivors of a rejected epCommSetActiveRanks failed: %s",
                                cudaGetErrorString(e));
  return local;
}

epResult_t GpuEngine::maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t stream) {
  DeviceScope scope(device_);
  cudaError_t e = cudaStreamSynchronize(streamOf(stream));
  GpuElastic el{};
  if (e == cudaSuccess) e = cudaMemcpy(&el, el_dev_, sizeof(el), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "epCommGetMaskedDrops: %s", cudaGetErrorString(e));
  for (int r = 0; r < comm_->nranks; ++r) {
    if (token_rows) token_rows[r] = static_cast<int64_t>(el.drops[kDropTokenRows][r]);
    if (a2a_elements) a2a_elements[r] = static_cast<int64_t>(el.drops[kDropA2aElements][r]);
  }
  return epSuccess;
}

}  // namespace epcomm
