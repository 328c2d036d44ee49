// The kernels' side of the GPU proxy's outbound rings (kernels/remote.cuh) for CPU writers: what the CPU tests of
// the proxy (tests/unit/test_gpu_proxy.cc) and its throughput bench (bench/net/proxy_bench.cc) use in place of
// kernels. Reserve with an atomic add, wait for room a lap behind (tested first against the largest consumed count
// read so far, GpuRemoteRing::seen, as the kernels do), write the header and payload, store the stamp last.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "common/gpu_remote.h"

namespace epcomm {

struct ProxyHostWriter {
  GpuRemoteRing g;
  // The consumed count, read, and seen raised to it (kernels/remote.cuh readConsumed).
  uint64_t readConsumed() const {
    const uint64_t c = __atomic_load_n(g.consumed, __ATOMIC_ACQUIRE);
    unsigned long long s = __atomic_load_n(g.seen, __ATOMIC_RELAXED);
    while (s < c && !__atomic_compare_exchange_n(g.seen, &s, c, true, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
    return c;
  }
  bool room(uint64_t end, int timeout_ms) const {
    if (end <= g.bytes || __atomic_load_n(g.seen, __ATOMIC_ACQUIRE) >= end - g.bytes) return true;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (readConsumed() < end - g.bytes) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::yield();
    }
    return true;
  }
  static void stamp(GpuRemoteRecord* h, uint64_t pos) { __atomic_store_n(&h->stamp, pos + 1, __ATOMIC_RELEASE); }
  // A record's header (stamp not yet stored) and its position; nullptr when no room came in time.
  GpuRemoteRecord* reserve(uint32_t type, uint32_t buf, uint64_t off, uint32_t len, uint64_t* pos_out,
                           int timeout_ms = 20000) const {
    const uint64_t need = remoteRecordBytes(type == kRemoteFlag ? 8 : len);
    for (;;) {
      const uint64_t pos = __atomic_fetch_add(g.reserved, need, __ATOMIC_RELAXED);
      const uint64_t at = pos % g.bytes;
      if (!room(pos + need, timeout_ms)) return nullptr;
      GpuRemoteRecord* h = reinterpret_cast<GpuRemoteRecord*>(g.data + at);
      if (at + need <= g.bytes) {
        h->type = type;
        h->buf = buf;
        h->off = off;
        h->len = type == kRemoteFlag ? 8 : len;
        *pos_out = pos;
        return h;
      }
      h->type = kRemoteSkip;
      h->len = static_cast<uint32_t>(g.bytes - at);
      stamp(h, pos);
      if (need > g.bytes - at) {
        h = reinterpret_cast<GpuRemoteRecord*>(g.data);
        h->type = kRemoteSkip;
        h->len = static_cast<uint32_t>(need - (g.bytes - at));
        stamp(h, pos + (g.bytes - at));
      }
    }
  }
  bool data(uint32_t buf, uint64_t off, const void* src, uint32_t len) const {
    uint64_t pos;
    GpuRemoteRecord* h = reserve(kRemoteData, buf, off, len, &pos);
    if (h == nullptr) return false;
    memcpy(h + 1, src, len);
    stamp(h, pos);
    return true;
  }
  bool flag(uint32_t buf, uint64_t off, uint64_t v) const {
    uint64_t pos;
    GpuRemoteRecord* h = reserve(kRemoteFlag, buf, off, 8, &pos);
    if (h == nullptr) return false;
    memcpy(h + 1, &v, 8);
    stamp(h, pos);
    return true;
  }
};

}  // namespace epcomm
