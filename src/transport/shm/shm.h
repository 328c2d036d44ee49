// shm transport: host memory shared by the processes of one host.
//
// Each rank owns one region (POSIX shared memory, unlinked as soon as every peer has mapped it, so nothing
// is left behind if a process dies). A region holds a small header and, for every source rank and channel,
// one single-producer/single-consumer byte ring: the source pushes into the ring that lives in the
// receiver's region; the receiver pulls from its own memory.
//
// Region layout:
//   [RegionHeader, 4 KiB]
//   [for src in 0..R-1, ch in 0..C-1: RingCtl (128 B) | data (ring_bytes, rounded up to 64 B)]
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "epcomm/epcomm.h"

namespace epcomm {

struct alignas(64) RegionHeader {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t nranks;
  int32_t nchannels;
  int64_t pid;
  uint64_t ring_bytes;
  std::atomic<uint32_t> ready;  // set once the owner finished initialising the region
  // Set by the owner's engine when it destroys its communicator cleanly, after its last sends are in the peers'
  // rings: its process may exit from then on without that counting as a death (what the bridge's BYE frame says
  // across hosts).
  std::atomic<uint32_t> bye;
  // Elastic ranks (host engine): what the owner published for its current resynchronization round, read by the
  // other survivors without the rings (whose contents a failure may have left out of step).
  alignas(64) std::atomic<uint64_t> rs_word;  // round * 8 + phase * 2 + failed
  std::atomic<uint64_t> rs_hash;              // hash of the mask the owner proposes
  std::atomic<uint64_t> rs_epoch;             // operations the owner has sent
  std::atomic<int32_t> rs_status;             // the owner's epResult_t for the call
  std::atomic<uint64_t> rs_ok;                // the last round the owner completed successfully (low 32 bits)
  // Recovery (epCommRecover, elastic.cc): what the owner knows of its peers, for the other survivors to agree on
  // whom to mask. Bits are only ever set (both sets grow over the communicator's life), so a reader may see any
  // mix of older and newer words and still reads a subset of the truth.
  static constexpr int kRankWords = EP_MAX_RANKS / 64;
  alignas(64) std::atomic<uint64_t> rc_gen;    // bumped (release) after bits below were set
  std::atomic<uint64_t> rc_accused[kRankWords];  // ranks the owner found dead, disconnected, gone or silent
  std::atomic<uint64_t> rc_masked[kRankWords];   // ranks a mask the owner committed masks
};
static_assert(sizeof(RegionHeader) <= 4096, "region header fits its page");

// Counters are monotonic byte counts over the life of the communicator, so no per-operation reset is needed.
struct alignas(64) RingCtl {
  std::atomic<uint64_t> tail;  // bytes written by the producer
  char pad0[56];
  std::atomic<uint64_t> head;  // bytes consumed by the consumer
  // The consumer's "done reading the producer's memory up to operation epoch N" (rows it pulled from the
  // producer instead of receiving them through this ring); monotonic like the counters.
  std::atomic<uint64_t> read_done;
  char pad1[48];
};
static_assert(sizeof(RingCtl) == 128, "ring control is two cache lines");

class ShmRegion {
 public:
  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  static size_t bytesFor(int nranks, int nchannels, size_t ring_bytes);
  // Creates (O_EXCL) and maps the region named name, initialises header and rings.
  epResult_t create(const std::string& name, int rank, int nranks, int nchannels, size_t ring_bytes);
  // The same layout in anonymous memory of this process alone, not in /dev/shm (which containers cap, 64 MiB by
  // default): for rings no other process maps (the GPU proxy's inboxes, a ring per rank). Pages are backed only as
  // they are written.
  epResult_t createPrivate(int rank, int nranks, int nchannels, size_t ring_bytes);
  // Maps a peer's region and checks its header.
  epResult_t open(const std::string& name, int expect_rank, int nranks, int nchannels, size_t ring_bytes);
  epResult_t unlink();  // removes the name; mappings stay valid
  void unmap();

  RegionHeader* header() const { return static_cast<RegionHeader*>(base_); }
  RingCtl* ringCtl(int src, int ch) const;
  uint8_t* ringData(int src, int ch) const;
  size_t ringBytes() const { return ring_bytes_; }
  void* base() const { return base_; }             // the whole mapping (the GPU proxy registers it with CUDA)
  size_t mappedBytes() const { return bytes_; }

 private:
  void initHeader(int rank, int nranks, int nchannels, size_t ring_bytes);
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t ring_bytes_ = 0;
  int nchannels_ = 0;
  std::string name_;
  bool owner_ = false;
  bool linked_ = false;
};

// One direction of one ring, as seen by its producer or its consumer. Plain memcpy in and out; the
// release/acquire pair on tail/head orders the data.
class RingEnd {
 public:
  RingEnd() = default;
  RingEnd(RingCtl* ctl, uint8_t* data, size_t bytes) : ctl_(ctl), data_(data), bytes_(bytes) {}
  bool valid() const { return ctl_ != nullptr; }

  // Producer: copies up to len bytes; returns the number copied (0 when full).
  size_t push(const void* src, size_t len);
  // Producer: room for a contiguous write of up to len bytes at the current tail; commit() publishes it.
  size_t freeBytes() const;
  // Consumer: bytes ready to read.
  size_t available() const;
  // Consumer: copies up to len bytes out; returns the number copied.
  size_t pull(void* dst, size_t len);
  // Consumer: pointer to len readable bytes if they are ready and contiguous in the ring, else nullptr
  // (then use pull/copyOut). release() consumes them.
  const uint8_t* peek(size_t len) const;
  // Consumer: copies len ready bytes at offset off from the read position without consuming them (with `copy`:
  // memcpy, or streamCopy for a destination nobody reads soon).
  void copyOut(void* dst, size_t off, size_t len, void* (*copy)(void*, const void*, size_t) = memcpy) const;
  void release(size_t len);
  // Consumer: drops everything the producer has published so far (the producer must have stopped pushing).
  void discardAll() { ctl_->head.store(ctl_->tail.load(std::memory_order_acquire), std::memory_order_release); }
  // Consumer: it has finished reading the producer's memory for operation `epoch`.
  void setReadDone(uint64_t epoch) { ctl_->read_done.store(epoch, std::memory_order_release); }
  // Producer: the last operation epoch for which the consumer finished reading this producer's memory.
  uint64_t readDone() const { return ctl_->read_done.load(std::memory_order_acquire); }

 private:
  RingCtl* ctl_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

std::string shmRegionName(const uint8_t* secret, int rank);

}  // namespace epcomm
