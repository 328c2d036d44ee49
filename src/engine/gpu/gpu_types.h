// Device-visible state of the GPU engine, shared by the kernels and the host code that sets them up.
//
// Each rank owns one communication buffer in GPU memory, allocated once at communicator creation and mapped
// by every peer of the host (CUDA IPC). Its size depends on ranks, channels and queue depth, not on tokens.
// Layout (offsets in GpuBufferLayout):
//   [GpuCtrl]                      the epoch
//   [mailbox: 2 x R entries]       notify: entry [epoch & 1][src] = src's counts, tagged with the epoch
//   [queue counters: 4 x R x C]    cumulative rows per (src, channel): dispatch tail (written by src), dispatch
//                                  head (written here, read by src), combine tail, combine head
//   [dispatch queues: R x C x Q]   slots of one row: x, scales, local expert ids, weights
//   [combine queues: R x C x Q]    slots of one expert-output row
//   [combine staging: R x max_tokens] where the receiving blocks move combine rows out of the queues, so that
//                                  each source drains independently; the reduction then reads them here
//
// An operation: a one-block kernel bumps ctrl.epoch first (so every block of the following kernels reads a
// value nobody writes during their launch); notify exchanges counts through the mailboxes; then one kernel
// whose even blocks send and odd blocks receive: channel c of a rank carries its tokens
// [T*c/C, T*(c+1)/C), pipelined through a bounded per-peer queue of Q rows. The counters only grow, so no
// per-operation reset exists (graph replays need none) and a sender waits for room by reading the peer's head.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/hd.h"

namespace epcomm {

constexpr int kGpuMaxRanks = 64;
constexpr int kGpuMaxExperts = 4096;
constexpr int kGpuMaxTopk = 32;
constexpr int kGpuMaxChannels = 32;

struct GpuCtrl {
  alignas(128) uint64_t epoch;   // written only by one-block begin/notify kernels
};

enum GpuQueueCounter { kDispTail = 0, kDispHead, kCombTail, kCombHead, kNumQueueCounters };

struct GpuBufferLayout {
  size_t mailbox, mailbox_entry;  // offset of mailbox[0][0], bytes per entry
  size_t qctrl, qctrl_stride;     // counters [kind][src][channel], one array of qctrl_stride bytes per kind
  size_t disp_q, disp_slot;       // dispatch queues and bytes per slot
  size_t comb_q;                  // combine queues (slots of x_stride bytes)
  size_t comb_stage;              // combine rows moved out of the queues: [src][max_tokens][x_stride]
  size_t x_stride, scale_stride;  // bytes of a row's x part and scale part in a slot
  size_t total;
  int nranks, channels, queue_rows, max_tokens;
};

struct MailboxHead {
  uint64_t tag;  // epoch, written last
  int32_t status;
  int32_t pad;
  // int32_t counts_to[R]; int32_t per_expert[L]; int32_t per_channel[C] follow
};

EP_HD GpuBufferLayout gpuBufferLayout(int nranks, int channels, int queue_rows, int max_hidden, int max_tokens) {
  auto up = [](size_t v) { return (v + 255) & ~size_t{255}; };
  GpuBufferLayout l{};
  l.nranks = nranks;
  l.channels = channels;
  l.queue_rows = queue_rows;
  l.max_tokens = max_tokens;
  l.x_stride = (static_cast<size_t>(max_hidden) * 2 + 15) & ~size_t{15};
  l.scale_stride = (static_cast<size_t>(max_hidden) / 128 * 4 + 15) & ~size_t{15};
  size_t off = up(sizeof(GpuCtrl));
  l.mailbox = off;
  l.mailbox_entry = (sizeof(MailboxHead) + 4 * (static_cast<size_t>(nranks) + kGpuMaxExperts / nranks + kGpuMaxChannels) +
                     15) & ~size_t{15};
  off = up(off + 2 * nranks * l.mailbox_entry);
  l.qctrl = off;
  l.qctrl_stride = up(static_cast<size_t>(nranks) * channels * 8);
  off = up(off + kNumQueueCounters * l.qctrl_stride);
  const size_t slots = static_cast<size_t>(nranks) * channels * queue_rows;
  l.disp_slot = l.x_stride + l.scale_stride + kGpuMaxTopk * 12;
  l.disp_q = off;
  off = up(off + slots * l.disp_slot);
  l.comb_q = off;
  off = up(off + slots * l.x_stride);
  l.comb_stage = off;
  off = up(off + static_cast<size_t>(nranks) * max_tokens * l.x_stride);
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
  uint8_t* in_rank;         // [max_tokens, R]
  int32_t* pos;             // [max_tokens, R] position of token t among the tokens this rank sends to r
  int32_t* prefix;          // [R + 1] first receive row of each source at this rank
  int32_t* recv_chan;       // [R, C] rows each source sends this rank on each channel
  int32_t* send_chan_base;  // [R, C] tokens this rank sends to r before channel c's first token
  int32_t* per_expert;      // [L] received rows naming each local expert
  int32_t* num_recv;        // [1]
};

// Everything an HT kernel needs, passed by value.
struct HtParams {
  int rank, nranks, op;
  GpuCtrl* ctrl;
  uint8_t* base[kGpuMaxRanks];  // every rank's buffer, mapped here
  GpuBufferLayout lay;
  GpuErrorRecord* err;
  uint64_t timeout_ns;
  int C, Q, G;                       // channels, queue rows, warps per peer in a block
  // operation
  int T, H, K, E, L, dtype, worst;  // worst = num_worst_tokens (0 = exact)
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
