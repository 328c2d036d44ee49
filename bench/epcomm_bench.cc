// epcomm-bench: HT and LL dispatch + combine (and alltoallv) at DESIGN.md's standard shapes, under epcomm-run.
//
//   epcomm-run -n 4 -- epcomm-bench [--ht-tokens 4096] [--ll-tokens 128] [--hidden 7168] [--topk 8]
//                                   [--experts 256] [--iters 5] [--warmup 2] [--ops ht,ll,a2a] [--sms 24]
//                                   [--csv FILE] [--net-raw-mb 64] [--net-raw-msg-kb 1024] [--net-raw-window 4]
//                                   [--blocking-sync]
//
// Prints one table on rank 0: operation, ranks, tokens, hidden, top-k, experts, SM budget, median time (the
// slowest rank's), GB/s per rank by DeepEP's accounting (bytes of token rows a rank receives (HT) or sends (LL)
// per second), and the headline ratio x_copy: useful bytes per second over the copy roofline measured by all
// ranks at once in this same run. Useful bytes count each row once per rank that receives it, read once and
// written once (host engine: each token row read once plus each received row written once), summed over
// ranks: a ratio that extra passes cannot raise. GPU rows also show moved_GB/s, the bytes the kernels actually
// move (a diagnostic: it grows with extra passes). --csv appends every row to FILE (scripts/plot_bench.py draws
// it; scripts/bench_sweep.sh sweeps SMs and tokens).
//
// Across hosts (epcomm-run --hosts H; GPU engine: the bytes its proxy forwarded, in the HT rows and the LL table's
// graph rows) the rows also show
// the bytes all ranks handed to the inter-host transport per operation (xhost_MB/op, epCommGetNetBytes) and per
// second (xhost_GB/s), and, measured in the same run between the same processes before and after the operations,
// the raw net throughput (epCommNetRawBandwidth: every rank streams --net-raw-mb MiB to every rank of other hosts at once
// over the same EPCOMM_NET backend, in --net-raw-msg-kb KiB messages, --net-raw-window in flight per peer and
// direction; --iters repetitions after --warmup before the operations and as many after, the median of all of them,
// each half's own printed beside it): a "net raw" row (GB/s summed over ranks like xhost_GB/s) and
// xhost/raw = xhost_GB/s over it for every operation. --net-raw-mb 0 leaves the raw measurement out; with every
// rank on one host it is off.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "epcomm/epcomm.h"
#ifdef EPCOMM_HAVE_GPU_ENGINE
#include <cuda_runtime.h>
#endif

namespace {

struct Options {
  int ht_tokens = 4096, ll_tokens = 128, hidden = 7168, topk = 8, experts = 256, iters = 5, warmup = 2, sms = 24;
  int net_raw_mb = 64, net_raw_msg_kb = 1024, net_raw_window = 4;  // raw net stream: MiB per peer, message, window
  bool ht = true, ll = true, a2a = false;
  // GPU engine: the host thread sleeps in CUDA's waits instead of spinning (cudaDeviceScheduleBlockingSync). CUDA
  // spins while a process has fewer contexts than cores: ranks on virtual hosts of one machine then take a core each
  // from the proxies and the net transport's helpers (s34, bench/results/h100-s34.log).
  bool blocking_sync = false;
  std::string csv;
};

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    epResult_t r_ = (call);                                                                           \
    if (r_ != epSuccess) {                                                                            \
      fprintf(stderr, "epcomm-bench: %s failed: %s: %s\n", #call, epGetErrorString(r_), epGetLastError(comm)); \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

epComm_t comm = nullptr;
int rank = 0, nranks = 1;

// This rank's cumulative bytes to ranks of other hosts (host engine; 0 on one host or where not counted).
double netBytes() {
  uint64_t b = 0;
  return epCommGetNetBytes(comm, &b) == epSuccess ? static_cast<double>(b) : 0.0;
}

// Aggregate memcpy bandwidth (bytes read + written per second, all ranks copying at once).
double memcpyRoofline() {
  const size_t bytes = size_t{128} << 20;
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  std::vector<double> t;
  for (int i = 0; i < 4; ++i) {
    CHECK(epCommBarrier(comm, nullptr));
    double t0 = nowSec();
    memcpy(b.data(), a.data(), bytes);
    t.push_back(nowSec() - t0);
    a[i] = b[i + 1];
  }
  double mine = median(t);
  std::vector<size_t> sc(nranks, 0), sd(nranks, 0), rc(nranks, 0), rd(nranks, 0);
  sc[0] = 1;
  std::vector<double> all(nranks, 0.0);
  if (rank == 0)
    for (int r = 0; r < nranks; ++r) {
      rc[r] = 1;
      rd[r] = r;
    }
  CHECK(epAlltoallv(comm, &mine, sc.data(), sd.data(), all.data(), rc.data(), rd.data(), epInt64, nullptr));
  double worst = *std::max_element(all.begin(), all.end());
  return rank == 0 ? 2.0 * bytes * nranks / worst : 0.0;
}

// Raw net throughput across hosts, in the same run and between the same processes as the operations: every rank
// streams to every rank of other hosts at once (epCommNetRawBandwidth). Measured twice, before and after the
// operations (--iters repetitions each, after --warmup), because one short measurement moved by a third from run
// to run on a 16-core host (s35): the reference is the median of both halves' repetitions pooled, and each half's
// own median is printed beside it so that a drift during the run shows. bytes: all ranks' bytes of one
// repetition; seconds: the slowest rank's median. {0, 0} on one host or with --net-raw-mb 0.
struct NetRaw {
  double bytes = 0, seconds = 0, before_s = 0, after_s = 0;
  std::vector<double> mine;  // this rank's times so far (before, then after)
  double gbs() const { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }
  double gbs(double s) const { return s > 0 ? bytes / s / 1e9 : 0.0; }
};

std::vector<double> gatherToRank0(const double* mine, int n);

// One half: --warmup + --iters repetitions; this rank's timed ones go into raw->mine. After the second half (after
// = true) the pooled and per-half figures are gathered on rank 0.
void netRaw(const Options& o, NetRaw* raw, bool after) {
  if (o.net_raw_mb <= 0) return;
  const size_t per_peer = static_cast<size_t>(o.net_raw_mb) << 20, msg = static_cast<size_t>(o.net_raw_msg_kb) << 10;
  uint64_t sent = 0;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    double s = 0;
    CHECK(epCommNetRawBandwidth(comm, per_peer, msg, o.net_raw_window, &sent, &s));  // one host: 0 at once
    if (i >= o.warmup) raw->mine.push_back(s);
  }
  if (!after) return;
  const size_t half = raw->mine.size() / 2;
  const double mine[4] = {median(raw->mine), median({raw->mine.begin(), raw->mine.begin() + half}),
                          median({raw->mine.begin() + half, raw->mine.end()}), static_cast<double>(sent)};
  const std::vector<double> all = gatherToRank0(mine, 4);
  if (rank == 0)
    for (int r = 0; r < nranks; ++r) {
      raw->seconds = std::max(raw->seconds, all[4 * r]);
      raw->before_s = std::max(raw->before_s, all[4 * r + 1]);
      raw->after_s = std::max(raw->after_s, all[4 * r + 2]);
      raw->bytes += all[4 * r + 3];
    }
}

// Random distinct experts per token.
void makeRouting(std::mt19937_64& rng, int T, int K, int E, std::vector<int64_t>& idx, std::vector<float>& w) {
  idx.resize(static_cast<size_t>(T) * K);
  w.resize(static_cast<size_t>(T) * K);
  std::vector<int> perm(E);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) {
      std::swap(perm[k], perm[k + rng() % (E - k)]);
      idx[static_cast<size_t>(t) * K + k] = perm[k];
      w[static_cast<size_t>(t) * K + k] = static_cast<float>(rng() % 1000) / 1000.0f;
    }
  }
}

void makeBf16(std::mt19937_64& rng, std::vector<uint16_t>& x, size_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  x.resize(n);
  for (auto& v : x) v = epcomm::floatToBf16(nd(rng));
}

// One rank's inputs of a benchmark: routing (distinct experts per token), weights and bf16 rows, from one seed.
struct Inputs {
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<uint16_t> x;
};
Inputs makeInputs(uint64_t seed, int T, int K, int E, int H) {
  std::mt19937_64 rng(seed);
  Inputs in;
  makeRouting(rng, T, K, E, in.idx, in.w);
  makeBf16(rng, in.x, static_cast<size_t>(T) * H);
  return in;
}

// HT dispatch arguments of the standard shape, bf16 rows; receive buffers are set by the caller.
epHtDispatchArgs_t htArgs(const Options& o, const void* x, const int64_t* idx, const float* w) {
  epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
  a.num_tokens = o.ht_tokens;
  a.hidden = o.hidden;
  a.topk = o.topk;
  a.num_experts = o.experts;
  a.dtype = epBfloat16;
  a.x = x;
  a.topk_idx = idx;
  a.topk_weights = w;
  return a;
}

struct Row {
  std::string op;
  int tokens;
  double median_s;      // slowest rank's median
  double deepep_gbs;    // mean over ranks
  double useful_bytes;  // summed over ranks
  double moved_bytes;   // summed over ranks; 0 where not measured
  double xhost_bytes;   // bytes sent to ranks of other hosts per iteration, summed over ranks (GPU: HT rows)
};

bool g_gpu = false;  // the communicator runs the GPU engine: gathers stage through device memory

// Every rank's n values, gathered to rank 0 over the communicator (zeros elsewhere).
std::vector<double> gatherToRank0(const double* mine, int n) {
  std::vector<size_t> sc(nranks, 0), sd(nranks, 0), rc(nranks, 0), rd(nranks, 0);
  sc[0] = n;
  if (rank == 0)
    for (int r = 0; r < nranks; ++r) {
      rc[r] = n;
      rd[r] = static_cast<size_t>(n) * r;
    }
  std::vector<double> all(static_cast<size_t>(n) * nranks, 0.0);
  if (!g_gpu) {
    CHECK(epAlltoallv(comm, mine, sc.data(), sd.data(), all.data(), rc.data(), rd.data(), epInt64, nullptr));
    return all;
  }
#ifdef EPCOMM_HAVE_GPU_ENGINE
  void *ds = nullptr, *dr = nullptr;
  cudaMalloc(&ds, sizeof(double) * n);
  cudaMalloc(&dr, sizeof(double) * all.size());
  cudaMemcpy(ds, mine, sizeof(double) * n, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  CHECK(epAlltoallv(comm, ds, sc.data(), sd.data(), dr, rc.data(), rd.data(), epInt64, nullptr));
  cudaDeviceSynchronize();
  cudaMemcpy(all.data(), dr, sizeof(double) * all.size(), cudaMemcpyDeviceToHost);
  cudaFree(ds);
  cudaFree(dr);
#endif
  return all;
}

Row reportRow(const std::string& op, int tokens, const std::vector<double>& times, double my_deepep_bytes,
              double my_useful_bytes, double my_moved_bytes = 0, double my_xhost_bytes = 0) {
  const double t = median(times);
  const double mine[5] = {t, my_deepep_bytes, my_useful_bytes, my_moved_bytes, my_xhost_bytes};
  const std::vector<double> all = gatherToRank0(mine, 5);
  Row row{op, tokens, 0, 0, 0, 0, 0};
  if (rank == 0)
    for (int r = 0; r < nranks; ++r) {
      const double* v = &all[5 * static_cast<size_t>(r)];
      row.xhost_bytes += v[4];
      row.median_s = std::max(row.median_s, v[0]);
      row.deepep_gbs += v[1] / v[0] / 1e9 / nranks;
      row.useful_bytes += v[2];
      row.moved_bytes += v[3];
    }
  return row;
}

void benchHt(const Options& o, std::vector<Row>& rows) {
  const int T = o.ht_tokens, H = o.hidden, K = o.topk, E = o.experts;
  auto [idx, w, x] = makeInputs(1234 + rank, T, K, E, H);
  epHtHandle_t h;
  CHECK(epHtHandleCreate(comm, T, &h));
  epHtDispatchArgs_t a = htArgs(o, x.data(), idx.data(), w.data());
  int num_recv = 0;
  std::vector<int> per_expert(E / nranks);
  CHECK(epHtDispatchNotify(comm, &a, h, &num_recv, per_expert.data(), nullptr));
  std::vector<uint16_t> recv_x(static_cast<size_t>(num_recv) * H);
  std::vector<int64_t> recv_idx(static_cast<size_t>(num_recv) * K);
  std::vector<float> recv_w(static_cast<size_t>(num_recv) * K);
  std::vector<uint16_t> combined(static_cast<size_t>(T) * H);
  a.recv_x = recv_x.data();
  a.recv_x_bytes = recv_x.size() * 2;
  a.recv_topk_idx = recv_idx.data();
  a.recv_topk_idx_bytes = recv_idx.size() * 8;
  a.recv_topk_weights = recv_w.data();
  a.recv_topk_weights_bytes = recv_w.size() * 4;
  epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
  c.num_tokens = T;
  c.hidden = H;
  c.dtype = epBfloat16;
  c.x = recv_x.data();
  c.x_bytes = recv_x.size() * 2;
  c.combined_x = combined.data();
  c.combined_x_bytes = combined.size() * 2;
  std::vector<double> td, tc;
  double xd = 0, xc = 0;  // bytes to other hosts over the timed iterations (dispatch = notify + dispatch)
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    CHECK(epCommBarrier(comm, nullptr));
    const double b0 = netBytes();
    double t0 = nowSec();
    CHECK(epHtDispatchNotify(comm, &a, h, &num_recv, per_expert.data(), nullptr));
    CHECK(epHtDispatch(comm, &a, h, nullptr));
    double t1 = nowSec();
    const double b1 = netBytes();
    CHECK(epCommBarrier(comm, nullptr));
    const double b2 = netBytes();
    double t2 = nowSec();
    CHECK(epHtCombine(comm, &c, h, nullptr));
    double t3 = nowSec();
    const double b3 = netBytes();
    if (i >= o.warmup) {
      td.push_back(t1 - t0);
      tc.push_back(t3 - t2);
      xd += b1 - b0;
      xc += b3 - b2;
    }
  }
  const double row = 2.0 * H;
  const double recv_bytes = num_recv * row;
  rows.push_back(reportRow("HT dispatch", T, td, recv_bytes, T * row + recv_bytes, 0, xd / o.iters));
  rows.push_back(reportRow("HT combine", T, tc, recv_bytes, recv_bytes + T * row, 0, xc / o.iters));  // useful: read once, written once
  epHtHandleDestroy(h);
}

void benchLl(const Options& o, std::vector<Row>& rows) {
  const int T = o.ll_tokens, H = o.hidden, K = o.topk, E = o.experts, L = E / nranks, M = T;
  auto [idx, w, x] = makeInputs(4321 + rank, T, K, E, H);
  epLlDispatchArgs_t d = EP_LL_DISPATCH_ARGS_INIT;
  d.num_tokens = T;
  d.max_tokens_per_rank = M;
  d.hidden = H;
  d.topk = K;
  d.num_experts = E;
  d.dtype = epBfloat16;
  d.x = x.data();
  d.topk_idx = idx.data();
  epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
  CHECK(epLlDispatchSizes(comm, &d, &s));
  std::vector<uint8_t> recv_x(s.recv_x);
  std::vector<int> recv_count(L), src_info(s.recv_src_info / 4);
  std::vector<int64_t> layout(s.recv_layout_range / 8);
  d.recv_x = recv_x.data();
  d.recv_x_bytes = recv_x.size();
  d.recv_count = recv_count.data();
  d.recv_count_bytes = recv_count.size() * 4;
  d.recv_src_info = src_info.data();
  d.recv_src_info_bytes = src_info.size() * 4;
  d.recv_layout_range = layout.data();
  d.recv_layout_range_bytes = layout.size() * 8;
  std::vector<uint16_t> out(static_cast<size_t>(T) * H);
  epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
  c.num_tokens = T;
  c.max_tokens_per_rank = M;
  c.hidden = H;
  c.topk = K;
  c.num_experts = E;
  c.dtype = epBfloat16;
  c.y = recv_x.data();  // the expert stand-in is the identity
  c.y_bytes = recv_x.size();
  c.recv_count = recv_count.data();
  c.recv_src_info = src_info.data();
  c.recv_layout_range = layout.data();
  c.topk_idx = idx.data();
  c.topk_weights = w.data();
  c.out = out.data();
  c.out_bytes = out.size() * 2;
  std::vector<double> td, tc;
  double xd = 0, xc = 0;  // bytes to other hosts over the timed iterations
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    CHECK(epCommBarrier(comm, nullptr));
    const double b0 = netBytes();
    double t0 = nowSec();
    CHECK(epLlDispatch(comm, &d, nullptr));
    double t1 = nowSec();
    const double b1 = netBytes();
    CHECK(epCommBarrier(comm, nullptr));
    const double b2 = netBytes();
    double t2 = nowSec();
    CHECK(epLlCombine(comm, &c, nullptr));
    double t3 = nowSec();
    const double b3 = netBytes();
    if (i >= o.warmup) {
      td.push_back(t1 - t0);
      tc.push_back(t3 - t2);
      xd += b1 - b0;
      xc += b3 - b2;
    }
  }
  double pairs = 0;
  for (int64_t e : idx) pairs += e >= 0;
  int recv_pairs = 0;
  for (int e = 0; e < L; ++e) recv_pairs += recv_count[e];
  const double row = 2.0 * H;
  rows.push_back(reportRow("LL dispatch", T, td, pairs * row, T * row + recv_pairs * row, 0, xd / o.iters));
  rows.push_back(reportRow("LL combine", T, tc, pairs * row, recv_pairs * row + T * row, 0, xc / o.iters));
}


double g_p2p = 0;  // NVLink peer copy bandwidth per rank (GPU engine, several GPUs)

#ifdef EPCOMM_HAVE_GPU_ENGINE
#define CUCHECK(call)                                                                   \
  do {                                                                                  \
    cudaError_t c_ = (call);                                                            \
    if (c_ != cudaSuccess) {                                                            \
      fprintf(stderr, "epcomm-bench: %s failed: %s\n", #call, cudaGetErrorString(c_));  \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

template <typename T>
T* devUpload(const std::vector<T>& v) {
  T* p = nullptr;
  CUCHECK(cudaMalloc(&p, v.size() * sizeof(T) + 16));
  CUCHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  CUCHECK(cudaDeviceSynchronize());  // a pageable copy may return before its DMA is done
  return p;
}
void* devAlloc(size_t bytes) {
  void* p = nullptr;
  CUCHECK(cudaMalloc(&p, bytes + 16));
  CUCHECK(cudaMemset(p, 0, bytes + 16));
  CUCHECK(cudaDeviceSynchronize());
  return p;
}

// Times `body` on the stream after a host barrier: every rank starts together (one GPU under MPS, or several).
template <typename F>
double timeOnStream(cudaStream_t s, F body) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  CHECK(epCommBarrier(comm, s));
  cudaEventRecord(a, s);
  body();
  cudaEventRecord(b, s);
  CUCHECK(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 1e3;
}

// Aggregate device-to-device copy bandwidth (bytes read + written per second), all ranks copying at once.
double copyRoofline(cudaStream_t s) {
  const size_t bytes = size_t{1} << 30;
  void* a = devAlloc(bytes);
  void* b = devAlloc(bytes);
  std::vector<double> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(timeOnStream(s, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s); }));
  cudaFree(a);
  cudaFree(b);
  const double mine = median(std::vector<double>(t.begin() + 1, t.end()));
  const std::vector<double> all = gatherToRank0(&mine, 1);  // the ranks copied at once: the slowest one's time
  return rank == 0 ? 2.0 * bytes * nranks / *std::max_element(all.begin(), all.end()) : 0.0;
}

// Peer-to-peer copy bandwidth from this rank's GPU to the next one (NVLink between GPUs), bytes moved per
// second per rank, all ranks copying at once; 0 when the ranks share one GPU.
double p2pBandwidth(cudaStream_t s) {
  int ndev = 0, dev = 0;
  cudaGetDeviceCount(&ndev);
  cudaGetDevice(&dev);
  if (ndev < 2) return 0;
  const int peer = (dev + 1) % ndev;
  const size_t bytes = size_t{1} << 30;
  void* src = devAlloc(bytes);
  void* dst = nullptr;
  cudaSetDevice(peer);
  CUCHECK(cudaMalloc(&dst, bytes));
  cudaSetDevice(dev);
  cudaDeviceEnablePeerAccess(peer, 0);
  cudaGetLastError();
  std::vector<double> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(timeOnStream(s, [&] { cudaMemcpyPeerAsync(dst, peer, src, dev, bytes, s); }));
  cudaFree(src);
  cudaFree(dst);
  return bytes / median(std::vector<double>(t.begin() + 1, t.end()));
}

void benchGpuHt(const Options& o, std::vector<Row>& rows, cudaStream_t s) {
  const int T = o.ht_tokens, H = o.hidden, K = o.topk, E = o.experts;
  auto [idx, w, x] = makeInputs(1234 + rank, T, K, E, H);
  int64_t* d_idx = devUpload(idx);
  float* d_w = devUpload(w);
  uint16_t* d_x = devUpload(x);
  epHtHandle_t h;
  CHECK(epHtHandleCreate(comm, T, &h));
  epHtDispatchArgs_t a = htArgs(o, d_x, d_idx, d_w);
  int num_recv = 0;
  CHECK(epHtDispatchNotify(comm, &a, h, &num_recv, nullptr, s));
  // Worst-token mode with the capacity of this routing: no host synchronization inside the timed calls.
  a.num_worst_tokens = num_recv > 0 ? num_recv : 1;
  const size_t rows_cap = a.num_worst_tokens;
  a.recv_x = devAlloc(rows_cap * H * 2);
  a.recv_x_bytes = rows_cap * H * 2;
  a.recv_topk_idx = static_cast<int64_t*>(devAlloc(rows_cap * K * 8));
  a.recv_topk_idx_bytes = rows_cap * K * 8;
  a.recv_topk_weights = static_cast<float*>(devAlloc(rows_cap * K * 4));
  a.recv_topk_weights_bytes = rows_cap * K * 4;
  epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
  c.num_tokens = T;
  c.hidden = H;
  c.dtype = epBfloat16;
  c.x = a.recv_x;
  c.x_bytes = a.recv_x_bytes;
  c.combined_x = devAlloc(static_cast<size_t>(T) * H * 2);
  c.combined_x_bytes = static_cast<size_t>(T) * H * 2;
  std::vector<double> td, tc, tg;
  double xd = 0, xc = 0;  // bytes sent to ranks of other hosts per timed dispatch / combine (0 on one host)
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const double b0 = netBytes();
    double d = timeOnStream(s, [&] { CHECK(epHtDispatch(comm, &a, h, s)); });
    const double b1 = netBytes();
    double cb = timeOnStream(s, [&] { CHECK(epHtCombine(comm, &c, h, s)); });
    const double b2 = netBytes();
    if (i >= o.warmup) {
      td.push_back(d);
      tc.push_back(cb);
      xd += (b1 - b0) / o.iters;
      xc += (b2 - b1) / o.iters;
    }
  }
  // The same pair captured once in a CUDA graph and replayed.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUCHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CHECK(epHtDispatch(comm, &a, h, s));
  CHECK(epHtCombine(comm, &c, h, s));
  CUCHECK(cudaStreamEndCapture(s, &graph));
  CUCHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    double g = timeOnStream(s, [&] { CUCHECK(cudaGraphLaunch(exec, s)); });
    if (i >= o.warmup) tg.push_back(g);
  }
  // Zero-copy combine (pull combine only: with the push combine the engine has no region, epNotSupported): after
  // each dispatch the "expert" writes its outputs (here: recv_x) into the region, untimed; the combine reads them
  // there.
  std::vector<double> tz;
  size_t region_bytes = 0;
  void* region = nullptr;
  const epResult_t region_rc = epHtCombineBuffer(comm, &region, &region_bytes);
  if (region_rc != epSuccess && region_rc != epNotSupported) CHECK(region_rc);
  const bool pull = region_rc == epSuccess;
  const char* pull_d_env = getenv("EPCOMM_GPU_HT_DISPATCH_PULL");  // the dispatch mode has no query: its parameter
  const bool pull_d = pull_d_env == nullptr || atoi(pull_d_env) != 0;
  if (pull) {
    epHtCombineArgs_t z = c;
    z.x = region;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      CHECK(epHtDispatch(comm, &a, h, s));
      CUCHECK(cudaMemcpyAsync(region, a.recv_x, a.recv_x_bytes, cudaMemcpyDeviceToDevice, s));
      double zc = timeOnStream(s, [&] { CHECK(epHtCombine(comm, &z, h, s)); });
      if (i >= o.warmup) tz.push_back(zc);
    }
  }
  // Registered combine input (epCommRegister): the plain combine's x, recv_x, registered once; the owners read
  // it in place, and the combine completes once they have. Pull combine only, as the zero-copy row (across hosts
  // neither exists).
  std::vector<double> tr;
  if (pull) {
    epMemRegion_t reg = nullptr;
    CHECK(epCommRegister(comm, a.recv_x, a.recv_x_bytes, &reg));
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      CHECK(epHtDispatch(comm, &a, h, s));
      double cr = timeOnStream(s, [&] { CHECK(epHtCombine(comm, &c, h, s)); });
      if (i >= o.warmup) tr.push_back(cr);
    }
    CHECK(epCommDeregister(reg));
  }
  const double row = 2.0 * H, recv = num_recv * row;
  // This rank's rows of its own tokens (the pull combine reads them in x, uncopied).
  int own_tokens = 0;
  for (int t = 0; t < T; ++t) {
    bool own = false;
    for (int k = 0; k < K; ++k) {
      const int64_t e = idx[static_cast<size_t>(t) * K + k];
      own |= e >= 0 && e / (E / nranks) == rank;
    }
    own_tokens += own;
  }
  // Bytes the kernels move through HBM (read + written), a diagnostic. Pull dispatch (the default) stages each
  // token once (read + write per token, T at most) and the receiver reads its rows there and writes them into
  // recv_x (2 per row); push dispatch reads each sent row, writes it into the receiver's queue, which the
  // receiving block reads and writes into recv_x (4 per row). Pull combine (the default) copies each
  // expert-output row but its own tokens' into this rank's staging (read + write; nothing with zero-copy), the
  // owner reads it there (or in x) and writes one output row per token (3 per row - 2 per own row + 1;
  // zero-copy 1 + 1). Push combine: into the source's queue, moved into its staging, read by the reduction
  // (5 per row + 1). Useful bytes: each received row read once and written once.
  // With implicit registration (EPCOMM_GPU_HT_AUTO_REGISTER=1, the default; one host, as pull says) the timed plain
  // combines read x in place once the owners mapped it: the registered row's bytes.
  const char* auto_env = getenv("EPCOMM_GPU_HT_AUTO_REGISTER");
  const bool auto_reg = pull && (auto_env == nullptr || atoi(auto_env) != 0);
  const double disp_bytes = pull_d ? 2 * recv + 2 * T * row : 4 * recv;
  const double comb_bytes = auto_reg ? recv + T * row : pull ? 3 * recv - 2 * own_tokens * row + T * row : 5 * recv + T * row;
  rows.push_back(reportRow("HT dispatch", T, td, recv, 2 * recv, disp_bytes, xd));
  rows.push_back(reportRow("HT combine", T, tc, recv, 2 * recv, comb_bytes, xc));
  if (pull) rows.push_back(reportRow("HT combine zero-copy", T, tz, recv, 2 * recv, recv + T * row));
  if (pull) rows.push_back(reportRow("HT combine registered", T, tr, recv, 2 * recv, recv + T * row));
  rows.push_back(reportRow("HT graph d+c", T, tg, 2 * recv, 4 * recv, disp_bytes + comb_bytes, xd + xc));
  {
    // fp8 dispatch: the same routing, rows of H bytes plus H/128 fp32 scales.
    std::vector<uint8_t> x8(static_cast<size_t>(T) * H);
    for (size_t i = 0; i < x8.size(); ++i) x8[i] = epcomm::floatToFp8(epcomm::bf16ToFloat(x[i]));
    std::vector<float> sc(static_cast<size_t>(T) * (H / 128), 1.0f);
    uint8_t* d_x8 = devUpload(x8);
    float* d_sc = devUpload(sc);
    epHtDispatchArgs_t a8 = a;
    a8.dtype = epFloat8E4M3;
    a8.x = d_x8;
    a8.x_scales = d_sc;
    a8.recv_x_bytes = rows_cap * H;
    a8.recv_x_scales = static_cast<float*>(devAlloc(rows_cap * (H / 128) * 4));
    a8.recv_x_scales_bytes = rows_cap * (H / 128) * 4;
    std::vector<double> t8;
    double xh8 = 0;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      const double b0 = netBytes();
      double d = timeOnStream(s, [&] { CHECK(epHtDispatch(comm, &a8, h, s)); });
      const double b1 = netBytes();
      if (i >= o.warmup) {
        t8.push_back(d);
        xh8 += (b1 - b0) / o.iters;
      }
    }
    const double row8 = H + H / 128 * 4.0, recv8 = num_recv * row8;
    const double moved8 = pull_d ? 2 * recv8 + 2 * T * row8 : 4 * recv8;
    rows.push_back(reportRow("HT dispatch fp8", T, t8, recv8, 2 * recv8, moved8, xh8));
    cudaFree(d_x8);
    cudaFree(d_sc);
    cudaFree(a8.recv_x_scales);
  }
  epResult_t ae;
  epErrorInfo_t info = EP_ERROR_INFO_INIT;
  CHECK(epCommGetAsyncError(comm, &ae, &info));
  if (ae != epSuccess || info.num_violations != 0) {
    fprintf(stderr, "epcomm-bench: rank %d: async error %s, %llu violations\n", rank, epGetErrorString(ae),
            static_cast<unsigned long long>(info.num_violations));
    exit(1);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  epHtHandleDestroy(h);
}

// LL on the GPU engine, microseconds. Eager: one call after a host barrier (median over iterations). Graph: a
// graph holding `kReps` back-to-back operations, replayed after a host barrier; its time / kReps per operation
// (median over replays), which amortizes the barrier's skew between ranks.
#ifdef EPCOMM_LL_PROBE  // kernels/ll_probe.cuh: phase stamps of LL dispatches, printed after each graph row
extern "C" void epcommLlProbeReset();
extern "C" void epcommLlProbeDump(const char* what, int rank);
#endif
struct LlTimes {
  std::string what;
  double eager_us, graph_us;
  double bytes;  // DeepEP's accounting: bytes of (token, expert) rows this rank sends
  double xhost_bytes = 0;  // across hosts: what every rank's proxy forwarded per operation, summed (graph replays)
};
std::vector<LlTimes> g_ll;

void benchGpuLl(const Options& o, cudaStream_t s) {
  const int T = o.ll_tokens, H = o.hidden, K = o.topk, E = o.experts, L = E / nranks, M = T, R = nranks;
  auto [idx, w, x] = makeInputs(4321 + rank, T, K, E, H);
  int64_t* d_idx = devUpload(idx);
  float* d_w = devUpload(w);
  uint16_t* d_x = devUpload(x);
  double pairs = 0;
  for (int64_t e : idx) pairs += e >= 0;
  const size_t rows = static_cast<size_t>(L) * R * M;
  void* recv_x = devAlloc(rows * H * 2);
  float* scales = static_cast<float*>(devAlloc(rows * (H / 128) * 4));
  int* cnt = static_cast<int*>(devAlloc(L * 4));
  int* src = static_cast<int*>(devAlloc(rows * 4));
  int64_t* lr = static_cast<int64_t*>(devAlloc(static_cast<size_t>(L) * R * 8));
  void* y = devAlloc(rows * H * 2);
  void* out = devAlloc(static_cast<size_t>(T) * H * 2);
  auto dargs = [&](bool fp8, unsigned phases) {
    epLlDispatchArgs_t d = EP_LL_DISPATCH_ARGS_INIT;
    d.num_tokens = T;
    d.max_tokens_per_rank = M;
    d.hidden = H;
    d.topk = K;
    d.num_experts = E;
    d.use_fp8 = fp8;
    d.phases = phases;
    d.x = d_x;
    d.topk_idx = d_idx;
    d.recv_x = recv_x;
    d.recv_x_bytes = rows * H * 2;
    d.recv_x_scales = fp8 ? scales : nullptr;
    d.recv_x_scales_bytes = fp8 ? rows * (H / 128) * 4 : 0;
    d.recv_count = cnt;
    d.recv_count_bytes = L * 4;
    d.recv_src_info = src;
    d.recv_src_info_bytes = rows * 4;
    d.recv_layout_range = lr;
    d.recv_layout_range_bytes = static_cast<size_t>(L) * R * 8;
    return d;
  };
  auto cargs = [&](unsigned phases) {
    epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
    c.num_tokens = T;
    c.max_tokens_per_rank = M;
    c.hidden = H;
    c.topk = K;
    c.num_experts = E;
    c.phases = phases;
    c.y = y;
    c.y_bytes = rows * H * 2;
    c.recv_count = cnt;
    c.recv_src_info = src;
    c.recv_layout_range = lr;
    c.topk_idx = d_idx;
    c.topk_weights = d_w;
    c.out = out;
    c.out_bytes = static_cast<size_t>(T) * H * 2;
    return c;
  };
  constexpr int kReps = 20;
  const int samples = std::max(o.iters, 1000 / kReps);
  auto measure = [&](const std::string& what, double bytes, const std::function<void()>& op) {
    std::vector<double> te, tg;
    for (int i = 0; i < o.warmup + samples; ++i) {
      double t = timeOnStream(s, op);
      if (i >= o.warmup) te.push_back(t);
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUCHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < kReps; ++r) op();
    CUCHECK(cudaStreamEndCapture(s, &graph));
    CUCHECK(cudaGraphInstantiate(&exec, graph, 0));
#ifdef EPCOMM_LL_PROBE
    epcommLlProbeReset();
#endif
    double xb = 0;  // this rank's bytes to other hosts over the timed replays (each replay waits for its operations)
    for (int i = 0; i < o.warmup + samples; ++i) {
      const double b0 = netBytes();
      double t = timeOnStream(s, [&] { CUCHECK(cudaGraphLaunch(exec, s)); });
      if (i >= o.warmup) {
        tg.push_back(t / kReps);
        xb += netBytes() - b0;
      }
    }
    const double mine = xb / samples / kReps;
    const std::vector<double> all = gatherToRank0(&mine, 1);  // collective: every rank measures the same rows
#ifdef EPCOMM_LL_PROBE
    epcommLlProbeDump(what.c_str(), rank);
#endif
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    double xhost = 0;
    for (double v : all) xhost += v;
    g_ll.push_back({what, median(te) * 1e6, median(tg) * 1e6, bytes, xhost});
  };
  // The halves' own times, eager: events around the send kernel and around the receive kernel.
  auto halves = [&](const std::string& what, const std::function<void()>& send, const std::function<void()>& recv) {
    cudaEvent_t ev[3];
    for (auto& e : ev) cudaEventCreate(&e);
    std::vector<double> ts, tr;
    for (int i = 0; i < o.warmup + samples; ++i) {
      CHECK(epCommBarrier(comm, s));
      cudaEventRecord(ev[0], s);
      send();
      cudaEventRecord(ev[1], s);
      recv();
      cudaEventRecord(ev[2], s);
      CUCHECK(cudaEventSynchronize(ev[2]));
      float a = 0, b = 0;
      cudaEventElapsedTime(&a, ev[0], ev[1]);
      cudaEventElapsedTime(&b, ev[1], ev[2]);
      if (i >= o.warmup) {
        ts.push_back(a * 1e3);
        tr.push_back(b * 1e3);
      }
    }
    for (auto& e : ev) cudaEventDestroy(e);
    g_ll.push_back({what + " send half", median(ts), 0, 0});
    g_ll.push_back({what + " recv half", median(tr), 0, 0});
  };
  const double row = 2.0 * H, row8 = H + H / 128 * 4.0;
  for (int fp8 = 0; fp8 < 2; ++fp8) {
    epLlDispatchArgs_t d = dargs(fp8, EP_LL_SEND_RECV), ds = dargs(fp8, EP_LL_SEND), dr = dargs(fp8, EP_LL_RECV);
    const std::string tag = fp8 ? " fp8" : "";
    const double b = pairs * (fp8 ? row8 : row);
    measure("dispatch" + tag, b, [&] { CHECK(epLlDispatch(comm, &d, s)); });
    measure("dispatch halves" + tag, b, [&] {
      CHECK(epLlDispatch(comm, &ds, s));
      CHECK(epLlDispatch(comm, &dr, s));
    });
  }
  // Zero-copy dispatch (config.ll_zero_copy_dispatch): the senders write the final rows into the receivers'
  // regions, so the receive half moves none. Refused across hosts (epNotSupported): no rows then.
  void* zx = nullptr;
  float* zsc = nullptr;
  size_t zxb = 0, zscb = 0;
  const epResult_t zd_rc = epLlDispatchBuffer(comm, &zx, &zxb, &zsc, &zscb);
  if (zd_rc != epNotSupported) CHECK(zd_rc);
  auto zargs = [&](bool fp8, unsigned phases) {
    epLlDispatchArgs_t d = dargs(fp8, phases);
    d.recv_x = zx;
    d.recv_x_bytes = zxb;
    d.recv_x_scales = fp8 ? zsc : nullptr;
    d.recv_x_scales_bytes = fp8 ? zscb : 0;
    return d;
  };
  if (zd_rc == epSuccess)
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      epLlDispatchArgs_t d = zargs(fp8, EP_LL_SEND_RECV), ds = zargs(fp8, EP_LL_SEND), dr = zargs(fp8, EP_LL_RECV);
      const std::string tag = fp8 ? " fp8" : "";
      const double b = pairs * (fp8 ? row8 : row);
      measure("dispatch zero-copy" + tag, b, [&] { CHECK(epLlDispatch(comm, &d, s)); });
      measure("dispatch halves zero-copy" + tag, b, [&] {
        CHECK(epLlDispatch(comm, &ds, s));
        CHECK(epLlDispatch(comm, &dr, s));
      });
    }
  epLlDispatchArgs_t d = dargs(false, EP_LL_SEND_RECV);
  CHECK(epLlDispatch(comm, &d, s));
  CUCHECK(cudaMemcpyAsync(y, recv_x, rows * H * 2, cudaMemcpyDeviceToDevice, s));
  epLlCombineArgs_t c = cargs(EP_LL_SEND_RECV), cs = cargs(EP_LL_SEND), cr = cargs(EP_LL_RECV);
  measure("combine", pairs * row, [&] { CHECK(epLlCombine(comm, &c, s)); });
  measure("combine halves", pairs * row, [&] {
    CHECK(epLlCombine(comm, &cs, s));
    CHECK(epLlCombine(comm, &cr, s));
  });
  {
    epLlDispatchArgs_t ds = dargs(false, EP_LL_SEND), dr = dargs(false, EP_LL_RECV);
    halves("dispatch", [&] { CHECK(epLlDispatch(comm, &ds, s)); }, [&] { CHECK(epLlDispatch(comm, &dr, s)); });
    if (zd_rc == epSuccess) {
      epLlDispatchArgs_t zs = zargs(false, EP_LL_SEND), zr = zargs(false, EP_LL_RECV);
      halves("dispatch zero-copy", [&] { CHECK(epLlDispatch(comm, &zs, s)); },
             [&] { CHECK(epLlDispatch(comm, &zr, s)); });
    }
    CUCHECK(cudaMemcpyAsync(y, recv_x, rows * H * 2, cudaMemcpyDeviceToDevice, s));
    halves("combine", [&] { CHECK(epLlCombine(comm, &cs, s)); }, [&] { CHECK(epLlCombine(comm, &cr, s)); });
  }
  void* region = nullptr;
  size_t region_bytes = 0;
  const epResult_t region_rc = epLlCombineBuffer(comm, &region, &region_bytes);  // epNotSupported across hosts
  if (region_rc != epNotSupported) CHECK(region_rc);
  if (region_rc == epSuccess) {
    CUCHECK(cudaMemcpyAsync(region, y, rows * H * 2, cudaMemcpyDeviceToDevice, s));
    epLlCombineArgs_t cz = cargs(EP_LL_SEND_RECV);
    cz.y = region;
    cz.y_bytes = region_bytes;
    measure("combine zero-copy", pairs * row, [&] { CHECK(epLlCombine(comm, &cz, s)); });
    if (zd_rc == epSuccess) {  // both zero-copy: what an expert layer that reads and writes the regions runs
      epLlDispatchArgs_t dz = zargs(false, EP_LL_SEND_RECV);
      measure("round trip zero-copy", 2 * pairs * row, [&] {
        CHECK(epLlDispatch(comm, &dz, s));
        CHECK(epLlCombine(comm, &cz, s));
      });
    }
  }
  measure("round trip", 2 * pairs * row, [&] {
    CHECK(epLlDispatch(comm, &d, s));
    CHECK(epLlCombine(comm, &c, s));
  });
  for (void* p : {static_cast<void*>(d_idx), static_cast<void*>(d_w), static_cast<void*>(d_x), recv_x,
                  static_cast<void*>(scales), static_cast<void*>(cnt), static_cast<void*>(src),
                  static_cast<void*>(lr), y, out})
    cudaFree(p);
}

// alltoallv (device counts) on the GPU engine: `bytes` per rank split evenly over the ranks. Useful work is each
// byte read once and written once: 2 * bytes * R per operation over the copy roofline of the same run.
void benchGpuA2a(const Options& o, std::vector<Row>& rows, cudaStream_t s) {
  const int R = nranks;
  for (size_t bytes = size_t{1} << 20; bytes <= (size_t{256} << 20); bytes <<= 2) {
    const size_t per = bytes / R / 4 * 4;  // float32 elements to each peer, as bytes
    void* sb = devAlloc(per * R);
    void* rb = devAlloc(per * R);
    std::vector<int64_t> counts(R, static_cast<int64_t>(per / 4));
    int64_t* dc = devUpload(counts);
    int64_t* rc = static_cast<int64_t*>(devAlloc(R * 8));
    std::vector<size_t> hc(R, per / 4), hd(R);
    for (int p = 0; p < R; ++p) hd[p] = p * (per / 4);
    std::vector<double> th, td;
    for (int i = 0; i < o.warmup + o.iters; ++i) {
      double a = timeOnStream(s, [&] {
        CHECK(epAlltoallv(comm, sb, hc.data(), hd.data(), rb, hc.data(), hd.data(), epFloat32, s));
      });
      double b = timeOnStream(s, [&] {
        CHECK(epAlltoallvDevice(comm, sb, dc, rb, per / 4 * R, rc, nullptr, epFloat32, s));
      });
      if (i >= o.warmup) {
        th.push_back(a);
        td.push_back(b);
      }
    }
    const double b = static_cast<double>(per) * R;  // bytes each rank sends (and receives)
    const std::string mib = std::to_string((per * R) >> 20) + "MiB";
    rows.push_back(reportRow("a2a " + mib + " host", 0, th, b, 2 * b));
    rows.push_back(reportRow("a2a " + mib + " device", 0, td, b, 2 * b));
    for (void* p : {sb, rb, static_cast<void*>(dc), static_cast<void*>(rc)}) cudaFree(p);
  }
}
#endif

int usage(const char* argv0, const std::string& why) {
  // Every rank prints: under epcomm-run the first rank to exit stops the others, so rank 0 may never get to it.
  fprintf(stderr,
          "epcomm-bench (rank %s): %s\n"
          "usage: epcomm-run -n R -- %s [--ht-tokens N] [--ll-tokens N] [--hidden H] [--topk K] [--experts E]\n"
          "                                [--iters N] [--warmup N] [--ops ht,ll,a2a] [--sms N] [--csv FILE]\n"
          "                                [--net-raw-mb MiB] [--net-raw-msg-kb KiB] [--net-raw-window N]\n"
          "                                [--blocking-sync]\n",
          getenv("EPCOMM_RANK") ? getenv("EPCOMM_RANK") : "?", why.c_str(), argv0);
  return 2;
}

// One CSV line per row (header when the file is new), for scripts/plot_bench.py.
// Across hosts: net_raw_gbs is the run's raw net throughput (the same on every row; 0 where not measured) and
// xhost_raw the row's xhost GB/s over it; a "net raw" row carries the raw stream itself (xhost_bytes: all ranks'
// bytes of one repetition).
void appendCsv(const Options& o, const char* engine, const std::vector<Row>& rows, double roof,
               const NetRaw& raw = NetRaw{}, bool raw_row = true) {
  static const char* kHeader =
      "op,engine,ranks,tokens,hidden,topk,experts,sms,median_us,deepep_gbs,useful_gbs,x_copy,moved_gbs,"
      "xhost_bytes,net_raw_gbs,xhost_raw";
  bool fresh = true;
  if (FILE* r = fopen(o.csv.c_str(), "r")) {  // a file of an older bench has fewer columns: say so, append anyway
    char line[512] = {0};
    fresh = fgets(line, sizeof(line), r) == nullptr;
    line[strcspn(line, "\n")] = 0;
    if (!fresh && strcmp(line, kHeader) != 0)
      fprintf(stderr, "epcomm-bench: --csv %s has another header (an older epcomm-bench?); rows appended with "
                      "this one's columns: %s\n", o.csv.c_str(), kHeader);
    fclose(r);
  }
  FILE* f = fopen(o.csv.c_str(), "a");
  if (f == nullptr) {
    fprintf(stderr, "epcomm-bench: cannot open --csv %s: %s\n", o.csv.c_str(), strerror(errno));
    return;
  }
  if (fresh) fprintf(f, "%s\n", kHeader);
  const double raw_gbs = raw.gbs();
  for (const Row& r : rows) {
    const double xhost_gbs = r.xhost_bytes / r.median_s / 1e9;
    fprintf(f, "%s,%s,%d,%d,%d,%d,%d,%d,%.3f,%.3f,%.3f,%.4f,%.3f,%.0f,%.3f,%.4f\n", r.op.c_str(), engine, nranks,
            r.tokens, o.hidden, o.topk, o.experts, o.sms, r.median_s * 1e6, r.deepep_gbs,
            r.useful_bytes / r.median_s / 1e9, r.useful_bytes / r.median_s / roof, r.moved_bytes / r.median_s / 1e9,
            r.xhost_bytes, raw_gbs, raw_gbs > 0 ? xhost_gbs / raw_gbs : 0.0);
  }
  if (raw_gbs > 0 && raw_row)
    fprintf(f, "net raw,%s,%d,0,%d,%d,%d,%d,%.3f,0,0,0,0,%.0f,%.3f,0\n", engine, nranks, o.hidden, o.topk,
            o.experts, o.sms, raw.seconds * 1e6, raw.bytes, raw_gbs);
  fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&](int& v) {
      if (i + 1 >= argc) exit(usage(argv[0], a + " needs a value"));
      char* end = nullptr;
      v = static_cast<int>(strtol(argv[++i], &end, 10));
      if (end == argv[i] || *end != '\0') exit(usage(argv[0], a + " takes a whole number, not '" + argv[i] + "'"));
    };
    if (a == "--ht-tokens") next(o.ht_tokens);
    else if (a == "--ll-tokens") next(o.ll_tokens);
    else if (a == "--hidden") next(o.hidden);
    else if (a == "--topk") next(o.topk);
    else if (a == "--experts") next(o.experts);
    else if (a == "--iters") next(o.iters);
    else if (a == "--warmup") next(o.warmup);
    else if (a == "--sms") next(o.sms);
    else if (a == "--net-raw-mb") next(o.net_raw_mb);
    else if (a == "--net-raw-msg-kb") next(o.net_raw_msg_kb);
    else if (a == "--net-raw-window") next(o.net_raw_window);
    else if (a == "--ops" && i + 1 < argc) {
      std::string ops = argv[++i];
      o.ht = ops.find("ht") != std::string::npos;
      o.ll = ops.find("ll") != std::string::npos;
      o.a2a = ops.find("a2a") != std::string::npos;
    } else if (a == "--blocking-sync") {
      o.blocking_sync = true;
    } else if (a == "--csv" && i + 1 < argc) {
      o.csv = argv[++i];
    } else {
      return usage(argv[0], "unknown argument '" + a + "'");
    }
  }
  if (o.ht_tokens < 1 || o.ll_tokens < 1 || o.hidden < 8 || o.topk < 1 || o.experts < 1 || o.iters < 1 ||
      o.warmup < 0 || o.sms < 0)
    return usage(argv[0], "--ht-tokens, --ll-tokens, --topk, --experts and --iters must be at least 1, --hidden "
                          "at least 8, --warmup and --sms not negative");
  if (o.topk > o.experts) return usage(argv[0], "--topk is larger than --experts");
  if (o.net_raw_mb < 0 || o.net_raw_mb > (1 << 20) || o.net_raw_msg_kb < 1 || o.net_raw_msg_kb > (1 << 20) ||
      o.net_raw_window < 1 || o.net_raw_window > 32)
    return usage(argv[0], "--net-raw-mb must be in [0, 2^20] (0: off), --net-raw-msg-kb in [1, 2^20], "
                          "--net-raw-window in [1, 32]");
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.ll_max_tokens_per_rank = o.ll_tokens;
  cfg.ll_max_hidden = o.hidden;
  cfg.ll_zero_copy_dispatch = 1;  // the zero-copy dispatch rows (ignored across hosts)
  if (getenv("EPCOMM_QUEUE_BYTES") == nullptr) cfg.queue_bytes = size_t{8} << 20;
  cfg.ht_max_tokens_per_rank = o.ht_tokens;
  cfg.ht_max_hidden = o.hidden;
  cfg.num_sms = o.sms;
#ifdef EPCOMM_HAVE_GPU_ENGINE
  if (o.blocking_sync) {  // before any CUDA call makes a context: applies to the device the engine takes
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
      cudaGetLastError();
      fprintf(stderr, "epcomm-bench: --blocking-sync ignored: no GPU\n");
    } else if ((e = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync)) != cudaSuccess) {
      fprintf(stderr, "epcomm-bench: --blocking-sync: cudaSetDeviceFlags: %s\n", cudaGetErrorString(e));
      return 1;
    }
  }
#else
  if (o.blocking_sync) return usage(argv[0], "--blocking-sync needs the GPU engine (this build has none)");
#endif
  CHECK(epCommInitFromEnv(&comm, &cfg));
  CHECK(epCommRank(comm, &rank));
  CHECK(epCommSize(comm, &nranks));
  epEngine_t engine;
  CHECK(epCommEngine(comm, &engine));
  if (o.experts % nranks != 0)
    return usage(argv[0], "--experts " + std::to_string(o.experts) + " is not a multiple of the " +
                              std::to_string(nranks) + " ranks");
  g_gpu = engine == EP_ENGINE_GPU;
  double roof = 0;
  NetRaw raw;
  std::vector<Row> rows;
  if (engine == EP_ENGINE_GPU) {
#ifdef EPCOMM_HAVE_GPU_ENGINE
    cudaStream_t s;
    CUCHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    roof = copyRoofline(s);
    g_p2p = p2pBandwidth(s);
    netRaw(o, &raw, false);  // across hosts: the proxy's net transport between the same processes
    if (o.ht) benchGpuHt(o, rows, s);
    if (o.ll) benchGpuLl(o, s);
    if (o.a2a) benchGpuA2a(o, rows, s);
    netRaw(o, &raw, true);
#endif
  } else {
    roof = memcpyRoofline();
    netRaw(o, &raw, false);
    if (o.ht) benchHt(o, rows);
    if (o.ll) benchLl(o, rows);
    netRaw(o, &raw, true);
  }
  if (rank == 0) {
    const bool gpu = engine == EP_ENGINE_GPU;
    printf("epcomm-bench: %s engine, %d ranks, SM budget %d, median of %d iterations; %s roofline %.2f GB/s "
           "(aggregate read+write, all ranks copying at once); x_copy = useful bytes per second over it\n",
           gpu ? "GPU" : "host", nranks, o.sms, o.iters, gpu ? "device-to-device copy" : "memcpy", roof / 1e9);
    printf("%-20s %5s %6s %6s %5s %7s %11s %14s %12s %8s", "operation", "ranks", "tokens", "hidden", "topk", "experts",
           "median_ms", "GB/s(DeepEP)", "useful_GB/s", "x_copy");
    bool xhost = raw.gbs() > 0;  // more than one host: bytes to other hosts per operation (all ranks, per iteration)
    for (const Row& r : rows) xhost = xhost || r.xhost_bytes > 0;
    if (gpu) printf(" %12s", "moved_GB/s");
    printf(xhost ? " %12s %11s" : "", "xhost_MB/op", "xhost_GB/s");
    printf(raw.gbs() > 0 ? " %9s\n" : "\n", "xhost/raw");
    if (g_p2p > 0)
      printf("NVLink peer copy: %.2f GB/s per rank (all ranks copying to the next GPU at once); x_p2p below is "
             "GB/s(DeepEP) over it\n", g_p2p / 1e9);
    for (const Row& r : rows) {
      const double useful = r.useful_bytes / r.median_s;
      printf("%-20s %5d %6d %6d %5d %7d %11.3f %14.2f %12.2f %8.3f", r.op.c_str(), nranks, r.tokens, o.hidden,
             o.topk, o.experts, r.median_s * 1e3, r.deepep_gbs, useful / 1e9, useful / roof);
      if (gpu) printf(" %12.2f", r.moved_bytes / r.median_s / 1e9);
      if (xhost) printf(" %12.3f %11.3f", r.xhost_bytes / 1e6, r.xhost_bytes / r.median_s / 1e9);
      if (raw.gbs() > 0) printf(" %9.3f", r.xhost_bytes / r.median_s / 1e9 / raw.gbs());
      if (g_p2p > 0) printf("   x_p2p %.3f", r.deepep_gbs * 1e9 / g_p2p);
      printf("\n");
    }
    if (raw.gbs() > 0) {
      printf("%-20s %5d %6s %6s %5s %7s %11.3f %14s %12s %8s %12.3f %11.3f %9s\n", "net raw", nranks, "-", "-", "-",
             "-", raw.seconds * 1e3, "-", "-", "-", raw.bytes / 1e6, raw.gbs(), "-");
      const char* net = getenv("EPCOMM_NET");
      printf("net raw: every rank streamed %d MiB to every rank of other hosts at once over net/%s (%d KiB messages, "
             "%d in flight per peer and direction; connections of its own, set up like the engine's), %d times "
             "before the operations and %d times after; the median of all %d (before alone %.3f GB/s, after alone "
             "%.3f); xhost/raw = xhost_GB/s over it\n", o.net_raw_mb, net && *net ? net : "socket", o.net_raw_msg_kb,
             o.net_raw_window, o.iters, o.iters, 2 * o.iters, raw.gbs(raw.before_s), raw.gbs(raw.after_s));
    }
#ifdef EPCOMM_HAVE_GPU_ENGINE
    // Across hosts the graph rows also give what all ranks' proxies forwarded per operation (xhost_MB/op), that per
    // second of rank 0's graph time (xhost_GB/s), and that over the raw net stream (xhost/raw).
    bool ll_xhost = raw.gbs() > 0;
    for (const LlTimes& t : g_ll) ll_xhost = ll_xhost || t.xhost_bytes > 0;
    if (!g_ll.empty())
      printf("LL on the GPU engine, rank 0's view: %d tokens, hidden %d, top-%d, %d experts; eager = one call after "
             "a host barrier, graph = back-to-back operations in one graph, per operation (median)\n%-22s %10s %10s "
             "%14s%s\n", o.ll_tokens, o.hidden, o.topk, o.experts, "LL operation", "eager_us", "graph_us",
             "GB/s(DeepEP)", ll_xhost ? (raw.gbs() > 0 ? "  xhost_MB/op  xhost_GB/s xhost/raw" : "  xhost_MB/op  xhost_GB/s") : "");
    std::vector<Row> ll_rows;
    for (const LlTimes& t : g_ll) {
      if (t.bytes > 0) printf("%-22s %10.1f %10.1f %14.2f", t.what.c_str(), t.eager_us, t.graph_us, t.bytes / t.graph_us / 1e3);
      else printf("%-22s %10.1f %10s %14s", t.what.c_str(), t.eager_us, "-", "-");
      const double xg = t.xhost_bytes / (t.graph_us * 1e-6) / 1e9;
      if (ll_xhost && t.bytes > 0) printf(" %12.3f %11.3f", t.xhost_bytes / 1e6, xg);
      if (ll_xhost && t.bytes > 0 && raw.gbs() > 0) printf(" %9.3f", xg / raw.gbs());
      printf("\n");
      ll_rows.push_back({"LL " + t.what + " eager", o.ll_tokens, t.eager_us * 1e-6, 0, 0, 0, 0});
      if (t.bytes > 0)
        ll_rows.push_back({"LL " + t.what + " graph", o.ll_tokens, t.graph_us * 1e-6, t.bytes / t.graph_us / 1e3, 0, 0,
                           t.xhost_bytes});
    }
    if (!o.csv.empty()) appendCsv(o, "gpu", ll_rows, roof, raw, false);  // the "net raw" row comes with the others
#endif
    if (!o.csv.empty()) appendCsv(o, gpu ? "gpu" : "host", rows, roof, raw);
  }
  CHECK(epCommDestroy(comm));
  return 0;
}
