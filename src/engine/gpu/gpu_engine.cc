#include "engine/gpu/gpu_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/host_id.h"
#include "common/log.h"
#include "common/param.h"
#include "kernels/ht.h"
#include "kernels/preload.h"

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
// HT across hosts hierarchical (1) or flat (0): the host engine's knob (host_engine.cc), read here for the GPU
// engine's dispatch.
EP_PARAM(HtHierarchical, "HT_HIERARCHICAL", 1);
// Hierarchical HT dispatch: the forwarder of a source on another host moves with the channel (1), so the source
// streams to several ranks there (every one when the channels are at least the host's ranks), each forwarding part
// of it, or is one rank per source and host (0, the host engine's choice).
EP_PARAM(GpuHtFwdSpread, "GPU_HT_FWD_SPREAD", 1);
// Hierarchical HT combine across hosts (1; kernels/ht.cu combineFor: one partial sum per token and host, the host
// engine's order) or flat (0: each rank sends its row back itself, the one-host order). 0 by default: on one H100
// with virtual hosts it took 2.2x flat's time at 2 x 2 ranks and 1.3x at 2 x 4 (its first version, a group of warps
// per owner and one queue per stream, 1.8x and 1.15x in the same run): the partials cross in fp32, and one rank per
// host and channel sends what each of its host's ranks sent before (bench/results/s42.log, call 3).
EP_PARAM(GpuHtCombineHier, "GPU_HT_COMBINE_HIER", 0);

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
  if (proxy_) {
    // What this rank's last operations wrote for other hosts still goes out, unless the communicator was aborted.
    std::vector<uint8_t> live(comm_->nranks);
    for (int r = 0; r < comm_->nranks; ++r) live[r] = remote_[r] && ((active_mask_ >> r) & 1);
    proxy_->stop(!aborted_, live.data(), comm_->config.timeout_ms);
    proxy_.reset();
  }
  if (err_host_) cudaFreeHost(err_host_);
  if (sync_disagree_) cudaFreeHost(sync_disagree_);
  if (resync_out_) cudaFreeHost(resync_out_);
  if (claims_) cudaFree(claims_);
  if (el_dev_) cudaFree(el_dev_);
  if (regions_dev_) cudaFree(regions_dev_);
  if (reg_stream_) cudaStreamDestroy(reg_stream_);
  if (auto_mirror_) cudaFreeHost(auto_mirror_);
  for (AutoSlot& s : auto_slots_)
    if (s.done) cudaEventDestroy(s.done);
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
  // Every kernel loaded before any runs: a lazy load at first launch can wait for spinning kernels (kernels/preload.h).
  e = preloadLlKernels();
  if (e == cudaSuccess) e = preloadHtKernels();
  if (e == cudaSuccess) e = preloadAlltoallvKernels();
  if (e == cudaSuccess) e = preloadElasticKernels();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "loading the GPU engine's kernels: %s", cudaGetErrorString(e));
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
    char host[160];     // hostIdentity: CUDA IPC maps the buffers of this host's ranks, the proxy reaches the others
    char machine[160];  // machineIdentity: virtual hosts on one machine still share its GPUs
  };
  std::vector<DevId> ids(R);
  cudaDeviceGetPCIBusId(ids[comm_->rank].bus, sizeof(ids[0].bus), device_);
  hostIdentity(ids[comm_->rank].host, sizeof(ids[0].host));
  machineIdentity(ids[comm_->rank].machine, sizeof(ids[0].machine));
  EPCHECK(comm_->bootstrap->allgather(ids.data(), sizeof(DevId), c.setup_timeout_ms));
  // Ranks of other hosts are never mapped: the proxy carries what is meant for them. Every rank sees the same
  // identities, so every rank takes the same decisions below.
  remote_.assign(R, 0);
  int sharing = 0;
  for (int r = 0; r < R; ++r) {
    ids[r].host[sizeof(ids[r].host) - 1] = 0;
    ids[r].bus[sizeof(ids[r].bus) - 1] = 0;
    ids[r].machine[sizeof(ids[r].machine) - 1] = 0;
    const bool same_host = strcmp(ids[r].host, ids[comm_->rank].host) == 0;
    remote_[r] = same_host ? 0 : 1;
    if (!same_host) remote_mask_ |= 1ull << r;
    // Bus ids repeat across machines; ranks of virtual hosts on this machine share this GPU's SMs all the same.
    sharing += strcmp(ids[r].machine, ids[comm_->rank].machine) == 0 && strcmp(ids[r].bus, ids[comm_->rank].bus) == 0;
  }
  // Hosts, numbered in the order of their lowest rank, as the host engine numbers them (common/host_id.h).
  {
    std::vector<const char*> hid(R);
    for (int r = 0; r < R; ++r) hid[r] = ids[r].host;
    const HostMap hosts = mapHosts(hid);
    host_of_.assign(R, 0);
    local_of_.assign(R, 0);
    host_ranks_.assign(hosts.ranks.size(), 0);
    for (int r = 0; r < R; ++r) {
      host_of_[r] = static_cast<uint8_t>(hosts.host_of[r]);
      local_of_[r] = static_cast<uint8_t>(hosts.local_idx[r]);
      host_ranks_[hosts.host_of[r]] |= 1ull << r;
    }
  }
  nhosts_ = static_cast<int>(host_ranks_.size());
  my_host_ = host_of_[comm_->rank];
  int widest = 0, narrowest = comm_->nranks;
  for (uint64_t m : host_ranks_) {
    widest = std::max(widest, __builtin_popcountll(m));
    narrowest = std::min(narrowest, __builtin_popcountll(m));
  }
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
  if (remote_mask_ != 0) {
    // Pull protocols read the peers' buffers, which a rank of another host cannot: across hosts HT pushes.
    ht_pull_ = ht_pull_dispatch_ = false;
    EP_INFO(kSubsysInit, "GPU engine: rank %d has %d ranks on other hosts: HT dispatch and combine push through the "
            "queues, a proxy carries the traffic between hosts", comm_->rank, __builtin_popcountll(remote_mask_));
  }
  // Across hosts HT dispatch is hierarchical (a token crosses to a host once; kernels/ht.cu forwardFrom) unless
  // EPCOMM_HT_HIERARCHICAL=0 (the host engine's knob) or a host is wider than a slot can name; the combine too with
  // EPCOMM_GPU_HT_COMBINE_HIER=1 (its expert outputs come back as one partial sum per host: combineFor).
  ht_hier_ = remote_mask_ != 0 && widest <= kGpuHierMaxLocal && epParamHtHierarchical() != 0;
  ht_fwd_spread_ = epParamGpuHtFwdSpread() != 0;
  ht_hier_combine_ = ht_hier_ && epParamGpuHtCombineHier() != 0;
  if (remote_mask_ != 0)
    EP_INFO(kSubsysInit, "GPU engine: %d hosts, HT dispatch across them %s, combine %s", nhosts_,
            ht_hier_ ? "hierarchical (once per host, then inside it)" : "flat",
            ht_hier_combine_ ? "hierarchical (one partial sum per token and host)" : "flat");
  lay_ = gpuBufferLayout(R, channels, queue_rows, c.ht_max_hidden, c.ht_max_tokens_per_rank, ht_pull_dispatch_,
                         ht_hier_ ? widest : 0, ht_hier_combine_ ? R - narrowest : 0);
  // Peers index each other's buffers with this layout and follow one protocol: every rank must have the same
  // (a different EPCOMM_NUM_SMS / GPU_QUEUE_ROWS / GPU_HT_*_PULL on one rank would hang or read out of bounds).
  struct Shape {
    uint64_t total;
    int32_t channels, queue_rows, pull, pull_dispatch, hier;
  };
  // hier: 0 flat, 1 hierarchical dispatch with one forwarder per source and host, 2 with the channel moving it;
  // + 4 with the hierarchical combine
  const int32_t hier = (ht_hier_ ? (ht_fwd_spread_ ? 2 : 1) : 0) + (ht_hier_combine_ ? 4 : 0);
  std::vector<Shape> shapes(R);
  shapes[comm_->rank] = {lay_.total, lay_.channels, lay_.queue_rows, ht_pull_ ? 1 : 0,
                         ht_pull_dispatch_ ? 1 : 0, hier};
  EPCHECK(comm_->bootstrap->allgather(shapes.data(), sizeof(Shape), c.setup_timeout_ms));
  for (int r = 0; r < R; ++r) {
    const Shape& a = shapes[r];
    const Shape& b = shapes[comm_->rank];
    EP_REQUIRE(a.total == b.total && a.channels == b.channels && a.queue_rows == b.queue_rows && a.pull == b.pull &&
                   a.pull_dispatch == b.pull_dispatch && a.hier == b.hier,
               epInvalidUsage,
               "rank %d's GPU engine differs from this rank's (channels %d / %d, queue rows %d / %d, pull combine "
               "%d / %d, pull dispatch %d / %d, hierarchical dispatch %d / %d, buffer %llu / %llu bytes): "
               "EPCOMM_NUM_SMS (or config.num_sms), EPCOMM_GPU_QUEUE_ROWS, EPCOMM_GPU_HT_COMBINE_PULL, "
               "EPCOMM_GPU_HT_DISPATCH_PULL, EPCOMM_HT_HIERARCHICAL, EPCOMM_GPU_HT_FWD_SPREAD and "
               "EPCOMM_GPU_HT_COMBINE_HIER must agree on every rank",
               r, a.channels, b.channels, a.queue_rows, b.queue_rows, a.pull, b.pull, a.pull_dispatch,
               b.pull_dispatch, a.hier, b.hier, static_cast<unsigned long long>(a.total),
               static_cast<unsigned long long>(b.total));
  }
  EPCHECK(bufs_.init(comm_->bootstrap.get(), lay_.total, c.setup_timeout_ms, remote_));
  e = cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(GpuErrorRecord), cudaHostAllocMapped);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostAlloc of the error record: %s", cudaGetErrorString(e));
  memset(err_host_, 0, sizeof(GpuErrorRecord));
  e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0);
  if (e != cudaSuccess) EP_FAIL(epCudaError, "cudaHostGetDevicePointer: %s", cudaGetErrorString(e));
  e = cudaMalloc(reinterpret_cast<void**>(&claims_), sizeof(GpuErrorClaims));
  if (e == cudaSuccess) e = cudaMemset(claims_, 0, sizeof(GpuErrorClaims));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "allocating the error claims: %s", cudaGetErrorString(e));
  e = cudaMalloc(reinterpret_cast<void**>(&regions_dev_), sizeof(GpuRegion) * kGpuRegionSlots);
  if (e == cudaSuccess) e = cudaMemset(regions_dev_, 0, sizeof(GpuRegion) * kGpuRegionSlots);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) EP_FAIL(epCudaError, "allocating the registered-memory table: %s", cudaGetErrorString(e));
  EPCHECK(initElastic());
  EPCHECK(initLl());
  EPCHECK(initImplicitRegistry());
  if (remote_mask_ != 0) {
    const size_t bytes[kRemoteNumBuffers] = {bufs_.local() ? lay_.total : 0, ll_bufs_.local() ? ll_lay_.total : 0};
    proxy_ = std::make_unique<GpuProxy>(comm_->rank, R, remote_, cudaProxyDevice(device_));
    EPCHECK(proxy_->start(comm_->bootstrap.get(), bytes, c.setup_timeout_ms));
    // Every rank's proxy is up before any kernel writes records for it.
    EPCHECK(comm_->bootstrap->barrier(c.setup_timeout_ms));
  }
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
  for (int r = 0; r < comm_->nranks; ++r)
    p.base[r] = remote_[r] ? reinterpret_cast<uint8_t*>(kGpuRemoteWindow) : static_cast<uint8_t*>(bufs_.peer(r));
  p.remote = remote_mask_;
  p.rem = proxy_ ? proxy_->table() : nullptr;
  p.lay = lay_;
  p.err = err_dev_;
  p.claims = claims_;
  p.el = el_dev_;
  p.regions = regions_dev_;
  p.x_region = -1;
  p.timeout_ns = static_cast<uint64_t>(comm_->config.timeout_ms) * 1000000ull;
  // Words in the far copy (host memory the proxy's thread writes) need system-scope loads and fences.
  p.gpu_scope = gpu_sharing_ == comm_->nranks && remote_mask_ == 0;
  p.far_in = proxy_ ? proxy_->farCopy(kRemoteHtBuffer) : nullptr;
  p.nhosts = nhosts_;
  p.fwd_spread = ht_fwd_spread_ ? 1 : 0;  // which rank forwards (dispatch) and combines (combine): forwarderOf
  p.my_host = my_host_;
  for (int r = 0; r < comm_->nranks; ++r) {
    p.host_of[r] = host_of_[r];
    p.local_of[r] = local_of_[r];
  }
  for (int h = 0; h < nhosts_; ++h) p.host_ranks[h] = host_ranks_[h];
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

void GpuEngine::pollAsyncError() {
  if (err_host_ == nullptr) return;
  volatile GpuErrorRecord* er = err_host_;
  if (er->code != 0 && comm_->async_error.load() == epSuccess)
    comm_->recordAsyncError(static_cast<epResult_t>(er->code), er->op, er->epoch, er->peer, er->phase);
  std::lock_guard<std::mutex> lock(comm_->error_mutex);
  comm_->violation = static_cast<epResult_t>(er->violation_code);
  comm_->num_violations = er->violations;
}

// Across hosts (epCommGetNetBytes): the record bytes this rank's proxy forwarded, once it has taken what the
// finished kernels wrote (at most the deadline); 0 on one host.
epResult_t GpuEngine::netBytesSent(uint64_t* bytes) {
  *bytes = 0;
  return proxy_ ? proxy_->bytesForwarded(bytes, comm_->config.timeout_ms) : epSuccess;
}

// Raw net throughput toward the active ranks of other hosts, between bootstrap barriers of all ranks (every rank
// has a proxy or none does).
epResult_t GpuEngine::netRawBandwidth(size_t bytes_per_peer, size_t msg_bytes, int window, uint64_t* bytes_sent,
                                      double* seconds) {
  *bytes_sent = 0;
  *seconds = 0;
  if (!proxy_) return epSuccess;
  std::vector<uint8_t> to(comm_->nranks, 0);
  for (int r = 0; r < comm_->nranks; ++r) to[r] = remote_[r] && ((active_mask_ >> r) & 1) ? 1 : 0;
  const int timeout_ms = comm_->config.timeout_ms;
  Bootstrap* bs = comm_->bootstrap.get();
  return proxy_->rawStream(to, bytes_per_peer, msg_bytes, window, timeout_ms,
                           [bs, timeout_ms] { return bs->barrier(timeout_ms); }, bytes_sent, seconds);
}

void GpuEngine::abort() {
  aborted_ = true;
  if (err_host_) reinterpret_cast<volatile GpuErrorRecord*>(err_host_)->abort = 1;
}

epResult_t checkAligned(const void* p, const char* name) {
  EP_REQUIRE((reinterpret_cast<uintptr_t>(p) & 15) == 0, epInvalidArgument,
             "%s = %p must be 16-byte aligned for the GPU engine", name, p);
  return epSuccess;
}

}  // namespace epcomm
