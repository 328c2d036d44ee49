// Device-visible state of the GPU engine, shared by the kernels and the host code that sets them up.
//
// Each rank owns one communication buffer in GPU memory, allocated once at communicator creation and mapped
// by every peer of the host (CUDA IPC). Layout (offsets in GpuBufferLayout):
//   [GpuCtrl]                       epochs, last-block counters, and the flags/acks peers write
//   [mailbox: 2 x R entries]        notify: entry [epoch & 1][src] = src's counts, tagged with the epoch
//   [dispatch staging]              rows peers send this rank, at their final receive position:
//       x [R*max_tokens][x_stride], scales [..][scale_stride], topk_idx [..][kGpuMaxTopk], weights [..]
//   [combine staging]               expert outputs returned to this rank: [src rank][max_tokens][x_stride]
//
// Protocol of one operation with epoch e (G1/G2 of the design): a one-block kernel bumps ctrl.epoch first, so
// every block of the following kernels reads a value nobody writes during their launch. A sender writes rows
// into a peer's staging only after that peer acknowledged (ack >= epoch of the previous op that used it) that
// it finished reading them; the last block of a sending kernel (found with a counter it resets) raises the
// peers' flags to e; the last block of a receiving kernel acknowledges to every sender.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/hd.h"

namespace epcomm {

constexpr int kGpuMaxRanks = 64;
constexpr int kGpuMaxExperts = 4096;
constexpr int kGpuMaxTopk = 32;

enum GpuCounter { kDoneDispatchSend = 0, kDoneDispatchRecv, kDoneCombineSend, kDoneCombineReduce, kNumDone };

// Lines this rank writes (epochs, counters) are kept apart from the lines peers write (flags, acks).
struct GpuCtrl {
  alignas(128) uint64_t epoch;             // written only by one-block begin/notify kernels
  uint64_t last_dispatch_epoch;            // last op that wrote dispatch staging
  uint64_t last_combine_epoch;             // last op that wrote combine staging
  alignas(128) uint32_t done[kNumDone];    // last-block counters, reset by the last block
  alignas(128) uint64_t data_flag[kGpuMaxRanks];  // src finished writing its dispatch rows of epoch v here
  uint64_t combine_flag[kGpuMaxRanks];     // src finished writing its combine rows of epoch v here
  uint64_t dispatch_ack[kGpuMaxRanks];     // peer finished reading the dispatch rows this rank wrote (epoch)
  uint64_t combine_ack[kGpuMaxRanks];      // peer finished reading the combine rows this rank wrote (epoch)
};

struct GpuBufferLayout {
  size_t mailbox, mailbox_entry;           // offset of mailbox[0][0], bytes per entry
  size_t disp_x, disp_scales, disp_idx, disp_w;
  size_t comb_x;
  size_t x_stride, scale_stride;           // bytes per staging row
  size_t total;
  int max_tokens;                          // per rank and call
  int staging_rows;                        // R * max_tokens
};

// Mailbox entry written by src into every peer's mailbox: its counts to every rank and, for that receiver,
// per local expert.
struct MailboxHead {
  uint64_t tag;     // epoch, written last
  int32_t status;
  int32_t pad;
  // int32_t counts_to[R]; int32_t per_expert[L] follow
};

EP_HD GpuBufferLayout gpuBufferLayout(int nranks, int max_tokens, int max_hidden) {
  auto up = [](size_t v) { return (v + 255) & ~size_t{255}; };
  GpuBufferLayout l{};
  l.max_tokens = max_tokens;
  l.staging_rows = nranks * max_tokens;
  l.x_stride = up(static_cast<size_t>(max_hidden) * 2);
  l.scale_stride = (static_cast<size_t>(max_hidden) / 128 * 4 + 15) & ~size_t{15};
  if (l.scale_stride == 0) l.scale_stride = 16;
  size_t off = up(sizeof(GpuCtrl));
  l.mailbox = off;
  l.mailbox_entry = (sizeof(MailboxHead) + 4 * static_cast<size_t>(nranks) + 4 * static_cast<size_t>(kGpuMaxExperts) /
                     nranks + 15) & ~size_t{15};
  off = up(off + 2 * nranks * l.mailbox_entry);
  const size_t rows = l.staging_rows;
  l.disp_x = off;
  off = up(off + rows * l.x_stride);
  l.disp_scales = off;
  off = up(off + rows * l.scale_stride);
  l.disp_idx = off;
  off = up(off + rows * kGpuMaxTopk * 8);
  l.disp_w = off;
  off = up(off + rows * kGpuMaxTopk * 4);
  l.comb_x = off;
  off = up(off + rows * l.x_stride);
  l.total = off;
  return l;
}

// What a failed device wait or a device-side argument violation recorded; host-mapped memory.
struct GpuErrorRecord {
  int32_t code;            // epResult_t of the first failure (0 = none)
  int32_t op;
  uint64_t epoch;
  int32_t rank, peer, phase;
  int32_t violation_code;  // first device-side argument violation (epExpertOutOfRange, epCapacityExceeded)
  uint64_t violations;     // how many
  int32_t abort;           // set by the host: waits give up
  int32_t pad;
};

// The handle's layout on the device.
struct GpuHandleDev {
  uint8_t* in_rank;   // [max_tokens, R]
  int32_t* pos;       // [max_tokens, R] position of token t among the tokens this rank sends to r
  int32_t* matrix;    // [R, R] tokens s sends to r
  int32_t* prefix;    // [R + 1] first receive row of each source at this rank
  int32_t* send_base; // [R] first row of this rank's tokens in r's staging
  int32_t* per_expert;// [L] received rows naming each local expert
  int32_t* num_recv;  // [1]
};

// Everything an HT kernel needs, passed by value.
struct HtParams {
  int rank, nranks, op;
  GpuCtrl* ctrl;
  uint8_t* base[kGpuMaxRanks];  // every rank's buffer, mapped here
  GpuBufferLayout lay;
  GpuErrorRecord* err;
  uint64_t timeout_ns;
  // operation
  int T, H, K, E, L, dtype, worst;  // worst = num_worst_tokens (0 = exact)
  int begins_dispatch;               // notify kernel also starts a dispatch (worst-token, not cached)
  size_t xrow, srow;                 // bytes of a row of x and of its scales
  const void* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_weights;
  void* recv_x;
  float* recv_x_scales;
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_per_expert_out;
  int* num_recv_out;
  void* combined_x;
  GpuHandleDev h;
};

}  // namespace epcomm
