// The net transport through libnccl-net-epcomm.so, driven the way NCCL's proxy drives a plugin (non-blocking
// isend/irecv, test() polling, many requests in flight), next to plain blocking TCP measured in the same run
// between two fresh processes on loopback.
//
//   net_bench [--mode both|pingpong|stream|bidir|all] [--min 1K] [--max 4M] [--step 4] [--window 8]
//             [--comms 1] [--poll all|oldest] [--bytes 256M] [--time 0.25]
//             [--backends socket,ofi,socket@/path/to/other/libnccl-net-epcomm.so,ofi+EPCOMM_OFI_PROVIDER=net]
//   Sizes go from --min to --max, multiplied by --step each time (4: 1K, 4K, 16K, ...; 2: every power of two).
//   --comms C: C plugin connections per direction (NCCL's channels), `window` requests in flight on each; the
//   TCP baseline keeps one connection per direction. --poll oldest: test() only the oldest request of each comm
//   and direction per pass, as NCCL's proxy does (default all: every request in flight, each pass).
//   A backend may name another build of the plugin after '@' (before/after comparisons in one run), and
//   environment settings for its two processes after '+': ofi+EPCOMM_OFI_PROVIDER=net+FI_TCP_NODELAY=1
//   (several settings of one backend in one run; the other backends' processes do not see them);
//   EPCOMM_NET_BENCH_PLUGIN replaces the built-in path (the bench carried to another machine).
//   EPCOMM_OFI_PROVIDER, EPCOMM_NET_NTHREADS, EPCOMM_NET_NSOCKS, ... tune the plugin as usual.
//   Backend `nccl` is NCCL's own Socket transport, taken from libnccl.so.2 (`nccl@/path/to/libnccl.so.2` names
//   the file): the same ncclNet_v11_t calls, so the plugin is compared with what NCCL_NET=Socket runs, on the
//   CPU and without a GPU. NCCL does not export it: its address comes from the library's symbol table (the
//   local object `ncclNetSocket`), so a stripped libnccl cannot serve. NCCL_SOCKET_NTHREADS and
//   NCCL_NSOCKS_PERTHREAD tune it (nccl+NCCL_SOCKET_NTHREADS=2); NCCL_SOCKET_IFNAME defaults to lo here.
//
// pingpong: one message each way per iteration (A: isend, then irecv; B: irecv, then isend; test() polled in
//           between); reports the one-way latency (round trip / 2). Baseline: blocking write/read ping-pong on
//           one TCP_NODELAY socket.
// stream:   the sender keeps `window` isends in flight (NCCL keeps up to 8 steps in flight per channel), the
//           receiver as many irecvs; time = first post to the receiver's ack of the last message. Baseline: one
//           TCP stream, blocking write()/read() of each message.
// bidir:    both processes stream at once, each to the other (what a 2-rank ring all_reduce does: every rank sends
//           and receives, one thread driving both, as NCCL's proxy does), `window` sends and `window` receives in
//           flight on each side; reports the bandwidth of one direction. Baseline: two TCP connections (one per
//           direction) driven by one thread per process with non-blocking send()/recv() in a busy loop, the way
//           NCCL's own Socket transport moves data by default (no helper threads: the proxy thread spins over
//           non-blocking sockets). Its buffers rotate like the plugin's (window x comms of them), so neither side's
//           copies run from cache alone.
// all:      pingpong, stream and bidir.
// Ratios are "plugin speed / TCP speed" (>1 = the plugin is faster), so both modes read the same way.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
    if (k < 0) { perror("net_bench: read from the peer process"); _exit(1); }
    if (k == 0) { fprintf(stderr, "net_bench: the peer process ended early (see its message above)\n"); _exit(1); }
    c += k, n -= k;
  }
}

struct Opts {
  size_t minSz = 1 << 10, maxSz = 4 << 20, bytes = 256 << 20;
  size_t step = 4;
  int window = 8;
  int comms = 1;  // connections per direction (plugin only; the TCP baseline keeps one)
  bool pollOldest = false;  // test only the oldest request per comm and direction (NCCL's proxy does this)
  double seconds = 0.25;  // target time per size and mode (pingpong); stream also caps at `bytes`
  bool pingpong = true, stream = true, bidir = false;
  int modes() const { return (pingpong ? 1 : 0) + (stream ? 1 : 0) + (bidir ? 1 : 0); }
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
bool gNcclSocket = false;  // backend `nccl`: gPluginPath is libnccl, the net is its built-in Socket transport

// Address of the object `name` in the loaded library `lib`, from the library file's symbol table (.symtab: local
// symbols too, which dlsym cannot see); null if the file has no such symbol (stripped).
void* localObject(void* lib, const char* name) {
  link_map* lm = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return nullptr;
  int fd = open(lm->l_name, O_RDONLY);
  if (fd < 0) return nullptr;
  struct stat st;
  void* map = fstat(fd, &st) == 0 ? mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) return nullptr;
  const auto* b = static_cast<const uint8_t*>(map);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(b);
  void* found = nullptr;
  if (static_cast<size_t>(st.st_size) >= sizeof(Elf64_Ehdr) && memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 &&
      eh->e_ident[EI_CLASS] == ELFCLASS64 && eh->e_shoff + eh->e_shnum * sizeof(Elf64_Shdr) <= static_cast<size_t>(st.st_size)) {
    const auto* sh = reinterpret_cast<const Elf64_Shdr*>(b + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum && !found; ++i) {
      if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
      const auto* sym = reinterpret_cast<const Elf64_Sym*>(b + sh[i].sh_offset);
      const char* str = reinterpret_cast<const char*>(b + sh[sh[i].sh_link].sh_offset);
      for (size_t k = 0; k < sh[i].sh_size / sizeof(Elf64_Sym); ++k)
        if (ELF64_ST_TYPE(sym[k].st_info) == STT_OBJECT && sym[k].st_name < sh[sh[i].sh_link].sh_size &&
            strcmp(str + sym[k].st_name, name) == 0) {
          found = reinterpret_cast<void*>(lm->l_addr + sym[k].st_value);
          break;
        }
    }
  }
  munmap(map, st.st_size);
  return found;
}

const ncclNet_v11_t* loadPlugin(void** ctx) {
  void* lib = dlopen(gPluginPath.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen: %s%s\n", dlerror(), gNcclSocket ? " (name the library: nccl@/path/to/libnccl.so.2)" : "");
    _exit(1);
  }
  // NCCL 2.28's built-in net is ncclNet_v11_t (its current ABI), the struct the plugin exports as ncclNetPlugin_v11.
  auto* net = static_cast<const ncclNet_v11_t*>(gNcclSocket ? localObject(lib, "ncclNetSocket")
                                                            : dlsym(lib, "ncclNetPlugin_v11"));
  if (!net) {
    fprintf(stderr, "net_bench: %s has no %s\n", gPluginPath.c_str(), gNcclSocket ? "symbol table entry ncclNetSocket (stripped?)" : "ncclNetPlugin_v11");
    _exit(1);
  }
  ncclNetCommConfig_t cfg{-1};
  CK(net->init(ctx, 1, &cfg, nullptr, nullptr));
  return net;
}

// Results travel from side A (the process that reports) back to the parent through `out`.
void pluginSide(bool a, int ctl, int out, const std::vector<size_t>& sizes, const Opts& o) {
  void* ctx;
  const ncclNet_v11_t* net = loadPlugin(&ctx);
  // Connections one per direction, as NCCL has: A sends on s0 and receives on r1; B the reverse. With --comms C,
  // C of each (NCCL's channels); buffers c*window .. c*window+window-1 travel on comm c. Ping-pong uses comm 0.
  int C = std::max(1, o.comms);
  std::vector<void*> lcs(C, nullptr), scs(C, nullptr), rcs(C, nullptr);
  for (int c = 0; c < C; ++c) {
    char h[NCCL_NET_HANDLE_MAXSIZE];
    CK(net->listen(ctx, 0, h, &lcs[c]));
    writeAll(ctl, h, sizeof(h));
    char ph[NCCL_NET_HANDLE_MAXSIZE];
    readAll(ctl, ph, sizeof(ph));
    while (!scs[c] || !rcs[c]) {
      ncclResult_t r = scs[c] ? ncclSuccess : net->connect(ctx, 0, ph, &scs[c], nullptr);
      if (r == ncclSuccess && !rcs[c]) r = net->accept(lcs[c], &rcs[c], nullptr);
      if (r != ncclSuccess) {
        fprintf(stderr, "net_bench: %s: connect/accept failed (%d)%s\n", net->name, r,
                gNcclSocket && r == ncclUnhandledCudaError
                    ? ": NCCL's Socket transport calls cudaGetDevice there, which needs a CUDA device" : "");
        _exit(1);
      }
    }
  }
  auto SC = [&](int w) { return scs[w / std::max(1, o.window)]; };  // buffer w belongs to comm w / window
  auto RC = [&](int w) { return rcs[w / std::max(1, o.window)]; };
  size_t maxSz = sizes.back();
  int W = std::max(1, o.window) * C;
  std::vector<char*> sb(W), rb(W);
  std::vector<void*> smh(W), rmh(W);
  for (int w = 0; w < W; ++w) {
    sb[w] = static_cast<char*>(aligned_alloc(4096, maxSz));
    rb[w] = static_cast<char*>(aligned_alloc(4096, maxSz));
    memset(sb[w], w, maxSz);
    memset(rb[w], 0, maxSz);
    CK(net->regMr(SC(w), sb[w], maxSz, NCCL_PTR_HOST, &smh[w]));
    CK(net->regMr(RC(w), rb[w], maxSz, NCCL_PTR_HOST, &rmh[w]));
  }
  auto post = [&](bool send, int w, size_t size) {
    void* req = nullptr;
    while (!req) {
      if (send) CK(net->isend(SC(w), sb[w], size, 0, smh[w], nullptr, &req));
      else {
        void* d = rb[w];
        int tag = 0;
        CK(net->irecv(RC(w), 1, &d, &size, &tag, &rmh[w], nullptr, &req));
      }
    }
    return req;
  };
  auto wait = [&](void* req) {
    int done = 0, s;
    while (!done) CK(net->test(req, &done, &s));
  };
  // Streaming, the way NCCL's proxy runs a channel: per comm a ring of `window` slots (buffers c*window + k),
  // message m in slot m % window, posted as soon as its slot is free. --poll oldest (NCCL's way) tests only the
  // oldest posted request of each comm per pass; --poll all tests every posted request each pass.
  struct Ring {
    int comm = 0, quota = 0, posted = 0, done = 0;
    std::vector<void*> req;
    std::vector<char> fin;
  };
  size_t curSize = 0;
  auto makeRings = [&](int iters) {
    std::vector<Ring> v(C);
    for (int c = 0; c < C; ++c) {
      v[c].comm = c;
      v[c].quota = iters / C + (c < iters % C ? 1 : 0);  // the same on both sides
      v[c].req.assign(o.window, nullptr);
      v[c].fin.assign(o.window, 0);
    }
    return v;
  };
  // One pass over a ring: post into free slots, test, retire completed slots in order. Returns messages retired.
  auto step = [&](Ring& g, bool send) {
    int win = static_cast<int>(g.req.size());
    while (g.posted < g.quota && g.posted - g.done < win) {
      int k = g.posted % win, w = g.comm * win + k;
      void* r = nullptr;
      if (send) CK(net->isend(scs[g.comm], sb[w], curSize, 0, smh[w], nullptr, &r));
      else {
        void* d = rb[w];
        int tag = 0;
        size_t sz = curSize;
        CK(net->irecv(rcs[g.comm], 1, &d, &sz, &tag, &rmh[w], nullptr, &r));
      }
      if (!r) break;  // retry on a later pass
      g.req[k] = r;
      g.fin[k] = 0;
      ++g.posted;
    }
    for (int m = g.done; m < g.posted; ++m) {
      int k = m % win;
      if (!g.fin[k]) {
        int f = 0, sz = 0;
        CK(net->test(g.req[k], &f, &sz));
        g.fin[k] = static_cast<char>(f);
      }
      if (o.pollOldest) break;
    }
    int retired = 0;
    while (g.done < g.posted && g.fin[g.done % win]) ++g.done, ++retired;
    return retired;
  };
  char sync = 0;
  for (size_t size : sizes) {
    curSize = size;
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
      std::vector<Ring> rings = makeRings(iters);
      int done = 0;
      while (done < iters)
        for (Ring& g : rings) done += step(g, a);  // A sends, B receives
      if (!a) writeAll(ctl, &sync, 1);  // ack: everything arrived
      else readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
    if (o.bidir) {
      // Both directions at once from this one thread: per comm, `window` sends and `window` receives in flight.
      int iters = streamIters(o, size);
      if (a) readAll(ctl, &sync, 1);
      else writeAll(ctl, &sync, 1);
      double t0 = now();
      std::vector<Ring> sr = makeRings(iters), rr = makeRings(iters);
      int done = 0;
      while (done < 2 * iters)
        for (int c = 0; c < C; ++c) {
          done += step(rr[c], false);
          done += step(sr[c], true);
        }
      // Both sides have received everything: each tells the other, A times until it hears B.
      writeAll(ctl, &sync, 1);
      readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
  }
  for (int w = 0; w < W; ++w) {
    CK(net->deregMr(SC(w), smh[w]));
    CK(net->deregMr(RC(w), rmh[w]));
  }
  writeAll(ctl, &sync, 1);  // both done before either closes
  readAll(ctl, &sync, 1);
  for (int c = 0; c < C; ++c) {
    CK(net->closeSend(scs[c]));
    CK(net->closeRecv(rcs[c]));
    CK(net->closeListen(lcs[c]));
  }
  net->finalize(ctx);
}

// ---- plain blocking TCP ------------------------------------------------------------------------------------------
// One loopback TCP connection, set up over the control pipe: the listening side sends its address, the other
// connects. TCP_NODELAY on, as NCCL's Socket transport sets it.
int tcpConnect(bool listens, int ctl) {
  int fd;
  sockaddr_in ad{};
  if (listens) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
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
    readAll(ctl, &ad, sizeof(ad));
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&ad), sizeof(ad)) != 0) { perror("connect"); _exit(1); }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void tcpSide(bool a, int ctl, int out, const std::vector<size_t>& sizes, const Opts& o) {
  const int fd = tcpConnect(!a, ctl);
  // bidir: a second connection, B -> A (the first carries A -> B), as NCCL has one connection per direction.
  const int fd2 = o.bidir ? tcpConnect(a, ctl) : -1;
  // As many distinct buffers as the plugin side has (window x comms, each way), used in turn: one reused buffer
  // would stay in cache and make the copies look cheaper than the plugin's, which cycle through all of theirs.
  int W = std::max(1, o.window) * std::max(1, o.comms);
  std::vector<std::vector<char>> sbufs(W, std::vector<char>(sizes.back(), 1));
  std::vector<std::vector<char>> rbufs(o.bidir ? W : 0, std::vector<char>(sizes.back(), 0));
  std::vector<char>& buf = sbufs[0];
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
        if (a) writeAll(fd, sbufs[i % W].data(), size);
        else readAll(fd, sbufs[i % W].data(), size);
      }
      if (!a) writeAll(ctl, &sync, 1);
      else readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
    if (o.bidir) {
      // One thread, non-blocking send() on one connection and recv() on the other, in a busy loop.
      int sfd = a ? fd : fd2, rfd = a ? fd2 : fd;
      int iters = streamIters(o, size);
      if (a) readAll(ctl, &sync, 1);
      else writeAll(ctl, &sync, 1);
      fcntl(sfd, F_SETFL, fcntl(sfd, F_GETFL) | O_NONBLOCK);
      fcntl(rfd, F_SETFL, fcntl(rfd, F_GETFL) | O_NONBLOCK);
      double t0 = now();
      size_t total = size * static_cast<size_t>(iters), sent = 0, got = 0;
      while (sent < total || got < total) {
        bool moved = false;
        if (sent < total) {
          size_t off = sent % size;
          ssize_t k = send(sfd, sbufs[sent / size % W].data() + off, size - off, MSG_NOSIGNAL);
          if (k > 0) sent += k, moved = true;
          else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) { perror("send"); _exit(1); }
        }
        if (got < total) {
          size_t off = got % size;
          ssize_t k = recv(rfd, rbufs[got / size % W].data() + off, size - off, 0);
          if (k > 0) got += k, moved = true;
          else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) { perror("recv"); _exit(1); }
        }
        (void)moved;  // spin, as NCCL's proxy thread does while it has operations in flight
      }
      fcntl(sfd, F_SETFL, fcntl(sfd, F_GETFL) & ~O_NONBLOCK);
      fcntl(rfd, F_SETFL, fcntl(rfd, F_GETFL) & ~O_NONBLOCK);
      writeAll(ctl, &sync, 1);
      readAll(ctl, &sync, 1);
      double gbps = static_cast<double>(size) * iters / (now() - t0) / 1e9;
      if (a) writeAll(out, &gbps, sizeof(gbps));
    }
  }
  close(fd);
  if (fd2 >= 0) close(fd2);
}

// Runs one configuration in two fresh processes (each loads the plugin itself, with `net` in EPCOMM_NET);
// returns side A's results in order: per size [pingpong us] [stream GB/s] [bidir GB/s].
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
        size_t plus = spec.find('+');
        std::string envs = plus == std::string::npos ? "" : spec.substr(plus + 1);
        spec = spec.substr(0, plus);
        for (size_t p = 0; p < envs.size();) {  // VAR=value pairs separated by '+'
          size_t q = envs.find('+', p);
          if (q == std::string::npos) q = envs.size();
          std::string kv = envs.substr(p, q - p);
          size_t eq = kv.find('=');
          if (eq != std::string::npos) setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
          p = q + 1;
        }
        size_t at = spec.find('@');
        gNcclSocket = spec.substr(0, at) == "nccl";
        if (gNcclSocket) {
          gPluginPath = "libnccl.so.2";
          setenv("NCCL_SOCKET_IFNAME", "lo", 0);
        }
        if (at != std::string::npos) gPluginPath = spec.substr(at + 1);
        if (!gNcclSocket) setenv("EPCOMM_NET", spec.substr(0, at).c_str(), 1);
      }
      if (net) pluginSide(side == 0, sv[side], res[1], sizes, o);
      else tcpSide(side == 0, sv[side], res[1], sizes, o);
      _exit(0);
    }
  }
  close(sv[0]);
  close(sv[1]);
  close(res[1]);
  size_t n = sizes.size() * o.modes();
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
    else if (!strcmp(argv[i], "--step")) o.step = std::max<size_t>(2, parseSize(argv[i + 1]));
    else if (!strcmp(argv[i], "--window")) o.window = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--comms")) o.comms = std::max(1, atoi(argv[i + 1]));
    else if (!strcmp(argv[i], "--poll")) o.pollOldest = !strcmp(argv[i + 1], "oldest");
    else if (!strcmp(argv[i], "--time")) o.seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--backends")) backends = argv[i + 1];
    else if (!strcmp(argv[i], "--mode")) {
      std::string m = argv[i + 1];
      o.pingpong = m == "both" || m == "pingpong" || m == "all";
      o.stream = m == "both" || m == "stream" || m == "all";
      o.bidir = m == "bidir" || m == "all";
      if (o.modes() == 0) {
        fprintf(stderr, "net_bench: unknown mode %s\n", m.c_str());
        return 2;
      }
    } else {
      fprintf(stderr, "usage: net_bench [--mode both|pingpong|stream|bidir|all] [--min 1K] [--max 4M] [--step 4] "
                      "[--window 8] [--comms 1] [--poll all|oldest] [--bytes 256M] [--time 0.25] [--backends socket,ofi,nccl]\n");
      return 2;
    }
  }
  if (const char* p = getenv("EPCOMM_NET_BENCH_PLUGIN")) gPluginPath = p;
  if (!getenv("EPCOMM_SOCKET_IFNAME")) setenv("EPCOMM_SOCKET_IFNAME", "lo", 1);
  std::vector<size_t> sizes;
  for (size_t s = std::max<size_t>(o.minSz, 1); s <= o.maxSz; s *= o.step) sizes.push_back(s);
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
  printf("# backends: %s%s%s; stream window %d x %d comm(s), poll %s; ratio = plugin speed / TCP speed (>1: plugin "
         "faster)\n", backends.c_str(), prov ? ", EPCOMM_OFI_PROVIDER=" : "", prov ? prov : "", o.window, o.comms,
         o.pollOldest ? "oldest" : "all");
  for (size_t k = 0; k < nets.size(); ++k)
    if (nets[k].find_first_of("@+") != std::string::npos) printf("# #%zu = %s\n", k, nets[k].c_str());
  int stride = o.modes();
  const char* titles[3] = {"ping-pong one-way latency (us)", "streaming bandwidth (GB/s)",
                           "bidirectional streaming, bandwidth of one direction (GB/s)"};
  bool on[3] = {o.pingpong, o.stream, o.bidir};
  for (int mode = 0, off = 0; mode < 3; ++mode) {
    if (!on[mode]) continue;
    printf("\n## %s\n%10s %12s", titles[mode], "size", "tcp");
    for (size_t k = 0; k < nets.size(); ++k) {
      std::string lab = nets[k].substr(0, std::min(nets[k].find('@'), nets[k].find('+')));
      if (nets[k].find_first_of("@+") != std::string::npos) lab += "#" + std::to_string(k);
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
    ++off;
  }
  return 0;
}
