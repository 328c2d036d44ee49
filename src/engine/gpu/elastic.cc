// GPU engine, elastic ranks: the active-ranks mask in device memory (every kernel reads it when it runs, so a
// captured graph replays under the newest mask), the drop counters, and epCommSetActiveRanks' resynchronization
// of the survivors (kernels/elastic.cu).
#include <cstring>

#include "common/checks.h"
#include "engine/gpu/gpu_engine.h"
#include "kernels/elastic.h"

namespace epcomm {

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
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostAlloc: %s", cudaGetErrorString(e));
  *sync_disagree_ = 0;
  return epSuccess;
}

epResult_t GpuEngine::checkHandleMask(const epHtHandle* h, const char* what) const {
  EP_REQUIRE(h->mask_gen == mask_gen_, epInvalidUsage,
             "%s: the handle's layout was computed before epCommSetActiveRanks masked a rank; dispatch again "
             "without EP_HT_USE_HANDLE_LAYOUT (or notify again) to refill it",
             what);
  return epSuccess;
}

// One rendezvous of the ranks in `mask` on the device; every one of them must come within the deadline and
// hold the same mask.
epResult_t GpuEngine::elasticSync(uint64_t mask, cudaStream_t s, const char* what) {
  int* disagree_dev = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&disagree_dev), sync_disagree_, 0);
  *reinterpret_cast<volatile int*>(sync_disagree_) = 0;
  // Twice the deadline: a survivor may come up to one deadline late (its failed kernels end at theirs).
  HtParams p = baseParams(epOpBarrier);
  p.timeout_ns *= 2;
  EPCHECK(checkLaunch(launchElasticSync(p, mask, ++sync_round_, disagree_dev, s), "the elastic sync kernel"));
  cudaError_t e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "%s: %s", what, cudaGetErrorString(e));
  volatile GpuErrorRecord* er = err_host_;
  if (er->code != 0)
    EP_FAIL(static_cast<epResult_t>(er->code), "%s: rank %d, which the mask keeps, did not take part within %d ms",
            what, er->peer, 2 * comm_->config.timeout_ms);
  const int d = *reinterpret_cast<volatile int*>(sync_disagree_);
  EP_REQUIRE(d == 0, epInvalidUsage, "%s: rank %d holds a different active-ranks mask than this rank", what, d - 1);
  return epSuccess;
}

epResult_t GpuEngine::setActiveRanks(const uint8_t* active, epStream_t stream) {
  const int R = comm_->nranks;
  uint64_t mask = 0;
  for (int r = 0; r < R; ++r)
    if (active[r]) mask |= 1ull << r;
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
  // 1. Every survivor has stopped (its kernels ended) and holds the same mask.
  EPCHECK(elasticSync(mask, s, "epCommSetActiveRanks"));
  // 2. The new mask, then the reset of what a failed operation left behind (no kernel of any survivor runs now).
  GpuElastic* el = el_dev_;
  e = cudaMemcpyAsync(&el->active, &mask, sizeof(mask), cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "epCommSetActiveRanks: %s", cudaGetErrorString(e));
  HtParams hp = baseParams(epOpBarrier);
  LlParams lp{};
  const bool has_ll = ll_lay_.total > 0;
  if (has_ll) lp = llParams(epOpBarrier);
  EPCHECK(checkLaunch(launchElasticResync(hp, has_ll ? &lp : nullptr, s), "the elastic resync kernel"));
  // 3. No survivor starts the next operation before every other one is clean.
  EPCHECK(elasticSync(mask, s, "epCommSetActiveRanks"));
  if ((active_mask_ & ~mask) != 0) ++mask_gen_;  // someone new is masked: HT handles filled before are stale
  active_mask_ = mask;
  for (int f = 0; f < 2; ++f) ll_recvd_[f] = ll_sent_[f];  // an outstanding receive half was discarded
  return epSuccess;
}

epResult_t GpuEngine::maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t stream) {
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
