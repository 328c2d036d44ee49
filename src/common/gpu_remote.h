// The GPU engine across hosts: what kernels and the proxy (src/engine/gpu/proxy.h) share.
//
// A rank of another host has no buffer mapped here. Kernels address its HT and LL buffers through a window that
// maps nothing (base[r] = kGpuRemoteWindow, so `base[r] + off` keeps the offset) and hand every write meant for it
// to this rank's proxy as a record in an outbound ring, one ring per remote rank, in pinned host memory that the
// kernels write over PCIe:
//
//   kernel --records--> ring[r] (host memory) --proxy--> net (NetBridge) --> r's proxy --> the far copy of r's
//   buffer (pinned host memory at the buffer's offsets, which r's kernels read for every word a rank of another
//   host writes; stored by the proxy's thread, no CUDA call; large DATA payloads the net transport receives there
//   itself, engine/gpu/proxy.h)
//
// A record is a 32-byte header and its payload, padded to 32 bytes: DATA (bytes to store at an offset of one of
// r's buffers) or FLAG (one 8-byte word, stored with release semantics once every earlier record from this rank
// has been stored there). Kernels release a protocol word (a tag, a tail, an acknowledgement) to a remote rank as
// a FLAG after the DATA records it covers; the proxies keep each (source, destination) stream in order, so r sees
// the word only once the bytes before it are in place: the same rule as a release store through CUDA IPC.
//
// Rings: a kernel reserves [pos, pos + size) with an atomic add on the ring's reservation counter (device memory),
// waits until the proxy has consumed what the ring held there a lap ago (`consumed`, host memory the proxy writes),
// writes header and payload, and stores the header's stamp (pos + 1) last, after a system-scope fence. The proxy
// reads records in ring order, each once its stamp is there. A record never wraps: one that would is preceded by
// SKIP records that fill the rest of the lap. The counters only grow (no per-operation reset: graph replays need
// none) and the proxy keeps no per-operation state, so everything captured in a CUDA graph replays across hosts.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/hd.h"

namespace epcomm {

constexpr uint64_t kGpuRemoteWindow = 1ull << 56;  // base[r] of a remote rank: beyond any GPU address, so a
                                                   // direct access faults instead of landing somewhere

enum GpuRemoteBuffer : uint32_t { kRemoteHtBuffer = 0, kRemoteLlBuffer = 1, kRemoteNumBuffers = 2 };
// kRemotePlaced: a DATA record whose payload the net transport stores into the far copy itself (NetBridge
// placement); only the sending proxy writes it, over a DATA header in its ring before the header goes out.
enum GpuRemoteType : uint32_t { kRemoteData = 1, kRemoteFlag = 2, kRemoteSkip = 3, kRemotePlaced = 4 };

struct alignas(16) GpuRemoteRecord {
  uint64_t stamp;  // ring position + 1, stored last
  uint32_t type;   // GpuRemoteType
  uint32_t buf;    // GpuRemoteBuffer (DATA, FLAG)
  uint64_t off;    // DATA, FLAG: byte offset in the destination buffer
  uint32_t len;    // DATA: payload bytes; SKIP: bytes of ring the record covers, itself included; FLAG: 8
  uint32_t pad;
  // DATA: payload, then padding to 32 bytes. FLAG: the 8-byte value follows.
};
static_assert(sizeof(GpuRemoteRecord) == 32, "the record header is part of the proxies' wire format");
constexpr uint32_t kRemoteRecordAlign = 32;
EP_HD uint64_t remoteRecordBytes(uint64_t payload) {
  return sizeof(GpuRemoteRecord) + ((payload + kRemoteRecordAlign - 1) & ~uint64_t{kRemoteRecordAlign - 1});
}

// One outbound ring, toward one remote rank.
struct GpuRemoteRing {
  uint8_t* data;                       // device address of the ring (pinned host memory, mapped)
  unsigned long long* reserved;        // device memory: bytes reserved so far
  const volatile uint64_t* consumed;   // device address of the proxy's count of bytes taken (host memory)
  uint64_t bytes;                      // ring size, a multiple of kRemoteRecordAlign
  // Device memory: the largest `consumed` a kernel has read (it only grows, so any value read once still bounds
  // it). Kernels test room against it and read host memory only when it is too low: a read of host memory per
  // record held every kernel of the GPU to about 0.9 M records/s in all, 1.9 GB/s with 2 KiB records and 12 of 50
  // GB/s with 14 KiB ones (bench/gpu/host_path_probe.cu, H100).
  unsigned long long* seen;
};

// The table kernels read (device memory): one ring per rank (unused for ranks of this host).
constexpr int kGpuRemoteMaxRanks = 64;  // == kGpuMaxRanks
struct GpuRemote {
  GpuRemoteRing ring[kGpuRemoteMaxRanks];
};

}  // namespace epcomm
