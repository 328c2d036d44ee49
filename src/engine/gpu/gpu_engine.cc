#include "engine/gpu/gpu_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/param.h"
#include "kernels/ht.h"

namespace epcomm {

EP_PARAM(GpuSms, "NUM_SMS", 24);
EP_PARAM(GpuQueueRows, "GPU_QUEUE_ROWS", 64);
// HT combine: 1 = the token owners pull the expert outputs from the peers' buffers (one copy of x into this
// rank's buffer, one read by the owner); 0 = push through the bounded queues (a copy more per row).
EP_PARAM(GpuHtCombinePull, "GPU_HT_COMBINE_PULL", 1);
// HT dispatch: 1 = each rank copies its tokens once into its buffer and the receivers pull their rows straight
// into recv_x (no queues; max_tokens dispatch slots more per rank): a copy less per row than 0, the push through
// the bounded queues. Once every block stages before it reads, 1.3-1.6x push's GB/s on one H200
// (bench/results/h200-ht-s7.log); before that, with one role per block, 3-8x slower than push.
EP_PARAM(GpuHtDispatchPull, "GPU_HT_DISPATCH_PULL", 1);
// Warps that serve one peer in an HT or alltoallv block (0 = as many as fit: 32 / ranks, at most 16).
EP_PARAM(GpuWarpsPerPeer, "GPU_WARPS_PER_PEER", 0);
// Queue rows a sender moves before it publishes them (0 = by the in-flight budget below, at most half a queue).
EP_PARAM(GpuQueueRound, "GPU_QUEUE_ROUND", 0);

namespace {

struct GpuHandle {
  GpuHandleDev dev{};
  void* mem = nullptr;
};

}  // namespace

int gpuDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Engine> makeGpuEngine(epComm* comm) { return std::make_unique<GpuEngine>(comm); }

GpuEngine::~GpuEngine() {
  // Kernels in flight read the error record and the buffers: let them finish first. They end promptly after
  // an abort, and within their deadline otherwise.
  cudaDeviceSynchronize();
  if (err_host_) cudaFreeHost(err_host_);
  if (sync_disagree_) cudaFreeHost(sync_disagree_);
  if (resync_out_) cudaFreeHost(resync_out_);
  if (claims_) cudaFree(claims_);
  if (el_dev_) cudaFree(el_dev_);
}

epResult_t GpuEngine::checkLaunch(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return epSuccess;
  return EP_ERROR(epCudaError, "launching %s failed: %s", what, cudaGetErrorString(e));
}

epResult_t GpuEngine::init() {
  const CommConfig& c = comm_->config;
  const int R = comm_->nranks;
  // A warp of each sending and receiving block serves one peer, so peers never wait behind each other.
  EP_REQUIRE(R <= 16, epNotSupported, "the GPU engine takes at most 16 ranks on one host (nranks = %d)", R);
  int ndev = gpuDeviceCount();
  EP_REQUIRE(ndev > 0, epCudaError, "the GPU engine was requested but no CUDA device is visible");
  if (c.cuda_device >= 0) {
    device_ = c.cuda_device;
  } else if (cudaGetDevice(&device_) != cudaSuccess || paramString("EPCOMM_LOCAL_RANK") != nullptr) {
    // Under epcomm-run without an explicit device: one device per local rank, wrapping (MPS shares one).
    const char* lr = paramString("EPCOMM_LOCAL_RANK");
    device_ = lr ? atoi(lr) % ndev : 0;
  }
  EP_REQUIRE(device_ < ndev, epInvalidArgument, "config.cuda_device = %d but only %d devices are visible", device_,
             ndev);
  cudaError_t e = cudaSetDevice(device_);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaSetDevice(%d): %s", device_, cudaGetErrorString(e));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_);
  blocks_ = c.num_sms > 0 ? c.num_sms : static_cast<int>(epParamGpuSms());
  if (sms > 0 && blocks_ > sms) blocks_ = sms;

  // Ranks sharing this GPU (processes under MPS): kernels that wait for peers spin, so every sharing rank's
  // blocks of one such kernel must be resident together, with SMs left for a late peer's next kernel, or they
  // could wait for a kernel that cannot be scheduled. Blocks of different MPS clients may not share an SM, so
  // count one SM per block: at most SMs / (sharing ranks + 1) blocks per kernel.
  struct DevId {
    char bus[32];
  };
  std::vector<DevId> ids(R);
  cudaDeviceGetPCIBusId(ids[comm_->rank].bus, sizeof(ids[0].bus), device_);
  EPCHECK(comm_->bootstrap->allgather(ids.data(), sizeof(DevId), c.timeout_ms));
  int sharing = 0;
  for (const DevId& d : ids) sharing += strcmp(d.bus, ids[comm_->rank].bus) == 0;
  const int cap = sms / (sharing + 1);
  if (sharing > 1 && blocks_ > cap) {
    EP_INFO(kSubsysInit, "%d ranks share GPU %s: %d blocks per kernel instead of %d", sharing,
            ids[comm_->rank].bus, cap > 0 ? cap : 1, blocks_);
    blocks_ = cap > 0 ? cap : 1;
  }
  // LL kernels are latency-bound: they take more SMs than HT's budget (up to 64), within the same sharing cap.
  ll_default_blocks_ = std::max(1, std::min(64, sharing > 1 ? cap : sms));
  gpu_sharing_ = sharing;
  gpu_sms_ = sms > 0 ? sms : 1;
  const int channels = std::max(1, std::min(blocks_ / 2, kGpuMaxChannels));
  const int queue_rows = static_cast<int>(epParamGpuQueueRows());
  // The reducing block consumes one token per warp per round (up to 32 warps): a queue holds at least that.
  EP_REQUIRE(queue_rows >= 32 && queue_rows <= 4096, epInvalidArgument,
             "EPCOMM_GPU_QUEUE_ROWS = %d is outside [32, 4096]", queue_rows);
  ht_pull_ = epParamGpuHtCombinePull() != 0;
  ht_pull_dispatch_ = epParamGpuHtDispatchPull() != 0;
  lay_ = gpuBufferLayout(R, channels, queue_rows, c.ht_max_hidden, c.ht_max_tokens_per_rank, ht_pull_dispatch_);
  // Peers index each other's buffers with this layout and follow one protocol: every rank must have the same
  // (a different EPCOMM_NUM_SMS / GPU_QUEUE_ROWS / GPU_HT_*_PULL on one rank would hang or read out of bounds).
  struct Shape {
    uint64_t total;
    int32_t channels, queue_rows, pull, pull_dispatch;
  };
  std::vector<Shape> shapes(R);
  shapes[comm_->rank] = {lay_.total, lay_.channels, lay_.queue_rows, ht_pull_ ? 1 : 0, ht_pull_dispatch_ ? 1 : 0};
  EPCHECK(comm_->bootstrap->allgather(shapes.data(), sizeof(Shape), c.timeout_ms));
  for (int r = 0; r < R; ++r) {
    const Shape& a = shapes[r];
    const Shape& b = shapes[comm_->rank];
    EP_REQUIRE(a.total == b.total && a.channels == b.channels && a.queue_rows == b.queue_rows && a.pull == b.pull &&
                   a.pull_dispatch == b.pull_dispatch,
               epInvalidUsage,
               "rank %d's GPU engine differs from this rank's (channels %d / %d, queue rows %d / %d, pull combine "
               "%d / %d, pull dispatch %d / %d, buffer %llu / %llu bytes): EPCOMM_NUM_SMS (or config.num_sms), "
               "EPCOMM_GPU_QUEUE_ROWS, EPCOMM_GPU_HT_COMBINE_PULL and EPCOMM_GPU_HT_DISPATCH_PULL must agree on "
               "every rank",
               r, a.channels, b.channels, a.queue_rows, b.queue_rows, a.pull, b.pull, a.pull_dispatch,
               b.pull_dispatch, static_cast<unsigned long long>(a.total), static_cast<unsigned long long>(b.total));
  }
  EPCHECK(bufs_.init(comm_->bootstrap.get(), lay_.total, c.timeout_ms));
  e = cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(GpuErrorRecord), cudaHostAllocMapped);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostAlloc of the error record: %s", cudaGetErrorString(e));
  memset(err_host_, 0, sizeof(GpuErrorRecord));
  e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostGetDevicePointer: %s", cudaGetErrorString(e));
  e = cudaMalloc(reinterpret_cast<void**>(&claims_), sizeof(GpuErrorClaims));
  if (e == cudaSuccess) e = cudaMemset(claims_, 0, sizeof(GpuErrorClaims));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "allocating the error claims: %s", cudaGetErrorString(e));
  EPCHECK(initElastic());
  EPCHECK(initLl());
  EP_INFO(kSubsysInit, "GPU engine ready: device %d, %d ranks, %zu-byte buffer, %d channels of %d-row queues",
          device_, R, lay_.total, lay_.channels, lay_.queue_rows);
  if (getenv("EPCOMM_GPU_REPORT") && comm_->rank == 0)
    fprintf(stderr, "epcomm: GPU engine: %d ranks share the GPU, %d channels (%d blocks per kernel), %d-row queues, "
            "%zu-byte buffer per rank\n", sharing, lay_.channels, 2 * lay_.channels, lay_.queue_rows, lay_.total);
  return epSuccess;
}

HtParams GpuEngine::baseParams(int op) const {
  HtParams p{};
  p.rank = comm_->rank;
  p.nranks = comm_->nranks;
  p.op = op;
  p.ctrl = static_cast<GpuCtrl*>(bufs_.local());
  for (int r = 0; r < comm_->nranks; ++r) p.base[r] = static_cast<uint8_t*>(bufs_.peer(r));
  p.lay = lay_;
  p.err = err_dev_;
  p.claims = claims_;
  p.el = el_dev_;
  p.timeout_ns = static_cast<uint64_t>(comm_->config.timeout_ms) * 1000000ull;
  p.gpu_scope = gpu_sharing_ == comm_->nranks;
  p.C = lay_.channels;
  p.Q = lay_.queue_rows;
  // G warps per peer, R * G warps per block (at most 32); named barriers 1..15 need R < 16 when G > 1.
  const int g_max = comm_->nranks >= 16 ? 1 : std::max(1, std::min(16, 32 / comm_->nranks));
  const int g_want = static_cast<int>(epParamGpuWarpsPerPeer());
  p.G = g_want > 0 ? std::min(g_want, g_max) : g_max;
  // A sender publishes its queue rows in rounds: each publication costs a fence that waits for the round's remote
  // stores (system scope; GPU scope when every rank runs on this GPU). Across NVLink that wait is long, and rounds
  // of one row per warp left the link idle between them; rounds of at most half a queue let the receiver drain one
  // half while the sender fills the other. Ranks that share a GPU fence cheaply, and there rounds of one row per
  // warp measured best, with system-scope fences (bench/results/h200-ht-rounds-s3.log, one H200 under MPS and two
  // H200s) and with GPU-scope ones (h200-ll-dispatch-s6.log, run51). Across NVLink the default keeps a rank's
  // rounds, all channels and peers together, near 6 MiB.
  const int half = std::max(1, lay_.queue_rows / 2);
  const int r_want = static_cast<int>(epParamGpuQueueRound());
  if (r_want > 0) {
    p.round = r_want;
  } else if (gpu_sharing_ > 1) {
    p.round = p.G;
  } else {
    const uint64_t queues = static_cast<uint64_t>(lay_.channels) * std::max(1, comm_->nranks - 1);
    p.round = static_cast<int>(std::min<uint64_t>((6ull << 20) / (queues * lay_.disp_slot), half));
  }
  p.round = std::min(std::max(p.round, p.G), half);  // fewer rows than warps would leave warps idle
  return p;
}

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
  // Every dispatch, not only those after an epHtCombineBuffer call: the region may be asked for after the dispatch
  // that precedes its first combine (the handle it sizes comes from that dispatch).
  p.zc_guard = ht_pull_ ? 1 : 0;
  p.num_recv_out = a->num_recv_tokens;
  p.h = h;
  return p;
}

void GpuEngine::pollAsyncError() {
  if (err_host_ == nullptr) return;
  volatile GpuErrorRecord* er = err_host_;
  if (er->code != 0 && comm_->async_error.load() == epSuccess)
    comm_->recordAsyncError(static_cast<epResult_t>(er->code), er->op, er->epoch, er->peer, er->phase);
  std::lock_guard<std::mutex> lock(comm_->error_mutex);
  comm_->violation = static_cast<epResult_t>(er->violation_code);
  comm_->num_violations = er->violations;
}

void GpuEngine::abort() {
  if (err_host_) reinterpret_cast<volatile GpuErrorRecord*>(err_host_)->abort = 1;
}

epResult_t GpuEngine::handleInit(epHtHandle* h) {
  const int R = comm_->nranks, T = h->max_tokens, C = lay_.channels;
  auto g = std::make_unique<GpuHandle>();
  const size_t tr = static_cast<size_t>(T > 0 ? T : 1) * R;
  const size_t ints = tr + (R + 1) + 2 * static_cast<size_t>(R) * C + kGpuMaxExperts + 1 + 2 * R;
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
  g->dev.in_rank = reinterpret_cast<uint8_t*>(g->dev.peer_base + R);
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

epResult_t checkAligned(const void* p, const char* name) {
  EP_REQUIRE((reinterpret_cast<uintptr_t>(p) & 15) == 0, epInvalidArgument,
             "%s = %p must be 16-byte aligned for the GPU engine", name, p);
  return epSuccess;
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
  p.recv_rows = h->recv_rows;
  // x at the start of the zero-copy region: the owners read it there. Overlapping it otherwise: a mistake (row i of
  // x must be row i of the region, which the combine rewrites while it reads x). combined_x must stay out of it:
  // the peers read the region while this rank writes its output.
  const uint8_t* region = static_cast<const uint8_t*>(bufs_.local()) + lay_.comb_stage;
  const uint8_t* region_end = region + htRegionBytes(lay_);
  const uint8_t* x = static_cast<const uint8_t*>(a->x);
  const uint8_t* out = static_cast<const uint8_t*>(a->combined_x);
  const size_t x_used = static_cast<size_t>(h->recv_rows) * xrow, out_used = static_cast<size_t>(a->num_tokens) * xrow;
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
  }
  cudaStream_t s = streamOf(stream);
  EPCHECK(checkLaunch(launchHtBegin(p, s), "the combine begin kernel"));
  return checkLaunch(launchHtCombine(p, s), "the combine kernel");
}

}  // namespace epcomm
