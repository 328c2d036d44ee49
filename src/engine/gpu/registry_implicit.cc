// GPU engine, implicit registration: a plain pull combine's x in caller memory (a framework's expert output) is
// shared with the peers without a collective call, so that after a few combines the owners read it in place as
// if it were registered with epCommRegister, and the copy of x into the communicator's buffer goes away.
//
// One-sided and lazy (common/gpu_layout.h, GpuAutoTable): this rank publishes the allocation that holds x in a
// slot of its buffer; each owner maps it at its next combine, fills its table row and acknowledges; this rank
// uses the slot from the combine after it saw every active owner's acknowledgement. Both sides learn what the
// other did from the host-mapped mirror the begin kernels refresh, so no call waits for a peer, and any failure
// (memory CUDA IPC cannot export, a peer that cannot map it) only leaves that combine copying x.
// Captured combines never take this path (their choice would outlive the slot): they copy, unless x is in memory
// registered with epCommRegister.
#include <cstddef>
#include <cstring>

#include "common/checks.h"
#include "common/log.h"
#include "common/param.h"
#include "engine/gpu/gpu_engine.h"

namespace epcomm {

// 1 = a pull combine's x in caller memory is shared with the peers on its own (this file); 0 = it is copied into
// the communicator's buffer on every call unless it lies in memory registered with epCommRegister.
EP_PARAM(GpuHtAutoRegister, "GPU_HT_AUTO_REGISTER", 1);

namespace {

// This thread may make the host-side copies below while another thread captures a graph in global mode (their
// streams are unrelated): relaxed for the scope, as the mode that thread captures in asks of other threads.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

uint64_t loadMirror(const uint64_t& w) { return *static_cast<const volatile uint64_t*>(&w); }

}  // namespace

epResult_t GpuEngine::initImplicitRegistry() {
  auto_reg_ = ht_pull_ && remote_mask_ == 0 && comm_->nranks > 1 && epParamGpuHtAutoRegister() != 0;
  if (!auto_reg_) return epSuccess;
  cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&auto_mirror_), sizeof(GpuAutoMirror), cudaHostAllocMapped);
  if (e == cudaSuccess) {
    memset(auto_mirror_, 0, sizeof(GpuAutoMirror));
    e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&auto_mirror_dev_), auto_mirror_, 0);
  }
  for (int j = 0; j < kGpuAutoRegions && e == cudaSuccess; ++j)
    e = cudaEventCreateWithFlags(&auto_slots_[j].done, cudaEventDisableTiming);
  if (e == cudaSuccess && reg_stream_ == nullptr) e = cudaStreamCreateWithFlags(&reg_stream_, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    // Not worth failing the communicator for: its combines copy x, as with EPCOMM_GPU_HT_AUTO_REGISTER=0.
    cudaGetLastError();
    EP_INFO(kSubsysGpu, "implicit registration off: setting it up failed (%s)", cudaGetErrorString(e));
    auto_reg_ = false;
    return epSuccess;
  }
  auto_imports_.assign(static_cast<size_t>(comm_->nranks) * kGpuAutoRegions, AutoImport{});
  auto_latest_.assign(comm_->nranks, 0);
  auto_table_.resize(2);
  return epSuccess;
}

void GpuEngine::implicitImport() {
  const int R = comm_->nranks, me = comm_->rank;
  RelaxedCapture relaxed;
  for (int r = 0; r < R; ++r) {
    if (r == me || !((active_mask_ >> r) & 1)) continue;
    const uint64_t seen = loadMirror(auto_mirror_->latest[r]);
    if (seen == auto_latest_[r]) continue;
    // The table twice: a copy's reads are unordered, so one that raced the source's rewrite shows as a mismatch
    // (the next call tries again).
    auto& a = auto_table_[0];
    auto& b = auto_table_[1];
    const uint8_t* at = static_cast<const uint8_t*>(bufs_.peer(r)) + lay_.auto_exp;
    cudaError_t e = cudaMemcpyAsync(&a, at, sizeof(a), cudaMemcpyDeviceToHost, reg_stream_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(&b, at, sizeof(b), cudaMemcpyDeviceToHost, reg_stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(reg_stream_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (memcmp(&a, &b, sizeof(a)) != 0 || a.latest < seen) continue;
    auto_latest_[r] = a.latest;
    for (int j = 0; j < kGpuAutoRegions; ++j) {
      const GpuAutoExport& x = a.slot[j];
      AutoImport& im = auto_imports_[static_cast<size_t>(r) * kGpuAutoRegions + j];
      if (x.gen == im.gen) continue;
      // The source gives a slot another allocation only after every combine that read the last one completed
      // (implicitSlot): nothing reads the old mapping any more.
      if (im.mapped != nullptr) reg_maps_.close(im.mapped);
      im.mapped = nullptr;
      void* m = nullptr;
      bool ok = false;
      if (x.bytes > 0) {
        cudaIpcMemHandle_t h;
        memcpy(&h, x.ipc, sizeof(h));
        ok = reg_maps_.open(h, r, &m, true) == epSuccess;  // a refusal is no error of the caller's call
      }
      GpuRegion* row = &regions_dev_[kGpuMaxRegions + j];
      uint8_t* base = ok ? static_cast<uint8_t*>(m) : nullptr;
      const uint64_t bytes = ok ? x.bytes : 0;
      e = cudaMemcpyAsync(&row->base[r], &base, sizeof(base), cudaMemcpyHostToDevice, reg_stream_);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(&row->bytes[r], &bytes, sizeof(bytes), cudaMemcpyHostToDevice, reg_stream_);
      if (e == cudaSuccess) e = cudaStreamSynchronize(reg_stream_);
      if (e != cudaSuccess) {
        cudaGetLastError();
        ok = false;
      }
      if (m != nullptr && !ok) reg_maps_.close(m);
      im.mapped = ok ? m : nullptr;
      im.gen = x.gen;
      // Acknowledged only once the table row is in place: the source reads from its next combine on.
      const uint64_t ack = x.gen * 2 + (ok ? 0 : 1);
      uint8_t* dst = static_cast<uint8_t*>(bufs_.local()) + lay_.auto_ack +
                     (static_cast<size_t>(r) * kGpuAutoRegions + j) * sizeof(uint64_t);
      e = cudaMemcpyAsync(dst, &ack, sizeof(ack), cudaMemcpyHostToDevice, reg_stream_);
      if (e == cudaSuccess) e = cudaStreamSynchronize(reg_stream_);
      if (e != cudaSuccess) cudaGetLastError();
      if (!ok) EP_INFO(kSubsysGpu, "implicit registration: rank %d's slot %d could not be mapped here", r, j);
    }
  }
}

int GpuEngine::implicitSlot(const void* x, size_t bytes, uint64_t* off) {
  ++auto_calls_;
  if (bytes == 0) return -1;
  RelaxedCapture relaxed;  // the lookups and cudaEventQuery below included
  cudaIpcMemHandle_t h;
  void* alloc = nullptr;
  size_t x_off = 0, alloc_bytes = 0;
  // Memory CUDA IPC cannot share, or x running past its allocation (the owners would read past it too): copied.
  if (ipcExport(x, bytes, device_, &h, &x_off, &alloc, &alloc_bytes, true) != epSuccess) return -1;
  if (alloc == bufs_.local() || alloc == ll_bufs_.local()) return -1;  // the peers map those already
  // Only allocations of 2 MiB or more that start a 2 MiB page, as every PyTorch caching-allocator segment and
  // large cudaMalloc does: CUDA packs small ones several to a page (the first of them starts it), CUDA IPC maps
  // whole pages, and a peer that mapped one of them could map no other (cudaErrorAlreadyMapped), epCommRegister's
  // included.
  constexpr size_t kPage = size_t{2} << 20;
  if (reinterpret_cast<uintptr_t>(alloc) % kPage != 0 || alloc_bytes < kPage) return -1;
  const uint8_t* base = static_cast<const uint8_t*>(alloc);
  const uint64_t owners = active_mask_ & ~(1ull << comm_->rank);
  for (int j = 0; j < kGpuAutoRegions; ++j) {
    AutoSlot& s = auto_slots_[j];
    if (s.state == AutoSlot::kFree || s.base != base || memcmp(&s.handle, &h, sizeof(h)) != 0) continue;
    s.last_use = auto_calls_;
    if (s.state == AutoSlot::kRefused) return -1;
    for (int o = 0; o < comm_->nranks && (owners & ~s.acked) != 0; ++o) {
      if (!((owners >> o) & 1) || ((s.acked >> o) & 1)) continue;
      const uint64_t ack = loadMirror(auto_mirror_->ack[o][j]);
      if (ack == s.gen * 2) s.acked |= 1ull << o;
      if (ack == s.gen * 2 + 1) {
        EP_INFO(kSubsysGpu, "implicit registration: rank %d cannot map allocation %p; combines from it copy x", o,
                alloc);
        s.state = AutoSlot::kRefused;
        return -1;
      }
    }
    if ((owners & ~s.acked) != 0) {
      s.state = AutoSlot::kPending;  // a rank let back in (epCommSetActiveRanks) may not have mapped it yet
      return -1;
    }
    if (s.state == AutoSlot::kPending)
      EP_INFO(kSubsysGpu, "implicit registration: allocation %p (%zu bytes) is slot %d; the owners read x in place",
              alloc, s.bytes, j);
    s.state = AutoSlot::kReady;
    *off = x_off;
    return kGpuMaxRegions + j;
  }
  // A new allocation: a free slot, else the least recently used one, if no combine in flight reads it and it sat
  // unused for kIdleCalls; and at most one such replacement per kGpuAutoRegions calls. A caller that cycles through
  // more allocations than the slots then keeps what it has and copies the rest, instead of trading slots (a
  // publication and every owner's mapping) on every call.
  int pick = -1;
  for (int j = 0; j < kGpuAutoRegions && pick < 0; ++j)
    if (auto_slots_[j].state == AutoSlot::kFree) pick = j;
  constexpr uint64_t kIdleCalls = 2 * kGpuAutoRegions;
  if (pick < 0 && auto_calls_ >= auto_replaced_ + kGpuAutoRegions && auto_calls_ > kIdleCalls) {
    uint64_t oldest = auto_calls_ - kIdleCalls;  // last used before this
    for (int j = 0; j < kGpuAutoRegions; ++j) {
      const AutoSlot& o = auto_slots_[j];
      if (o.pinned || o.last_use >= oldest) continue;
      const cudaError_t q = cudaEventQuery(o.done);
      if (q != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      oldest = o.last_use;
      pick = j;
    }
    if (pick >= 0) auto_replaced_ = auto_calls_;
  }
  if (pick < 0) return -1;
  AutoSlot& s = auto_slots_[pick];
  GpuAutoExport e{};
  e.gen = ++auto_gen_;
  e.bytes = alloc_bytes;
  memcpy(e.ipc, &h, sizeof(h));
  // The payload, its gen, then the table's latest: an owner that sees latest reads this slot (one stream, in
  // order; it reads the table twice).
  uint8_t* table = static_cast<uint8_t*>(bufs_.local()) + lay_.auto_exp;
  uint8_t* at = table + offsetof(GpuAutoTable, slot) + pick * sizeof(GpuAutoExport);
  cudaError_t ce = cudaMemcpyAsync(at + 8, reinterpret_cast<const uint8_t*>(&e) + 8, sizeof(e) - 8,
                                   cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(at, &e.gen, 8, cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess)
    ce = cudaMemcpyAsync(table + offsetof(GpuAutoTable, latest), &e.gen, 8, cudaMemcpyHostToDevice, reg_stream_);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(reg_stream_);
  if (ce != cudaSuccess) {
    // The owners may see part of the new entry: this rank never uses nor replaces the slot again.
    cudaGetLastError();
    s.state = AutoSlot::kRefused;
    s.pinned = true;
    return -1;
  }
  cudaEvent_t done = s.done;
  s = AutoSlot{};
  s.done = done;
  s.state = AutoSlot::kPending;
  s.gen = e.gen;
  s.handle = h;
  s.base = base;
  s.bytes = alloc_bytes;
  s.last_use = auto_calls_;
  return -1;  // copied this time; the owners map it at their next combines
}

bool GpuEngine::implicitWaiting() const {
  for (const AutoSlot& s : auto_slots_)
    if (s.state == AutoSlot::kPending) return true;
  return false;
}

void GpuEngine::implicitUsed(int slot, cudaStream_t s, bool launched) {
  const int j = slot - kGpuMaxRegions;
  if (j < 0 || j >= kGpuAutoRegions) return;
  RelaxedCapture relaxed;
  if (!launched || cudaEventRecord(auto_slots_[j].done, s) != cudaSuccess) {
    // Without the event the slot must never be replaced: nothing would tell when the owners stopped reading it.
    cudaGetLastError();
    auto_slots_[j].pinned = true;
  }
}

}  // namespace epcomm
