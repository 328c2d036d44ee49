// libnccl-net-epcomm.so: NCCL's net-plugin ABI (v8..v11) over epcomm's net transport.
//
// NCCL_NET_PLUGIN=epcomm (or the .so's absolute path) NCCL_NET=epcomm makes NCCL load this library and send
// every inter-node byte through src/transport/net; EPCOMM_NET=socket|ofi picks the backend. Only the four
// ncclNetPlugin_vN structs are exported (exports.map); everything else is hidden.
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "plugin/nccl/nccl_net_abi.h"
#include "transport/net/net.h"

using epcomm::net::NetBackend;
using epcomm::net::NetProperties;

namespace {

std::mutex gInitMu;
NetBackend* gNet = nullptr;
std::string gWhyNot;
ncclDebugLogger_t gLogger = nullptr;

// Route our log lines through NCCL's logger so they obey NCCL_DEBUG/NCCL_DEBUG_SUBSYS and land in its file.
void ncclSink(int level, const char* file, int line, const char* msg) {
  ncclDebugLogger_t lf = gLogger;
  if (!lf) return;
  ncclDebugLogLevel l = level == epcomm::net::kNetLogWarn   ? NCCL_LOG_WARN
                        : level == epcomm::net::kNetLogInfo ? NCCL_LOG_INFO
                                                            : NCCL_LOG_TRACE;
  lf(l, NCCL_NET, file, line, "%s", msg);
}

ncclResult_t toNccl(epResult_t r) {
  switch (r) {
    case epSuccess: return ncclSuccess;
    case epSystemError: return ncclSystemError;
    case epRemoteError:
    case epTimeout: return ncclRemoteError;
    case epInvalidArgument:
    case epNullPointer: return ncclInvalidArgument;
    case epInvalidUsage: return ncclInvalidUsage;
    default: return ncclInternalError;
  }
}

#define PCHECK(call)                        \
  do {                                      \
    epResult_t r_ = (call);                 \
    if (r_ != epSuccess) return toNccl(r_); \
  } while (0)

ncclResult_t commonInit(ncclDebugLogger_t logFunction) {
  std::lock_guard<std::mutex> g(gInitMu);
  if (logFunction) {
    gLogger = logFunction;
    epcomm::net::netSetLogSink(ncclSink);
  }
  if (gNet) return ncclSuccess;
  gNet = epcomm::net::netBackend(&gWhyNot);
  if (!gNet) {
    // NCCL then tries the next plugin (or fails loudly when NCCL_NET=epcomm): say why we are not offered.
    NET_WARN("NET/epcomm: not offered: %s", gWhyNot.c_str());
    return ncclSystemError;
  }
  NET_INFO("NET/epcomm: backend %s, %d device(s)", gNet->name(), gNet->devices());
  return ncclSuccess;
}

ncclResult_t pDevices(int* ndev) {
  *ndev = gNet ? gNet->devices() : 0;
  return ncclSuccess;
}

// Property strings must outlive the call; devices are few and fixed, so keep one copy per device.
struct PropStrings {
  std::string name, pci;
};
PropStrings gProps[epcomm::net::kNetMaxDevs];

ncclResult_t fillCommon(int dev, NetProperties* p, char** name, char** pci) {
  if (!gNet) return ncclInternalError;
  PCHECK(gNet->getProperties(dev, p));
  if (dev < 0 || dev >= epcomm::net::kNetMaxDevs) return ncclInternalError;
  std::lock_guard<std::mutex> g(gInitMu);
  gProps[dev].name = p->name;
  gProps[dev].pci = p->pciPath;
  *name = gProps[dev].name.data();
  *pci = gProps[dev].pci.empty() ? nullptr : gProps[dev].pci.data();
  return ncclSuccess;
}

int ptrBits(int s) { return (s & epcomm::net::kNetPtrHost ? NCCL_PTR_HOST : 0) | (s & epcomm::net::kNetPtrCuda ? NCCL_PTR_CUDA : 0); }

ncclResult_t pGetProperties_v11(int dev, ncclNetProperties_v11_t* props) {
  NetProperties p;
  memset(props, 0, sizeof(*props));
  ncclResult_t r = fillCommon(dev, &p, &props->name, &props->pciPath);
  if (r != ncclSuccess) return r;
  props->guid = p.guid;
  props->ptrSupport = ptrBits(p.ptrSupport);
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  props->speed = p.speedMbps;
  props->port = p.port;
  props->latency = p.latencyUs;
  props->maxComms = p.maxComms;
  props->maxRecvs = p.maxRecvs;
  props->netDeviceType = NCCL_NET_DEVICE_HOST;
  props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  props->maxP2pBytes = NCCL_MAX_NET_SIZE_BYTES;
  props->maxCollBytes = NCCL_MAX_NET_SIZE_BYTES;
  props->maxMultiRequestSize = 1;
  return ncclSuccess;
}

ncclResult_t pGetProperties_v9(int dev, ncclNetProperties_v9_t* props) {
  ncclNetProperties_v11_t p;
  ncclResult_t r = pGetProperties_v11(dev, &p);
  if (r != ncclSuccess) return r;
  memcpy(props, &p, sizeof(*props));  // v9 is a prefix of v11
  return ncclSuccess;
}

ncclResult_t pGetProperties_v8(int dev, ncclNetProperties_v8_t* props) {
  ncclNetProperties_v11_t p;
  ncclResult_t r = pGetProperties_v11(dev, &p);
  if (r != ncclSuccess) return r;
  props->name = p.name;
  props->pciPath = p.pciPath;
  props->guid = p.guid;
  props->ptrSupport = p.ptrSupport;
  props->regIsGlobal = p.regIsGlobal;
  props->speed = p.speed;
  props->port = p.port;
  props->latency = p.latency;
  props->maxComms = p.maxComms;
  props->maxRecvs = p.maxRecvs;
  props->netDeviceType = p.netDeviceType;
  props->netDeviceVersion = p.netDeviceVersion;
  return ncclSuccess;
}

ncclResult_t pListen(int dev, void* handle, void** listenComm) {
  *listenComm = nullptr;
  if (!gNet) return ncclInternalError;
  PCHECK(gNet->listen(dev, handle, listenComm));
  return ncclSuccess;
}

ncclResult_t pConnect(int dev, void* handle, void** sendComm, ncclNetDeviceHandle_t** devComm) {
  (void)devComm;  // device offload requested by NCCL is ignored: we are a host (NCCL_NET_DEVICE_HOST) plugin
  *sendComm = nullptr;
  if (!gNet) return ncclInternalError;
  PCHECK(gNet->connect(dev, handle, sendComm));
  return ncclSuccess;
}

ncclResult_t pAccept(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** devComm) {
  (void)devComm;
  *recvComm = nullptr;
  if (!gNet) return ncclInternalError;
  PCHECK(gNet->accept(listenComm, recvComm));
  return ncclSuccess;
}

ncclResult_t pRegMr(void* comm, void* data, size_t size, int type, void** mhandle) {
  int t = type == NCCL_PTR_CUDA ? epcomm::net::kNetPtrCuda : epcomm::net::kNetPtrHost;
  PCHECK(gNet->regMr(comm, data, size, t, mhandle));
  return ncclSuccess;
}

ncclResult_t pDeregMr(void* comm, void* mhandle) {
  PCHECK(gNet->deregMr(comm, mhandle));
  return ncclSuccess;
}

ncclResult_t pIsend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request) {
  *request = nullptr;
  PCHECK(gNet->isend(sendComm, data, size, tag, mhandle, request));
  return ncclSuccess;
}

ncclResult_t pIrecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles, void** request) {
  // NCCL may pre-set *request to NCCL_NET_OPTIONAL_RECV_COMPLETION; we always return a real, pollable request.
  *request = nullptr;
  PCHECK(gNet->irecv(recvComm, n, data, sizes, tags, mhandles, request));
  return ncclSuccess;
}

ncclResult_t pIsend_v8(void* sendComm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) return ncclInvalidArgument;
  return pIsend(sendComm, data, static_cast<size_t>(size), tag, mhandle, request);
}

ncclResult_t pIrecv_v8(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request) {
  if (n < 1 || n > epcomm::net::kNetMaxRecvs) return ncclInvalidArgument;
  size_t s[epcomm::net::kNetMaxRecvs];
  for (int i = 0; i < n; ++i) {
    if (sizes[i] < 0) return ncclInvalidArgument;
    s[i] = static_cast<size_t>(sizes[i]);
  }
  return pIrecv(recvComm, n, data, s, tags, mhandles, request);
}

ncclResult_t pIsend_v10(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                        void** request) {
  (void)phandle;
  return pIsend(sendComm, data, size, tag, mhandle, request);
}

ncclResult_t pIrecv_v10(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                        void** phandles, void** request) {
  (void)phandles;
  return pIrecv(recvComm, n, data, sizes, tags, mhandles, request);
}

ncclResult_t pIflush(void*, int, void**, int*, void**, void** request) {
  // Host-only plugin (no NCCL_PTR_CUDA, forceFlush=0): NCCL never flushes. Being asked is misuse.
  *request = nullptr;
  NET_WARN("NET/epcomm: iflush called on a host-memory plugin");
  return ncclInternalError;
}

ncclResult_t pTest(void* request, int* done, int* sizes) {
  // test() is not told n; the backend fills exactly n entries and leaves the rest at SIZE_MAX, so only the
  // n ints NCCL passed are written.
  size_t s[epcomm::net::kNetMaxRecvs];
  for (auto& v : s) v = SIZE_MAX;
  PCHECK(gNet->test(request, done, s));
  if (*done && sizes) {
    for (int i = 0; i < epcomm::net::kNetMaxRecvs; ++i) {
      if (s[i] == SIZE_MAX) break;
      sizes[i] = s[i] > static_cast<size_t>(INT32_MAX) ? INT32_MAX : static_cast<int>(s[i]);
    }
  }
  return ncclSuccess;
}

ncclResult_t pCloseSend(void* c) { return toNccl(gNet ? gNet->closeSend(c) : epSuccess); }
ncclResult_t pCloseRecv(void* c) { return toNccl(gNet ? gNet->closeRecv(c) : epSuccess); }
ncclResult_t pCloseListen(void* c) { return toNccl(gNet ? gNet->closeListen(c) : epSuccess); }

// ---- version shims ----------------------------------------------------------------------------------------------
ncclResult_t pInit_v8(ncclDebugLogger_t lf) { return commonInit(lf); }
ncclResult_t pInit_v10(ncclDebugLogger_t lf, ncclProfilerCallback_t) { return commonInit(lf); }

struct PluginCtx {
  uint64_t commId;
  int trafficClass;
};

ncclResult_t pInit_v11(void** ctx, uint64_t commId, ncclNetCommConfig_t* config, ncclDebugLogger_t lf,
                       ncclProfilerCallback_t) {
  *ctx = nullptr;
  ncclResult_t r = commonInit(lf);
  if (r != ncclSuccess) return r;
  *ctx = new PluginCtx{commId, config ? config->trafficClass : -1};
  return ncclSuccess;
}

ncclResult_t pFinalize_v11(void* ctx) {
  // Per-communicator context only: connections were closed by closeSend/closeRecv/closeListen, and the
  // process-wide backend holds no per-comm resources.
  delete static_cast<PluginCtx*>(ctx);
  return ncclSuccess;
}

ncclResult_t pListen_v11(void* ctx, int dev, void* handle, void** lc) {
  (void)ctx;
  return pListen(dev, handle, lc);
}
ncclResult_t pConnect_v11(void* ctx, int dev, void* handle, void** sc, ncclNetDeviceHandle_t** dc) {
  (void)ctx;
  return pConnect(dev, handle, sc, dc);
}
ncclResult_t pConnect_v10(int dev, ncclNetCommConfig_t* config, void* handle, void** sc, ncclNetDeviceHandle_t** dc) {
  (void)config;
  return pConnect(dev, handle, sc, dc);
}

}  // namespace

// `const` objects have internal linkage in C++ unless declared extern first.
extern "C" {
extern __attribute__((visibility("default"))) const ncclNet_v11_t ncclNetPlugin_v11;
extern __attribute__((visibility("default"))) const ncclNet_v10_t ncclNetPlugin_v10;
extern __attribute__((visibility("default"))) const ncclNet_v9_t ncclNetPlugin_v9;
extern __attribute__((visibility("default"))) const ncclNet_v8_t ncclNetPlugin_v8;

const ncclNet_v11_t ncclNetPlugin_v11 = {
    "epcomm", pInit_v11, pDevices, pGetProperties_v11, pListen_v11, pConnect_v11, pAccept, pRegMr,
    nullptr /*regMrDmaBuf*/, pDeregMr, pIsend_v10, pIrecv_v10, pIflush, pTest, pCloseSend, pCloseRecv,
    pCloseListen, nullptr /*getDeviceMr*/, nullptr /*irecvConsumed*/, nullptr /*makeVDevice*/, pFinalize_v11,
    nullptr /*setNetAttr*/};

const ncclNet_v10_t ncclNetPlugin_v10 = {
    "epcomm", pInit_v10, pDevices, pGetProperties_v9, pListen, pConnect_v10, pAccept, pRegMr, nullptr, pDeregMr,
    pIsend_v10, pIrecv_v10, pIflush, pTest, pCloseSend, pCloseRecv, pCloseListen, nullptr, nullptr, nullptr};

const ncclNet_v9_t ncclNetPlugin_v9 = {
    "epcomm", pInit_v8, pDevices, pGetProperties_v9, pListen, pConnect, pAccept, pRegMr, nullptr, pDeregMr,
    pIsend, pIrecv, pIflush, pTest, pCloseSend, pCloseRecv, pCloseListen, nullptr, nullptr, nullptr};

const ncclNet_v8_t ncclNetPlugin_v8 = {
    "epcomm", pInit_v8, pDevices, pGetProperties_v8, pListen, pConnect, pAccept, pRegMr, nullptr, pDeregMr,
    pIsend_v8, pIrecv_v8, pIflush, pTest, pCloseSend, pCloseRecv, pCloseListen, nullptr, nullptr};

}  // extern "C"
