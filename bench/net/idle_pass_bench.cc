// What one pass of tests over many idle connections costs, as the net bridge makes it (every posted receive of
// every peer of other hosts tested each pass, hundreds at 32 hosts): the socket backend on its own, N connections
// within this process (1 data stream each, as EPCOMM_NET_STREAM_BUDGET gives at 64 peers or more), one receive
// posted on each and nothing arriving; passes with every test reading its socket, then (the same connections,
// now watched: a comm cannot be unwatched) passes that poll readiness once first (NetBackend::openPoller).
//
//   idle_pass_bench [--peers 8,64,248] [--passes 2000] [--reps 3]
//
// Prints, per N: microseconds per pass and nanoseconds per idle test, each way (best of reps), and their ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "net_pair.h"
#include "transport/net/net.h"

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Seconds per pass over the posted receives (after a poll where `poller` is not null), best of `reps`.
double timePasses(epcomm::net::NetBackend* net, std::vector<void*>& reqs, void* poller, int passes, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    for (int k = 0; k < passes; ++k) {
      if (poller) net->pollReady(poller);
      for (void* q : reqs) {
        int done = 0;
        size_t got = 0;
        if (net->test(q, &done, &got) != epSuccess || done) {
          fprintf(stderr, "idle_pass_bench: a receive on an idle connection %s\n", done ? "completed" : "failed");
          exit(1);
        }
      }
    }
    best = std::min(best, (now() - t0) / passes);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> peers = {8, 64, 248};
  int passes = 2000, reps = 3;
  for (int i = 1; i < argc; ++i) {
    const bool more = i + 1 < argc;
    if (!strcmp(argv[i], "--peers") && more) {
      peers.clear();
      std::stringstream ss(argv[++i]);
      for (std::string t; std::getline(ss, t, ',');) peers.push_back(atoi(t.c_str()));
    } else if (!strcmp(argv[i], "--passes") && more) {
      passes = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--reps") && more) {
      reps = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: idle_pass_bench [--peers 8,64,248] [--passes 2000] [--reps 3]\n");
      return 2;
    }
  }
  printf("idle_pass_bench: socket backend, 1 receive posted per connection, nothing arriving, best of %d x %d passes\n",
         reps, passes);
  printf("%6s %14s %14s %14s %14s %8s\n", "peers", "read_us/pass", "poll_us/pass", "read_ns/test", "poll_ns/test",
         "ratio");
  for (int n : peers) {
    // Both ends of each connection and its listener (descriptorsPerConnection counts one end).
    std::string why;
    epcomm::net::NetBackend* sock = epcomm::net::netSocketBackend(&why);
    if (sock == nullptr) {
      fprintf(stderr, "idle_pass_bench: no socket backend: %s\n", why.c_str());
      return 1;
    }
    if (epcomm::net::ensureDescriptors(static_cast<size_t>(n) * (2 * sock->descriptorsPerConnection(1) + 1),
                                       "idle_pass_bench's connections") != epSuccess) {
      fprintf(stderr, "idle_pass_bench: %s\n", epcomm::net::netLastError());
      return 1;
    }
    std::vector<std::unique_ptr<NetPair>> pairs;
    std::vector<void*> reqs, mhs;
    std::vector<char> buf(static_cast<size_t>(n) * 4096);
    for (int i = 0; i < n; ++i) {
      pairs.push_back(std::make_unique<NetPair>());
      if (!connectNetPair(pairs.back().get(), 1)) {
        fprintf(stderr, "idle_pass_bench: connection %d of %d: %s\n", i, n, epcomm::net::netLastError());
        return 1;
      }
      NetPair& p = *pairs.back();
      void* data = &buf[static_cast<size_t>(i) * 4096];
      size_t size = 4096;
      int tag = 0;
      void *mh = nullptr, *req = nullptr;
      if (p.net->regMr(p.recv, data, size, epcomm::net::kNetPtrHost, &mh) != epSuccess ||
          p.net->irecv(p.recv, 1, &data, &size, &tag, &mh, &req) != epSuccess || req == nullptr) {
        fprintf(stderr, "idle_pass_bench: posting a receive: %s\n", epcomm::net::netLastError());
        return 1;
      }
      mhs.push_back(mh);
      reqs.push_back(req);
    }
    epcomm::net::NetBackend* net = pairs[0]->net;
    void* poller = net->openPoller();
    if (poller == nullptr) {
      fprintf(stderr, "idle_pass_bench: the socket backend offers no readiness\n");
      return 1;
    }
    const double read_s = timePasses(net, reqs, nullptr, passes, reps);
    for (auto& p : pairs)
      if (net->watchRecv(poller, p->recv) != epSuccess) {
        fprintf(stderr, "idle_pass_bench: watchRecv: %s\n", epcomm::net::netLastError());
        return 1;
      }
    const double poll_s = timePasses(net, reqs, poller, passes, reps);
    printf("%6d %14.2f %14.2f %14.0f %14.0f %8.1f\n", n, read_s * 1e6, poll_s * 1e6, read_s / n * 1e9,
           poll_s / n * 1e9, read_s / poll_s);
    fflush(stdout);
    pairs.clear();  // the comms first, then their poller (net.h)
    net->closePoller(poller);
  }
  return 0;
}
