// GPU engine, registered memory (epCommRegister / epCommDeregister): caller memory that the peers map, so that
// a pull combine reads x where the caller wrote it instead of a copy in the communicator's buffer.
//
// Registration is collective and rare, and the caller's all-gather may be gone after creation (bootstrap.h), so
// the ranks agree through their own buffers: each writes a GpuRegEntry into its buffer with cudaMemcpy and reads
// the peers' through the IPC mappings, on a stream of its own, until every active peer's entry carries the round
// (a host-side count every rank advances alike) or the deadline passes. Two exchanges per registration: the
// handles and every rank's verdict on its arguments, then whether every rank could map every peer, so that either
// every rank holds the region or none does. An exchange that fails (a peer missing at the deadline, ranks in
// different calls) leaves the ranks' rounds apart for good, so it breaks the communicator, as a failed wait in
// an operation does.
#include <unistd.h>

#include <cstring>

#include "common/checks.h"
#include "common/log.h"
#include "common/time.h"
#include "engine/gpu/gpu_engine.h"

namespace epcomm {

static_assert(kGpuMaxRegions == EP_MAX_MEM_REGIONS, "the device table holds every region the header allows");
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(GpuRegEntry::ipc), "an IPC handle fits the entry");

static const char* regKindName(int kind) {
  return kind == kRegRegister ? "epCommRegister" : kind == kRegVerdict ? "epCommRegister (mapping)" : "epCommDeregister";
}

epResult_t GpuEngine::regExchange(const GpuRegEntry& mine, std::vector<GpuRegEntry>* all, const char* what) {
  const int R = comm_->nranks, me = comm_->rank;
  if (reg_stream_ == nullptr && cudaStreamCreateWithFlags(&reg_stream_, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    reg_stream_ = nullptr;
    EP_FAIL(epCudaError, "%s: cannot create the registration stream", what);
  }
  const uint64_t round = ++reg_round_;
  const size_t at = lay_.reg + ((round & 1) * static_cast<size_t>(R)) * sizeof(GpuRegEntry);
  auto entry = [&](int r) { return static_cast<uint8_t*>(bufs_.peer(r)) + at + static_cast<size_t>(r) * sizeof(GpuRegEntry); };
  // Every failure from here on leaves this rank's round ahead of some peer's: the communicator is broken.
  auto broken = [&](epResult_t code, int peer) {
    comm_->recordAsyncError(code, epOpRegister, round, peer, epPhaseHeader);
    return code;
  };
  GpuRegEntry e = mine;
  e.round = round;
  // The payload, then the round: a reader that sees the round sees the payload (one stream, in order).
  cudaError_t ce = cudaMemcpyAsync(entry(me) + 8, reinterpret_cast<const uint8_t*>(&e) + 8, sizeof(e) - 8,
                                   cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(entry(me), &e.round, 8, cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(reg_stream_);
  if (ce != cudaSuccess)
    return broken(EP_ERROR(epCudaError, "%s: publishing this rank's entry: %s", what, cudaGetErrorString(ce)), -1);
  all->assign(R, GpuRegEntry{});
  (*all)[me] = e;
  const Deadline deadline = Deadline::afterMs(comm_->config.timeout_ms);
  for (int r = 0; r < R; ++r) {
    if (r == me || !((active_mask_ >> r) & 1)) continue;
    GpuRegEntry& got = (*all)[r];
    for (int seen = 0; seen < 2;) {  // once the round is there, read the entry once more: a copy's reads are unordered
      ce = cudaMemcpyAsync(&got, entry(r), sizeof(got), cudaMemcpyDeviceToHost, reg_stream_);
      if (ce == cudaSuccess) ce = cudaStreamSynchronize(reg_stream_);
      if (ce != cudaSuccess)
        return broken(EP_ERROR(epCudaError, "%s: reading rank %d's entry: %s", what, r, cudaGetErrorString(ce)), r);
      if (got.round == round) {
        ++seen;
        continue;
      }
      if (got.round > round)
        return broken(EP_ERROR(epInternalError, "%s: rank %d is at registration round %llu, this rank at %llu", what,
                               r, static_cast<unsigned long long>(got.round), static_cast<unsigned long long>(round)),
                      r);
      if (comm_->aborted.load()) return broken(EP_ERROR(epAborted, "%s: the communicator was aborted", what), r);
      if (deadline.expired())
        return broken(EP_ERROR(epTimeout, "%s: rank %d did not arrive within %d ms", what, r, comm_->config.timeout_ms),
                      r);
      usleep(50);
    }
    if (got.kind != mine.kind)
      return broken(EP_ERROR(epInvalidUsage, "%s on this rank met %s on rank %d: every rank must make the same "
                             "registration calls in the same order", what, regKindName(got.kind), r), r);
  }
  return epSuccess;
}

epResult_t GpuEngine::registerMemory(void* ptr, size_t bytes, epResult_t local, int* slot) {
  const int R = comm_->nranks, me = comm_->rank;
  // Registered memory serves the pull combine, which ranks on several hosts do not use (they push): every rank
  // refuses alike, with no exchange.
  if (remote_mask_ != 0) {
    if (local != epSuccess) return local;
    EP_FAIL(epNotSupported, "epCommRegister: ranks on other hosts cannot map this memory (the GPU engine pushes "
            "across hosts)");
  }
  GpuRegEntry mine{};
  mine.kind = kRegRegister;
  mine.code = local;
  int free_slot = -1;
  for (int k = 0; k < kGpuMaxRegions && free_slot < 0; ++k)
    if (!regions_[k].used) free_slot = k;
  void* alloc = nullptr;
  if (mine.code == epSuccess && free_slot < 0)
    mine.code = EP_ERROR(epInvalidUsage, "%d regions are registered already, the most at once (EP_MAX_MEM_REGIONS)",
                         kGpuMaxRegions);
  if (mine.code == epSuccess) {
    cudaIpcMemHandle_t h{};
    size_t off = 0;
    mine.code = ipcExport(ptr, bytes, device_, &h, &off, &alloc);
    memcpy(mine.ipc, &h, sizeof(h));
    mine.offset = off;
    mine.bytes = bytes;
  }
  if (mine.code == epSuccess && (alloc == bufs_.local() || alloc == ll_bufs_.local()))  // local(): nullptr if none
    mine.code = EP_ERROR(epInvalidArgument, "ptr = %p lies in the communicator's own buffers, which the peers map "
                         "already (use epHtCombineBuffer / epLlCombineBuffer)", ptr);
  mine.slot = free_slot;
  std::vector<GpuRegEntry> all;
  EPCHECK(regExchange(mine, &all, "epCommRegister"));
  if (local != epSuccess) return local;  // the message the API layer set stays the thread's error
  if (mine.code != epSuccess) return static_cast<epResult_t>(mine.code);
  for (int r = 0; r < R; ++r) {
    if (r == me || !((active_mask_ >> r) & 1)) continue;
    if (all[r].code != epSuccess)
      EP_FAIL(static_cast<epResult_t>(all[r].code), "epCommRegister was refused on rank %d (%s); nothing is registered",
              r, epGetErrorString(static_cast<epResult_t>(all[r].code)));
  }
  for (int r = 0; r < R; ++r)  // every rank checks every other: all see a disagreement
    if (r != me && ((active_mask_ >> r) & 1) && all[r].slot != free_slot)
      EP_FAIL(epInvalidUsage, "epCommRegister: rank %d would use region slot %d, this rank slot %d: the ranks "
              "registered and deregistered in different orders", r, all[r].slot, free_slot);
  // Map every peer's part; then agree that every rank could, and only then fill the device table.
  Region& reg = regions_[free_slot];
  reg.mapped.assign(R, nullptr);
  GpuRegion table{};
  epResult_t mapped = epSuccess;
  for (int r = 0; r < R && mapped == epSuccess; ++r) {
    if (r == me) {
      table.base[r] = static_cast<uint8_t*>(ptr);
      table.bytes[r] = bytes;
      continue;
    }
    if (!((active_mask_ >> r) & 1)) continue;
    cudaIpcMemHandle_t h;
    memcpy(&h, all[r].ipc, sizeof(h));
    mapped = reg_maps_.open(h, r, &reg.mapped[r]);
    if (mapped == epSuccess) {
      table.base[r] = static_cast<uint8_t*>(reg.mapped[r]) + all[r].offset;
      table.bytes[r] = all[r].bytes;
    }
  }
  GpuRegEntry verdict{};
  verdict.kind = kRegVerdict;
  verdict.code = mapped;
  verdict.slot = free_slot;
  std::vector<GpuRegEntry> verdicts;
  epResult_t agreed = regExchange(verdict, &verdicts, "epCommRegister");
  for (int r = 0; r < R && agreed == epSuccess && mapped == epSuccess; ++r)
    if (r != me && ((active_mask_ >> r) & 1) && verdicts[r].code != epSuccess)
      agreed = EP_ERROR(static_cast<epResult_t>(verdicts[r].code),
                        "epCommRegister: rank %d could not map the peers' memory (%s); nothing is registered", r,
                        epGetErrorString(static_cast<epResult_t>(verdicts[r].code)));
  if (mapped == epSuccess && agreed == epSuccess) {
    const cudaError_t ce = cudaMemcpyAsync(&regions_dev_[free_slot], &table, sizeof(table), cudaMemcpyHostToDevice,
                                           reg_stream_);
    if (ce != cudaSuccess || cudaStreamSynchronize(reg_stream_) != cudaSuccess) {
      // The peers hold the region, this rank cannot: the ranks disagree from here on.
      agreed = EP_ERROR(epCudaError, "epCommRegister: writing the region table: %s", cudaGetErrorString(ce));
      comm_->recordAsyncError(agreed, epOpRegister, reg_round_, -1, epPhaseHeader);
    }
  }
  if (mapped != epSuccess || agreed != epSuccess) {
    for (void* m : reg.mapped)
      if (m != nullptr) reg_maps_.close(m);
    reg.mapped.clear();
    return mapped != epSuccess ? mapped : agreed;
  }
  reg.used = true;
  reg.ptr = static_cast<const uint8_t*>(ptr);
  reg.bytes = bytes;
  reg.gen = ++reg_gen_;
  // The handle's id carries the registration's generation: a stale handle never names a later region in its slot.
  *slot = static_cast<int>((reg.gen % (1u << 20)) * kGpuMaxRegions + free_slot);
  EP_INFO(kSubsysGpu, "registered %zu bytes at %p as region %d", bytes, ptr, free_slot);
  return epSuccess;
}

epResult_t GpuEngine::deregisterMemory(int id) {
  const int slot = id >= 0 ? id % kGpuMaxRegions : -1;
  EP_REQUIRE(slot >= 0 && regions_[slot].used &&
                 regions_[slot].gen % (1u << 20) == static_cast<uint64_t>(id / kGpuMaxRegions),
             epInvalidArgument, "the region (id %d) is not registered on this communicator", id);
  // Every rank's operations that may read the region (its own, and its combines that wait for the owners) end
  // before any rank unmaps: each finishes its device work, then the exchange is the barrier.
  cudaError_t ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) EP_FAIL(epCudaError, "epCommDeregister: cudaDeviceSynchronize: %s", cudaGetErrorString(ce));
  GpuRegEntry mine{};
  mine.kind = kRegDeregister;
  mine.slot = slot;
  std::vector<GpuRegEntry> all;
  EPCHECK(regExchange(mine, &all, "epCommDeregister"));
  // Checked before anything is released, by every rank against every other: all refuse alike, all keep it.
  for (int r = 0; r < comm_->nranks; ++r)
    EP_REQUIRE(r == comm_->rank || !((active_mask_ >> r) & 1) || all[r].slot == slot, epInvalidUsage,
               "epCommDeregister: rank %d deregistered region slot %d, this rank slot %d: the ranks deregister in "
               "different orders", r, all[r].slot, slot);
  Region& reg = regions_[slot];
  GpuRegion zero{};
  ce = cudaMemcpyAsync(&regions_dev_[slot], &zero, sizeof(zero), cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(reg_stream_);
  for (void* m : reg.mapped)
    if (m != nullptr) reg_maps_.close(m);
  reg = Region{};
  if (ce != cudaSuccess) EP_FAIL(epCudaError, "epCommDeregister: clearing the region table: %s", cudaGetErrorString(ce));
  return epSuccess;
}

int GpuEngine::regionOf(const void* x, size_t bytes, uint64_t* off) const {
  const uint8_t* p = static_cast<const uint8_t*>(x);
  for (int k = 0; k < kGpuMaxRegions; ++k) {
    const Region& r = regions_[k];
    if (r.used && p >= r.ptr && bytes <= r.bytes && static_cast<size_t>(p - r.ptr) <= r.bytes - bytes) {
      *off = static_cast<uint64_t>(p - r.ptr);
      return k;
    }
  }
  return -1;
}

}  // namespace epcomm
