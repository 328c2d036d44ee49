// GPU engine, high-throughput (HT) mode: handles, the layout kernel's launch, notify, dispatch, combine and the
// zero-copy combine region; host-side checks and launches of kernels/ht.cu. The buffer layout and protocol are
// described in common/gpu_layout.h; the engine's creation, its shared parameters and error polling are in
// gpu_engine.cc.
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "engine/gpu/gpu_engine.h"
#include "kernels/ht.h"

namespace epcomm {

namespace {

// What an epHtHandle holds on the GPU engine: the device arrays of its layout, in one allocation.
struct GpuHandle {
  GpuHandleDev dev{};
  void* mem = nullptr;
};

}  // namespace

HtParams GpuEngine::dispatchParams(int op, const epHtDispatchArgs_t* a, const GpuHandleDev& h) const {
  HtParams p = baseParams(op);
  p.T = a->num_tokens;
  p.H = a->hidden;
  p.K = a->topk;
  p.E = a->num_experts;
  p.L = a->num_experts / comm_->nranks;
  p.dtype = a->dtype;
  p.worst = a->num_worst_tokens;
  p.xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  p.srow = a->dtype == epFloat8E4M3 ? sizeof(float) * (a->hidden / EP_FP8_BLOCK) : 0;
  p.x = a->x;
  p.x_scales = a->x_scales;
  p.topk_idx = a->topk_idx;
  p.topk_weights = a->topk_weights;
  p.recv_x = a->recv_x;
  p.recv_x_scales = a->recv_x_scales;
  p.recv_topk_idx = a->recv_topk_idx;
  p.recv_topk_weights = a->recv_topk_weights;
  p.recv_per_expert_out = a->recv_tokens_per_expert;
  p.pull_dispatch = ht_pull_dispatch_ ? 1 : 0;
  p.hier = ht_hier_ ? 1 : 0;  // read by notify and the push dispatch across hosts
  p.hier_combine = ht_hier_combine_ ? 1 : 0;
  // Every dispatch, not only those after an epHtCombineBuffer call: the region may be asked for after the dispatch
  // that precedes its first combine (the handle it sizes comes from that dispatch).
  p.zc_guard = ht_pull_ ? 1 : 0;
  p.num_recv_out = a->num_recv_tokens;
  p.h = h;
  return p;
}

epResult_t GpuEngine::handleInit(epHtHandle* h) {
  const int R = comm_->nranks, T = h->max_tokens, C = lay_.channels;
  auto g = std::make_unique<GpuHandle>();
  const size_t tr = static_cast<size_t>(T > 0 ? T : 1) * R;
  // Hierarchical combine: the forwarder's places, for every row a source may send it (lay_.max_tokens each), written
  // by the dispatch and read by the combine.
  const size_t places = ht_hier_combine_ ? static_cast<size_t>(R) * lay_.max_tokens * lay_.fwd_idx : 0;
  const size_t ints = 2 * tr + (R + 1) + 4 * static_cast<size_t>(R) * C + kGpuMaxExperts + 1 + 2 * R + places;
  const size_t bytes = 4 * ints + tr + 64;
  cudaError_t e = cudaMalloc(&g->mem, bytes);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaMalloc of a %zu-byte handle failed: %s", bytes, cudaGetErrorString(e));
  // cudaMemset runs on the legacy stream, asynchronously: finish it before kernels on other streams write here.
  e = cudaMemset(g->mem, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cudaFree(g->mem);
    EP_FAIL(epCudaError, "clearing a handle failed: %s", cudaGetErrorString(e));
  }
  int32_t* p = static_cast<int32_t*>(g->mem);
  g->dev.pos = p;
  g->dev.prefix = g->dev.pos + tr;
  g->dev.recv_chan = g->dev.prefix + R + 1;
  g->dev.send_chan_base = g->dev.recv_chan + R * C;
  g->dev.per_expert = g->dev.send_chan_base + R * C;
  g->dev.num_recv = g->dev.per_expert + kGpuMaxExperts;
  g->dev.masked = g->dev.num_recv + 1;
  g->dev.peer_base = g->dev.masked + R;
  g->dev.fpos = g->dev.peer_base + R;
  g->dev.fchan_base = g->dev.fpos + tr;
  g->dev.fwd_chan = g->dev.fchan_base + R * C;
  g->dev.fwd_place = g->dev.fwd_chan + R * C;
  g->dev.in_rank = reinterpret_cast<uint8_t*>(g->dev.fwd_place + places);
  h->gpu = g.release();
  return epSuccess;
}

void GpuEngine::handleFree(epHtHandle* h) {
  auto* g = static_cast<GpuHandle*>(h->gpu);
  if (g == nullptr) return;
  cudaFree(g->mem);
  delete g;
  h->gpu = nullptr;
}

epResult_t GpuEngine::layout(const int64_t* topk_idx, int T, int K, int E, int* per_rank, int* per_expert,
                             uint8_t* in_rank, epStream_t stream) {
  HtParams p = baseParams(epOpLayout);
  p.T = T;
  p.K = K;
  p.E = E;
  p.L = E / comm_->nranks;
  p.topk_idx = topk_idx;
  return checkLaunch(launchLayout(p, per_rank, per_expert, in_rank, streamOf(stream)), "the layout kernel");
}

// Shape checks only the GPU engine has (its queue slots and combine staging are sized at creation).
static epResult_t checkGpuShape(const GpuBufferLayout& lay, int max_tokens, int T, int E, int K, size_t xrow) {
  EP_REQUIRE(E <= kGpuMaxExperts, epInvalidNumExperts, "num_experts = %d exceeds the GPU engine's %d", E,
             kGpuMaxExperts);
  EP_REQUIRE(K <= kGpuMaxTopk, epInvalidTopk, "topk = %d exceeds %d", K, kGpuMaxTopk);
  EP_REQUIRE(xrow <= lay.x_stride, epInvalidHidden,
             "rows of %zu bytes exceed the %zu bytes per row the buffers were sized for (config.ht_max_hidden)",
             xrow, lay.x_stride);
  EP_REQUIRE(T <= max_tokens, epCapacityExceeded, "num_tokens = %d exceeds config.ht_max_tokens_per_rank = %d", T,
             max_tokens);
  return epSuccess;
}

epResult_t GpuEngine::htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                               int* per_expert_host, epStream_t stream) {
  EPCHECK(local);
  auto* g = static_cast<GpuHandle*>(h->gpu);
  const int R = comm_->nranks, L = a->num_experts / R;
  EPCHECK(checkGpuShape(lay_, comm_->config.ht_max_tokens_per_rank, a->num_tokens, a->num_experts, a->topk, 0));
  HtParams p = dispatchParams(epOpHtNotify, a, g->dev);
  cudaStream_t s = streamOf(stream);
  EPCHECK(checkLaunch(launchHtNotify(p, s), "the notify kernel"));
  // Exact mode: the counts are host-visible, so this call waits for them (the kernel's waits have deadlines).
  cudaError_t e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "notify: %s", cudaGetErrorString(e));
  pollAsyncError();
  int ae = comm_->async_error.load();
  if (ae != epSuccess) EP_FAIL(static_cast<epResult_t>(ae), "notify failed on the device: %s", epGetErrorString(static_cast<epResult_t>(ae)));
  std::vector<int32_t> prefix(R + 1), per(L);
  cudaMemcpy(prefix.data(), g->dev.prefix, sizeof(int32_t) * (R + 1), cudaMemcpyDeviceToHost);
  cudaMemcpy(per.data(), g->dev.per_expert, sizeof(int32_t) * L, cudaMemcpyDeviceToHost);
  h->num_tokens = a->num_tokens;
  h->num_experts = a->num_experts;
  h->num_recv = prefix[R];
  h->recv_rows = h->num_recv;
  h->recv_prefix.assign(prefix.begin(), prefix.end());
  h->recv_per_expert.assign(per.begin(), per.end());
  h->mask_gen = mask_gen_;
  h->valid = true;
  *num_recv_host = h->num_recv;
  if (per_expert_host) memcpy(per_expert_host, per.data(), sizeof(int) * L);
  return epSuccess;
}

epResult_t GpuEngine::htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) {
  EPCHECK(local);
  auto* g = static_cast<GpuHandle*>(h->gpu);
  const size_t xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  EPCHECK(checkGpuShape(lay_, comm_->config.ht_max_tokens_per_rank, a->num_tokens, a->num_experts, a->topk, xrow));
  EPCHECK(checkAligned(a->x, "x"));
  EPCHECK(checkAligned(a->recv_x, "recv_x"));
  const bool cached = a->num_worst_tokens == 0 || (a->flags & EP_HT_USE_HANDLE_LAYOUT);
  HtParams p = dispatchParams(epOpHtDispatch, a, g->dev);
  cudaStream_t s = streamOf(stream);
  if (cached) {
    EPCHECK(checkHandleMask(h, "epHtDispatch"));
    EPCHECK(checkLaunch(launchHtBegin(p, s), "the dispatch begin kernel"));
  } else {
    EPCHECK(checkLaunch(launchHtNotify(p, s), "the notify kernel"));
    h->num_tokens = a->num_tokens;
    h->num_experts = a->num_experts;
    h->recv_rows = a->num_worst_tokens;
    h->mask_gen = mask_gen_;
    h->valid = true;
  }
  return checkLaunch(launchHtDispatch(p, s), "the dispatch kernel");
}

// The zero-copy HT combine region: the pull combine's staging, which holds row i of a combine's x at i * xrow.
static size_t htRegionBytes(const GpuBufferLayout& l) {
  return static_cast<size_t>(l.nranks) * l.max_tokens * l.x_stride;
}

epResult_t GpuEngine::htCombineBuffer(void** x, size_t* bytes) {
  EP_REQUIRE(ht_pull_, epNotSupported,
             "zero-copy HT combine needs the pull combine (EPCOMM_GPU_HT_COMBINE_PULL=1, the default): the push "
             "combine keeps its own staging there");
  *x = static_cast<uint8_t*>(bufs_.local()) + lay_.comb_stage;
  *bytes = htRegionBytes(lay_);
  return epSuccess;
}

epResult_t GpuEngine::htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t stream) {
  EPCHECK(local);
  auto* g = static_cast<GpuHandle*>(h->gpu);
  const size_t xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  EP_REQUIRE(xrow <= lay_.x_stride, epInvalidHidden,
             "combine rows of %zu bytes exceed the %zu bytes per row the buffers were sized for", xrow, lay_.x_stride);
  EPCHECK(checkAligned(a->x, "x"));
  EPCHECK(checkAligned(a->combined_x, "combined_x"));
  EPCHECK(checkHandleMask(h, "epHtCombine"));
  HtParams p = baseParams(epOpHtCombine);
  p.T = a->num_tokens;
  p.H = a->hidden;
  p.dtype = a->dtype;
  p.xrow = xrow;
  p.x = a->x;
  p.combined_x = a->combined_x;
  p.h = g->dev;
  p.pull = ht_pull_ ? 1 : 0;
  p.hier = ht_hier_combine_ ? 1 : 0;  // across hosts: the forwarders of the dispatch combine their host's rows
  p.recv_rows = h->recv_rows;
  // x at the start of the zero-copy region: the owners read it there. Overlapping it otherwise: a mistake (row i of
  // x must be row i of the region, which the combine rewrites while it reads x). combined_x must stay out of it:
  // the peers read the region while this rank writes its output.
  const uint8_t* region = static_cast<const uint8_t*>(bufs_.local()) + lay_.comb_stage;
  const uint8_t* region_end = region + htRegionBytes(lay_);
  const uint8_t* x = static_cast<const uint8_t*>(a->x);
  const uint8_t* out = static_cast<const uint8_t*>(a->combined_x);
  const size_t x_used = static_cast<size_t>(h->recv_rows) * xrow, out_used = static_cast<size_t>(a->num_tokens) * xrow;
  const bool x_meets_out = out_used > 0 && x_used > 0 && out < x + x_used && x < out + out_used;
  if (ht_pull_ && x != region && x < region_end && x + x_used > region)
    EP_FAIL(epInvalidArgument, "x = %p (%zu bytes) overlaps the zero-copy combine region (epHtCombineBuffer) at %p "
            "but does not start there: pass the region's start", a->x, x_used, static_cast<const void*>(region));
  if (ht_pull_ && out_used > 0 && out < region_end && out + out_used > region)
    EP_FAIL(epInvalidArgument, "combined_x = %p (%zu bytes) overlaps the zero-copy combine region (epHtCombineBuffer) "
            "at %p, which the peers read during the combine", a->combined_x, out_used,
            static_cast<const void*>(region));
  if (ht_pull_ && x == region) {
    EP_REQUIRE(static_cast<size_t>(h->recv_rows) * xrow <= htRegionBytes(lay_), epBufferTooSmall,
               "x is the zero-copy combine region, %zu bytes, but %d rows of %zu bytes do not fit in it",
               htRegionBytes(lay_), h->recv_rows, xrow);
    p.zero_copy = 1;
  } else if (ht_pull_) {
    p.x_region = regionOf(x, x_used, &p.x_off);  // registered (epCommRegister): the owners read x there
    // ... while this rank writes combined_x: the two must not overlap.
    if (p.x_region >= 0 && x_meets_out)
      EP_FAIL(epInvalidArgument, "combined_x = %p (%zu bytes) overlaps x = %p (%zu bytes), which lies in registered "
              "memory that the peers read during the combine", a->combined_x, out_used, a->x, x_used);
  }
  cudaStream_t s = streamOf(stream);
  // Implicit registration (registry_implicit.cc), outside graph capture only: a captured combine keeps its choice
  // for every replay, longer than a slot is held. x overlapping combined_x keeps the copy as well.
  int implicit = -1;
  if (auto_reg_) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &cap) != cudaSuccess) {
      cudaGetLastError();
      cap = cudaStreamCaptureStatusActive;
    }
    if (cap == cudaStreamCaptureStatusNone) {
      implicitImport();
      p.auto_mirror = auto_mirror_dev_;
      if (!p.zero_copy && p.x_region < 0 && !x_meets_out) implicit = p.x_region = implicitSlot(x, x_used, &p.x_off);
      p.auto_acks = implicitWaiting() ? 1 : 0;
    }
  }
  epResult_t rc = checkLaunch(launchHtBegin(p, s), "the combine begin kernel");
  if (rc == epSuccess) rc = checkLaunch(launchHtCombine(p, s), "the combine kernel");
  // x stays the caller's once the combine completes: that waits until every owner has read it.
  if (rc == epSuccess && p.x_region >= 0) rc = checkLaunch(launchHtEnd(p, s), "the combine end kernel");
  if (implicit >= 0) {  // a slot whose combine may not end cleanly is never given to another allocation
    implicitUsed(implicit, s, rc == epSuccess);
    auto_used_ += rc == epSuccess;
  }
  return rc;
}

}  // namespace epcomm
