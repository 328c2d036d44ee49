// Raw throughput of libnccl-net-epcomm.so between two processes on loopback, next to one plain TCP stream
// (a simple blocking send/recv loop) measured in the same run.
//
//   net_bench [--min 64K] [--max 256M] [--window 4] [--bytes 2G]
//   EPCOMM_NET=socket|ofi (and EPCOMM_NET_NTHREADS, EPCOMM_NET_NSOCKS, ...) tune the plugin as usual.
//
// Each size: the sender keeps `window` isends in flight (NCCL keeps up to 8 steps in flight per channel),
// the receiver as many irecvs; time = first post to the receiver's ack of the last message.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "plugin/nccl/nccl_net_abi.h"

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

size_t parseSize(const char* s) {
  char* end;
  double v = strtod(s, &end);
  switch (*end) {
    case 'k': case 'K': v *= 1024; break;
    case 'm': case 'M': v *= 1024 * 1024; break;
    case 'g': case 'G': v *= 1024.0 * 1024 * 1024; break;
  }
  return static_cast<size_t>(v);
}

#define CK(x)                                                            \
  do {                                                                   \
    ncclResult_t r_ = (x);                                               \
    if (r_ != ncclSuccess) {                                             \
      fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #x, r_); \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

void writeAll(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n) {
    ssize_t k = write(fd, c, n);
    if (k <= 0) { perror("write"); exit(1); }
    c += k, n -= k;
  }
}
void readAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n) {
    ssize_t k = read(fd, c, n);
    if (k <= 0) { perror("read"); exit(1); }
    c += k, n -= k;
  }
}

int iterations(size_t size, size_t bytes) { return static_cast<int>(std::max<size_t>(4, std::min<size_t>(2000, bytes / size))); }

// ---- plugin ------------------------------------------------------------------------------------------------------
const ncclNet_v11_t* loadPlugin(void** ctx) {
  void* lib = dlopen(EPCOMM_NCCL_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); exit(1); }
  auto* net = static_cast<const ncclNet_v11_t*>(dlsym(lib, "ncclNetPlugin_v11"));
  ncclNetCommConfig_t cfg{-1};
  CK(net->init(ctx, 1, &cfg, nullptr, nullptr));
  return net;
}

void pluginRun(bool sender, int ctl, const std::vector<size_t>& sizes, size_t bytes, int window, std::vector<double>* gbps) {
  void* ctx;
  const ncclNet_v11_t* net = loadPlugin(&ctx);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = nullptr, *comm = nullptr;
  if (!sender) {
    CK(net->listen(ctx, 0, handle, &lc));
    writeAll(ctl, handle, sizeof(handle));
    while (!comm) CK(net->accept(lc, &comm, nullptr));
  } else {
    readAll(ctl, handle, sizeof(handle));
    while (!comm) CK(net->connect(ctx, 0, handle, &comm, nullptr));
  }
  size_t maxSz = sizes.back();
  std::vector<char*> bufs(window);
  std::vector<void*> mhs(window);
  for (int w = 0; w < window; ++w) {
    bufs[w] = static_cast<char*>(aligned_alloc(4096, maxSz));
    memset(bufs[w], w, maxSz);
    CK(net->regMr(comm, bufs[w], maxSz, NCCL_PTR_HOST, &mhs[w]));
  }
  for (size_t size : sizes) {
    int iters = iterations(size, bytes);
    char sync = 0;
    if (sender) readAll(ctl, &sync, 1);  // receiver ready
    else writeAll(ctl, &sync, 1);
    double t0 = now();
    std::vector<void*> reqs(window, nullptr);
    int posted = 0, done = 0;
    while (done < iters) {
      for (int w = 0; w < window; ++w) {
        if (!reqs[w] && posted < iters) {
          if (sender) CK(net->isend(comm, bufs[w], size, 0, mhs[w], nullptr, &reqs[w]));
          else {
            void* d = bufs[w];
            int tag = 0;
            CK(net->irecv(comm, 1, &d, &size, &tag, &mhs[w], nullptr, &reqs[w]));
          }
          if (reqs[w]) ++posted;
        }
        if (reqs[w]) {
          int fin = 0, s = 0;
          CK(net->test(reqs[w], &fin, &s));
          if (fin) reqs[w] = nullptr, ++done;
        }
      }
    }
    if (!sender) writeAll(ctl, &sync, 1);  // ack: everything arrived
    else readAll(ctl, &sync, 1);
    double t = now() - t0;
    if (sender) gbps->push_back(static_cast<double>(size) * iters / t / 1e9);
  }
  for (int w = 0; w < window; ++w) CK(net->deregMr(comm, mhs[w]));
  if (sender) CK(net->closeSend(comm));
  else {
    CK(net->closeRecv(comm));
    CK(net->closeListen(lc));
  }
  net->finalize(ctx);
}

// ---- one plain TCP stream --------------------------------------------------------------------------------------
void tcpRun(bool sender, int ctl, const std::vector<size_t>& sizes, size_t bytes, std::vector<double>* gbps) {
  int fd;
  if (!sender) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(l, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(l, 1);
    socklen_t al = sizeof(a);
    getsockname(l, reinterpret_cast<sockaddr*>(&a), &al);
    writeAll(ctl, &a, sizeof(a));
    fd = accept(l, nullptr, nullptr);
    close(l);
  } else {
    sockaddr_in a;
    readAll(ctl, &a, sizeof(a));
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) { perror("connect"); exit(1); }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> buf(sizes.back(), 1);
  for (size_t size : sizes) {
    int iters = iterations(size, bytes);
    char sync = 0;
    if (sender) readAll(ctl, &sync, 1);
    else writeAll(ctl, &sync, 1);
    double t0 = now();
    for (int i = 0; i < iters; ++i) {
      if (sender) writeAll(fd, buf.data(), size);
      else readAll(fd, buf.data(), size);
    }
    if (!sender) writeAll(ctl, &sync, 1);
    else readAll(ctl, &sync, 1);
    if (sender) gbps->push_back(static_cast<double>(size) * iters / (now() - t0) / 1e9);
  }
  close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  size_t minSz = 64 << 10, maxSz = 256 << 20, bytes = 2ull << 30;
  int window = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--min")) minSz = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--max")) maxSz = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--bytes")) bytes = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--window")) window = atoi(argv[i + 1]);
  }
  if (!getenv("EPCOMM_SOCKET_IFNAME")) setenv("EPCOMM_SOCKET_IFNAME", "lo", 1);
  std::vector<size_t> sizes;
  for (size_t s = minSz; s <= maxSz; s *= 4) sizes.push_back(s);
  std::vector<double> plug, tcp;
  for (int phase = 0; phase < 2; ++phase) {
    int sv[2];
    socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    pid_t pid = fork();
    if (pid == 0) {
      close(sv[0]);
      std::vector<double> unused;
      if (phase == 0) pluginRun(false, sv[1], sizes, bytes, window, &unused);
      else tcpRun(false, sv[1], sizes, bytes, &unused);
      _exit(0);
    }
    close(sv[1]);
    if (phase == 0) pluginRun(true, sv[0], sizes, bytes, window, &plug);
    else tcpRun(true, sv[0], sizes, bytes, &tcp);
    int st;
    waitpid(pid, &st, 0);
    close(sv[0]);
  }
  const char* be = getenv("EPCOMM_NET");
  printf("# epcomm net plugin (EPCOMM_NET=%s, window %d) vs one TCP stream, loopback, 2 processes\n",
         be ? be : "socket", window);
  printf("%12s %14s %14s %8s\n", "size", "epcomm GB/s", "1xTCP GB/s", "ratio");
  for (size_t i = 0; i < sizes.size(); ++i) {
    char sz[32];
    if (sizes[i] >= (1 << 20)) snprintf(sz, sizeof(sz), "%zu MiB", sizes[i] >> 20);
    else snprintf(sz, sizeof(sz), "%zu KiB", sizes[i] >> 10);
    printf("%12s %14.2f %14.2f %8.2f\n", sz, plug[i], tcp[i], plug[i] / tcp[i]);
  }
  return 0;
}
