// Throughput of the GPU engine's inter-host proxy alone, on the CPU: R forked processes, each on a host of its own
// (every peer is remote), each with a GpuProxy over host memory (hostProxyDevice) and W writer threads standing in
// for the kernels (engine/gpu/proxy_host_writer.h): DATA records of --record-kb KiB (an HT queue slot is 14 KiB at
// hidden 7168) into every peer's HT buffer, a FLAG after every --flag-every of a writer's records (the queue tails),
// --mb MiB per peer per repetition. Against it, in the same processes and before it, the raw stream of the proxy's
// own net bridge (GpuProxy::rawStream, what epCommNetRawBandwidth measures): the ratio says what the proxy's path
// (ring -> outbox -> net -> inbox -> far copy) costs apart from the GPU.
//
//   proxy_bench [--ranks 2] [--mb 256] [--record-kb 14] [--writers 4] [--flag-every 16] [--reps 3]
//               [--raw-msg-kb 1024] [--raw-window 4]
//
// Prints, on rank 0: GB/s summed over ranks (bytes sent to other hosts over the slowest rank's time) for the raw
// stream and for the proxy, and their ratio; and the CPU time all ranks spent per byte sent in each (the proxy's
// without the writers' own): where the cores are few, what the proxy costs shows there rather than in the ratio.
// EPCOMM_NET picks the backend, as for the engines.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "engine/gpu/proxy.h"
#include "engine/gpu/proxy_host_writer.h"

namespace {

struct Options {
  int ranks = 2, mb = 256, record_kb = 14, writers = 4, flag_every = 16, reps = 3;
  int raw_msg_kb = 1024, raw_window = 4;  // the raw stream's messages and how many are in flight per peer and direction
};

constexpr int kTimeoutMs = 60000;
constexpr size_t kSlotsPerPeer = 256;  // the records cycle through this many slots of the receiver's slice

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU seconds (user + system) of this process (RUSAGE_SELF) or of the calling thread (RUSAGE_THREAD).
double cpuSeconds(int who) {
  rusage u{};
  getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

#define BENCH_CHECK(cond, ...)                     \
  do {                                             \
    if (!(cond)) {                                 \
      fprintf(stderr, "proxy_bench: rank %d: ", rank); \
      fprintf(stderr, __VA_ARGS__);                \
      fprintf(stderr, "\n");                       \
      return 1;                                    \
    }                                              \
  } while (0)

int runRank(const Options& o, const epUniqueId& id, int rank) {
  const int R = o.ranks;
  std::unique_ptr<epcomm::Bootstrap> bs;
  BENCH_CHECK(epcomm::bootstrapInitSocket(&id, rank, R, kTimeoutMs, &bs) == epSuccess, "bootstrap: %s",
              epGetLastError(nullptr));
  const size_t rec = static_cast<size_t>(o.record_kb) << 10, slice = rec * kSlotsPerPeer;
  const size_t ll_bytes = 8 * static_cast<size_t>(R) * (o.writers + 1);  // [source][writer] tails, then done words
  std::vector<uint8_t> remote(R, 1);
  remote[rank] = 0;
  epcomm::GpuProxy proxy(rank, R, remote, epcomm::hostProxyDevice());
  const size_t bytes[epcomm::kRemoteNumBuffers] = {slice * R, ll_bytes};
  BENCH_CHECK(proxy.start(bs.get(), bytes, kTimeoutMs) == epSuccess, "proxy: %s", epGetLastError(nullptr));
  BENCH_CHECK(bs->barrier(kTimeoutMs) == epSuccess, "barrier");

  // The raw stream between the same processes, the same backend.
  uint64_t raw_sent = 0;
  double raw_s = 0;
  const double raw_cpu0 = cpuSeconds(RUSAGE_SELF);
  BENCH_CHECK(proxy.rawStream(remote, static_cast<size_t>(o.mb) << 20, static_cast<size_t>(o.raw_msg_kb) << 10,
                              o.raw_window, kTimeoutMs,
                              [&] { return bs->barrier(kTimeoutMs); }, &raw_sent, &raw_s) == epSuccess,
              "raw stream: %s", epGetLastError(nullptr));
  const double raw_cpu = cpuSeconds(RUSAGE_SELF) - raw_cpu0;

  const epcomm::GpuRemote* t = proxy.table();
  std::vector<epcomm::ProxyHostWriter> to;
  for (int p = 0; p < R; ++p) to.push_back(epcomm::ProxyHostWriter{t->ring[p]});
  const uint8_t* far_ll = proxy.farCopy(epcomm::kRemoteLlBuffer, true);
  const size_t per_peer = (static_cast<size_t>(o.mb) << 20) / rec;  // records per peer per repetition
  std::vector<uint8_t> payload(rec);
  for (size_t i = 0; i < rec; ++i) payload[i] = static_cast<uint8_t>(i * 7 + rank);
  double best = 1e30, proxy_cpu = 0;
  for (int rep = 1; rep <= o.reps; ++rep) {
    BENCH_CHECK(bs->barrier(kTimeoutMs) == epSuccess, "barrier");
    const double t0 = now(), cpu0 = cpuSeconds(RUSAGE_SELF);
    std::atomic<int> failed{0};
    std::vector<std::thread> ws;
    std::vector<double> writer_cpu(o.writers, 0);
    for (int w = 0; w < o.writers; ++w)
      ws.emplace_back([&, w] {
        struct Note {  // the thread's CPU time, however it ends
          double* at;
          ~Note() { *at = cpuSeconds(RUSAGE_THREAD); }
        } note{&writer_cpu[w]};
        for (int q = 0; q < R; ++q) {
          if (q == rank) continue;
          uint64_t mine = 0;
          for (size_t i = w; i < per_peer && !failed; i += o.writers) {
            const uint64_t off = rank * slice + (i % kSlotsPerPeer) * rec;
            if (!to[q].data(epcomm::kRemoteHtBuffer, off, payload.data(), static_cast<uint32_t>(rec))) failed = 1;
            if (++mine % o.flag_every == 0 &&
                !to[q].flag(epcomm::kRemoteLlBuffer, 8 * (static_cast<size_t>(rank) * o.writers + w), mine))
              failed = 1;
          }
        }
      });
    for (auto& th : ws) th.join();
    BENCH_CHECK(!failed, "a writer found no room in its ring within %d ms", 20000);
    // Every record before it is stored at the peer before this word is (stream order).
    for (int q = 0; q < R; ++q)
      if (q != rank)
        BENCH_CHECK(to[q].flag(epcomm::kRemoteLlBuffer, 8 * (static_cast<size_t>(R) * o.writers + rank), rep),
                    "done flag");
    for (int s = 0; s < R; ++s) {
      if (s == rank) continue;
      const uint64_t* word = reinterpret_cast<const uint64_t*>(far_ll + 8 * (static_cast<size_t>(R) * o.writers + s));
      const double until = now() + kTimeoutMs / 1e3;
      while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < static_cast<uint64_t>(rep)) {
        BENCH_CHECK(now() < until, "repetition %d from rank %d never completed", rep, s);
        std::this_thread::yield();
      }
    }
    best = std::min(best, now() - t0);
    proxy_cpu += cpuSeconds(RUSAGE_SELF) - cpu0;
    for (double c : writer_cpu) proxy_cpu -= c;
  }
  // Rank 0 prints: sent bytes summed over ranks, over the slowest rank's time.
  struct Mine {
    double raw_bytes, raw_s, bytes, s, raw_cpu, proxy_cpu;
  } mine{static_cast<double>(raw_sent), raw_s, static_cast<double>(per_peer * rec * (R - 1)), best, raw_cpu,
         proxy_cpu};
  std::vector<Mine> all(R);
  all[rank] = mine;
  BENCH_CHECK(bs->allgather(all.data(), sizeof(Mine), kTimeoutMs) == epSuccess, "allgather");
  if (rank == 0) {
    double rb = 0, rs = 0, pb = 0, ps = 0, rc = 0, pc = 0;
    for (const Mine& m : all) {
      rb += m.raw_bytes;
      rs = std::max(rs, m.raw_s);
      pb += m.bytes;
      ps = std::max(ps, m.s);
      rc += m.raw_cpu;
      pc += m.proxy_cpu;
    }
    const double raw = rs > 0 ? rb / rs / 1e9 : 0, prox = ps > 0 ? pb / ps / 1e9 : 0;
    printf("proxy_bench: %d ranks (one per host), %d MiB per peer, %d KiB records, %d writers, a FLAG every %d "
           "records, best of %d, net/%s\n", R, o.mb, o.record_kb, o.writers, o.flag_every, o.reps,
           getenv("EPCOMM_NET") ? getenv("EPCOMM_NET") : "default");
    // CPU per byte: all reps' bytes for the proxy (its CPU is summed over them), one stream's for raw.
    printf("%-10s %10s %10s %10s %12s %12s\n", "ranks", "raw_GB/s", "proxy_GB/s", "proxy/raw", "raw_cpu_ns/B",
           "proxy_cpu_ns/B");
    printf("%-10d %10.3f %10.3f %10.3f %12.3f %12.3f\n", R, raw, prox, raw > 0 ? prox / raw : 0.0,
           rb > 0 ? rc / rb * 1e9 : 0.0, pb > 0 ? pc / (pb * o.reps) * 1e9 : 0.0);
  }
  std::vector<uint8_t> live(R, 1);
  proxy.stop(true, live.data(), 5000);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    int* v = a == "--ranks" ? &o.ranks : a == "--mb" ? &o.mb : a == "--record-kb" ? &o.record_kb
           : a == "--writers" ? &o.writers : a == "--flag-every" ? &o.flag_every : a == "--reps" ? &o.reps
           : a == "--raw-msg-kb" ? &o.raw_msg_kb : a == "--raw-window" ? &o.raw_window : nullptr;
    if (v == nullptr || i + 1 >= argc) {
      fprintf(stderr, "usage: proxy_bench [--ranks 2] [--mb 256] [--record-kb 14] [--writers 4] [--flag-every 16] "
                      "[--reps 3] [--raw-msg-kb 1024] [--raw-window 4] (unknown or incomplete argument '%s')\n",
              a.c_str());
      return 2;
    }
    *v = atoi(argv[++i]);
  }
  if (o.ranks < 2 || o.ranks > 64 || o.mb < 1 || o.record_kb < 1 || o.record_kb > 512 || o.writers < 1 ||
      o.writers > 64 || o.flag_every < 1 || o.reps < 1 || o.raw_msg_kb < 1 || o.raw_msg_kb > 65536 ||
      o.raw_window < 1 || o.raw_window > 64) {
    fprintf(stderr, "proxy_bench: --ranks must be in [2, 64], --record-kb in [1, 512], --writers in [1, 64], "
                    "--raw-msg-kb in [1, 65536], --raw-window in [1, 64], --mb, --flag-every and --reps at least 1\n");
    return 2;
  }
  epUniqueId id;
  if (epGetUniqueId(&id) != epSuccess) {
    fprintf(stderr, "proxy_bench: epGetUniqueId: %s\n", epGetLastError(nullptr));
    return 1;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = runRank(o, id, r);
      fflush(stdout);  // _exit does not flush stdio
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  return rc;
}
