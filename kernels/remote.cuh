// Writes meant for a rank of another host (common/gpu_remote.h): records in the outbound ring toward it, which this
// rank's proxy forwards. Every kernel family uses these at the places where it writes into a peer's buffer: a DATA
// record for bytes, a FLAG record where it would release a protocol word (publish() chooses by the peer).
#pragma once
#include "kernels/device_common.cuh"

namespace epcomm {
namespace dev {

__device__ __forceinline__ bool isRemote(uint64_t remote, int r) { return (remote >> r) & 1; }
// Kernels that write to peers come in two instances, chosen at launch: kX = false for communicators whose ranks
// share one host (the remote code compiles away, registers included: what they were before ranks on other hosts
// existed) and kX = true otherwise. farMask<kX>(p) is the mask those kernels test.
template <bool kX, class P>
__device__ __forceinline__ uint64_t farMask(const P& p) {
  return kX ? p.remote : 0;
}
// Selects the instance of a loop written for both cases (`if constexpr (decltype(tag)::value)` inside).
template <bool kFar>
struct FarTag {
  static constexpr bool value = kFar;
};
// Where the words that `writer` stores into `owner`'s buffer live: owner's buffer, mapped here (or its remote
// window), except this rank's own words written by a rank of another host, which its proxy stores in the far copy
// (common/gpu_remote.h). Every access of such a word goes through here (HtParams and LlParams alike).
template <class P>
__device__ __forceinline__ uint8_t* baseOf(const P& p, int owner, int writer) {
  return owner == p.rank && isRemote(p.remote, writer) ? p.far_in : p.base[owner];
}
// Offset of an address computed in a remote rank's window (base[r] = kGpuRemoteWindow) in that rank's buffer.
__device__ __forceinline__ uint64_t remoteOff(const void* in_window) {
  return reinterpret_cast<uint64_t>(in_window) - kGpuRemoteWindow;
}

// The proxy's consumed count of ring g as this kernel reads it: host memory, and the largest value read so far
// (g.seen, device memory) raised to it.
__device__ __forceinline__ uint64_t readConsumed(const GpuRemoteRing& g) {
  const uint64_t c = *g.consumed;
  atomicMax(g.seen, static_cast<unsigned long long>(c));
  return c;
}

// Waits until the proxy has taken what the ring held below `end` a lap ago (the ring has room up to `end`), with
// the communicator's deadline. False on timeout (recorded, peer = the ring's rank) or abort. Unlike waitAtLeast it
// does not give up when another wait has failed: a reservation left without its record would stop the ring. Host
// memory is read only when the largest count read so far (g.seen) is too low (gpu_remote.h).
template <class P>
__device__ bool ringRoom(const P& p, const GpuRemoteRing& g, uint64_t end, int peer, uint64_t epoch) {
  if (end <= g.bytes || *reinterpret_cast<volatile unsigned long long*>(g.seen) >= end - g.bytes ||
      readConsumed(g) >= end - g.bytes)
    return true;
  WaitClock clock;
  volatile GpuErrorRecord* err = p.err;
  for (uint32_t it = 1;; ++it) {
    if (readConsumed(g) >= end - g.bytes) return true;
    if ((it & 15) == 0) {
      if (err->abort != 0) return false;
      if (clock.over(p.timeout_ns)) {
        recordError(p, epTimeout, peer, epPhaseData, epoch);
        return false;
      }
    }
    __nanosleep(256);
  }
}

// The header's stamp, stored last: the proxy reads the record once it sees it.
__device__ __forceinline__ void stampRecord(GpuRemoteRecord* h, uint64_t pos) {
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(&h->stamp) = pos + 1;
}

// A reserved record: its header in the ring and its position (the stamp is pos + 1); hdr == nullptr if none.
struct RemoteSlot {
  GpuRemoteRecord* hdr;
  uint64_t pos;
  __device__ uint8_t* payload() const { return reinterpret_cast<uint8_t*>(hdr + 1); }
};

// One thread: reserves a record of `type` with `len` payload bytes (FLAG: 8) for offset `off` of buffer `buf` of
// remote rank `owner`, and writes its header but the stamp. A reservation that would cross the ring's end fills
// the rest of the lap (and what it took of the next) with SKIP records and reserves again. {nullptr} when the
// wait for room failed; the failure is recorded, and the ring toward `owner` is then stuck for good.
template <class P>
__device__ RemoteSlot remoteReserve(const P& p, int owner, uint32_t type, uint32_t buf, uint64_t off, uint32_t len,
                                    uint64_t epoch) {
  const GpuRemoteRing g = p.rem->ring[owner];
  const uint64_t need = remoteRecordBytes(type == kRemoteFlag ? 8 : len);
  for (;;) {
    const uint64_t pos = atomicAdd(g.reserved, static_cast<unsigned long long>(need));
    const uint64_t at = pos % g.bytes;
    if (!ringRoom(p, g, pos + need, owner, epoch)) return RemoteSlot{nullptr, 0};
    if (at + need <= g.bytes) {
      GpuRemoteRecord* h = reinterpret_cast<GpuRemoteRecord*>(g.data + at);
      h->type = type;
      h->buf = buf;
      h->off = off;
      h->len = type == kRemoteFlag ? 8 : len;
      return RemoteSlot{h, pos};
    }
    const uint64_t first = g.bytes - at;  // a multiple of the record alignment, as every size here
    GpuRemoteRecord* h = reinterpret_cast<GpuRemoteRecord*>(g.data + at);
    h->type = kRemoteSkip;
    h->len = static_cast<uint32_t>(first);
    stampRecord(h, pos);
    if (need > first) {
      h = reinterpret_cast<GpuRemoteRecord*>(g.data);
      h->type = kRemoteSkip;
      h->len = static_cast<uint32_t>(need - first);
      stampRecord(h, pos + first);
    }
  }
}

// Warp-wide (every lane, the same arguments): a DATA record of `len` bytes for offset `off` of `owner`'s buffer
// `buf`. The lanes write the payload (payload() in every lane; hdr nullptr in every lane after a failed wait),
// then call remoteCommitWarp.
template <class P>
__device__ RemoteSlot remoteDataWarp(const P& p, int owner, uint32_t buf, uint64_t off, uint32_t len, uint64_t epoch) {
  RemoteSlot s{nullptr, 0};
  if ((threadIdx.x & 31) == 0) s = remoteReserve(p, owner, kRemoteData, buf, off, len, epoch);
  s.hdr = reinterpret_cast<GpuRemoteRecord*>(__shfl_sync(kFull, reinterpret_cast<uint64_t>(s.hdr), 0));
  s.pos = __shfl_sync(kFull, s.pos, 0);
  return s;
}
// Every lane's payload stores are ordered before the stamp that lane 0 stores.
__device__ __forceinline__ void remoteCommitWarp(const RemoteSlot& s) {
  if (s.hdr == nullptr) return;
  __threadfence_system();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) stampRecord(s.hdr, s.pos);
}

// One thread: `owner` sees `v` at offset `off` of its buffer `buf` only after every record this rank sent it
// before (a release store, across hosts). False after a failed wait for room.
template <class P>
__device__ bool remoteFlag(const P& p, int owner, uint32_t buf, uint64_t off, uint64_t v, uint64_t epoch) {
  const RemoteSlot s = remoteReserve(p, owner, kRemoteFlag, buf, off, 8, epoch);
  if (s.hdr == nullptr) return false;
  *reinterpret_cast<uint64_t*>(s.payload()) = v;
  stampRecord(s.hdr, s.pos);
  return true;
}

// One thread: releases the protocol word at `w` (an address in `owner`'s buffer `buf`, mapped or in its remote
// window) with value v: a release store for a rank of this host (at GPU scope when gpu_scope), a FLAG record for
// a rank of another host.
template <bool kX, class P>
__device__ __forceinline__ void publish(const P& p, int owner, uint32_t buf, uint64_t* w, uint64_t v, uint64_t epoch,
                                        bool gpu_scope) {
  if (isRemote(farMask<kX>(p), owner)) remoteFlag(p, owner, buf, remoteOff(w), v, epoch);
  else stRelease(w, v, gpu_scope);
}

}  // namespace dev
}  // namespace epcomm
