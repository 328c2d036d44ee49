// Conformance harness for libnccl-net-epcomm.so, driven the way NCCL drives it: dlopen the built plugin,
// take one exported ncclNetPlugin_vN, and run 2-4 forked processes on loopback per case. Every case runs for
// the socket backend and for the ofi backend with the providers "tcp;ofi_rxm", "net" (libfabric 1.17's RDM over
// TCP without rxm, a fork its man page says goes back into tcp; libfabric 2.x's tcp offers FI_EP_RDM itself)
// and "shm" (skipped, with the reason, where the plugin does not offer them). Each process does its own dlopen + init after fork, so the
// backend and its parameters come from that process's environment.
#include <dirent.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../unit/multiproc.h"
#include "plugin/nccl/nccl_net_abi.h"

#ifndef EPCOMM_NCCL_PLUGIN_PATH
#error "EPCOMM_NCCL_PLUGIN_PATH must name the built libnccl-net-epcomm.so"
#endif

namespace {

// ---- the plugin, normalised to one calling convention --------------------------------------------------------
struct Net {
  int ver = 11;
  void* lib = nullptr;
  const ncclNet_v11_t* v11 = nullptr;
  const ncclNet_v10_t* v10 = nullptr;
  const ncclNet_v9_t* v9 = nullptr;
  const ncclNet_v8_t* v8 = nullptr;
  void* ctx = nullptr;
  std::string err;

  bool load(int version) {
    ver = version;
    lib = dlopen(EPCOMM_NCCL_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      err = dlerror();
      return false;
    }
    char sym[32];
    snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", version);
    void* s = dlsym(lib, sym);
    if (!s) {
      err = std::string("missing ") + sym;
      return false;
    }
    switch (version) {
      case 11: v11 = static_cast<const ncclNet_v11_t*>(s); break;
      case 10: v10 = static_cast<const ncclNet_v10_t*>(s); break;
      case 9: v9 = static_cast<const ncclNet_v9_t*>(s); break;
      default: v8 = static_cast<const ncclNet_v8_t*>(s); break;
    }
    return true;
  }
  const char* name() const { return v11 ? v11->name : v10 ? v10->name : v9 ? v9->name : v8->name; }
  // The plugin's warnings go to stderr with the rank process's pid: when a case fails, its log says what the
  // plugin saw (many cases provoke errors on purpose, so warnings of passing cases are expected there too).
  static void logger(ncclDebugLogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
    if (level != NCCL_LOG_WARN) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "[pid %d plugin WARN] %s\n", static_cast<int>(getpid()), msg);
  }
  ncclResult_t init() {
    if (v11) {
      ncclNetCommConfig_t cfg{-1};
      return v11->init(&ctx, 0x1234, &cfg, logger, nullptr);
    }
    if (v10) return v10->init(logger, nullptr);
    if (v9) return v9->init(logger);
    return v8->init(logger);
  }
  ncclResult_t finalize() { return v11 ? v11->finalize(ctx) : ncclSuccess; }
  int devices() {
    int n = 0;
    if (v11) v11->devices(&n);
    else if (v10) v10->devices(&n);
    else if (v9) v9->devices(&n);
    else v8->devices(&n);
    return n;
  }
  ncclResult_t props(int dev, ncclNetProperties_v11_t* p) {
    memset(p, 0, sizeof(*p));
    if (v11) return v11->getProperties(dev, p);
    if (v10 || v9) return (v10 ? v10->getProperties : v9->getProperties)(dev, reinterpret_cast<ncclNetProperties_v9_t*>(p));
    ncclNetProperties_v8_t q;
    ncclResult_t r = v8->getProperties(dev, &q);
    p->name = q.name;
    p->pciPath = q.pciPath;
    p->ptrSupport = q.ptrSupport;
    p->speed = q.speed;
    p->maxComms = q.maxComms;
    p->maxRecvs = q.maxRecvs;
    p->netDeviceType = q.netDeviceType;
    return r;
  }
  ncclResult_t listen(int dev, void* h, void** lc) {
    if (v11) return v11->listen(ctx, dev, h, lc);
    if (v10) return v10->listen(dev, h, lc);
    if (v9) return v9->listen(dev, h, lc);
    return v8->listen(dev, h, lc);
  }
  ncclResult_t connect(int dev, void* h, void** sc) {
    ncclNetDeviceHandle_t* dh = nullptr;
    if (v11) return v11->connect(ctx, dev, h, sc, &dh);
    ncclNetCommConfig_t cfg{-1};
    if (v10) return v10->connect(dev, &cfg, h, sc, &dh);
    if (v9) return v9->connect(dev, h, sc, &dh);
    return v8->connect(dev, h, sc, &dh);
  }
  ncclResult_t accept(void* lc, void** rc) {
    ncclNetDeviceHandle_t* dh = nullptr;
    if (v11) return v11->accept(lc, rc, &dh);
    if (v10) return v10->accept(lc, rc, &dh);
    if (v9) return v9->accept(lc, rc, &dh);
    return v8->accept(lc, rc, &dh);
  }
  ncclResult_t regMr(void* c, void* d, size_t n, int type, void** mh) {
    if (v11) return v11->regMr(c, d, n, type, mh);
    if (v10) return v10->regMr(c, d, n, type, mh);
    if (v9) return v9->regMr(c, d, n, type, mh);
    return v8->regMr(c, d, n, type, mh);
  }
  ncclResult_t deregMr(void* c, void* mh) {
    if (v11) return v11->deregMr(c, mh);
    if (v10) return v10->deregMr(c, mh);
    if (v9) return v9->deregMr(c, mh);
    return v8->deregMr(c, mh);
  }
  ncclResult_t isend(void* sc, void* d, size_t n, int tag, void* mh, void** req) {
    if (v11) return v11->isend(sc, d, n, tag, mh, nullptr, req);
    if (v10) return v10->isend(sc, d, n, tag, mh, nullptr, req);
    if (v9) return v9->isend(sc, d, n, tag, mh, req);
    return v8->isend(sc, d, static_cast<int>(n), tag, mh, req);
  }
  ncclResult_t irecv(void* rc, int n, void** d, size_t* sizes, int* tags, void** mh, void** req) {
    void* ph[8] = {};
    if (v11) return v11->irecv(rc, n, d, sizes, tags, mh, ph, req);
    if (v10) return v10->irecv(rc, n, d, sizes, tags, mh, ph, req);
    if (v9) return v9->irecv(rc, n, d, sizes, tags, mh, req);
    int is[8];
    for (int i = 0; i < n; ++i) is[i] = static_cast<int>(sizes[i]);
    return v8->irecv(rc, n, d, is, tags, mh, req);
  }
  ncclResult_t test(void* req, int* done, int* sizes) {
    if (v11) return v11->test(req, done, sizes);
    if (v10) return v10->test(req, done, sizes);
    if (v9) return v9->test(req, done, sizes);
    return v8->test(req, done, sizes);
  }
  ncclResult_t closeSend(void* c) { return v11 ? v11->closeSend(c) : v10 ? v10->closeSend(c) : v9 ? v9->closeSend(c) : v8->closeSend(c); }
  ncclResult_t closeRecv(void* c) { return v11 ? v11->closeRecv(c) : v10 ? v10->closeRecv(c) : v9 ? v9->closeRecv(c) : v8->closeRecv(c); }
  ncclResult_t closeListen(void* c) { return v11 ? v11->closeListen(c) : v10 ? v10->closeListen(c) : v9 ? v9->closeListen(c) : v8->closeListen(c); }
};

// libfabric's shm provider backs each endpoint with a 16 MiB /dev/shm file (the plugin names it
// "epcomm-<pid>-<nonce>") and unlinks it only when the library is unloaded normally. Our ranks leave with _exit
// or are killed, so the parent removes what each one left once the whole run is over.
std::vector<std::string> shmFilesStartingWith(const std::string& prefix) {
  std::vector<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) names.push_back(std::string("/dev/shm/") + e->d_name);
    closedir(d);
  }
  return names;
}
void removeShmLeftovers(pid_t pid) {
  for (const std::string& f : shmFilesStartingWith("epcomm-" + std::to_string(pid) + "-")) unlink(f.c_str());
}

// ---- shared memory between the forked ranks (handles, barriers, flags) ----------------------------------------
constexpr int kMaxRanks = 4;
struct Shared {
  std::atomic<int> barrierCount;
  std::atomic<int> barrierGen;
  std::atomic<int> handleReady[kMaxRanks][kMaxRanks];
  char handles[kMaxRanks][kMaxRanks][NCCL_NET_HANDLE_MAXSIZE];
  std::atomic<int> flag[8];
  std::atomic<pid_t> pid[kMaxRanks];
  char msg[kMaxRanks][512];
};

Shared* gShared = nullptr;
int gNranks = 2;

void barrier() {
  int gen = gShared->barrierGen.load();
  if (gShared->barrierCount.fetch_add(1) + 1 == gNranks) {
    gShared->barrierCount.store(0);
    gShared->barrierGen.fetch_add(1);
  } else {
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (gShared->barrierGen.load() == gen && std::chrono::steady_clock::now() < end) usleep(100);
  }
}

#define FAILRET(code, ...)                                      \
  do {                                                          \
    fprintf(stderr, "[rank fail] %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__);                               \
    fprintf(stderr, "\n");                                      \
    return (code);                                              \
  } while (0)
#define CK(call)                                                         \
  do {                                                                   \
    ncclResult_t ck_ = (call);                                           \
    if (ck_ != ncclSuccess) FAILRET(10, "%s -> %d", #call, (int)ck_);    \
  } while (0)
#define REQ(cond, ...)                          \
  do {                                          \
    if (!(cond)) FAILRET(11, __VA_ARGS__);      \
  } while (0)

struct Backend {
  const char* name;      // socket | ofi
  const char* provider;  // for ofi
  int version;
};

std::string caseName(const Backend& b) {
  std::string s = b.name;
  if (b.provider) {
    s += "_";
    for (const char* p = b.provider; *p; ++p) s += isalnum(static_cast<unsigned char>(*p)) ? *p : '_';
  }
  return s + "_v" + std::to_string(b.version);
}

void setBackendEnv(const Backend& b) {
  setenv("EPCOMM_NET", b.name, 1);
  setenv("EPCOMM_SOCKET_IFNAME", "lo", 1);
  if (b.provider) setenv("EPCOMM_OFI_PROVIDER", b.provider, 1);
  else unsetenv("EPCOMM_OFI_PROVIDER");
}

// In a rank: load + init the plugin for this backend.
int openNet(const Backend& b, Net* net) {
  setBackendEnv(b);
  if (!net->load(b.version)) FAILRET(20, "load: %s", net->err.c_str());
  CK(net->init());
  REQ(net->devices() > 0, "no devices");
  return 0;
}

// Drives one request to completion (or error) within `ms`.
ncclResult_t waitReq(Net* net, void* req, int* sizes, int ms = 60000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  int done = 0;
  while (!done) {
    ncclResult_t r = net->test(req, &done, sizes);
    if (r != ncclSuccess) return r;
    if (std::chrono::steady_clock::now() > end) return ncclInternalError;  // the harness's own hang guard
  }
  return ncclSuccess;
}

// rank `recvRank` listens and publishes its handle; rank `sendRank` connects. Both loop (non-blocking).
int pairConnect(Net* net, int me, int sendRank, int recvRank, void** sc, void** rc, void** lc = nullptr,
                int* sendIters = nullptr, int* recvIters = nullptr) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  if (me == recvRank) {
    void* l = nullptr;
    char* h = gShared->handles[recvRank][sendRank];
    CK(net->listen(0, h, &l));
    REQ(l != nullptr, "listen returned no comm");
    gShared->handleReady[recvRank][sendRank].store(1);
    int it = 0;
    *rc = nullptr;
    while (*rc == nullptr) {
      CK(net->accept(l, rc));
      ++it;
      REQ(std::chrono::steady_clock::now() < end, "accept did not complete");
    }
    if (recvIters) *recvIters = it;
    if (lc) *lc = l;
    else CK(net->closeListen(l));
  } else if (me == sendRank) {
    while (!gShared->handleReady[recvRank][sendRank].load()) {
      usleep(100);
      REQ(std::chrono::steady_clock::now() < end, "no handle");
    }
    char h[NCCL_NET_HANDLE_MAXSIZE];
    memcpy(h, gShared->handles[recvRank][sendRank], sizeof(h));
    int it = 0;
    *sc = nullptr;
    while (*sc == nullptr) {
      CK(net->connect(0, h, sc));
      ++it;
      REQ(std::chrono::steady_clock::now() < end, "connect did not complete");
    }
    if (sendIters) *sendIters = it;
  }
  return 0;
}

inline uint8_t pat(size_t i, uint32_t seed) { return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 12)) & 0xff); }
void fill(void* p, size_t n, uint32_t seed) {
  auto* b = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = pat(i, seed);
}
bool check(const void* p, size_t n, uint32_t seed, size_t* bad = nullptr) {
  auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i)
    if (b[i] != pat(i, seed)) {
      if (bad) *bad = i;
      return false;
    }
  return true;
}

// Posts with retry: a NULL request means "not now"; progress the oldest outstanding one meanwhile.
int postSend(Net* net, void* sc, void* d, size_t n, int tag, void* mh, void** req) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    CK(net->isend(sc, d, n, tag, mh, req));
    if (*req) return 0;
    REQ(std::chrono::steady_clock::now() < end, "isend never accepted");
    usleep(50);
  }
}
int postRecv(Net* net, void* rc, int k, void** d, size_t* sizes, int* tags, void** mh, void** req) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    *req = reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION);  // as NCCL does for LL/LL128
    CK(net->irecv(rc, k, d, sizes, tags, mh, req));
    REQ(*req != reinterpret_cast<void*>(NCCL_NET_OPTIONAL_RECV_COMPLETION), "irecv left the pre-set request");
    if (*req) return 0;
    REQ(std::chrono::steady_clock::now() < end, "irecv never accepted");
    usleep(50);
  }
}
// One receive of up to `size` bytes into `data`: the common case of postRecv.
int postRecvOne(Net* net, void* rc, void* data, size_t size, int tag, void* mh, void** req) {
  return postRecv(net, rc, 1, &data, &size, &tag, &mh, req);
}

// ---- cases -------------------------------------------------------------------------------------------------------
class NetPlugin : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    const Backend& b = GetParam();
    std::string why;
    if (!available(b, &why)) GTEST_SKIP() << caseName(b) << " not offered here: " << why;
    gShared = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    ASSERT_NE(gShared, MAP_FAILED);
    memset(static_cast<void*>(gShared), 0, sizeof(Shared));
  }
  void TearDown() override {
    if (gShared) munmap(gShared, sizeof(Shared));
    gShared = nullptr;
  }
  // Runs body on n ranks; every rank must exit 0.
  void run(int n, const std::function<int(int, Net*)>& body, int timeoutMs = 120000) {
    auto codes = runCodes(n, body, timeoutMs);
    for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << caseName(GetParam());
  }
  std::vector<int> runCodes(int n, const std::function<int(int, Net*)>& body, int timeoutMs = 120000) {
    gNranks = n;
    const Backend b = GetParam();
    auto codes = epcomm::test::runRanks(n, [&](int rank) {
      gShared->pid[rank].store(getpid());
      Net net;
      int rc = openNet(b, &net);
      if (rc) return rc;
      rc = body(rank, &net);
      net.finalize();
      return rc;
    }, timeoutMs, removeShmLeftovers);
    return codes;
  }

  // Probed once per backend in a child, so that the test process itself never initialises the plugin.
  static bool available(const Backend& b, std::string* why) {
    static std::map<std::string, std::pair<bool, std::string>> cache;
    std::string key = std::string(b.name) + "/" + (b.provider ? b.provider : "");
    auto it = cache.find(key);
    if (it != cache.end()) {
      *why = it->second.second;
      return it->second.first;
    }
    int pfd[2];
    if (pipe(pfd) != 0) return false;
    pid_t pid = fork();
    if (pid == 0) {
      close(pfd[0]);
      setBackendEnv(b);
      setenv("EPCOMM_DEBUG", "NONE", 1);
      Net net;
      int code = 0;
      std::string msg;
      if (!net.load(11)) code = 1, msg = net.err;
      else if (net.init() != ncclSuccess || net.devices() <= 0) code = 2, msg = "plugin init failed (see EPCOMM_DEBUG=WARN)";
      ssize_t w = write(pfd[1], msg.data(), msg.size());
      (void)w;
      _exit(code);
    }
    close(pfd[1]);
    char buf[512] = {0};
    ssize_t k = read(pfd[0], buf, sizeof(buf) - 1);
    (void)k;
    close(pfd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    removeShmLeftovers(pid);
    bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    cache[key] = {ok, buf};
    *why = buf;
    return ok;
  }
};

// The ABI-level cases run on every exported version; the behavioural ones on v11 only (the versions share
// the implementation behind thin shims).
class NetPluginAbi : public NetPlugin {};

TEST_P(NetPluginAbi, PropertiesAndHandle) {
  run(1, [](int, Net* net) {
    REQ(strcmp(net->name(), "epcomm") == 0, "name %s", net->name());
    for (int d = 0; d < net->devices(); ++d) {
      ncclNetProperties_v11_t p;
      CK(net->props(d, &p));
      REQ(p.name && p.name[0], "no name");
      REQ(p.ptrSupport & NCCL_PTR_HOST, "no host pointers");
      REQ(p.speed > 0, "speed %d", p.speed);
      REQ(p.maxComms > 0 && p.maxRecvs >= 1 && p.maxRecvs <= 8, "maxRecvs %d", p.maxRecvs);
      REQ(p.netDeviceType == NCCL_NET_DEVICE_HOST, "device type");
      if (net->ver >= 9) REQ(p.vProps.ndevs == 1 && p.vProps.devs[0] == d, "vProps");
      if (net->ver >= 9) REQ(p.maxP2pBytes > 0 && p.maxCollBytes > 0, "max bytes");
    }
    // listen writes at most NCCL_NET_HANDLE_MAXSIZE bytes.
    unsigned char h[2 * NCCL_NET_HANDLE_MAXSIZE];
    memset(h, 0xA5, sizeof(h));
    void* lc = nullptr;
    CK(net->listen(0, h, &lc));
    REQ(lc != nullptr, "no listen comm");
    for (size_t i = NCCL_NET_HANDLE_MAXSIZE; i < sizeof(h); ++i) REQ(h[i] == 0xA5, "handle overflow at %zu", i);
    // accept with nobody connecting returns promptly with a NULL comm (non-blocking).
    void* rc = reinterpret_cast<void*>(1);
    auto t0 = std::chrono::steady_clock::now();
    CK(net->accept(lc, &rc));
    REQ(rc == nullptr, "accept invented a comm");
    REQ(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200), "accept blocked");
    CK(net->closeListen(lc));
    if (net->ver == 11) REQ(net->v11->finalize != nullptr, "finalize must be non-NULL");
    // Only the plugin structs are exported.
    REQ(dlsym(net->lib, "_ZN6epcomm3net10netBackendEPNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE") == nullptr,
        "internal symbol exported");
    REQ(dlsym(net->lib, "ncclNetPlugin_v8") && dlsym(net->lib, "ncclNetPlugin_v9") &&
            dlsym(net->lib, "ncclNetPlugin_v10") && dlsym(net->lib, "ncclNetPlugin_v11"),
        "missing export");
    return 0;
  });
}

TEST_P(NetPluginAbi, ConnectAcceptAndSizes) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    int sIt = 0, rIt = 0;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc, nullptr, &sIt, &rIt)) return e;
    const size_t sizes[] = {0, 1, 4096, 1 << 20, 64 << 20};
    size_t maxSz = 64 << 20;
    char* buf = static_cast<char*>(malloc(maxSz + 64));
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, maxSz + 64, NCCL_PTR_HOST, &mh));
    uint32_t seed = 1;
    for (size_t sz : sizes) {
      void* req = nullptr;
      if (rank == 0) {
        fill(buf, sz, seed);
        if (int e = postSend(net, sc, buf, sz, 7, mh, &req)) return e;
        int got = -1;
        CK(waitReq(net, req, &got));
      } else {
        memset(buf, 0, sz + 64);
        if (int e = postRecvOne(net, rc, buf, sz + 64, 7, mh, &req)) return e;  // a buffer larger than the send
        int got = -1;
        CK(waitReq(net, req, &got));
        REQ(got == static_cast<int>(sz), "size %zu reported as %d", sz, got);
        size_t bad = 0;
        REQ(check(buf, sz, seed, &bad), "size %zu: corrupt at byte %zu", sz, bad);
        for (size_t i = sz; i < sz + 64; ++i) REQ(buf[i] == 0, "size %zu: wrote past the message", sz);
      }
      ++seed;
    }
    CK(net->deregMr(rank == 0 ? sc : rc, mh));
    free(buf);
    barrier();
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    return 0;
  });
}

TEST_P(NetPlugin, InflightOrderingAndTags) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr int kN = 64;  // beyond NCCL_NET_MAX_REQUESTS
    std::vector<std::vector<char>> bufs(kN);
    std::vector<void*> reqs(kN), mhs(kN);
    void* comm = rank == 0 ? sc : rc;
    for (int i = 0; i < kN; ++i) {
      size_t sz = (i % 3 == 0) ? (300 << 10) : (i % 3 == 1 ? 1000 + i : 70 << 10);  // both paths interleaved
      bufs[i].resize(sz + 128);
      CK(net->regMr(comm, bufs[i].data(), bufs[i].size(), NCCL_PTR_HOST, &mhs[i]));
      void* mh = mhs[i];
      int tag = i % 5;
      if (rank == 0) {
        fill(bufs[i].data(), sz, 1000 + i);
        if (int e = postSend(net, sc, bufs[i].data(), sz, tag, mh, &reqs[i])) return e;
      } else {
        if (int e = postRecvOne(net, rc, bufs[i].data(), bufs[i].size(), tag, mh, &reqs[i])) return e;
      }
    }
    // Complete in reverse order: completion order is free, matching order is not.
    for (int i = kN - 1; i >= 0; --i) {
      int got = -1;
      CK(waitReq(net, reqs[i], &got));
      if (rank == 1) {
        size_t sz = bufs[i].size() - 128;
        REQ(got == static_cast<int>(sz), "msg %d size %d", i, got);
        REQ(check(bufs[i].data(), sz, 1000 + i), "msg %d out of order or corrupt", i);
      }
      CK(net->deregMr(comm, mhs[i]));
    }
    barrier();
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    return 0;
  });
}

// Sizes around the socket backend's lone-message limit (EPCOMM_NET_ASSIST_MAX, 512 KiB where the assist is on: moved by
// the caller, no helper woken; meson runs this suite with it on and, for socket, off) and above it, as a ping-pong
// (every message alone on its connection); some rounds post the receive late, so the sender's message waits in the
// sockets; and a lone message completed after a small one posted behind it (the caller tests the later request first).
TEST_P(NetPlugin, LoneMessagesAroundTheAssistLimit) {
  run(2, [](int rank, Net* net) {
    void *s01 = nullptr, *r01 = nullptr, *s10 = nullptr, *r10 = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &s01, &r01)) return e;
    if (int e = pairConnect(net, rank, 1, 0, &s10, &r10)) return e;
    void* sc = rank == 0 ? s01 : s10;
    void* rc = rank == 0 ? r10 : r01;
    const size_t sizes[] = {(64 << 10) + 1, 256 << 10, 512 << 10, (512 << 10) + 1, 2 << 20};
    std::vector<char> out(2 << 20), in((2 << 20) + 64);
    void *mo, *mi;
    CK(net->regMr(sc, out.data(), out.size(), NCCL_PTR_HOST, &mo));
    CK(net->regMr(rc, in.data(), in.size(), NCCL_PTR_HOST, &mi));
    for (size_t sz : sizes)
      for (int round = 0; round < 12; ++round) {
        const bool late = round % 4 == 3;
        const uint32_t seed = static_cast<uint32_t>(sz) + round;
        void* req = nullptr;
        int got = -1;
        if (rank == (round & 1)) {  // this rank pings
          fill(out.data(), sz, seed);
          if (int e = postSend(net, sc, out.data(), sz, 3, mo, &req)) return e;
          CK(waitReq(net, req, &got));
          if (int e = postRecvOne(net, rc, in.data(), in.size(), 3, mi, &req)) return e;
          CK(waitReq(net, req, &got));
          REQ(got == static_cast<int>(sz) && check(in.data(), sz, seed + 1), "pong of %zu bytes: size %d or data wrong", sz, got);
        } else {
          if (late) usleep(20000);
          if (int e = postRecvOne(net, rc, in.data(), in.size(), 3, mi, &req)) return e;
          CK(waitReq(net, req, &got));
          REQ(got == static_cast<int>(sz) && check(in.data(), sz, seed), "ping of %zu bytes: size %d or data wrong", sz, got);
          fill(out.data(), sz, seed + 1);
          if (int e = postSend(net, sc, out.data(), sz, 3, mo, &req)) return e;
          CK(waitReq(net, req, &got));
        }
      }
    // A lone 300 KiB message, then a 100-byte one; both sides complete the small one first.
    std::vector<char> small(128);
    void* ms;
    CK(net->regMr(rank == 0 ? sc : rc, small.data(), small.size(), NCCL_PTR_HOST, &ms));
    void *rbig = nullptr, *rsmall = nullptr;
    int gb = -1, gs = -1;
    if (rank == 0) {
      fill(out.data(), 300 << 10, 91);
      fill(small.data(), 100, 92);
      if (int e = postSend(net, sc, out.data(), 300 << 10, 5, mo, &rbig)) return e;
      if (int e = postSend(net, sc, small.data(), 100, 6, ms, &rsmall)) return e;
    } else {
      if (int e = postRecvOne(net, rc, in.data(), in.size(), 5, mi, &rbig)) return e;
      if (int e = postRecvOne(net, rc, small.data(), small.size(), 6, ms, &rsmall)) return e;
    }
    CK(waitReq(net, rsmall, &gs));
    CK(waitReq(net, rbig, &gb));
    if (rank == 1)
      REQ(gs == 100 && gb == (300 << 10) && check(small.data(), 100, 92) && check(in.data(), 300 << 10, 91),
          "lone message completed second: sizes %d / %d or data wrong", gb, gs);
    CK(net->deregMr(rank == 0 ? sc : rc, ms));
    CK(net->deregMr(sc, mo));
    CK(net->deregMr(rc, mi));
    barrier();
    CK(net->closeSend(sc));
    CK(net->closeRecv(rc));
    return 0;
  });
}

// Messages one after another, each posted as the one before completes (each side keeps one request in flight): the
// moment a helper thread runs out of work and goes to sleep is the moment the next message's chunks are queued. The
// socket backend wakes only a helper that sleeps or is about to (Helper::sleeping); a wake-up lost there leaves the
// chunks until the helper's poll() times out, up to a second. No message may take that long: at most 2 of 300 slower
// than 600 ms (a loaded machine's scheduling), where a lost wake-up shows in many. Every message is checked.
// (Mutation-checked: with no wake-up at all it fails; the helper's re-check after setting `sleeping` closes a window
// of a few hundred ns that this test does not hit on the 2-core VM even at 3000 messages.)
TEST_P(NetPlugin, NoWakeUpLostBetweenMessages) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr int kMsgs = 300;
    const size_t sizes[] = {(192 << 10) + 8, 1 << 20, (64 << 10) + 8};
    // Sender: one buffer per size, filled once, so that the next send is posted the moment the last one completes.
    // Receiver: two buffers in turn, the next receive posted before the last one's bytes are checked.
    std::vector<char> buf(3 << 20);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
    if (rank == 0)
      for (int k = 0; k < 3; ++k) fill(buf.data() + (k << 20), sizes[k], 700 + k);
    int slow = 0;
    double worst_ms = 0;
    auto lap = [&, t0 = std::chrono::steady_clock::now()]() mutable {
      const auto t = std::chrono::steady_clock::now();
      const double ms = std::chrono::duration<double, std::milli>(t - t0).count();
      t0 = t;
      worst_ms = std::max(worst_ms, ms);
      slow += ms > 600;
    };
    void* req = nullptr;
    int got = -1;
    if (rank == 1 && postRecvOne(net, rc, buf.data(), 1 << 20, 2, mh, &req) != 0) return 1;
    for (int i = 0; i < kMsgs; ++i) {
      if (rank == 0) {
        if (int e = postSend(net, sc, buf.data() + ((i % 3) << 20), sizes[i % 3], 2, mh, &req)) return e;
        CK(waitReq(net, req, &got));
        lap();
        continue;
      }
      CK(waitReq(net, req, &got));
      lap();
      if (i + 1 < kMsgs)
        if (int e = postRecvOne(net, rc, buf.data() + (((i + 1) & 1) << 20), 1 << 20, 2, mh, &req)) return e;
      REQ(got == static_cast<int>(sizes[i % 3]) && check(buf.data() + ((i & 1) << 20), got, 700 + i % 3),
          "message %d: size %d or data wrong", i, got);
    }
    REQ(slow <= 2, "rank %d: %d of %d messages took over 600 ms (worst %.0f ms): a helper slept through new work", rank,
        slow, kMsgs, worst_ms);
    CK(net->deregMr(rank == 0 ? sc : rc, mh));
    barrier();
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    return 0;
  });
}

TEST_P(NetPluginAbi, GroupedReceives) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    ncclNetProperties_v11_t p;
    CK(net->props(0, &p));
    int n = p.maxRecvs;
    REQ(n >= 2, "maxRecvs %d: grouped receives not offered", n);
    void* comm = rank == 0 ? sc : rc;
    for (int round = 0; round < 3; ++round) {
      std::vector<std::vector<char>> bufs(n);
      auto sizeOf = [&](int i) -> size_t { return i == 0 ? 0 : (i % 2 ? 100 * i : (256 << 10) * i); };
      if (rank == 0) {
        std::vector<void*> mhs(n);
        std::vector<int> order(n);
        for (int i = 0; i < n; ++i) order[i] = i;
        std::mt19937 g(round);
        std::shuffle(order.begin(), order.end(), g);  // the sender's order within a group is free
        std::vector<void*> reqs(n);
        for (int k = 0; k < n; ++k) {
          int i = order[k];
          bufs[i].resize(sizeOf(i) + 1);
          fill(bufs[i].data(), sizeOf(i), 77 * round + i);
          void* mh;
          CK(net->regMr(comm, bufs[i].data(), bufs[i].size(), NCCL_PTR_HOST, &mh));
          mhs[i] = mh;
          if (int e = postSend(net, sc, bufs[i].data(), sizeOf(i), 100 + i, mh, &reqs[k])) return e;
        }
        for (int k = 0; k < n; ++k) {
          int s;
          CK(waitReq(net, reqs[k], &s));
        }
        for (int i = 0; i < n; ++i) CK(net->deregMr(comm, mhs[i]));
      } else {
        std::vector<void*> d(n), mhs(n);
        std::vector<size_t> caps(n);
        std::vector<int> tags(n), got(n, -1);
        for (int i = 0; i < n; ++i) {
          bufs[i].resize(sizeOf(i) + 4096);
          CK(net->regMr(comm, bufs[i].data(), bufs[i].size(), NCCL_PTR_HOST, &mhs[i]));
          d[i] = bufs[i].data();
          caps[i] = bufs[i].size();
          tags[i] = 100 + i;
        }
        void* req = nullptr;
        if (int e = postRecv(net, rc, n, d.data(), caps.data(), tags.data(), mhs.data(), &req)) return e;
        CK(waitReq(net, req, got.data()));
        for (int i = 0; i < n; ++i) {
          REQ(got[i] == static_cast<int>(sizeOf(i)), "group buffer %d: size %d, want %zu", i, got[i], sizeOf(i));
          REQ(check(bufs[i].data(), sizeOf(i), 77 * round + i), "group buffer %d: wrong data", i);
          CK(net->deregMr(comm, mhs[i]));
        }
      }
    }
    barrier();
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    return 0;
  });
}

TEST_P(NetPlugin, BackPressureAndRegistration) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    // Registration: many regions, deregistered in another order; CUDA memory is not accepted by a host plugin.
    std::vector<std::vector<char>> regions(16, std::vector<char>(1 << 16));
    std::vector<void*> mhs(16);
    for (int i = 0; i < 16; ++i) CK(net->regMr(rank == 0 ? sc : rc, regions[i].data(), regions[i].size(), NCCL_PTR_HOST, &mhs[i]));
    for (int i = 15; i >= 0; i -= 2) CK(net->deregMr(rank == 0 ? sc : rc, mhs[i]));
    for (int i = 0; i < 16; i += 2) CK(net->deregMr(rank == 0 ? sc : rc, mhs[i]));
    // Back-pressure: the sender pushes 256 x 1 MiB while the receiver is not yet receiving.
    constexpr int kMsgs = 256;
    constexpr size_t kSz = 1 << 20;
    std::vector<char> big(kSz * 8);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, big.data(), big.size(), NCCL_PTR_HOST, &mh));
    if (rank == 0) {
      for (int s = 0; s < 8; ++s) fill(big.data() + s * kSz, kSz, 500 + s);
      std::vector<void*> inflight;
      int posted = 0;
      auto end = std::chrono::steady_clock::now() + std::chrono::seconds(90);
      while (posted < kMsgs || !inflight.empty()) {
        REQ(std::chrono::steady_clock::now() < end, "back-pressure: stuck at %d", posted);
        if (posted < kMsgs) {
          void* req = nullptr;
          CK(net->isend(sc, big.data() + (posted % 8) * kSz, kSz, 1, mh, &req));
          if (req) {
            inflight.push_back(req);
            ++posted;
            continue;
          }
        }
        if (!inflight.empty()) {
          int done = 0, s;
          CK(net->test(inflight.front(), &done, &s));
          if (done) inflight.erase(inflight.begin());
        }
      }
      gShared->flag[0].store(posted);
    } else {
      usleep(500 * 1000);  // let the sender run into full buffers / NULL requests
      for (int i = 0; i < kMsgs; ++i) {
        void* req = nullptr;
        void* d = big.data() + (i % 8) * kSz;
        if (int e = postRecvOne(net, rc, d, kSz, 1, mh, &req)) return e;
        int got;
        CK(waitReq(net, req, &got));
        REQ(got == static_cast<int>(kSz) && check(d, kSz, 500 + (i % 8)), "back-pressure msg %d wrong", i);
      }
    }
    CK(net->deregMr(rank == 0 ? sc : rc, mh));
    barrier();
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    return 0;
  });
}

TEST_P(NetPlugin, FourRanksAllPairs) {
  run(4, [](int rank, Net* net) {
    // Every rank listens once and accepts its three peers on that one listen comm; everyone connects to
    // everyone, all loops interleaved (non-blocking contract: no order can deadlock).
    void* lc = nullptr;
    CK(net->listen(0, gShared->handles[rank][0], &lc));
    gShared->handleReady[rank][0].store(1);
    void* sc[kMaxRanks] = {};
    std::vector<void*> rcs;
    char h[kMaxRanks][NCCL_NET_HANDLE_MAXSIZE];
    bool have[kMaxRanks] = {};
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    int connected = 0;
    while (connected < 3 || rcs.size() < 3) {
      REQ(std::chrono::steady_clock::now() < end, "all-pairs connect stuck (%d/%zu)", connected, rcs.size());
      for (int p = 0; p < 4; ++p) {
        if (p == rank || sc[p]) continue;
        if (!have[p]) {
          if (!gShared->handleReady[p][0].load()) continue;
          memcpy(h[p], gShared->handles[p][0], NCCL_NET_HANDLE_MAXSIZE);
          have[p] = true;
        }
        CK(net->connect(0, h[p], &sc[p]));
        if (sc[p]) ++connected;
      }
      if (rcs.size() < 3) {
        void* rc = nullptr;
        CK(net->accept(lc, &rc));
        if (rc) rcs.push_back(rc);
      }
    }
    // Accepted comms arrive in any order: the first message on each says who the peer is.
    static int who[3];
    static int ids[4];
    std::vector<void*> byPeer(4, nullptr);
    void *mh = nullptr, *mhIds = nullptr;
    CK(net->regMr(rcs[0], who, sizeof(who), NCCL_PTR_HOST, &mh));
    CK(net->regMr(rcs[0], ids, sizeof(ids), NCCL_PTR_HOST, &mhIds));
    std::vector<void*> reqs;
    for (int p = 0; p < 4; ++p)
      if (p != rank) {
        void* r;
        ids[p] = rank;
        if (int e = postSend(net, sc[p], &ids[p], sizeof(int), 0, mhIds, &r)) return e;
        reqs.push_back(r);
      }
    for (int i = 0; i < 3; ++i) {
      void* r;
      if (int e = postRecvOne(net, rcs[i], &who[i], sizeof(int), 0, mh, &r)) return e;
      int s;
      CK(waitReq(net, r, &s));
      REQ(who[i] >= 0 && who[i] < 4 && who[i] != rank, "bad peer id %d", who[i]);
      byPeer[who[i]] = rcs[i];
    }
    for (void* r : reqs) {
      int s;
      CK(waitReq(net, r, &s));
    }
    // Then 2 MiB from everyone to everyone, concurrently.
    constexpr size_t kSz = 2 << 20;
    std::vector<std::vector<char>> out(4, std::vector<char>(kSz)), in(4, std::vector<char>(kSz));
    std::vector<void*> all, mhOut(4), mhIn(4);
    for (int p = 0; p < 4; ++p) {
      if (p == rank) continue;
      fill(out[p].data(), kSz, rank * 10 + p);
      CK(net->regMr(sc[p], out[p].data(), kSz, NCCL_PTR_HOST, &mhOut[p]));
      CK(net->regMr(byPeer[p], in[p].data(), kSz, NCCL_PTR_HOST, &mhIn[p]));
      void* r;
      if (int e = postSend(net, sc[p], out[p].data(), kSz, 3, mhOut[p], &r)) return e;
      all.push_back(r);
      if (int e = postRecvOne(net, byPeer[p], in[p].data(), kSz, 3, mhIn[p], &r)) return e;
      all.push_back(r);
    }
    for (void* r : all) {
      int s;
      CK(waitReq(net, r, &s));
    }
    for (int p = 0; p < 4; ++p)
      if (p != rank) REQ(check(in[p].data(), kSz, p * 10 + rank), "data from %d wrong", p);
    barrier();
    for (int p = 0; p < 4; ++p)
      if (sc[p]) CK(net->closeSend(sc[p]));
    for (void* rc : rcs) CK(net->closeRecv(rc));
    CK(net->closeListen(lc));
    return 0;
  });
}

// DESIGN R5: a connection that does not present the listen's secret is dropped (and logged); the listen comm
// keeps working for the real peer.
TEST_P(NetPlugin, WrongSecretIsDropped) {
  run(2, [](int rank, Net* net) {
    if (rank == 1) {
      void* lc = nullptr;
      CK(net->listen(0, gShared->handles[1][0], &lc));
      gShared->handleReady[1][0].store(1);
      // While only the impostor connects, nothing is accepted.
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(800);
      while (std::chrono::steady_clock::now() < until) {
        void* rc = nullptr;
        CK(net->accept(lc, &rc));
        REQ(rc == nullptr, "accepted a connection with a wrong secret");
        usleep(1000);
      }
      gShared->flag[1].store(1);  // now the real connect
      void* rc = nullptr;
      auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!rc) {
        CK(net->accept(lc, &rc));
        REQ(std::chrono::steady_clock::now() < end, "real peer not accepted after the impostor");
      }
      int v = 0;
      void* req;
      void* mh = nullptr;
      CK(net->regMr(rc, &v, sizeof(v), NCCL_PTR_HOST, &mh));
      if (int e = postRecvOne(net, rc, &v, sizeof(v), 0, mh, &req)) return e;
      int s;
      CK(waitReq(net, req, &s));
      REQ(v == 4242, "got %d", v);
      barrier();
      CK(net->closeRecv(rc));
      CK(net->closeListen(lc));
    } else {
      while (!gShared->handleReady[1][0].load()) usleep(100);
      char bad[NCCL_NET_HANDLE_MAXSIZE];
      memcpy(bad, gShared->handles[1][0], sizeof(bad));
      bad[8] ^= 0x5a;  // the secret lives at bytes 8..15 of every epcomm handle
      void* badSc = nullptr;
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
      while (!badSc && std::chrono::steady_clock::now() < until) {
        if (net->connect(0, bad, &badSc) != ncclSuccess) break;  // refused outright is fine too
      }
      while (!gShared->flag[1].load()) usleep(100);
      if (badSc) net->closeSend(badSc);
      char h[NCCL_NET_HANDLE_MAXSIZE];
      memcpy(h, gShared->handles[1][0], sizeof(h));
      void* sc = nullptr;
      auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!sc) {
        CK(net->connect(0, h, &sc));
        REQ(std::chrono::steady_clock::now() < end, "connect stuck");
      }
      static int v = 4242;
      void* mh = nullptr;
      CK(net->regMr(sc, &v, sizeof(v), NCCL_PTR_HOST, &mh));
      void* req;
      if (int e = postSend(net, sc, &v, sizeof(v), 0, mh, &req)) return e;
      int s;
      CK(waitReq(net, req, &s));
      barrier();
      CK(net->closeSend(sc));
    }
    return 0;
  });
}

TEST_P(NetPlugin, CloseInFlight) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr size_t kSz = 128 << 20;
    char* buf = static_cast<char*>(malloc(kSz));
    memset(buf, 1, kSz);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    if (rank == 0) {
      void* reqs[4];
      for (auto& r : reqs)
        if (int e = postSend(net, sc, buf, kSz, 0, mh, &r)) return e;
      int done, s;
      CK(net->test(reqs[0], &done, &s));
      auto t0 = std::chrono::steady_clock::now();
      CK(net->closeSend(sc));  // mid-transfer: must release everything and return promptly
      REQ(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5), "closeSend blocked");
      gShared->flag[2].store(1);
    } else {
      void* req;
      void* d = buf;
      size_t cap = kSz;
      int tag = 0;
      if (int e = postRecv(net, rc, 1, &d, &cap, &tag, &mh, &req)) return e;
      int doneEarly = 0, sz0;
      ncclResult_t r = ncclSuccess;
      // Keep progressing while waiting, as NCCL's proxy thread does (libfabric providers need both sides).
      while (!gShared->flag[2].load() && r == ncclSuccess && !doneEarly) r = net->test(req, &doneEarly, &sz0);
      while (!gShared->flag[2].load()) usleep(100);
      // Either the first message made it before the close, or the error names the peer — never a hang.
      int got;
      if (r == ncclSuccess && !doneEarly) r = waitReq(net, req, &got, 20000);
      REQ(r == ncclSuccess || r == ncclRemoteError || r == ncclSystemError, "test -> %d", r);
      // The second message was in flight when the sender closed: it either arrives whole (a backend whose
      // close lets the provider finish what it already started, ofi) or fails naming the peer (socket); it
      // never hangs and never arrives cut.
      if (int e = postRecv(net, rc, 1, &d, &cap, &tag, &mh, &req)) {
        (void)e;  // an error already at posting time is an expected outcome too
      } else {
        r = waitReq(net, req, &got, 20000);
        REQ(r == ncclRemoteError || r == ncclSystemError || (r == ncclSuccess && got == static_cast<int>(kSz)),
            "message after close: test -> %d (%d bytes)", r, got);
      }
      // closeRecv with a receive posted: releases everything.
      void* req2 = nullptr;
      net->irecv(rc, 1, &d, &cap, &tag, &mh, &req2);
      CK(net->closeRecv(rc));
    }
    free(buf);
    return 0;
  });
}

// A peer killed mid-transfer turns into an error that names it, well within EPCOMM_TIMEOUT_MS.
void killedPeer(int victim, const std::function<void(const std::function<int(int, Net*)>&)>& runner) {
  runner([victim](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr size_t kSz = 256 << 20;  // far more than the sockets can buffer
    char* buf = static_cast<char*>(malloc(kSz));
    memset(buf, 3, kSz);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    if (rank == 0) {
      // Post once (NULL = not now is acceptable; the survivor then retries in its wait loop below).
      CK(net->isend(sc, buf, kSz, 0, mh, &req));
    } else {
      if (int e = postRecvOne(net, rc, buf, kSz, 0, mh, &req)) return e;
    }
    if (rank == victim) {
      // Let the transfer start, then die without closing anything. A killed sender stops driving its
      // side right after posting (a fast provider could otherwise finish 256 MiB before the kill); a killed
      // receiver progresses a little first so that data is flowing.
      for (int i = 0; i < (victim == 0 ? 0 : 20); ++i) {
        int done, s;
        if (req) net->test(req, &done, &s);
        usleep(1000);
      }
      for (int i = 0; i < 1000 && !req && victim == 0; ++i) net->isend(sc, buf, kSz, 0, mh, &req);
      gShared->flag[3].store(1);
      raise(SIGKILL);
    }
    ncclResult_t r = ncclSuccess;
    int got, done = 0;
    // A surviving sender keeps progressing (providers need both sides for the connection); a surviving
    // receiver waits until the sender is gone, so that the message cannot have been delivered whole (shm's
    // CMA lets the receiver pull the data without any help from the sender).
    while (victim == 1 && !gShared->flag[3].load() && r == ncclSuccess && req) r = net->test(req, &done, &got);
    REQ(!done, "the whole message went through before the kill");
    while (!gShared->flag[3].load()) usleep(100);
    if (victim == 0) usleep(200 * 1000);
    auto t0 = std::chrono::steady_clock::now();
    auto end = t0 + std::chrono::seconds(30);
    while (r == ncclSuccess && !req && std::chrono::steady_clock::now() < end) r = net->isend(sc, buf, kSz, 0, mh, &req);
    if (r == ncclSuccess && req) r = waitReq(net, req, &got, 30000);
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    REQ(r == ncclRemoteError || r == ncclSystemError, "survivor's test -> %d after %.1fs", r, sec);
    REQ(sec < 12, "error took %.1f s (EPCOMM_TIMEOUT_MS=10000)", sec);
    if (rank == 0) CK(net->closeSend(sc));
    else CK(net->closeRecv(rc));
    free(buf);
    return 0;
  });
}

TEST_P(NetPlugin, SenderKilledMidTransfer) {
  setenv("EPCOMM_TIMEOUT_MS", "10000", 1);
  gNranks = 2;
  const Backend b = GetParam();
  killedPeer(0, [&](const std::function<int(int, Net*)>& body) {
    auto codes = epcomm::test::runRanks(2, [&](int rank) {
      Net net;
      int rc = openNet(b, &net);
      return rc ? rc : body(rank, &net);
    }, 60000, removeShmLeftovers);
    EXPECT_EQ(codes[0], 128 + SIGKILL);
    EXPECT_EQ(codes[1], 0) << "survivor";
  });
  unsetenv("EPCOMM_TIMEOUT_MS");
}

TEST_P(NetPlugin, ReceiverKilledMidTransfer) {
  setenv("EPCOMM_TIMEOUT_MS", "10000", 1);
  gNranks = 2;
  const Backend b = GetParam();
  killedPeer(1, [&](const std::function<int(int, Net*)>& body) {
    auto codes = epcomm::test::runRanks(2, [&](int rank) {
      Net net;
      int rc = openNet(b, &net);
      return rc ? rc : body(rank, &net);
    }, 60000, removeShmLeftovers);
    EXPECT_EQ(codes[1], 128 + SIGKILL);
    EXPECT_EQ(codes[0], 0) << "survivor";
  });
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// libfabric's default shm region name is "<pid>:..."; a region left by a dead process with a since reused pid
// would block the endpoint (CI hit this once pids wrapped). The plugin names regions "epcomm-<pid>-<nonce>".
TEST_P(NetPlugin, ShmRegionNameIsUnique) {
  const char* prov = GetParam().provider;
  if (!prov || strcmp(prov, "shm") != 0) GTEST_SKIP() << "ofi shm only";
  run(1, [](int, Net* net) {
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    CK(net->listen(0, h, &lc));  // opens the device, hence the endpoint
    const std::string ours = "epcomm-" + std::to_string(getpid()) + "-", dflt = std::to_string(getpid()) + ":";
    const size_t nOurs = shmFilesStartingWith(ours).size(), nDflt = shmFilesStartingWith(dflt).size();
    REQ(nOurs == 1 && nDflt == 0, "/dev/shm holds %zu regions named %s* and %zu named %s*", nOurs, ours.c_str(), nDflt,
        dflt.c_str());
    CK(net->closeListen(lc));
    return 0;
  });
}

// A peer that stops (alive, sockets open, SIGSTOP) while the other side waits: the waiting side's request fails
// with a timeout within EPCOMM_TIMEOUT_MS instead of hanging. The stopped process's heartbeats cease; every
// waiting request of its peer fails (the receiver's below; socket: mostly as a receive stalled mid-message, which
// fails on the missing bytes alone; shm's CMA may pull the first message out of the stopped sender, so a second
// receive, which no send will ever match, has to fail as well).
TEST_P(NetPlugin, StalledSenderTimesOut) {
  setenv("EPCOMM_TIMEOUT_MS", "2000", 1);
  auto codes = runCodes(2, [this](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    const size_t kSz = GetParam().provider ? (64 << 20) : (256 << 20);  // ofi posts up to 64 MiB at once
    char* buf = static_cast<char*>(malloc(kSz));
    memset(buf, 5, kSz);
    void* req = nullptr;
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    if (rank == 0) {
      if (int e = postSend(net, sc, buf, kSz, 0, mh, &req)) return e;
      int done, s;
      CK(net->test(req, &done, &s));
      gShared->flag[4].store(1);
      raise(SIGSTOP);  // the receiver kills us once it has seen the timeout
      return 0;
    }
    if (int e = postRecvOne(net, rc, buf, kSz, 0, mh, &req)) return e;
    // Progress while the sender starts (libfabric providers connect on first use and need both sides).
    int got = 0, early = 0;
    ncclResult_t r = ncclSuccess;
    while (!gShared->flag[4].load() && r == ncclSuccess && !early) r = net->test(req, &early, &got);
    while (!gShared->flag[4].load()) usleep(100);
    auto t0 = std::chrono::steady_clock::now();
    if (r == ncclSuccess && !early) r = waitReq(net, req, &got, 20000);
    if (r == ncclSuccess && GetParam().provider) {  // pulled whole from the stopped sender (shm): wait for more
      r = postRecvOne(net, rc, buf, kSz, 0, mh, &req) ? ncclInternalError : waitReq(net, req, &got, 20000);
    }
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    kill(gShared->pid[0].load(), SIGKILL);
    REQ(r == ncclRemoteError, "test -> %d after %.1fs", r, sec);
    REQ(sec < 6, "timeout took %.1f s (EPCOMM_TIMEOUT_MS=2000)", sec);
    CK(net->closeRecv(rc));
    return 0;
  });
  EXPECT_EQ(codes[0], 128 + SIGKILL) << "the stopped sender";
  EXPECT_EQ(codes[1], 0) << "receiver";
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// The other direction: the receiver stops after posting one receive; the sender's send that it does not drain
// (the first one once the sockets are full, or the second, which no receive matches) fails within the deadline:
// the stopped receiver's heartbeats cease (ofi: on the side channel; socket: on the connection's liveness socket).
TEST_P(NetPlugin, StalledReceiverTimesOut) {
  setenv("EPCOMM_TIMEOUT_MS", "2000", 1);
  auto codes = runCodes(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr size_t kSz = 64 << 20;
    char* buf = static_cast<char*>(malloc(kSz));
    memset(buf, 6, kSz);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    if (rank == 1) {
      if (int e = postRecvOne(net, rc, buf, kSz, 0, mh, &req)) return e;
      int done, s;
      CK(net->test(req, &done, &s));
      gShared->flag[4].store(1);
      raise(SIGSTOP);
      return 0;
    }
    while (!gShared->flag[4].load()) usleep(100);
    auto t0 = std::chrono::steady_clock::now();
    ncclResult_t r = ncclSuccess;
    int got;
    for (int i = 0; i < 2 && r == ncclSuccess; ++i) {
      if (postSend(net, sc, buf, kSz, 0, mh, &req)) {
        r = ncclRemoteError;  // refused at posting time: also an error, not a hang
        break;
      }
      r = waitReq(net, req, &got, 20000);
    }
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    kill(gShared->pid[1].load(), SIGKILL);
    REQ(r == ncclRemoteError, "test -> %d after %.1fs", r, sec);
    REQ(sec < 6, "timeout took %.1f s (EPCOMM_TIMEOUT_MS=2000)", sec);
    CK(net->closeSend(sc));
    return 0;
  });
  EXPECT_EQ(codes[0], 0) << "sender";
  EXPECT_EQ(codes[1], 128 + SIGKILL) << "the stopped receiver";
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// A receive still waiting for its message, from a peer that stopped before sending anything, fails within the
// deadline as well: the stopped process's heartbeats cease.
TEST_P(NetPlugin, StoppedPeerFailsPostedReceive) {
  setenv("EPCOMM_TIMEOUT_MS", "2000", 1);
  auto codes = runCodes(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    if (rank == 0) {
      gShared->flag[4].store(1);
      raise(SIGSTOP);  // the receiver kills us once it has seen the timeout
      return 0;
    }
    uint64_t v = 0;
    void* mh = nullptr;
    CK(net->regMr(rc, &v, sizeof(v), NCCL_PTR_HOST, &mh));
    while (!gShared->flag[4].load()) usleep(100);
    void* req = nullptr;
    int got = 0;
    auto t0 = std::chrono::steady_clock::now();
    ncclResult_t r = postRecvOne(net, rc, &v, sizeof(v), 0, mh, &req) ? ncclInternalError : waitReq(net, req, &got, 20000);
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    kill(gShared->pid[0].load(), SIGKILL);
    REQ(r == ncclRemoteError, "test -> %d after %.1fs", r, sec);
    REQ(sec < 6, "timeout took %.1f s (EPCOMM_TIMEOUT_MS=2000)", sec);
    CK(net->closeRecv(rc));
    return 0;
  });
  EXPECT_EQ(codes[0], 128 + SIGKILL) << "the stopped sender";
  EXPECT_EQ(codes[1], 0) << "receiver";
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// An idle peer is no stall: a receive posted long (several deadlines) before the peer sends completes.
TEST_P(NetPlugin, IdlePeerIsNoStall) {
  setenv("EPCOMM_TIMEOUT_MS", "500", 1);
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    uint64_t v = 42;
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, &v, sizeof(v), NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    int got;
    if (rank == 1) {
      v = 0;
      if (int e = postRecvOne(net, rc, &v, sizeof(v), 3, mh, &req)) return e;
      CK(waitReq(net, req, &got, 20000));
      REQ(v == 42 && got == sizeof(v), "got %llu (%d bytes)", static_cast<unsigned long long>(v), got);
      barrier();
      CK(net->closeRecv(rc));
    } else {
      usleep(2000 * 1000);  // 4 deadlines without a single plugin call: computing, not stalled
      if (int e = postSend(net, sc, &v, sizeof(v), 3, mh, &req)) return e;
      CK(waitReq(net, req, &got, 20000));
      barrier();
      CK(net->closeSend(sc));
    }
    return 0;
  });
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// A live receiver that posts its receives late is no stall either, however long the sender's sends wait with
// full sockets and nothing accepted by the kernel (NCCL posts a receive when its rank reaches the collective,
// which may be long after the sender did): each receive comes 3 deadlines after the previous one completed.
TEST_P(NetPlugin, LateReceiverIsNoStall) {
  // 1 s, not 0.5 s: on a loaded 2-core machine a heartbeat thread can be off the CPU for half a second (one
  // false stall in a full run beside a benchmark).
  setenv("EPCOMM_TIMEOUT_MS", "1000", 1);
  run(2, [this](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    constexpr int kMsgs = 2;
    const size_t kSz = GetParam().provider ? (64 << 20) : (256 << 20);  // more than the sockets buffer
    char* buf = static_cast<char*>(malloc(kSz));
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    void* reqs[kMsgs] = {};
    int got;
    if (rank == 0) {
      fill(buf, kSz, 21);
      for (auto& r : reqs)
        if (int e = postSend(net, sc, buf, kSz, 0, mh, &r)) return e;
      for (int i = 0; i < kMsgs; ++i) {
        ncclResult_t r = waitReq(net, reqs[i], &got, 30000);
        REQ(r == ncclSuccess, "send %d to a live, late receiver: test -> %d", i, r);
      }
      barrier();
      CK(net->closeSend(sc));
    } else {
      for (int i = 0; i < kMsgs; ++i) {
        usleep(3000 * 1000);  // 3 deadlines without a plugin call: busy elsewhere, not stalled
        memset(buf, 0, kSz);
        if (int e = postRecvOne(net, rc, buf, kSz, 0, mh, &reqs[i])) return e;
        CK(waitReq(net, reqs[i], &got, 30000));
        size_t bad = 0;
        REQ(got == static_cast<int>(kSz) && check(buf, kSz, 21, &bad), "message %d: %d bytes, bad at %zu", i, got, bad);
      }
      barrier();
      CK(net->closeRecv(rc));
    }
    free(buf);
    return 0;
  }, 60000);
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// A reader that is slow but progressing is no stall: the receiver runs in short bursts (the sender stops it for
// 300 ms, lets it run for 50 ms, again and again, with EPCOMM_TIMEOUT_MS=1000), so the sender's send waits on
// full sockets most of the time, but never a whole deadline without a sign of life from the peer.
TEST_P(NetPlugin, SlowReaderIsNoStall) {
  setenv("EPCOMM_TIMEOUT_MS", "1000", 1);
  run(2, [this](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    const size_t kSz = GetParam().provider ? (64 << 20) : (256 << 20);
    char* buf = static_cast<char*>(malloc(kSz));
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, kSz, NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    int got;
    if (rank == 1) {
      memset(buf, 0, kSz);
      if (int e = postRecvOne(net, rc, buf, kSz, 0, mh, &req)) return e;
      gShared->flag[4].store(1);
      CK(waitReq(net, req, &got, 60000));
      size_t bad = 0;
      REQ(got == static_cast<int>(kSz) && check(buf, kSz, 22, &bad), "%d bytes, bad at %zu", got, bad);
      barrier();
      CK(net->closeRecv(rc));
    } else {
      fill(buf, kSz, 22);
      while (!gShared->flag[4].load()) usleep(100);
      std::atomic<bool> stop{false};
      std::atomic<int> bursts{0};
      std::thread throttle([&] {
        const pid_t peer = gShared->pid[1].load();
        while (!stop.load()) {
          kill(peer, SIGSTOP);
          usleep(300 * 1000);
          kill(peer, SIGCONT);
          usleep(50 * 1000);
          bursts.fetch_add(1);
        }
      });
      auto t0 = std::chrono::steady_clock::now();
      ncclResult_t r = ncclSuccess;
      if (postSend(net, sc, buf, kSz, 0, mh, &req)) r = ncclInternalError;
      else r = waitReq(net, req, &got, 60000);
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stop.store(true);
      throttle.join();
      REQ(r == ncclSuccess, "send to a slow reader: test -> %d after %.1f s (%d bursts)", r, sec, bursts.load());
      barrier();
      CK(net->closeSend(sc));
    }
    free(buf);
    return 0;
  }, 90000);
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// Both peers stopped together and continued later (a suspended job) is no stall either: neither heard from the
// other while it was stopped itself. Rank 1 waits on a receive (its peer has not sent yet) and, over socket, on a
// send that fills the sockets (its peer has not posted yet) while rank 2 stops both ranks for 4 deadlines.
TEST_P(NetPlugin, SuspendedJobIsNoStall) {
  // Over libfabric's shm provider this case failed in 2 of 4 fresh-clone CI runs (2026-11-30), and over ofi net
  // once (2026-12-01): the waiting rank's receive got a remote error after the resume. The cause (73072bd): the
  // ofi stall check read the resume time before "awake", so a heartbeat turn between the two reads (both threads
  // wake at the same SIGCONT) judged the peer on this process's own stop (test_net_turn_clock reproduces that
  // order's race).
  // A deadline well below the stop, with room for a slow machine: under ASAN on a loaded 2-core CI host, 500 ms
  // once passed before the resumed peer's first heartbeat was scheduled (ofi shm), a false verdict of the test.
  setenv("EPCOMM_TIMEOUT_MS", "1500", 1);
  // ofi: the receive only. A provider starts a send only with the peer's progress calls, which the stopped-
  // elsewhere peer does not make before the stop, so the big send could not be posted in time.
  const bool bigToo = GetParam().provider == nullptr;
  run(3, [this, bigToo](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr, *sc2 = nullptr, *rc2 = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;   // 0 -> 1: rank 1's receive waits
    if (int e = pairConnect(net, rank, 1, 0, &sc2, &rc2)) return e;  // 1 -> 0: rank 1's send waits
    if (rank == 2) {
      while (gShared->flag[4].load() < 2) usleep(100);
      usleep(200 * 1000);
      const pid_t a = gShared->pid[0].load(), b = gShared->pid[1].load();
      kill(a, SIGSTOP);
      kill(b, SIGSTOP);
      usleep(4000 * 1000);
      kill(b, SIGCONT);  // the waiting side first: it must not judge its peer before the peer had a turn
      usleep(50 * 1000);
      kill(a, SIGCONT);
      gShared->flag[5].store(1);
      barrier();
      return 0;
    }
    const size_t kSz = GetParam().provider ? (64 << 20) : (256 << 20);
    char* buf = static_cast<char*>(malloc(kSz));
    uint64_t v = rank == 0 ? 42 : 0;
    void *mh = nullptr, *mhv = nullptr;
    CK(net->regMr(rank == 0 ? rc2 : sc2, buf, kSz, NCCL_PTR_HOST, &mh));
    CK(net->regMr(rank == 0 ? sc : rc, &v, sizeof(v), NCCL_PTR_HOST, &mhv));
    void *reqBig = nullptr, *reqSmall = nullptr;
    int got;
    if (rank == 1) {
      fill(buf, kSz, 23);
      if (int e = postRecvOne(net, rc, &v, sizeof(v), 0, mhv, &reqSmall)) return e;
      if (bigToo) {
        if (int e = postSend(net, sc2, buf, kSz, 0, mh, &reqBig)) return e;
      }
      gShared->flag[4].fetch_add(1);
      int doneSmall = 0, doneBig = bigToo ? 0 : 1;
      auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!(doneSmall && doneBig)) {
        if (!doneSmall) CK(net->test(reqSmall, &doneSmall, &got));
        if (!doneBig) CK(net->test(reqBig, &doneBig, &got));
        REQ(std::chrono::steady_clock::now() < end, "requests did not complete");
      }
      REQ(v == 42, "got %llu", static_cast<unsigned long long>(v));
    } else {
      gShared->flag[4].fetch_add(1);
      while (!gShared->flag[5].load()) usleep(1000);  // busy elsewhere: no plugin call until well after the resume
      usleep(300 * 1000);
      if (bigToo) {
        if (int e = postRecvOne(net, rc2, buf, kSz, 0, mh, &reqBig)) return e;
      }
      if (int e = postSend(net, sc, &v, sizeof(v), 0, mhv, &reqSmall)) return e;
      CK(waitReq(net, reqSmall, &got, 30000));
      if (bigToo) {
        CK(waitReq(net, reqBig, &got, 30000));
        size_t bad = 0;
        REQ(got == static_cast<int>(kSz) && check(buf, kSz, 23, &bad), "%d bytes, bad at %zu", got, bad);
      }
    }
    barrier();
    if (rank == 0) {
      CK(net->closeSend(sc));
      CK(net->closeRecv(rc2));
    } else {
      CK(net->closeRecv(rc));
      CK(net->closeSend(sc2));
    }
    free(buf);
    return 0;
  }, 60000);
  unsetenv("EPCOMM_TIMEOUT_MS");
}

// Close with sends (and receives) in flight, then unmap their buffers at once and keep the process using the
// plugin: nothing of the closed comm may touch that memory afterwards (a provider still reading a send buffer
// or writing a receive buffer would crash this process), close returns promptly, and the peer sees whole
// messages or errors, never a hang.
TEST_P(NetPlugin, CloseDrainsInFlightAndUnmaps) {
  run(2, [](int rank, Net* net) {
    void *sc = nullptr, *rc = nullptr, *sc2 = nullptr, *rc2 = nullptr;
    if (int e = pairConnect(net, rank, 0, 1, &sc, &rc)) return e;
    barrier();  // the handle slot is reused for a second connection, which stays open
    if (rank == 1) gShared->handleReady[1][0].store(0);
    barrier();
    if (int e = pairConnect(net, rank, 0, 1, &sc2, &rc2)) return e;
    constexpr int kMsgs = 6;
    const size_t sizes[kMsgs] = {64, 4096, 65536, 1 << 20, 8 << 20, 32 << 20};
    size_t total = 0;
    for (size_t z : sizes) total += z;
    char* buf = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQ(buf != MAP_FAILED, "mmap");
    memset(buf, 7, total);
    void* mh = nullptr;
    CK(net->regMr(rank == 0 ? sc : rc, buf, total, NCCL_PTR_HOST, &mh));
    void* reqs[kMsgs] = {};
    if (rank == 0) {
      size_t off = 0;
      for (int i = 0; i < kMsgs; ++i) {
        if (int e = postSend(net, sc, buf + off, sizes[i], 0, mh, &reqs[i])) return e;
        off += sizes[i];
      }
      int done, s;
      CK(net->test(reqs[0], &done, &s));
      while (!gShared->flag[1].load()) usleep(100);  // the receiver has posted half of the receives
      auto t0 = std::chrono::steady_clock::now();
      CK(net->deregMr(sc, mh));
      CK(net->closeSend(sc));
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      munmap(buf, total);
      gShared->flag[2].store(1);
      REQ(sec < 5, "closeSend took %.1f s", sec);
    } else {
      // Post the first half; the rest of the sends have no receive when the sender closes.
      size_t off = 0;
      for (int i = 0; i < kMsgs / 2; ++i) {
        if (int e = postRecvOne(net, rc, buf + off, sizes[i], 0, mh, &reqs[i])) return e;
        off += sizes[i];
      }
      gShared->flag[1].store(1);
      for (int i = 0; i < kMsgs / 2; ++i) {
        int got;
        ncclResult_t r = waitReq(net, reqs[i], &got, 20000);
        REQ(r == ncclSuccess || r == ncclRemoteError || r == ncclSystemError, "receive %d: test -> %d", i, r);
        if (r != ncclSuccess) break;
        REQ(got == static_cast<int>(sizes[i]), "receive %d: %d bytes of %zu", i, got, sizes[i]);
      }
      while (!gShared->flag[2].load()) usleep(100);
      // Receives posted for messages that never come, then closed and unmapped.
      void* late[2];
      for (auto& lr : late) {
        void* d = buf;
        size_t cap = sizes[0];
        int tag = 1;
        lr = nullptr;
        if (net->irecv(rc, 1, &d, &cap, &tag, &mh, &lr) != ncclSuccess) break;
      }
      auto t0 = std::chrono::steady_clock::now();
      CK(net->deregMr(rc, mh));
      CK(net->closeRecv(rc));
      REQ(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5), "closeRecv blocked");
      munmap(buf, total);
    }
    // Keep the device busy on the second connection for a while: any provider progress on the closed comm's
    // operations now happens, against unmapped memory if close left them in the provider's hands.
    // Known limit (libfabric 1.17, libfabric.so.1.20; shm and net): they cancel receives only, and the large
    // sends left unmatched at close (nothing to receive them; shm: the closing receiver's zero-byte sinks do
    // not match them either) hold up later traffic between the same two endpoints, so the second connection
    // is not driven there. net (RDM straight over one TCP stream per pair of endpoints, no rxm) leaves an
    // unmatched message's bytes in the stream, ahead of everything sent after it.
    const char* prov = getenv("EPCOMM_OFI_PROVIDER");
    if (prov && (strcmp(prov, "shm") == 0 || strcmp(prov, "net") == 0) && getenv("EPCOMM_NET") &&
        strcmp(getenv("EPCOMM_NET"), "ofi") == 0) {
      barrier();
      if (rank == 0) CK(net->closeSend(sc2));
      else CK(net->closeRecv(rc2));
      return 0;
    }
    std::vector<char> b2(1 << 20, 9);
    void* mh2 = nullptr;
    CK(net->regMr(rank == 0 ? sc2 : rc2, b2.data(), b2.size(), NCCL_PTR_HOST, &mh2));
    for (int i = 0; i < 20; ++i) {
      void* q = nullptr;
      int got;
      if (rank == 0) {
        if (int e = postSend(net, sc2, b2.data(), b2.size(), 2, mh2, &q)) return e;
      } else {
        if (int e = postRecvOne(net, rc2, b2.data(), b2.size(), 2, mh2, &q)) return e;
      }
      CK(waitReq(net, q, &got, 20000));
    }
    CK(net->deregMr(rank == 0 ? sc2 : rc2, mh2));
    barrier();
    if (rank == 0) CK(net->closeSend(sc2));
    else CK(net->closeRecv(rc2));
    return 0;
  });
}

std::vector<Backend> backends(std::initializer_list<int> versions) {
  std::vector<Backend> v;
  for (int ver : versions) v.push_back({"socket", nullptr, ver});
  for (const char* prov : {"tcp;ofi_rxm", "net", "shm"})
    for (int ver : versions) v.push_back({"ofi", prov, ver});
  return v;
}

auto nameOf = [](const ::testing::TestParamInfo<Backend>& i) { return caseName(i.param); };
INSTANTIATE_TEST_SUITE_P(V11, NetPlugin, ::testing::ValuesIn(backends({11})), nameOf);
INSTANTIATE_TEST_SUITE_P(AllVersions, NetPluginAbi, ::testing::ValuesIn(backends({11, 10, 9, 8})), nameOf);

}  // namespace
