// GPU engine, low-latency (LL) dispatch and combine: host-side checks and launches of kernels/ll.cu. The
// buffer layout and the protocol (tags, acknowledgements, parities, epochs) are described at LlLayout in
// common/gpu_layout.h; nothing here is read by the kernels between operations, so every half is capturable.
#include <algorithm>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/param.h"
#include "engine/gpu/gpu_engine.h"
#include "kernels/ll.h"

namespace epcomm {

// Blocks of every LL kernel: a fixed grid per communicator (the kernels count finished blocks cumulatively).
// Tests set it far above what can be resident at once to show that no block waits for another of its launch.
EP_PARAM(GpuLlBlocks, "GPU_LL_BLOCKS", 0);
// Receive halves launched as programmatic dependents of the send half (they start while it runs). Only with one
// rank per GPU: ranks sharing a GPU would then hold two kernels' blocks each, more than the SMs they share.
EP_PARAM(GpuLlPdl, "GPU_LL_PDL", 1);
// Calls with both halves run them in one cooperative launch (when the grid fits on the device at once, one
// block per SM): one launch and one prologue fewer on the latency path. 0 = always two kernels.
EP_PARAM(GpuLlFused, "GPU_LL_FUSED", 1);
// Fused kernels launched as programmatic dependents of the kernel before them on the stream (they wait for it with
// griddepcontrol.wait before their first load; LL send halves let the next kernel start at their own start):
// back-to-back LL operations overlap a launch latency with the operation before (0-1.3 us an operation at R = 2,
// one H200; bench/results/h200-s17.log). A parked kernel holds its SMs while it waits, and a kernel whose peer
// kernel cannot get SMs waits until the deadline (forced on at R = 8 on one H200, LL timed out). One block per SM
// (the fused kernels use 115-128 registers a thread), G ranks on this GPU, B blocks:
//   1: where 2 G B <= SMs: every rank but one holds a running and a parked kernel, and the one left can still
//      start its kernel beside a kernel it launched on another stream (one rank per GPU: B <= SMs / 2);
//   2: where (2 G - 1) B <= SMs (R = 2 on one H200 at the default blocks), for callers that never launch LL work
//      on a second stream while chained kernels run (the first such launch would find no SMs left for a peer);
//   0: never. Either way only on one host and while every LL launch of the communicator has used one stream.
EP_PARAM(GpuLlPdlChain, "GPU_LL_PDL_CHAIN", 1);
// Zero-copy LL dispatch, where a rank has fewer rows than warps: a row is split into at most this many parts, a
// warp each (1 to 32), and in a fused kernel the last blocks (0 to blocks - 1; -1: a tenth of the grid) write no
// rows: they derive the receive side (layout, recv_src_info) while the others write. At the goal shape (R = 2, 64
// tokens, 64 experts, one H200) 16 parts with 4 such blocks of 44 took the dispatch from 15.5 to 14.9 us, where 16
// parts with none took it to 17.3: the row writers then also derive the receive side, after their rows
// (bench/results/h200-s24.log). With the destinations in registers as well (LaneDsts), one H100 measured 17.2 ->
// 14.7 us there against the code before both (bench/results/h100-s25.log).
EP_PARAM(GpuLlZdParts, "GPU_LL_ZD_PARTS", 16);
EP_PARAM(GpuLlZdRside, "GPU_LL_ZD_RSIDE", -1);

epResult_t GpuEngine::initLl() {
  const CommConfig& c = comm_->config;
  if (c.ll_max_tokens_per_rank <= 0) return epSuccess;
  const int R = comm_->nranks;
  // The combine slots are indexed by (expert, token), so their size follows the experts the buffers serve.
  const int experts = c.ll_num_experts > 0 ? c.ll_num_experts : 256;
  EP_REQUIRE(experts % R == 0 && experts <= kGpuMaxExperts, epInvalidNumExperts,
             "config.ll_num_experts = %d (0 means 256 on the GPU engine) must be a multiple of nranks = %d and at "
             "most %d",
             experts, R, kGpuMaxExperts);
  EP_REQUIRE(c.ll_max_hidden % 128 == 0, epInvalidHidden,
             "config.ll_max_hidden = %d must be a multiple of 128 on the GPU engine", c.ll_max_hidden);
  // Zero-copy dispatch regions only where every peer maps them (the senders write into them).
  const bool zd = c.ll_zero_copy_dispatch && remote_mask_ == 0;
  if (c.ll_zero_copy_dispatch && !zd)
    EP_INFO(kSubsysInit, "config.ll_zero_copy_dispatch ignored: ranks on other hosts cannot write this rank's regions");
  ll_lay_ = llLayout(R, c.ll_max_tokens_per_rank, experts, c.ll_max_hidden, zd);
  EPCHECK(ll_bufs_.init(comm_->bootstrap.get(), ll_lay_.total, c.setup_timeout_ms, remote_));
  const int64_t want = epParamGpuLlBlocks();
  ll_blocks_ = want > 0 ? static_cast<int>(std::min<int64_t>(want, 1 << 16)) : ll_default_blocks_;
  ll_pdl_ = gpu_sharing_ == 1 && epParamGpuLlPdl() != 0;
  int coop = 0;
  cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device_);
  // A fused kernel waits for its peers' fused kernels, so every rank's grid on this GPU must be resident at once
  // (one block per SM): a cooperative launch only checks that its own grid fits the GPU, and a rank whose grid had
  // to wait for SMs behind a peer's would hold that peer until the deadline. The default grid always fits (SMs over
  // ranks on the GPU + 1); only a larger EPCOMM_GPU_LL_BLOCKS runs the halves as two launches instead.
  const bool fusable = coop != 0 && epParamGpuLlFused() != 0;
  ll_fused_ = fusable && static_cast<int64_t>(gpu_sharing_) * ll_blocks_ <= gpu_sms_;
  if (fusable && !ll_fused_ && ll_blocks_ <= gpu_sms_)
    EP_INFO(kSubsysInit, "GPU engine LL: %d ranks x %d blocks exceed GPU %d's %d SMs: the halves of an LL call run as "
            "two launches", gpu_sharing_, ll_blocks_, device_, gpu_sms_);
  const int64_t chain = epParamGpuLlPdlChain(), held = chain >= 2 ? 2 * gpu_sharing_ - 1 : 2 * gpu_sharing_;
  ll_pdl_chain_ = ll_fused_ && chain > 0 && remote_mask_ == 0 && held * ll_blocks_ <= gpu_sms_;
  EP_INFO(kSubsysInit, "GPU engine LL: %zu-byte buffer for %d tokens per rank, %d experts, hidden %d; %d blocks%s%s%s",
          ll_lay_.total, c.ll_max_tokens_per_rank, experts, c.ll_max_hidden, ll_blocks_,
          ll_fused_ ? ", halves fused" : "", ll_pdl_chain_ ? " (chained launches)" : "",
          ll_pdl_ ? ", receive halves as dependent launches" : "");
  return epSuccess;
}

// The fields both LL operations' args share (dispatch and combine args name them alike).
template <typename Args>
LlParams GpuEngine::llParams(int op, const Args& a) const {
  LlParams p = llParams(op);
  p.T = a.num_tokens;
  p.M = a.max_tokens_per_rank;
  p.H = a.hidden;
  p.K = a.topk;
  p.E = a.num_experts;
  p.L = a.num_experts / comm_->nranks;
  p.dtype = a.dtype;
  p.layout = a.layout;
  p.xrow = static_cast<size_t>(a.hidden) * dtypeSize(a.dtype);
  return p;
}
template LlParams GpuEngine::llParams(int, const epLlDispatchArgs_t&) const;
template LlParams GpuEngine::llParams(int, const epLlCombineArgs_t&) const;

LlParams GpuEngine::llParams(int op) const {
  LlParams p{};
  p.rank = comm_->rank;
  p.nranks = comm_->nranks;
  p.op = op;
  p.blocks = ll_blocks_;
  for (int r = 0; r < comm_->nranks; ++r)
    p.base[r] = remote_[r] ? reinterpret_cast<uint8_t*>(kGpuRemoteWindow) : static_cast<uint8_t*>(ll_bufs_.peer(r));
  p.remote = remote_mask_;
  p.rem = proxy_ ? proxy_->table() : nullptr;
  p.lay = ll_lay_;
  p.err = err_dev_;
  p.claims = claims_;
  p.el = el_dev_;
  p.timeout_ns = static_cast<uint64_t>(comm_->config.timeout_ms) * 1000000ull;
  p.pdl = ll_pdl_;
  // Words in the far copy (host memory the proxy's thread writes) need system-scope loads and fences.
  p.gpu_scope = gpu_sharing_ == comm_->nranks && remote_mask_ == 0;
  p.far_in = proxy_ ? proxy_->farCopy(kRemoteLlBuffer) : nullptr;
  return p;
}

// What the GPU engine adds to the API layer's checks: the limits its buffers were sized for, and the order of
// halves (at most one operation of each family between its halves; a receive half needs its send half).
epResult_t GpuEngine::llCheck(int family, unsigned phases, int num_experts, int hidden, int dtype, int topk) const {
  const char* what = family == kLlDispatch ? "LL dispatch" : "LL combine";
  EP_REQUIRE(ll_lay_.total > 0, epInvalidUsage,
             "the communicator was created without low-latency capacity (config.ll_max_tokens_per_rank = 0)");
  EP_REQUIRE(num_experts <= ll_lay_.max_experts, epInvalidNumExperts,
             "num_experts = %d exceeds the %d experts the GPU engine's LL buffers were sized for "
             "(config.ll_num_experts; 0 means 256)",
             num_experts, ll_lay_.max_experts);
  EP_REQUIRE(topk <= kGpuMaxTopk, epInvalidTopk, "topk = %d exceeds the GPU engine's %d", topk, kGpuMaxTopk);
  const size_t row = static_cast<size_t>(hidden) * dtypeSize(dtype);
  EP_REQUIRE(row <= ll_lay_.comb_row, epInvalidHidden,
             "rows of %zu bytes (hidden %d, %s) exceed the %zu bytes the LL buffers hold per row (config.ll_max_hidden "
             "in bf16 elements)",
             row, hidden, dtypeName(dtype), ll_lay_.comb_row);
  const bool outstanding = ll_sent_[family] != ll_recvd_[family];
  EP_REQUIRE(!((phases & EP_LL_SEND) && outstanding), epInvalidUsage,
             "%s send half issued while the previous one's receive half (EP_LL_RECV) is still outstanding", what);
  EP_REQUIRE(!(phases == EP_LL_RECV && !outstanding), epInvalidUsage,
             "%s receive half (EP_LL_RECV) called with no matching send half outstanding", what);
  return epSuccess;
}

epResult_t GpuEngine::llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t stream) {
  EPCHECK(local);
  EPCHECK(llCheck(kLlDispatch, a->phases, a->num_experts, a->hidden, a->dtype, a->topk));
  EPCHECK(checkAligned(a->x, "x"));
  EPCHECK(checkAligned(a->recv_x, "recv_x"));
  LlParams p = llParams(epOpLlDispatch, *a);
  p.use_fp8 = a->use_fp8 != 0;
  p.srow = p.use_fp8 ? sizeof(float) * (a->hidden / EP_FP8_BLOCK) : 0;
  p.drow = p.use_fp8 ? static_cast<size_t>(a->hidden) : p.xrow;
  if (a->phases & EP_LL_SEND) {
    EPCHECK(zeroCopyDispatch(*a, p));
  } else {
    p.zd = ll_recv_zd_;  // the send half's mode (one dispatch between halves)
  }
  EP_REQUIRE(llSendSmemBytes(a->num_tokens, a->topk, a->num_experts, p.zd) <= kLlMaxSmem, epCapacityExceeded,
             "num_tokens x topk = %d x %d is more routing than the GPU engine's LL dispatch stages (%zu bytes of "
             "shared memory)",
             a->num_tokens, a->topk, kLlMaxSmem);
  if (a->phases & EP_LL_SEND) ll_recv_zd_ = p.zd;
  p.x = a->x;
  p.topk_idx = a->topk_idx;
  p.recv_x = a->recv_x;
  p.recv_x_scales = a->recv_x_scales;
  p.recv_count = a->recv_count;
  p.recv_src_info = a->recv_src_info;
  p.recv_layout_range = a->recv_layout_range;
  p.recv_topk_idx = a->recv_topk_idx;
  p.zc_guard = ll_zero_copy_;
  return llLaunch(kLlDispatch, a->phases, p, stream);
}

// Whether a fused launch on `s` may be chained (LlParams::pdl_chain): only while every LL launch of this communicator
// has gone to one stream, so that a rank holds at most a running and a parked kernel (and, once, a kernel on the
// second stream beside them: EPCOMM_GPU_LL_PDL_CHAIN=1 leaves the SMs for it). The first launch on a second stream
// turns chaining off for good. Graphs captured before keep their chained launches: a graph is replayed on one
// stream at a time, not beside other LL work of the communicator.
bool GpuEngine::llChain(cudaStream_t s) {
  if (!ll_pdl_chain_) return false;
  if (!ll_stream_seen_) {
    ll_stream_seen_ = true;
    ll_stream_ = s;
  } else if (s != ll_stream_) {
    ll_pdl_chain_ = false;
    EP_INFO(kSubsysEngine, "GPU engine LL: launches on a second stream; chained launches off for this communicator");
  }
  return ll_pdl_chain_;
}

// The launches of one LL call: both halves in one cooperative kernel when allowed, else one kernel per half;
// the halves issued are counted for the call-order checks.
epResult_t GpuEngine::llLaunch(int family, unsigned phases, const LlParams& p, epStream_t stream) {
  using Launcher = cudaError_t (*)(const LlParams&, cudaStream_t);
  static const Launcher kBoth[2] = {launchLlDispatch, launchLlCombine};
  static const Launcher kSend[2] = {launchLlDispatchSend, launchLlCombineSend};
  static const Launcher kRecv[2] = {launchLlDispatchRecv, launchLlCombineRecv};
  static const char* kName[2] = {"LL dispatch", "LL combine"};
  cudaStream_t s = streamOf(stream);
  const bool chain = llChain(s);
  if (phases == EP_LL_SEND_RECV && ll_fused_) {
    LlParams q = p;
    q.pdl_chain = chain;
    const cudaError_t e = kBoth[family](q, s);
    if (e != cudaErrorCooperativeLaunchTooLarge) {
      EPCHECK(checkLaunch(e, kName[family]));
      ++ll_sent_[family];
      ++ll_recvd_[family];
      return epSuccess;
    }
    // Fewer blocks can be resident than initLl counted SMs for (an MPS client held to part of the GPU by an
    // active-thread percentage, say): the halves run as two launches from now on, this call's included. Nothing
    // was launched, and the refusal is not sticky; it is cleared so that later checks do not see it.
    (void)cudaGetLastError();
    ll_fused_ = false;
    ll_pdl_chain_ = false;
    EP_WARN("GPU engine LL: a cooperative launch of %d blocks does not fit on this device as this process sees it "
            "(%s); both halves of an LL call now run as two launches (set EPCOMM_GPU_LL_BLOCKS lower to keep one)",
            p.blocks, cudaGetErrorString(e));
  }
  if (phases & EP_LL_SEND) {
    EPCHECK(checkLaunch(kSend[family](p, s), kName[family]));
    ++ll_sent_[family];
  }
  if (phases & EP_LL_RECV) {
    EPCHECK(checkLaunch(kRecv[family](p, s), kName[family]));
    ++ll_recvd_[family];
  }
  return epSuccess;
}

// The zero-copy regions are the two halves (parities) of this rank's combine slot area, which peers write only
// in combines that are not zero-copy (all ranks use one mode per combine: it is part of the operation).
static size_t zcRegionBytes(const LlLayout& l) {
  return static_cast<size_t>(l.max_experts) * l.max_tokens * l.comb_row;
}

epResult_t GpuEngine::llCombineBuffer(void** y, size_t* bytes) {
  EP_REQUIRE(ll_lay_.total > 0, epInvalidUsage,
             "the communicator was created without low-latency capacity (config.ll_max_tokens_per_rank = 0)");
  EP_REQUIRE(remote_mask_ == 0, epNotSupported,
             "zero-copy LL combine: the token owners read the expert ranks' regions, which ranks on other hosts "
             "cannot; pass y in your own memory");
  const uint64_t next = ll_sent_[kLlCombine] + 1;
  *y = static_cast<uint8_t*>(ll_bufs_.local()) + ll_lay_.comb + (next & 1) * zcRegionBytes(ll_lay_);
  *bytes = zcRegionBytes(ll_lay_);
  ll_zero_copy_ = true;
  return epSuccess;
}

// The two zero-copy dispatch output regions, each recv_x rows then fp8 scales (LlLayout::zd).
uint8_t* GpuEngine::zdRegion(int i) const {
  return static_cast<uint8_t*>(ll_bufs_.local()) + ll_lay_.zd + static_cast<size_t>(i) * ll_lay_.zd_region;
}

epResult_t GpuEngine::llDispatchBuffer(void** x, size_t* x_bytes, float** scales, size_t* scales_bytes) {
  EP_REQUIRE(ll_lay_.total > 0, epInvalidUsage,
             "the communicator was created without low-latency capacity (config.ll_max_tokens_per_rank = 0)");
  EP_REQUIRE(remote_mask_ == 0, epNotSupported,
             "zero-copy LL dispatch: the senders write the receivers' regions, which ranks on other hosts cannot; "
             "pass recv_x in your own memory");
  EP_REQUIRE(ll_lay_.zd_region > 0, epInvalidUsage,
             "zero-copy LL dispatch regions are allocated only with config.ll_zero_copy_dispatch = 1");
  uint8_t* r = zdRegion(static_cast<int>((ll_sent_[kLlDispatch] + 1) & 1));
  *x = r;
  *x_bytes = ll_lay_.zd_x_bytes;
  *scales = reinterpret_cast<float*>(r + ll_lay_.zd_x_bytes);
  *scales_bytes = ll_lay_.zd_sc_bytes;
  return epSuccess;
}

// A send half whose recv_x is a zero-copy region (epLlDispatchBuffer): checks it and sets p.zd and the offsets
// the senders write at.
epResult_t GpuEngine::zeroCopyDispatch(const epLlDispatchArgs_t& a, LlParams& p) const {
  p.zd = 0;
  if (ll_lay_.zd_region == 0) return epSuccess;
  const uint8_t* x = static_cast<const uint8_t*>(a.recv_x);
  if (x < zdRegion(0) || x >= zdRegion(2)) return epSuccess;
  const size_t off = static_cast<size_t>(x - zdRegion(0)), in = off % ll_lay_.zd_region;
  EP_REQUIRE(in == 0, epInvalidArgument,
             "recv_x lies %zu bytes into a zero-copy LL dispatch region: pass the pointer epLlDispatchBuffer gave",
             in);
  EP_REQUIRE(a.layout == EP_LL_EXPERT_MAJOR, epNotSupported,
             "zero-copy LL dispatch outputs are expert-major only (layout = %d); pass recv_x in your own memory",
             a.layout);
  const uint8_t* sc = x + ll_lay_.zd_x_bytes;
  EP_REQUIRE(!a.use_fp8 || reinterpret_cast<const uint8_t*>(a.recv_x_scales) == sc, epInvalidArgument,
             "recv_x is a zero-copy LL dispatch region, so recv_x_scales must be that region's scales "
             "(epLlDispatchBuffer's recv_x_scales)");
  const size_t rows = static_cast<size_t>(p.L) * comm_->nranks * p.M;
  EP_REQUIRE(rows * p.drow <= ll_lay_.zd_x_bytes, epBufferTooSmall,
             "the dispatch's %zu rows of %zu bytes exceed the zero-copy region's %zu bytes (config.ll_num_experts x "
             "ll_max_tokens_per_rank rows of ll_max_hidden bf16)",
             rows, p.drow, ll_lay_.zd_x_bytes);
  p.zd = 1;
  p.zd_parts = static_cast<int>(std::clamp<int64_t>(epParamGpuLlZdParts(), 1, 32));
  const int64_t rside = epParamGpuLlZdRside();
  p.zd_rside = static_cast<int>(std::clamp<int64_t>(rside < 0 ? p.blocks / 10 : rside, 0, p.blocks - 1));
  p.zd_x_off = static_cast<uint64_t>(x - static_cast<const uint8_t*>(ll_bufs_.local()));
  return epSuccess;
}

epResult_t GpuEngine::llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t stream) {
  EPCHECK(local);
  EPCHECK(llCheck(kLlCombine, a->phases, a->num_experts, a->hidden, a->dtype, a->topk));
  if ((a->phases & EP_LL_SEND) && a->layout == EP_LL_EXPERT_MAJOR)
    EP_REQUIRE(a->recv_src_info != nullptr, epNullPointer,
               "recv_src_info is NULL: the GPU engine's expert-major combine needs it (pass dispatch's output)");
  EPCHECK(checkAligned(a->y, "y"));
  EPCHECK(checkAligned(a->out, "out"));
  LlParams p = llParams(epOpLlCombine, *a);
  p.y = a->y;
  p.recv_count = const_cast<int*>(a->recv_count);
  p.recv_src_info = const_cast<int*>(a->recv_src_info);
  p.recv_layout_range = const_cast<int64_t*>(a->recv_layout_range);
  p.recv_topk_idx = const_cast<int64_t*>(a->recv_topk_idx);
  p.topk_idx = a->topk_idx;
  p.topk_weights = a->topk_weights;
  p.out = a->out;
  // y inside one of this rank's zero-copy regions: a zero-copy combine.
  const uint8_t* region = static_cast<const uint8_t*>(ll_bufs_.local()) + ll_lay_.comb;
  const uint8_t* y = static_cast<const uint8_t*>(a->y);
  if (remote_mask_ == 0 && y >= region && y < region + 2 * zcRegionBytes(ll_lay_)) {
    const size_t need = static_cast<size_t>(p.L) * comm_->nranks * p.M * p.xrow;
    const size_t in_region = static_cast<size_t>(y - region) % zcRegionBytes(ll_lay_);
    EP_REQUIRE(in_region + need <= zcRegionBytes(ll_lay_), epBufferTooSmall,
               "y lies in a zero-copy region (epLlCombineBuffer) but its %zu bytes run past the region's end", need);
    p.zero_copy = 1;
    p.y_off = static_cast<uint64_t>(y - static_cast<const uint8_t*>(ll_bufs_.local()));
  }
  // The receive half must know the mode too: it is the send half's (one combine per kind between halves).
  if (a->phases == EP_LL_RECV) {
    p.zero_copy = ll_recv_zero_copy_;
    p.y_off = 0;
  }
  // Checked on both halves, so that a send half is never accepted whose receive half would be refused.
  EP_REQUIRE(llCombineSmemBytes(a->num_tokens, a->topk, a->num_experts, p.L) <= kLlMaxSmem, epCapacityExceeded,
             "num_tokens x topk = %d x %d with %d experts is more routing than the GPU engine's LL combine stages "
             "(%zu bytes of shared memory)",
             a->num_tokens, a->topk, a->num_experts, kLlMaxSmem);
  if (a->phases & EP_LL_SEND) ll_recv_zero_copy_ = p.zero_copy;
  // Both halves in this call: y stays as it is until the receive half, which reads this rank's own rows there.
  p.own_in_y = a->phases == EP_LL_SEND_RECV && !p.zero_copy;
  return llLaunch(kLlCombine, a->phases, p, stream);
}

}  // namespace epcomm
