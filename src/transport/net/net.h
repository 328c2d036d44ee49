// epcomm's inter-host transport, shaped like NCCL's net API so that plugin/nccl is a thin ABI shim over it
// and epcomm's own proxy can drive the very same code.
//
//   listen(dev) -> handle (<= kNetHandleSize bytes, sent to the peer out of band) + listen comm
//   connect(dev, handle) / accept(listen comm): non-blocking; a null comm means "call again"
//   isend / irecv (grouped: n buffers picked by tag) / test: asynchronous; a null request means "retry later"
//   regMr / deregMr: registration (a no-op for sockets, fi_mr_reg for libfabric)
//
// Contracts every backend keeps (the NCCL plugin ABI requires them):
// - sends and receives match in posting order per connection (per tag where matchesByTag()); a receive buffer may
//   be larger than the send;
// - at least kNetMaxRequests requests in flight per comm (x kNetMaxRecvs on the send side);
// - errors are results: a peer that dies or closes makes test() fail with a message that names the peer;
//   a request already complete when the end is noticed (a message that arrived whole before the peer closed) is
//   still delivered;
// - stall deadline: a request that waits on a peer that stopped (SIGSTOP, a frozen host, a cut link) fails within
//   EPCOMM_TIMEOUT_MS; a live peer that is idle, late to post or slow never makes it fail (heartbeats);
// - close* releases everything, even with transfers in flight: it cancels the comm's posted sends and receives
//   and drains their completions (ofi: within EPCOMM_OFI_CLOSE_MS) before it returns;
// - deregMr(comm, mhandle) may also come after close of that comm (the handle keeps what it needs; `comm` is
//   then not dereferenced). Close-then-deregister is the safe order when operations may still be posted: a
//   region must not be deregistered while an operation references it (undefined for verbs and efa).
#pragma once
#include <sys/uio.h>  // iovec

#include <cstddef>
#include <cstdint>
#include <string>

#include "epcomm/epcomm.h"

namespace epcomm::net {

constexpr int kNetHandleSize = 128;   // == NCCL_NET_HANDLE_MAXSIZE
constexpr int kNetMaxRecvs = 8;       // largest grouped receive
constexpr int kNetMaxScatter = 1024;  // most pieces of a scattered receive (irecvScatter; IOV_MAX on Linux)
constexpr int kNetMaxRequests = 32;   // == NCCL_NET_MAX_REQUESTS (we accept more, see kNetRequestPool)
constexpr int kNetRequestPool = kNetMaxRequests * kNetMaxRecvs * 2;
constexpr int kNetMaxDevs = 4;

enum NetPtrType : int { kNetPtrHost = 0x1, kNetPtrCuda = 0x2 };

struct NetProperties {
  std::string name;      // interface / domain name
  std::string pciPath;   // empty for virtual devices (lo, veth, ...)
  uint64_t guid = 0;
  int ptrSupport = kNetPtrHost;
  int speedMbps = 10000;
  int port = 0;
  float latencyUs = 0;
  int maxComms = 65536;
  int maxRecvs = kNetMaxRecvs;
};

// One backend instance per process (chosen by EPCOMM_NET). All handles are opaque pointers.
class NetBackend {
 public:
  virtual ~NetBackend() = default;
  virtual const char* name() const = 0;
  virtual int devices() const = 0;
  virtual epResult_t getProperties(int dev, NetProperties* props) = 0;
  virtual epResult_t listen(int dev, void* handle, void** listenComm) = 0;
  virtual epResult_t connect(int dev, void* handle, void** sendComm) = 0;
  // connect() with hints on how the connection carries its messages, for a caller that knows its traffic (the net
  // bridge). Both ends use what the connecting side chose; a backend without streams ignores them.
  struct StreamHints {
    // At most this many parallel data streams (the socket backend: data sockets, and helper threads on each side),
    // 0 for the backend's default: for a caller that opens many connections at once (the bridge, one per rank of
    // other hosts, which may be hundreds).
    int max_streams = 0;
    // A message is not cut into pieces smaller than this for its streams (the socket backend's EPCOMM_NET_MIN_CHUNK,
    // which wins where set), 0 for the backend's default: for a caller whose messages are many and mid-sized, where
    // every piece costs a helper's wake-up on each side.
    size_t min_chunk = 0;
  };
  virtual epResult_t connectStreams(int dev, void* handle, const StreamHints& hints, void** sendComm) {
    (void)hints;
    return connect(dev, handle, sendComm);
  }
  // File descriptors one end of a connection made with connectStreams(max_streams) holds (0: none that grow with
  // connections, as far as this backend knows): what a caller must find room for under RLIMIT_NOFILE.
  virtual int descriptorsPerConnection(int max_streams) const {
    (void)max_streams;
    return 0;
  }
  virtual epResult_t accept(void* listenComm, void** recvComm) = 0;
  virtual epResult_t regMr(void* comm, void* data, size_t size, int type, void** mhandle) = 0;
  virtual epResult_t deregMr(void* comm, void* mhandle) = 0;
  virtual epResult_t isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request) = 0;
  virtual epResult_t irecv(void* recvComm, int n, void** data, const size_t* sizes, const int* tags,
                           void** mhandles, void** request) = 0;
  virtual epResult_t test(void* request, int* done, size_t* sizes) = 0;
  // While on, isend on sendComm may hold back what it would send at once (the socket backend: the message's header
  // and inline payload; a large message's data still goes), until cork(off) or a test() of that comm's requests
  // sends everything held at once: several small messages posted together (the net bridge's frames) then cost one
  // syscall, not one each. Off by default; a backend without it ignores it.
  virtual void cork(void* sendComm, bool on) { (void)sendComm, (void)on; }
  // A receive of one message (tag 0) whose bytes land in `niov` pieces in order (the pieces copied: `iov` need not
  // outlive the call), for backends with scatters(); the same contracts as irecv. The net bridge receives a run of
  // GPU proxy records this way: headers into its inbox, payloads straight into their far copies.
  virtual bool scatters() const { return false; }
  // Whether messages of different tags are matched apart, each tag in its own posting order (ofi: the tag is part
  // of libfabric's match bits), so that receives of one tag may be posted ahead of those of another. False (the
  // socket backend): every message takes the oldest receive posted, whatever its tag must be.
  virtual bool matchesByTag() const { return false; }
  virtual epResult_t irecvScatter(void* recvComm, const iovec* iov, int niov, void** request) {
    (void)recvComm, (void)iov, (void)niov;
    *request = nullptr;
    return epNotSupported;
  }
  // Readiness, for a caller that keeps receives posted on many connections and tests every one of them in each pass
  // (the net bridge, up to hundreds of peers): a test() of an idle socket receive costs a recv() that finds nothing
  // (0.6-0.8 us), one per peer and pass. After watchRecv(poller, recvComm), test() of that comm's requests reads
  // its control stream only while pollReady(poller) last saw bytes, an end or an error waiting on it (or its last
  // read filled what it asked for): a pass over idle peers then costs one syscall. pollReady may be called from
  // several threads at once; tests see what any of them saw. Close the watched comms before closePoller.
  // openPoller: nullptr where the backend has no readiness (every test() then looks for itself).
  virtual void* openPoller() { return nullptr; }
  virtual epResult_t watchRecv(void* poller, void* recvComm) {
    (void)poller, (void)recvComm;
    return epNotSupported;
  }
  virtual void pollReady(void* poller) { (void)poller; }
  // Takes a watched comm out of the poller's set: its tests read for themselves again. For a comm the caller stops
  // testing while it stays open (a peer that said goodbye and closed its end, which would be reported by every poll).
  // Not concurrently with tests of that comm; a no-op for a comm the poller does not watch.
  virtual void unwatchRecv(void* poller, void* recvComm) { (void)poller, (void)recvComm; }
  virtual void closePoller(void* poller) { (void)poller; }
  virtual epResult_t closeSend(void* sendComm) = 0;
  virtual epResult_t closeRecv(void* recvComm) = 0;
  virtual epResult_t closeListen(void* listenComm) = 0;
};

// The process-wide backend selected by EPCOMM_NET=socket|ofi (default socket). On failure returns nullptr and
// *why says why the backend is not offered (e.g. "libfabric.so.1 not found").
NetBackend* netBackend(std::string* why);
// Backends can also be made explicitly (tests compare them); the object lives for the whole process.
NetBackend* netSocketBackend(std::string* why);
NetBackend* netOfiBackend(std::string* why);

// Makes room under RLIMIT_NOFILE for `more` descriptors beyond those open now (and a margin): raises the soft limit
// toward the hard one where needed (logged at INFO), else fails with epSystemError naming both limits and `what`
// (the connections that need them), before a socket() or accept() deep in connection set-up would fail with EMFILE.
// The failure is not logged here (netLastError has it): the caller reports it, so it is logged once.
epResult_t ensureDescriptors(size_t more, const char* what);
// File descriptors this process has open now (/proc/self/fd; 0 where that cannot be read).
size_t openDescriptors();

// ---- logging: through NCCL's logger when the plugin was loaded by NCCL, else epcomm's own log ----------------
enum NetLogLevel : int { kNetLogWarn = 1, kNetLogInfo = 2, kNetLogTrace = 3 };
using NetLogSink = void (*)(int level, const char* file, int line, const char* msg);
void netSetLogSink(NetLogSink sink);
bool netLogEnabled(int level);
void netLog(int level, const char* file, int line, const char* fmt, ...) __attribute__((format(printf, 4, 5)));

// Decide an error: log it once (WARN), remember it as this thread's last net error, evaluate to the code.
epResult_t netError(epResult_t code, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
const char* netLastError();
// Record a message as this thread's last net error without logging it again (it was logged at its source).
epResult_t netQuietError(epResult_t code, const char* msg);

}  // namespace epcomm::net

#define NET_WARN(...) ::epcomm::net::netLog(::epcomm::net::kNetLogWarn, __FILE__, __LINE__, __VA_ARGS__)
#define NET_INFO(...)                                                                       \
  do {                                                                                      \
    if (::epcomm::net::netLogEnabled(::epcomm::net::kNetLogInfo))                           \
      ::epcomm::net::netLog(::epcomm::net::kNetLogInfo, __FILE__, __LINE__, __VA_ARGS__);   \
  } while (0)
#define NET_TRACE(...)                                                                      \
  do {                                                                                      \
    if (::epcomm::net::netLogEnabled(::epcomm::net::kNetLogTrace))                          \
      ::epcomm::net::netLog(::epcomm::net::kNetLogTrace, __FILE__, __LINE__, __VA_ARGS__);  \
  } while (0)
#define NET_ERR(code, ...) ::epcomm::net::netError((code), __FILE__, __LINE__, __VA_ARGS__)
#define NET_FAIL(code, ...) return NET_ERR((code), __VA_ARGS__)
#define NETCHECK(call)                     \
  do {                                     \
    epResult_t net_res_ = (call);          \
    if (net_res_ != epSuccess) return net_res_; \
  } while (0)
