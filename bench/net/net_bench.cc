// The net transport through libnccl-net-epcomm.so, driven the way NCCL's proxy drives a plugin (non-blocking
// isend/irecv, test() polling, many requests in flight), next to plain blocking TCP measured in the same run
// between two fresh processes on loopback.
//
//   net_bench [--mode both|pingpong|stream] [--min 1K] [--max 4M] [--window 8] [--bytes 256M]
//             [--backends socket,ofi,socket@/path/to/other/libnccl-net-epcomm.so] [--time 0.25]
//   A backend may name another build of the plugin after '@' (before/after comparisons in one run);
//   EPCOMM_NET_BENCH_PLUGIN replaces the built-in path (the bench carried to another machine).
//   EPCOMM_OFI_PROVIDER, EPCOMM_NET_NTHREADS, EPCOMM_NET_NSOCKS, ... tune the plugin as usual.
//
// pingpong: one message each way per iteration (A: isend, then irecv; B: irecv, then isend; test() polled in
//           between); reports the one-way latency (round trip / 2). Baseline: blocking write/read ping-pong on
//           one TCP_NODELAY socket.
// stream:   the sender keeps `window` isends in flight (NCCL keeps up to 8 steps in flight per channel), the
//           receiver as many irecvs; time = first post to the receiver's ack of the last message. Baseline: one
//           TCP stream, blocking write()/read() of each message.
// Ratios are "plugin speed / TCP speed" (>1 = the plugin is faster), so both modes read the same way.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
      _exit(1);                                                          \
    }                                                                    \
  } while (0)

void writeAll(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n) {
    ssize_t k = write(fd, c, n);
    if (k <= 0) { perror("write"); _exit(1); }
    c += k, n -= k;
  }
}
void readAll(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n) {
    ssize_t k = read(fd, c, n);
    if (k <= 0) { perror("read"); _exit(1); }
    c += k, n -= k;
  }
}

struct Opts {
  size_t minSz = 1 << 10, maxSz = 4 << 20, bytes = 256 << 20;
  int window = 8;
  double seconds = 0.25;  // target time per size and mode (pingpong); stream also caps at `bytes`
  bool pingpong = true, stream = true;
};

// Iterations for a size: about `seconds` at a guessed speed, within [20, 20000]; the same count is used by the
// plugin and by the baseline (both sides of a phase compute it identically).
int pingIters(const Opts& o, size_t size) {
  double guess = 20e-6 + size / 2e9;  // round trip guess: 20 us + size at 2 GB/s each way
  return static_cast<int>(std::clamp(o.seconds / guess, 20.0, 20000.0));
}
int streamIters(const Opts& o, size_t size) {
  return static_cast<int>(std::clamp<size_t>(std::min<size_t>(o.bytes, static_cast<size_t>(o.seconds * 3e9)) / size,
                                             32, 100000));
}

// ---- plugin ------------------------------------------------------------------------------------------------------
std::string gPluginPath = EPCOMM_NCCL_PLUGIN_PATH;

const ncclNet_v11_t* loadPlugin(void** ctx) {
  void* lib = dlopen(gPluginPath.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); _exit(1); }
  auto* net = static_cast<const ncclNet_v11_t*>(dlsym(lib, "ncclNetPlugin_v11"));
  ncclNetCommConfig_t cfg{-1};
  CK(net->init(ctx, 1, &cfg, nullptr, nullptr));
  return net;
}

// Results travel from side A (the process that reports) back to the parent through `out`.
void pluginSide(bool a, int ctl, int out, const std::vector<size_t>& sizes, const Opts& o) {
  void* ctx;
  const ncclNet_v11_t* net = loadPlugin(&ctx);
  // Two connections, one per direction, as NCCL has: A sends on s0 and receives on r1; B the reverse.
  char h[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = nullptr, *sc = nullptr, *rc = nullptr;
  CK(net->listen(ctx, 0, h, &lc));
  writeAll(ctl, h, sizeof(h));
  char ph[NCCL_NET_HANDLE_MAXSIZE];
  readAll(ctl, ph, sizeof(ph));
  while (!sc || !rc) {
    if (!sc) CK(net->connect(ctx, 0, ph, &sc, nullptr));
    if (!rc) CK(net->accept(lc, &rc, nullptr));
  }
  size_t maxSz = sizes.back();
  int W = std::max(1, o.window);
  std::vector<char*> sb(W), rb(W);
  std::vector<void*> smh(W), rmh(W);
  for (int w = 0; w < W; ++w) {
    sb[w] = static_cast<char*>(aligned_alloc(4096, maxSz));
    rb[w] = static_cast<char*>(aligned_alloc(4096, maxSz));
    memset(sb[w], w, maxSz);
    memset(rb[w], 0, maxSz);
    CK(net->regMr(sc, sb[w], maxSz, NCCL_PTR_HOST, &smh[w]));
    CK(net->regMr(rc, rb[w], maxSz, NCCL_PTR_HOST, &rmh[w]));
  }
  auto post = [&](bool send, int w, size_t size) {
    void* req = nullptr;
    while (!req) {
      if (send) CK(net->isend(sc, sb[w], size, 0, smh[w], nullptr, &req));
      else {
        void* d = rb[w];
        int tag = 0;
        CK(net->irecv(rc, 1, &d, &size, &tag, &rmh[w], nullptr, &req));
      }
    }
    return req;
  };
  auto wait = [&](void* req) {
    int done = 0, s;
    while (!done) CK(net->test(req, &done, &s));
  };
  char sync = 0;
  for (size_t size : sizes) {
    if (o.pingpong) {
      int iters = pingIters(o, size);
      for (int phase = 0; phase < 2; ++phase) {  // warm-up, then timed
        int n = phase == 0 ? std::max(4, iters / 10) : iters;
        if (a) readAll(ctl, &sync, 1);
        else writeAll(ctl, &sync, 1);
        double t0 = now();
        for (int i = 0; i < n; ++i) {
          if (a) {
            void* r = post(false, 0, size);  // post the receive first, as NCCL does
            wait(post(true, 0, size));
            wait(r);
          } else {
            wait(post(false, 0, size));
            wait(post(true, 0, size));
          }
        }
        double us = (now() - t0) / n / 2 * 1e6;
        if (a && phase == 1) writeAll(out, &us, sizeof(us));
      }
    }
    if (o.stream) {
      int iters = streamIters(o, size);
      if (a) readAll(ctl, &sync, 1);  // B (receiver) ready
      else writeAll(ctl, &sync, 1);
      double t0 = now();
      std::vector<void*> reqs(W, nullptr);
      int posted = 0, done = 0;
      while (done < iters) {
        for (int w = 0; w < W; ++w) {
          if (!reqs[w] && posted < iters) {
            if (a) CK(net->isend(sc, sb[w], size, 0, smh[w], nullptr, &reqs[w]));
            else {
              void* d = rb[w];
              int tag = 0;
              CK(net->irecv(rc, 1, &d, &size, &tag, &rmh[w], nullptr, &reqs[w]));
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
      if (!a) writeAll(ctl, &sync, 1);  // ack: everything arrived
      else readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
  }
  for (int w = 0; w < W; ++w) {
    CK(net->deregMr(sc, smh[w]));
    CK(net->deregMr(rc, rmh[w]));
  }
  writeAll(ctl, &sync, 1);  // both done before either closes
  readAll(ctl, &sync, 1);
  CK(net->closeSend(sc));
  CK(net->closeRecv(rc));
  CK(net->closeListen(lc));
  net->finalize(ctx);
}

// ---- plain blocking TCP ------------------------------------------------------------------------------------------
void tcpSide(bool a, int ctl, int out, const std::vector<size_t>& sizes, const Opts& o) {
  int fd;
  if (!a) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in ad{};
    ad.sin_family = AF_INET;
    ad.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(l, reinterpret_cast<sockaddr*>(&ad), sizeof(ad));
    listen(l, 1);
    socklen_t al = sizeof(ad);
    getsockname(l, reinterpret_cast<sockaddr*>(&ad), &al);
    writeAll(ctl, &ad, sizeof(ad));
    fd = accept(l, nullptr, nullptr);
    close(l);
  } else {
    sockaddr_in ad;
    readAll(ctl, &ad, sizeof(ad));
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&ad), sizeof(ad)) != 0) { perror("connect"); _exit(1); }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> buf(sizes.back(), 1);
  char sync = 0;
  for (size_t size : sizes) {
    if (o.pingpong) {
      int iters = pingIters(o, size);
      for (int phase = 0; phase < 2; ++phase) {
        int n = phase == 0 ? std::max(4, iters / 10) : iters;
        if (a) readAll(ctl, &sync, 1);
        else writeAll(ctl, &sync, 1);
        double t0 = now();
        for (int i = 0; i < n; ++i) {
          if (a) {
            writeAll(fd, buf.data(), size);
            readAll(fd, buf.data(), size);
          } else {
            readAll(fd, buf.data(), size);
            writeAll(fd, buf.data(), size);
          }
        }
        double us = (now() - t0) / n / 2 * 1e6;
        if (a && phase == 1) writeAll(out, &us, sizeof(us));
      }
    }
    if (o.stream) {
      int iters = streamIters(o, size);
      if (a) readAll(ctl, &sync, 1);
      else writeAll(ctl, &sync, 1);
      double t0 = now();
      for (int i = 0; i < iters; ++i) {
        if (a) writeAll(fd, buf.data(), size);
        else readAll(fd, buf.data(), size);
      }
      if (!a) writeAll(ctl, &sync, 1);
      else readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
  }
  close(fd);
}

// Runs one configuration in two fresh processes (each loads the plugin itself, with `net` in EPCOMM_NET);
// returns side A's results in order: per size [pingpong us] [stream GB/s].
std::vector<double> runPair(const char* net, const std::vector<size_t>& sizes, const Opts& o) {
  int sv[2], res[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || pipe(res) != 0) { perror("socketpair"); exit(1); }
  pid_t pids[2];
  for (int side = 0; side < 2; ++side) {
    pids[side] = fork();
    if (pids[side] == 0) {
      close(res[0]);
      close(sv[1 - side]);
      if (net) {
        std::string spec = net;
        size_t at = spec.find('@');
        if (at != std::string::npos) gPluginPath = spec.substr(at + 1);
        setenv("EPCOMM_NET", spec.substr(0, at).c_str(), 1);
      }
      if (net) pluginSide(side == 0, sv[side], res[1], sizes, o);
      else tcpSide(side == 0, sv[side], res[1], sizes, o);
      _exit(0);
    }
  }
  close(sv[0]);
  close(sv[1]);
  close(res[1]);
  size_t n = sizes.size() * ((o.pingpong ? 1 : 0) + (o.stream ? 1 : 0));
  std::vector<double> v(n, 0.0);
  readAll(res[0], v.data(), n * sizeof(double));
  close(res[0]);
  for (pid_t p : pids) {
    int st;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "net_bench: %s side failed\n", net ? net : "tcp");
      exit(1);
    }
  }
  return v;
}

std::string fmtSize(size_t s) {
  char b[32];
  if (s >= (1 << 20)) snprintf(b, sizeof(b), "%zu MiB", s >> 20);
  else if (s >= 1024) snprintf(b, sizeof(b), "%zu KiB", s >> 10);
  else snprintf(b, sizeof(b), "%zu B", s);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  std::string backends = "socket";
  if (const char* e = getenv("EPCOMM_NET")) backends = e;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--min")) o.minSz = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--max")) o.maxSz = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--bytes")) o.bytes = parseSize(argv[i + 1]);
    else if (!strcmp(argv[i], "--window")) o.window = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--time")) o.seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--backends")) backends = argv[i + 1];
    else if (!strcmp(argv[i], "--mode")) {
      o.pingpong = strcmp(argv[i + 1], "stream") != 0;
      o.stream = strcmp(argv[i + 1], "pingpong") != 0;
    } else {
      fprintf(stderr, "usage: net_bench [--mode both|pingpong|stream] [--min 1K] [--max 4M] [--window 8] "
                      "[--bytes 256M] [--time 0.25] [--backends socket,ofi]\n");
      return 2;
    }
  }
  if (const char* p = getenv("EPCOMM_NET_BENCH_PLUGIN")) gPluginPath = p;
  if (!getenv("EPCOMM_SOCKET_IFNAME")) setenv("EPCOMM_SOCKET_IFNAME", "lo", 1);
  std::vector<size_t> sizes;
  for (size_t s = std::max<size_t>(o.minSz, 1); s <= o.maxSz; s *= 4) sizes.push_back(s);
  std::vector<std::string> nets;
  for (size_t p = 0; p <= backends.size();) {
    size_t q = backends.find(',', p);
    if (q == std::string::npos) q = backends.size();
    if (q > p) nets.push_back(backends.substr(p, q - p));
    p = q + 1;
  }
  std::vector<double> tcp = runPair(nullptr, sizes, o);
  std::vector<std::vector<double>> res;
  for (const auto& n : nets) res.push_back(runPair(n.c_str(), sizes, o));
  const char* prov = getenv("EPCOMM_OFI_PROVIDER");
  printf("# epcomm net plugin vs plain blocking TCP, loopback, 2 processes per configuration, same run\n");
  printf("# backends: %s%s%s; stream window %d; ratio = plugin speed / TCP speed (>1: plugin faster)\n",
         backends.c_str(), prov ? ", EPCOMM_OFI_PROVIDER=" : "", prov ? prov : "", o.window);
  int stride = (o.pingpong ? 1 : 0) + (o.stream ? 1 : 0);
  for (int mode = 0; mode < 2; ++mode) {
    if ((mode == 0 && !o.pingpong) || (mode == 1 && !o.stream)) continue;
    int off = mode == 0 ? 0 : (o.pingpong ? 1 : 0);
    printf("\n## %s\n%10s %12s", mode == 0 ? "ping-pong one-way latency (us)" : "streaming bandwidth (GB/s)", "size",
           "tcp");
    for (size_t k = 0; k < nets.size(); ++k) {
      std::string lab = nets[k].substr(0, nets[k].find('@'));
      if (nets[k].find('@') != std::string::npos) lab += "@" + std::to_string(k);
      printf(" %12s %8s", lab.c_str(), "ratio");
    }
    printf("\n");
    for (size_t i = 0; i < sizes.size(); ++i) {
      double t = tcp[i * stride + off];
      printf("%10s %12.2f", fmtSize(sizes[i]).c_str(), t);
      for (size_t k = 0; k < nets.size(); ++k) {
        double v = res[k][i * stride + off];
        printf(" %12.2f %8.2f", v, mode == 0 ? t / v : v / t);
      }
      printf("\n");
    }
  }
  return 0;
}
