// Helpers the GPU test programs share: per-rank checks, all ranks' inputs generated identically on every rank,
// poisoned device buffers, the stand-in expert, device selection and the GPU engine's test config.
#pragma once
#include <cuda_runtime.h>
#include <execinfo.h>
#include <signal.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../unit/multiproc.h"
#include "common/dtype.h"
#include "epcomm/epcomm.h"

namespace {

#define CK(...) EP_RANK_CHECK(g_rank, __VA_ARGS__)
#define CKE(call, comm)                                                                                  \
  do {                                                                                                   \
    epResult_t r_ = (call);                                                                              \
    CK(r_ == epSuccess, "%s -> %s: %s", #call, epGetErrorString(r_), epGetLastError(comm));              \
  } while (0)
#define CKC(call)                                                  \
  do {                                                             \
    cudaError_t c_ = (call);                                       \
    CK(c_ == cudaSuccess, "%s -> %s", #call, cudaGetErrorString(c_)); \
  } while (0)

int g_rank = -1;  // this process's rank, for the check messages
uint64_t g_seed = 0;

std::vector<int> rankCounts() {
  const char* s = getenv("EPCOMM_GPU_TEST_RANKS");
  std::string v = s ? s : "2,4,8";
  std::vector<int> out;
  for (size_t i = 0; i < v.size();) {
    size_t j = v.find(',', i);
    out.push_back(atoi(v.substr(i, j - i).c_str()));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

// All ranks' inputs, generated identically on every rank from (seed, rank).
struct Inputs {
  int T;
  std::vector<uint8_t> x;       // [T, H] dtype
  std::vector<float> scales;    // fp8
  std::vector<int64_t> idx;     // [T, K]
  std::vector<float> w;         // [T, K]
};

Inputs makeInputs(uint64_t seed, int rank, int T, int H, int K, int E, int dtype, bool structured) {
  std::mt19937_64 rng(seed * 1000003 + rank);
  Inputs in;
  in.T = T;
  in.x.resize(static_cast<size_t>(T) * H * epDataTypeSize(static_cast<epDataType_t>(dtype)));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < H; ++j) {
      float v = nd(rng);
      if (structured && j < 3) v = j == 0 ? static_cast<float>(rank) : j == 1 ? static_cast<float>(t % 256) : static_cast<float>(t / 256);
      epcomm::storeFromFloat(in.x.data(), static_cast<size_t>(t) * H + j, dtype, v);
    }
  if (dtype == epFloat8E4M3) {
    in.scales.resize(static_cast<size_t>(T) * (H / 128));
    for (auto& s : in.scales) s = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
  }
  rng.seed(seed * 7777777 + rank);  // routing from its own stream, independent of H and dtype
  in.idx.resize(static_cast<size_t>(T) * K);
  in.w.resize(static_cast<size_t>(T) * K);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      int64_t e = static_cast<int64_t>(k) * (E / K) + static_cast<int64_t>(rng() % (E / K));
      if (rng() % 11 == 0) e = -1;
      if (k > 0 && rng() % 29 == 0) e = in.idx[static_cast<size_t>(t) * K];  // an occasional repeat
      in.idx[static_cast<size_t>(t) * K + k] = e;
      in.w[static_cast<size_t>(t) * K + k] = static_cast<float>(rng() % 10000) / 10000.0f;
    }
  return in;
}

template <typename T>
struct DevBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t count, int poison = 0xA5) : n(count) {
    cudaMalloc(&p, bytes() ? bytes() : 16);
    cudaMemset(p, poison, bytes() ? bytes() : 16);
    cudaDeviceSynchronize();  // the tests' streams do not synchronize with the legacy default stream
  }
  ~DevBuf() { cudaFree(p); }
  size_t bytes() const { return n * sizeof(T); }
  std::vector<T> host() const {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, bytes(), cudaMemcpyDeviceToHost);
    return v;
  }
  // A pageable cudaMemcpy may return before its DMA completes: synchronize before other streams read.
  void upload(const std::vector<T>& v) {
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  }
};

// Stand-in expert: y = x * (rank + 1), in fp32, rounded to the row type.
template <int kDtype>
__global__ void expertKernel(const void* x, void* y, size_t n, float scale) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    epcomm::storeFromFloat(y, i, kDtype, __fmul_rn(epcomm::loadAsFloat(x, i, kDtype), scale));
}
void expert(const void* x, void* y, size_t n, float scale, int dtype, cudaStream_t s) {
  if (dtype == epBfloat16) expertKernel<epBfloat16><<<132, 256, 0, s>>>(x, y, n, scale);
  else if (dtype == epFloat16) expertKernel<epFloat16><<<132, 256, 0, s>>>(x, y, n, scale);
  else expertKernel<epFloat32><<<132, 256, 0, s>>>(x, y, n, scale);
}
std::vector<uint8_t> expertHost(const std::vector<uint8_t>& x, size_t n, float scale, int dtype) {
  std::vector<uint8_t> y(x.size());
  for (size_t i = 0; i < n; ++i) epcomm::storeFromFloat(y.data(), i, dtype, epcomm::loadAsFloat(x.data(), i, dtype) * scale);
  return y;
}

// One GPU per rank when there are enough, otherwise ranks share (under MPS).
cudaError_t selectDevice(int rank) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  return e != cudaSuccess ? e : cudaSetDevice(rank % n);
}

// The short deadlines that tests of timeouts and recovery set, times EPCOMM_GPU_TEST_DEADLINE_SCALE (default 1):
// under compute-sanitizer every kernel and the rendezvous run many times slower, so those runs scale them up.
inline int shortDeadlineMs(int ms) {
  const char* s = getenv("EPCOMM_GPU_TEST_DEADLINE_SCALE");
  const int scale = s ? atoi(s) : 1;
  return ms * (scale > 1 ? scale : 1);
}

// Virtual hosts: EPCOMM_GPU_TEST_HOSTS = H > 1 puts the ranks of the GPU communicators the tests create on H hosts
// (rank r of R on host r * H / R, through EPCOMM_HOSTID while the communicator is created), so that the GPU engine
// reaches the ranks of other hosts through its proxy. The host-engine references run on one host, except the HT
// tests' with EPCOMM_GPU_HT_COMBINE_HIER=1 (test_gpu_ht.cu initPair): the same hosts, whose combine order then is the
// hierarchical one (epcomm.h).
inline int testHosts() {
  const char* s = getenv("EPCOMM_GPU_TEST_HOSTS");
  const int h = s ? atoi(s) : 1;
  return h > 1 ? h : 1;
}
inline bool crossHosts() { return testHosts() > 1; }
bool g_cross_hosts = false;  // the last GPU communicator this rank created spans several hosts
// A communicator of either engine whose rank r of R is on host r * hosts / R.
inline epResult_t initOnHosts(epComm_t* comm, int R, const epUniqueId* id, int rank, const epConfig_t* cfg,
                              int hosts) {
  if (hosts > 1) {
    char v[64];
    snprintf(v, sizeof(v), "gpu-test-host-%d", rank * hosts / R);
    setenv("EPCOMM_HOSTID", v, 1);
  }
  const epResult_t r = epCommInitRank(comm, R, id, rank, cfg);
  if (hosts > 1) unsetenv("EPCOMM_HOSTID");
  return r;
}
inline epResult_t initGpuComm(epComm_t* comm, int R, const epUniqueId* id, int rank, const epConfig_t* cfg,
                              int hosts = testHosts()) {
  g_cross_hosts = hosts > 1 && R > 1;
  return initOnHosts(comm, R, id, rank, cfg, hosts);
}

epConfig_t gpuConfig() {
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_GPU;
  cfg.timeout_ms = 20000;
  cfg.cuda_device = -1;  // the device the rank selected (rank % devices)
  cfg.ht_max_tokens_per_rank = 512;
  cfg.ht_max_hidden = 7168;
  return cfg;
}

// A crashing rank prints its stack (resolve the addresses with addr2line -e <test binary>) before it dies.
void crashHandler(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  char head[64];
  const int len = snprintf(head, sizeof(head), "rank %d: signal %d, stack:\n", g_rank, sig);
  if (write(2, head, len) < 0) {}
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
inline void installCrashHandler() {
  signal(SIGSEGV, crashHandler);
  signal(SIGBUS, crashHandler);
  signal(SIGABRT, crashHandler);
}

// Device-side input generator: fresh x and routing for replay `it`, without host work between replays. With
// `blocked`, expert k of a token is drawn from the k-th of K equal blocks (distinct experts, as HT wants); else
// from all E (repeats possible, which LL must send once).
__global__ void genInputs(uint16_t* x, int64_t* idx, float* w, int T, int H, int K, int E, uint64_t seed,
                          bool blocked) {
  auto hash = [](uint64_t v) {
    v ^= v >> 33;
    v *= 0xff51afd7ed558ccdull;
    v ^= v >> 33;
    v *= 0xc4ceb9fe1a85ec53ull;
    return v ^ (v >> 33);
  };
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<size_t>(T) * H; i += gridDim.x * blockDim.x)
    x[i] = epcomm::floatToBf16(static_cast<float>(static_cast<int>(hash(seed * 7919 + i) % 2001) - 1000) / 256.0f);
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<size_t>(T) * K; i += gridDim.x * blockDim.x) {
    const int k = static_cast<int>(i % K);
    uint64_t hv = hash(seed * 104729 + i + 1);
    const int64_t e = blocked ? static_cast<int64_t>(k) * (E / K) + static_cast<int64_t>((hv >> 8) % (E / K))
                              : static_cast<int64_t>((hv >> 8) % E);
    idx[i] = (hv % 13 == 0) ? -1 : e;
    w[i] = static_cast<float>(hv % 1000) / 1000.0f;
  }
}

// The communicator recorded no asynchronous error and no device-side violation (a CK failure otherwise).
#define CK_CLEAN(comm, what)                                                                                  \
  do {                                                                                                        \
    epResult_t ae_;                                                                                           \
    epErrorInfo_t info_ = EP_ERROR_INFO_INIT;                                                                 \
    CKE(epCommGetAsyncError(comm, &ae_, &info_), comm);                                                       \
    CK(ae_ == epSuccess && info_.num_violations == 0, "%s: async error %s (op %d, epoch %llu, peer %d), %llu " \
       "violations", what, epGetErrorString(ae_), info_.op, static_cast<unsigned long long>(info_.epoch),      \
       info_.peer, static_cast<unsigned long long>(info_.num_violations));                                    \
  } while (0)

// The same, but capacity violations (the overflowing alltoallv rounds make them on purpose) are allowed.
#define CK_CLEAN_BUT_CAPACITY(comm, what)                                                                     \
  do {                                                                                                        \
    epResult_t ae_;                                                                                           \
    epErrorInfo_t info_ = EP_ERROR_INFO_INIT;                                                                 \
    CKE(epCommGetAsyncError(comm, &ae_, &info_), comm);                                                       \
    CK(ae_ == epSuccess && (info_.num_violations == 0 || info_.violation == epCapacityExceeded),              \
       "%s: async error %s (op %d, epoch %llu, peer %d, phase %d), %llu violations (first %s)", what,         \
       epGetErrorString(ae_), info_.op, static_cast<unsigned long long>(info_.epoch), info_.peer, info_.phase, \
       static_cast<unsigned long long>(info_.num_violations), epGetErrorString(info_.violation));             \
  } while (0)

// Elastic ranks: the calling survivor masks `gone` (every rank with gone[r] set) on comm.
inline epResult_t maskRanks(epComm_t comm, int R, const std::vector<int>& gone, cudaStream_t s) {
  std::vector<int32_t> active(R, 1);
  for (int r : gone) active[r] = 0;
  return epCommSetActiveRanks(comm, active.data(), s);
}

// Both engines counted the same masked drops (the host engine is the reference).
#define CK_SAME_DROPS(g, h, R)                                                                              \
  do {                                                                                                      \
    std::vector<int64_t> gr_(R, -1), ga_(R, -1), hr_(R, -2), ha_(R, -2);                                   \
    CKE(epCommGetMaskedDrops(g, gr_.data(), ga_.data(), nullptr), g);                                      \
    CKE(epCommGetMaskedDrops(h, hr_.data(), ha_.data(), nullptr), h);                                      \
    for (int r_ = 0; r_ < (R); ++r_)                                                                        \
      CK(gr_[r_] == hr_[r_] && ga_[r_] == ha_[r_], "masked drops to rank %d: GPU %lld rows %lld elements, "  \
         "host %lld rows %lld elements", r_, (long long)gr_[r_], (long long)ga_[r_], (long long)hr_[r_],     \
         (long long)ha_[r_]);                                                                               \
  } while (0)

// Every rank's exit code of a runRanks() run is 0.
inline void expectAllRanksOk(const std::vector<int>& codes, uint64_t seed) {
  for (size_t r = 0; r < codes.size(); ++r)
    EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << codes.size() << ", seed " << seed;
}

// The GPUs this process would see and the SMs of the first, asked in a child so that this process never
// initialises CUDA before forking (a test sizes the environment of the ranks it forks next by it); devices 0 if
// none or the child could not tell, sms 0 if it could not tell.
struct GpuShape {
  int devices = 0, sms = 0;
};
inline GpuShape gpuShape() {
  int fds[2];
  if (pipe(fds) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    GpuShape g;
    if (cudaGetDeviceCount(&g.devices) != cudaSuccess) g.devices = 0;
    if (g.devices > 0 && cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) g.sms = 0;
    _exit(write(fds[1], &g, sizeof(g)) == static_cast<ssize_t>(sizeof(g)) ? 0 : 1);
  }
  close(fds[1]);
  GpuShape g;
  if (read(fds[0], &g, sizeof(g)) != static_cast<ssize_t>(sizeof(g))) g = GpuShape{};
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return g;
}

// An environment variable set for the ranks a test forks, unset again however the test ends (later tests fork
// from the same process).
struct ScopedEnv {
  ScopedEnv(const char* name, const std::string& value) : name_(name) { setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// Whether a CUDA device is visible (asked in a child, gpuShape).
inline bool haveGpu() { return gpuShape().devices > 0; }

// main() of a GPU test program: exit 77 (skipped) without a GPU, the run's seed printed, crash stacks on.
inline int runGpuTests(int argc, char** argv) {
  if (!haveGpu()) {
    printf("no CUDA device: the gpu suite is skipped\n");
    return 77;
  }
  g_seed = getenv("EPCOMM_TEST_SEED") ? strtoull(getenv("EPCOMM_TEST_SEED"), nullptr, 0) : std::random_device{}();
  printf("seed %llu (EPCOMM_TEST_SEED reproduces)\n", static_cast<unsigned long long>(g_seed));
  installCrashHandler();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace
