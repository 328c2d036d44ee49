// Device-visible state of the GPU engine, shared by the kernels (kernels/) and the host code that sets them up
// (src/engine/gpu/); it lives below both (DESIGN.md: dependencies point down).
//
// Each rank owns one communication buffer in GPU memory, allocated once at communicator creation and mapped
// by every peer of the host (CUDA IPC). Its size depends on ranks, channels and queue depth, not on tokens.
// Layout (offsets in GpuBufferLayout):
//   [GpuCtrl]                      the epoch; where this rank's pull-combine rows are (GpuCombineSource)
//   [elastic sync: 2 x 4 x R]      [kind][round % 4][src] GpuSyncEntry: kind 0 for epCommSetActiveRanks, 1 for the barrier
//                                  among survivors (separate rounds: a barrier one rank fails fast on must not
//                                  shift the rounds of the next epCommSetActiveRanks)
//   [registration: 2 x R]          GpuRegEntry [round & 1][src]: the host-side exchange of epCommRegister
//   [implicit registration]        GpuAutoTable: the allocations this rank offers its peers without a collective
//                                  call; then its acknowledgements [src][slot] of the peers' (uint64)
//   [mailbox: 2 x R entries]       notify: entry [epoch & 1][src] = src's counts, tagged with the epoch
//   [queue counters: K x R x C]    per (src, channel), K = kNumQueueCounters: cumulative rows of the queues —
//                                  dispatch tail (written by src), dispatch head (written here, read by src),
//                                  combine tail, combine head, ... — and the epochs of the pull combine and pull
//                                  dispatch (GpuQueueCounter)
//   [dispatch queues: R x C x Q]   slots of one row: x, scales, local expert ids, weights (hierarchical dispatch
//                                  across hosts: then where the token goes at each rank of the receiver's host)
//   [combine queues: R x C x Q]    slots of one expert-output row
//   [combine staging: R x max_tokens] push combine: where the receiving blocks move combine rows out of the
//                                  queues, so that each source drains independently; the reduction reads them
//                                  here. Pull combine (the default): this rank's combine input, row i of x at
//                                  byte i * xrow (its receive order; rows of its own tokens are not copied, it
//                                  reads them in x), which the token owners read straight from here; the caller
//                                  may write x here itself (zero-copy, epHtCombineBuffer)
//
//   [dispatch staging: max_tokens] pull dispatch (EPCOMM_GPU_HT_DISPATCH_PULL=1, the default): this rank's
//                                  tokens, row t at t in the dispatch slot format (x, scales, expert ids, weights)
//   [dispatch lists: R x max_tokens] pull dispatch only: list[r][i] = the token this rank sends to r as its i-th
//
// Pull dispatch, per (source s, channel c): s copies its channel-c tokens once into its staging, fills the lists,
// and publishes ready[s][c] = epoch in every active receiver's counters; receiver r reads s's rows for it
// (list[r][...]) straight from s's staging into recv_x and acknowledges (ack[r][c] in s's counters). As for the
// combine, s overwrites its staging only once every receiver acknowledged what s last published.
//
// Pull combine, per (owner s, channel c): this rank copies the rows of s's channel-c tokens into its staging
// and publishes ready[this rank][c] = epoch in s's counters; s waits for ready from every active rank, reduces
// each token from the peers' staging rows in ascending rank order, then acknowledges (ack[s][c] = epoch in the
// copier's counters). A copier overwrites its rows for s only once s acknowledged the combine it last published
// (sent[s][c], its own record), so the next combine never changes rows a slow owner still reads. With x in memory
// the copier registered (epCommRegister, or implicitly: GpuAutoTable) it copies none of x's rows: its begin kernel
// publishes where x is (GpuCtrl::comb_src, after the waits above), the owners read that after its ready counter and
// take the rows from there, and an end kernel after the combine waits for every owner's acknowledgement, so that x
// is free again when the combine completes.
// In both pull paths the two blocks of channel c each do half of the channel (rows of every peer, tokens or
// receive rows of this rank), first staging and then reading, with a ready and an ack counter per half
// (kPullReady / kPullReady1, ...): every block of the launch must be resident at once, which the grid's size
// (at most the SMs / (ranks on the GPU + 1) per rank) gives.
//
// An operation: a one-block kernel bumps ctrl.epoch first (so every block of the following kernels reads a
// value nobody writes during their launch); notify exchanges counts through the mailboxes; then one kernel (and
// the one-block end kernel after a combine from registered memory). In the push paths its even blocks send and odd blocks receive: channel c of a rank carries its tokens
// [T*c/C, T*(c+1)/C), pipelined through a bounded per-peer queue of Q rows (a rank's rows to itself skip the
// queue and go straight to their final rows). The counters only grow, so no per-operation reset exists (graph
// replays need none) and a sender waits for room by reading the peer's head. Senders publish the tail in rounds
// of `round` rows (HtParams, at most Q/2, so the receiver drains one half while the sender fills the other) and
// receivers the head per round; one warp per peer group polls (kernels/queues.cuh groupWait).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/gpu_remote.h"
#include "common/hd.h"

namespace epcomm {

constexpr int kGpuMaxRanks = 64;
static_assert(kGpuRemoteMaxRanks == kGpuMaxRanks, "one remote ring per rank");
constexpr int kGpuMaxExperts = 4096;
constexpr int kGpuMaxTopk = 32;
constexpr int kGpuMaxChannels = 32;
// Hierarchical HT dispatch across hosts (HtParams::hier): the widest host it serves. A forwarded slot names the
// token's place at each rank of the destination host, one int32 per rank (GpuBufferLayout::fwd_idx).
constexpr int kGpuHierMaxLocal = 16;

// Where a rank's pull-combine rows are, published by its begin kernel for the owners: rows [0, have) of x at
// byte `off` of registered region `region` (epCommRegister, or an implicit slot from kGpuMaxRegions on; -1: in
// the combine staging, as are rows past `have`, which the copier zeroes there). The owners read it after that
// rank's ready counter, so it is the combine's.
struct GpuCombineSource {
  int32_t region;
  int32_t have;
  uint64_t off;
};

struct GpuCtrl {
  alignas(128) uint64_t epoch;   // written only by one-block begin/notify kernels
  alignas(128) GpuCombineSource comb_src;  // written by the combine's begin kernel
};

// Memory registered with epCommRegister, as this rank mapped every rank's part: base[r] (nullptr: rank r gave
// none) and its length. A table of kGpuMaxRegions in device memory, the same slot on every rank.
constexpr int kGpuMaxRegions = 32;
struct GpuRegion {
  uint8_t* base[kGpuMaxRanks];
  uint64_t bytes[kGpuMaxRanks];
};

// Implicit registration (src/engine/gpu/registry_implicit.cc): a plain pull combine's x, in caller memory, is
// offered to the peers without a collective call, so that from a later call on the owners read it in place, as
// if registered. Each rank has kGpuAutoRegions slots of its own; slot j of rank r is row kGpuMaxRegions + j of
// every owner's GpuRegion table, filled once that owner mapped it. Nothing waits: the source publishes the
// allocation in its GpuAutoTable (the slot's payload, its gen, then the table's latest gen), each owner maps it at
// its next combine and acknowledges gen * 2 (+ 1 if it could not) in its own buffer, and the source uses the slot
// from the combine after it saw every active owner's acknowledgement. The hosts learn the peers' latest gens and
// (while the source waits for some) the acknowledgements from a host-mapped mirror (GpuAutoMirror) that each
// combine's begin kernel refreshes, so no call reads the peers' memory from the host unless something changed.
// A slot gets another allocation only after the last combine that read the old one completed.
constexpr int kGpuAutoRegions = 32;
constexpr int kGpuRegionSlots = kGpuMaxRegions + kGpuAutoRegions;
struct alignas(128) GpuAutoExport {
  uint64_t gen;      // 0: never published; a new one, larger than any before, each time the slot changes
  uint64_t bytes;    // of the allocation
  uint8_t ipc[64];   // cudaIpcMemHandle_t of the allocation, mapped from its start
};
struct GpuAutoTable {
  alignas(128) uint64_t latest;  // the largest gen published in any slot
  GpuAutoExport slot[kGpuAutoRegions];
};
// What a combine's begin kernel saw (host-mapped, one per rank): latest[r] of rank r's table, and ack[r][j] =
// rank r's acknowledgement of this rank's slot j (refreshed only while this rank waits for one).
struct GpuAutoMirror {
  uint64_t latest[kGpuMaxRanks];
  uint64_t ack[kGpuMaxRanks][kGpuAutoRegions];
};

// The host-side exchange of epCommRegister / epCommDeregister (src/engine/gpu/registry.cc): entry
// [round & 1][src] in every rank's own buffer, written by src with cudaMemcpy (payload first, then the round) and
// read by the peers through their mappings. A rank starts round n + 2 only after it read every peer's entry of
// round n + 1, which a peer writes only after it read round n: two entries per source suffice.
enum GpuRegKind { kRegRegister = 1, kRegVerdict = 2, kRegDeregister = 3 };
struct alignas(128) GpuRegEntry {
  uint64_t round;
  int32_t kind;      // GpuRegKind: ranks in different calls at one round are told apart
  int32_t pad;
  int32_t code;      // epSuccess, or the result that refused the call on src
  int32_t slot;      // the region slot src uses (the same on every rank, or the calls were not in one order)
  uint8_t ipc[64];   // cudaIpcMemHandle_t of the allocation holding src's memory
  uint64_t offset;   // of src's memory in that allocation
  uint64_t bytes;
};

// Counter arrays [src][channel] in each rank's buffer. Pull combine: kPullReady[src][c] in the owner's buffer
// (written by src), kPullAck[owner][c] and kPullSent[owner][c] in the copier's (written by the owner / itself);
// the two blocks of a channel each publish and acknowledge their half: kPullReady / kPullAck for block 2c,
// kPullReady1 / kPullAck1 for block 2c+1 (pull dispatch: kPullDReady1 / kPullDAck1).
// Pull dispatch: kPullDReady[src][c] in the receiver's buffer, kPullDAck[receiver][c] and kPullDSent in the
// source's.
// Toward a rank of another host (common/gpu_remote.h) a sender cannot read the receiver's counters: it keeps the
// tail it last published itself (kDispSent / kCombSent [receiver][c], in its own buffer) and the receiver sends
// its head back (kDispHeadBack / kCombHeadBack [receiver][c] in the sender's buffer, written by the receiver).
// Hierarchical dispatch (HtParams::hier): a source's rows for a rank d of another host reach d through the
// source's forwarder on d's host, which writes them into d's dispatch queue for that source as the source would
// have and publishes kDispFwdTail[src][c] in d's buffer; d publishes kDispFwdHead[src][c] there (the forwarder
// reads it for room). Their own pair of counters: the forwarder of a source changes with the active mask, and the
// source's direct queue counters stay the source's.
// Hierarchical combine (the same forwarder, now the combiner of the owner's tokens on its host): every other rank d
// of the host copies its rows for owner s's channel c into its comb_out region and publishes, in its own buffer,
// kCombOutStart[s][c] (the first row there) and then kCombOutReady[s][c] = epoch; the combiner reads the rows from
// there and, done, stores kCombOutAck[s][c] = epoch in d's buffer. d overwrites comb_out only once every ack has
// caught up with its ready (htBeginKernel). The combiner streams one partial per token to s through s's combine
// queues of every rank of its host on that channel in turn (two slots per partial; the counters are the kComb*
// ones of its own queue to s).
enum GpuQueueCounter { kDispTail = 0, kDispHead, kCombTail, kCombHead, kPullReady, kPullAck, kPullSent,
                       kPullDReady, kPullDAck, kPullDSent, kPullReady1, kPullAck1, kPullDReady1, kPullDAck1,
                       kDispSent, kDispHeadBack, kCombSent, kCombHeadBack, kDispFwdTail, kDispFwdHead,
                       kCombOutStart, kCombOutReady, kCombOutAck, kNumQueueCounters };

struct GpuBufferLayout {
  size_t sync;                    // elastic sync entries [kind][src]
  size_t reg;                     // registration exchange entries [round & 1][src] (GpuRegEntry)
  size_t auto_exp, auto_ack;      // implicit registration: GpuAutoTable; acknowledgements uint64 [src][slot]
  size_t mailbox, mailbox_entry;  // offset of mailbox[0][0], bytes per entry
  size_t qctrl, qctrl_stride;     // counters [kind][src][channel], one array of qctrl_stride bytes per kind
  size_t disp_q, disp_slot;       // dispatch queues and bytes per slot
  size_t disp_fwd;                // hierarchical dispatch: offset in a slot of int32 [fwd_idx], the token's place
  int fwd_idx;                    // among the source's channel rows for each rank of the receiving host (-1: none)
  size_t comb_q;                  // combine queues (slots of x_stride bytes)
  size_t comb_stage;              // push: combine rows moved out of the queues, [src][max_tokens][x_stride];
                                  // pull: x, rows of xrow bytes in receive order (the zero-copy region)
  size_t comb_out;                // hierarchical combine: this rank's rows for owners on other hosts, which the
                                  // combiner of its host reads, [far_ranks * max_tokens][x_stride] (0 bytes without)
  int far_ranks;                  // ranks on other hosts than the rank's own, at most (R - the smallest host)
  size_t disp_stage, disp_list;   // pull dispatch: [max_tokens][disp_slot], [R][max_tokens] int32 (0 bytes
                                  // without pull dispatch: both offsets equal total)
  size_t x_stride, scale_stride;  // bytes of a row's x part and scale part in a slot
  size_t total;
  int nranks, channels, queue_rows, max_tokens;
};

// Written by survivor src into every kept peer's sync area: the payload first, then the round (a host-side count
// that every survivor advances alike, failures included), so a reader that sees the round sees the payload.
// Rounds use kGpuSyncSlots entries in turn. A rank rejecting epCommSetActiveRanks publishes its round and returns
// without waiting, so its next call's round may arrive before a slow peer has read this one: with one entry that
// round's mask replaced the rejection and the slow peer agreed to a call the others refused (seen at R = 8). The
// next call waits for every kept peer, so a writer is at most two rounds ahead of a reader: round r + 4, which
// reuses round r's entry, comes only after every kept peer passed round r.
struct alignas(64) GpuSyncEntry {
  uint64_t mask;         // the mask src holds (0: src rejected the call)
  uint64_t round;
  uint64_t ht_epoch;     // src's HT epoch and LL epochs, so that the survivors continue from the largest
  uint64_t ll_epoch[2];  // per family: max(send, receive) epoch
  uint64_t pad[3];
};
enum GpuSyncKind { kSyncElastic = 0, kSyncBarrier = 1 };
constexpr int kGpuSyncSlots = 4;  // entries per (kind, source), used by rounds in turn
// What the resync settled on (host-mapped; written by the resync kernel).
struct GpuResyncOut {
  uint64_t ht_epoch;
  uint64_t ll_epoch[2];
};

// Elastic ranks on the device (one per rank, device memory): the active-ranks mask that every kernel reads when
// it runs (so graph replays pick up a new mask) and the cumulative drop counters epCommGetMaskedDrops reports.
enum GpuDropKind { kDropTokenRows = 0, kDropA2aElements = 1 };
struct GpuElastic {
  uint64_t active;                                 // bit r set: rank r is active
  unsigned long long drops[2][kGpuMaxRanks];       // [GpuDropKind][destination rank]
};
EP_HD bool rankActive(const GpuElastic* el, int r) { return (el->active >> r) & 1; }

// A mailbox tag names the operation as well as its epoch (mailboxTag), so that ranks that issued different operations
// at one epoch (HT notify on some, alltoallv on others: both count through the mailboxes) find out, instead of
// reading each other's counts in the wrong format.
enum GpuMailboxKind : uint64_t { kMailboxHtNotify = 1, kMailboxA2a = 2 };
constexpr uint64_t kMailboxKinds = 4;
EP_HD uint64_t mailboxTag(uint64_t epoch, uint64_t kind) { return epoch * kMailboxKinds + kind; }

struct MailboxHead {
  uint64_t tag;  // mailboxTag(epoch, kind), written last
  int32_t status;
  int32_t pad;
  // int32_t counts_to[R]; int32_t per_expert[L]; int32_t per_channel[C]; int32_t to_host[C] follow
  // (to_host: hierarchical dispatch, the tokens of each channel bound for the receiver's host when that is not the
  // source's; what the receiver forwards when it is the source's forwarder there)
};

// The areas that hold rows start at multiples of 64 KiB. Where they started mattered more than anything the kernels
// do: at R = 8 on one H200 (MPS), HT dispatch and combine ran 1.6x slower whenever the areas sat 128 B to 4 KiB past
// a multiple of 64 KiB, and as fast as before at 64 KiB and 2 MiB shifts (bench/results/h200-s10.log, run74).
EP_HD size_t rowAreaAlign(size_t v) { return (v + 65535) & ~size_t{65535}; }

// fwd_idx: hierarchical HT dispatch across hosts, the widest host (<= kGpuHierMaxLocal); 0 without it.
// far_ranks: hierarchical combine, the most ranks any rank has on other hosts (comb_out's rows: max_tokens each).
EP_HD GpuBufferLayout gpuBufferLayout(int nranks, int channels, int queue_rows, int max_hidden, int max_tokens,
                                      bool pull_dispatch, int fwd_idx = 0, int far_ranks = 0) {
  auto up = [](size_t v) { return (v + 255) & ~size_t{255}; };
  GpuBufferLayout l{};
  l.nranks = nranks;
  l.channels = channels;
  l.queue_rows = queue_rows;
  l.max_tokens = max_tokens;
  l.x_stride = (static_cast<size_t>(max_hidden) * 2 + 15) & ~size_t{15};
  l.scale_stride = (static_cast<size_t>(max_hidden) / 128 * 4 + 15) & ~size_t{15};
  size_t off = up(sizeof(GpuCtrl));
  l.sync = off;
  off = up(off + 2 * kGpuSyncSlots * static_cast<size_t>(nranks) * sizeof(GpuSyncEntry));
  l.reg = off;
  off = up(off + 2 * static_cast<size_t>(nranks) * sizeof(GpuRegEntry));
  l.auto_exp = off;
  off = up(off + sizeof(GpuAutoTable));
  l.auto_ack = off;
  off = up(off + static_cast<size_t>(nranks) * kGpuAutoRegions * sizeof(uint64_t));
  l.mailbox = off;
  l.mailbox_entry =
      (sizeof(MailboxHead) + 4 * (static_cast<size_t>(nranks) + kGpuMaxExperts / nranks + 2 * kGpuMaxChannels) + 15) &
      ~size_t{15};
  off = up(off + 2 * nranks * l.mailbox_entry);
  l.qctrl = off;
  l.qctrl_stride = up(static_cast<size_t>(nranks) * channels * 8);
  off = up(off + kNumQueueCounters * l.qctrl_stride);
  const size_t slots = static_cast<size_t>(nranks) * channels * queue_rows;
  l.disp_fwd = l.x_stride + l.scale_stride + kGpuMaxTopk * 12;
  l.fwd_idx = fwd_idx;
  l.disp_slot = l.disp_fwd + ((4 * static_cast<size_t>(fwd_idx) + 15) & ~size_t{15});
  l.disp_q = off = rowAreaAlign(off);
  off = rowAreaAlign(off + slots * l.disp_slot);
  l.comb_q = off;
  off = rowAreaAlign(off + slots * l.x_stride);
  l.comb_stage = off;
  off = rowAreaAlign(off + static_cast<size_t>(nranks) * max_tokens * l.x_stride);
  l.comb_out = off;
  l.far_ranks = far_ranks;
  off = rowAreaAlign(off + static_cast<size_t>(far_ranks) * max_tokens * l.x_stride);
  l.disp_stage = off;
  if (pull_dispatch) off = rowAreaAlign(off + static_cast<size_t>(max_tokens) * l.disp_slot);
  l.disp_list = off;
  if (pull_dispatch) off = rowAreaAlign(off + static_cast<size_t>(nranks) * max_tokens * 4);
  l.total = off;
  return l;
}

// ---------------------------------------------------------------------------------------------------------
// Low-latency (LL) region: a second buffer per rank, allocated at creation when config.ll_max_tokens_per_rank
// > 0 and mapped by every peer like the HT buffer. Two families (dispatch = 0, combine = 1), each with its own
// epochs, so a dispatch and a combine may be between their halves at once. Operation n of a family uses
// parity n & 1 of the slot areas, so the send half of n + 1 never writes where the receive half of n reads.
//   [LlCtrl]                                   epochs and completion counters, written by this rank only
//   [tag:  2 fam x 2 par x R] uint64          written by src: "my rows of operation n are in" (= n)
//   [ack:  2 fam x R] uint64                  written by dst: "I finished reading your operation n" (= n)
//   [dispatch counts: 2 par x R] LlCountEntry T of src and its (token, expert) pairs per local expert
//   [dispatch slots:  2 par x R x M] slot     token t of src at [src][t]: LlSlotMeta, row, scales; a token
//                                              goes once to each rank that hosts one of its experts
//   [combine slots:   2 par x E x M] row       expert outputs for this rank's tokens: rank-major at
//                                              [expert x][t]; expert-major packed, expert rank A's rows in
//                                              block A of M x L rows, expert by expert, token order
//                                              (kernels/ll.cu combPackedPtr); with zero-copy combines, the
//                                              regions the expert outputs are written to (epLlCombineBuffer)
//                                              and the peers read from
//   [zero-copy headers: 2 par] LlZcHeader      where this rank's expert outputs of operation n are, and the
//                                              row layout (recv_layout_range) they follow
// Only with config.ll_zero_copy_dispatch (zero-copy dispatches, epLlDispatchBuffer):
//   [zd entries: 4 slots x R] LlZdEntry + E int32 + M x kGpuMaxTopk routing words
//                                              written by src in slot n % 4: first which of its output regions
//                                              operation n uses (started: src issued n, the region is free);
//                                              then its T and every expert's pair count (epoch); then, per
//                                              (token, k), the expert and the pair's index
//                                              among src's pairs of that expert (routed), from which the receiver
//                                              derives recv_src_info while the rows are still landing
//   [zd regions: 2] rows [E x M][row], scales  the output regions the senders write final rows into
// A sender first waits until the receiver acknowledged operation n - 2 (it read that parity's slots), writes
// its rows, and the last of its blocks to finish publishes the tags; a receiver waits for every peer's tag,
// reads, and its last block acknowledges. Epochs are advanced by the last block of each launch (rule G2).
// A zero-copy dispatch's sender waits for no acknowledgement first: its entries go to slot n % 4, whose operation
// n - 4 every receiver acknowledged before the sender's n - 2 ended; it checks the acknowledgements of n - 2 by
// the end of n. Its rows wait for the receivers' started words (their regions are free) and the counts of the
// lower sources (the rows follow theirs).
// ---------------------------------------------------------------------------------------------------------
enum LlFamily { kLlDispatch = 0, kLlCombine = 1 };

struct LlCtrl {
  alignas(128) uint64_t send_epoch[2];  // send halves completed, per family
  alignas(128) uint64_t recv_epoch[2];  // receive halves completed
  alignas(128) uint64_t send_done[2];   // cumulative blocks finished, per family (last-block detection)
  alignas(128) uint64_t recv_done[2];
};

struct LlSlotMeta {
  uint64_t epoch;  // operation that wrote the slot: a slot of an older operation is not a token of this one
  int32_t token;
  int32_t pad;
  int32_t expert[2 * kGpuMaxTopk];  // per k: local expert id on the receiver or -1, and the token's index
                                    // among the sender's tokens of that expert (first occurrence only, else -1;
                                    // expert-major only, -1 in rank-major)
};

// A zero-copy dispatch's entry of `src` for operation `epoch`, in slot epoch % kLlZdSlots; int32 counts[max_experts]
// (pairs per expert) follow, then uint32 routing words [T][K] (llZdRoutingWord), published on their own by `routed`.
// Four slots, so that a sender overwrites the slot of operation e - 4, whose acknowledgements it saw in e - 2: no
// sender waits for an acknowledgement before its entries (it checks those of e - 2 by the end of e).
constexpr int kLlZdSlots = 4;
struct LlZdEntry {
  uint64_t epoch;  // written last of T and the counts (after a fence): they are of this operation
  int32_t T;
  int32_t pad;
  uint64_t routed;   // written after the routing words (after a fence): they are of operation `routed`
  uint64_t started;  // llZdStartedWord, written by src first thing in its send half: its output region is free
};
// What a zero-copy dispatch's sender needs from a receiver before writing rows there: that the receiver issued its
// send half of operation e (so its region's earlier rows are no longer read) and which region it named.
EP_HD uint64_t llZdStartedWord(uint64_t e, int region) { return (e << 1) | static_cast<uint64_t>(region & 1); }
EP_HD int llZdStartedRegion(uint64_t w) { return static_cast<int>(w & 1); }
// Routing word of src's pair (t, k): expert x + 1 in the low 16 bits (0: no expert, or a repeat within the token),
// the pair's index among src's pairs of x (token order) in the high 16 bits. A token count fits: the LL dispatch
// stages T x K routing in kLlMaxSmem bytes of shared memory, so T < 2^16.
static_assert(kGpuMaxExperts < 0xffff, "an expert id + 1 fits the routing word's low half");
EP_HD uint32_t llZdRoutingWord(int expert, int pos) {
  return expert < 0 ? 0u : static_cast<uint32_t>(expert + 1) | (static_cast<uint32_t>(pos) << 16);
}
EP_HD int llZdRoutingExpert(uint32_t w) { return static_cast<int>(w & 0xffffu) - 1; }
EP_HD int llZdRoutingPos(uint32_t w) { return static_cast<int>(w >> 16); }

struct LlZcHeader {
  uint64_t y_off;  // offset of the expert outputs in the owner's LL buffer
  uint64_t pad;
  // int64_t layout_range[E] follows (expert-major: recv_layout_range of the owner's dispatch)
};

struct LlLayout {
  size_t tag, ack, counts, count_entry, slots, slot, slot_row, slot_scales, comb, comb_row, zc, zc_entry;
  // Zero-copy dispatch (all 0 when the communicator has none): entries, src_info side arrays, output regions.
  size_t zd_ent, zd_ent_size, zd_routing, zd, zd_x_bytes, zd_sc_bytes, zd_region;
  size_t total;
  int nranks, max_tokens, max_experts, max_hidden;
};

// zero_copy_dispatch: also the areas of zero-copy dispatches (epLlDispatchBuffer), config.ll_zero_copy_dispatch.
EP_HD LlLayout llLayout(int nranks, int max_tokens, int max_experts, int max_hidden, bool zero_copy_dispatch = false) {
  auto up = [](size_t v) { return (v + 255) & ~size_t{255}; };
  auto up16 = [](size_t v) { return (v + 15) & ~size_t{15}; };
  LlLayout l{};
  l.nranks = nranks;
  l.max_tokens = max_tokens;
  l.max_experts = max_experts;
  l.max_hidden = max_hidden;
  size_t off = up(sizeof(LlCtrl));
  l.tag = off;
  off = up(off + 4 * static_cast<size_t>(nranks) * 8);
  l.ack = off;
  off = up(off + 2 * static_cast<size_t>(nranks) * 8);
  l.counts = off;
  l.count_entry = up16(16 + 4 * static_cast<size_t>(max_experts / nranks));
  off = up(off + 2 * static_cast<size_t>(nranks) * l.count_entry);
  l.slot_row = up16(sizeof(LlSlotMeta));                              // row offset inside a slot
  l.slot_scales = l.slot_row + up16(static_cast<size_t>(max_hidden) * 2);  // bf16 bytes (fp32 rows: H/2)
  l.slot = l.slot_scales + up16(static_cast<size_t>(max_hidden) / 128 * 4);
  l.slots = off = rowAreaAlign(off);
  off = rowAreaAlign(off + 2 * static_cast<size_t>(nranks) * max_tokens * l.slot);
  l.comb_row = up16(static_cast<size_t>(max_hidden) * 2);
  l.comb = off;
  off = up(off + 2 * static_cast<size_t>(max_experts) * max_tokens * l.comb_row);
  l.zc = off;
  l.zc_entry = up(sizeof(LlZcHeader) + 8 * static_cast<size_t>(max_experts));
  off = up(off + 2 * l.zc_entry);
  if (zero_copy_dispatch) {
    const size_t rows = static_cast<size_t>(max_experts) * max_tokens;
    l.zd_ent = off;
    l.zd_routing = up16(sizeof(LlZdEntry) + 4 * static_cast<size_t>(max_experts));  // offset in an entry
    l.zd_ent_size = l.zd_routing + up16(4 * static_cast<size_t>(max_tokens) * kGpuMaxTopk);
    off = up(off + kLlZdSlots * static_cast<size_t>(nranks) * l.zd_ent_size);
    l.zd_x_bytes = rows * l.comb_row;                                   // [L][R*M] rows of the call's row size
    l.zd_sc_bytes = up(rows * (static_cast<size_t>(max_hidden) / 128) * 4);  // fp8 scales [L][R*M][H/128]
    l.zd_region = rowAreaAlign(l.zd_x_bytes + l.zd_sc_bytes);
    l.zd = off = rowAreaAlign(off);
    off = rowAreaAlign(off + 2 * l.zd_region);
  }
  l.total = off;
  return l;
}

// What a failed device wait or a device-side argument violation recorded; host-mapped memory. Kernels write it
// with plain stores only: a GPU need not perform atomics on host memory (cudaDevAttrHostNativeAtomicSupported is 0
// on PCIe hosts), so who writes is decided by device-scope atomics on GpuErrorClaims in device memory.
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

// Device-memory side of the error record: the first failure and the first violation are claimed here, and the
// violation count is kept here (the record holds a copy for the host).
struct GpuErrorClaims {
  int error;                      // 1 once a failure is recorded (cleared by epCommSetActiveRanks)
  int violation;                  // 1 once a violation code is recorded
  unsigned long long violations;  // how many
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
  int32_t* masked;          // [R] tokens of the layout not sent because r was masked (added to the drop
                            // counters by every dispatch that uses the layout)
  int32_t* peer_base;       // [R] receive row at rank r of this rank's first token there (pull combine)
  // Hierarchical dispatch across hosts (HtParams::hier):
  int32_t* fpos;            // [max_tokens, R] position of token t among the tokens this rank forwards to host h
                            // (t * R + h; hosts of other ranks only)
  int32_t* fchan_base;      // [R, C] tokens this rank forwards to host h before channel c's first token
  int32_t* fwd_chan;        // [R, C] rows source s sends this rank on channel c to forward (s of another host,
                            // this rank its forwarder here; 0 otherwise)
  int32_t* fwd_place;       // [R, max_tokens, fwd_idx] (hierarchical combine only) what the forwarder read in each
                            // slot it forwarded: for source s's i-th forwarded row (channel by channel), the token's
                            // place among s's channel rows at each rank of this host (-1: none); the combine reads it
                            // back
};

// The k-th rank (0-based, ascending) of the ranks in `mask`, or -1 when it holds k or fewer.
EP_HD int kthRank(uint64_t mask, int k) {
  for (; k > 0 && mask; --k) mask &= mask - 1;
  if (mask == 0) return -1;
  int r = 0;
  while (((mask >> r) & 1) == 0) ++r;
  return r;
}

// Hierarchical HT dispatch: the rank of host h (its ranks: mask `host`) that forwards what rank s sends there: the
// (local index of s mod n)-th of the host's n active ranks, as in the host engine; -1 when none is active. Every
// rank computes it from the same active mask, so sources and forwarders agree.
EP_HD int hierForwarder(uint64_t host, uint64_t active, int local_of_s) {
  const uint64_t m = host & active;
  int n = 0;
  for (uint64_t x = m; x; x &= x - 1) ++n;
  return n == 0 ? -1 : kthRank(m, local_of_s % n);
}

// Everything an HT kernel needs, passed by value.
struct HtParams {
  int rank, nranks, op;
  GpuCtrl* ctrl;
  uint8_t* base[kGpuMaxRanks];  // every rank's buffer, mapped here (ranks of other hosts: kGpuRemoteWindow)
  GpuBufferLayout lay;
  uint64_t remote;              // bit r: rank r is on another host; what is meant for it goes through rem's rings
  const GpuRemote* rem;
  uint8_t* far_in;              // with ranks of other hosts: what they write into this rank's HT buffer lands at
                                // the same offsets of this copy in pinned host memory (GpuProxy::farCopy)
  GpuErrorRecord* err;
  GpuErrorClaims* claims;
  GpuElastic* el;
  uint64_t timeout_ns;
  int gpu_scope;                     // every rank runs on this GPU (ranks under MPS): GPU-scope fences suffice
  int C, Q, G;                       // channels, queue rows, warps per peer in a block
  int round;                         // queue rows moved between two publications of a counter (<= Q / 2)
  // operation
  int T, H, K, E, L, dtype, worst;  // worst = num_worst_tokens (0 = exact)
  int pull;                          // combine: pull (1) or push through the queues (0)
  int pull_dispatch;                 // dispatch: pull (1; the layout has a dispatch staging) or push (0)
  int recv_rows;                     // combine: rows of x (the handle's receive rows)
  int zero_copy;                     // pull combine: x is this rank's combine staging (epHtCombineBuffer): no copy
  int zc_guard;                      // dispatch (pull combine): wait until the owners have read the last combine's
                                     // staging rows, which the caller may overwrite next (epHtCombineBuffer)
  // Hierarchical HT dispatch across hosts (push dispatch, hier = 1): a token crosses to another host once, to the
  // forwarder there of the source's channel (hierForwarder, through kernels/ht.cu forwarderOf), which hands each
  // rank of its host the slot the source would have sent it. Hosts are numbered in the order of their lowest rank;
  // a rank's local index is its place among its host's ranks, ascending. In a combine, hier = 1 is the
  // hierarchical combine (EPCOMM_GPU_HT_COMBINE_HIER): that forwarder sums its host's rows for the owner.
  int hier;
  int hier_combine;                  // dispatch: the combine is hierarchical, so forwardFrom keeps the places
                                     // (GpuHandleDev::fwd_place, allocated only then)
  int fwd_spread;                    // the forwarder of (source, host) moves with the channel (kernels/ht.cu
                                     // forwarderOf): each source streams to every rank of the host, not one
  int nhosts, my_host;
  uint8_t host_of[kGpuMaxRanks];     // host number of each rank
  uint8_t local_of[kGpuMaxRanks];    // local index of each rank
  uint64_t host_ranks[kGpuMaxRanks];  // [host]: bit r set for the ranks of that host
  size_t xrow, srow;                 // bytes of a row of x and of its scales
  const GpuRegion* regions;          // [kGpuRegionSlots] registered memory (epCommRegister, then implicit slots)
  int x_region;                      // pull combine: x lies in registered region x_region, at byte x_off of this
  uint64_t x_off;                    // rank's part (the owners read it there: no copy), or -1
  GpuAutoMirror* auto_mirror;        // pull combine with implicit registration: what the begin kernel saw, or null
  int auto_acks;                     // ... and the acknowledgements too (this rank waits for some)
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

// Everything an LL kernel needs, passed by value.
struct LlParams {
  int rank, nranks, op, blocks;
  uint8_t* base[kGpuMaxRanks];  // every rank's LL buffer, mapped here (ranks of other hosts: kGpuRemoteWindow)
  LlLayout lay;
  uint64_t remote;              // as in HtParams
  const GpuRemote* rem;
  uint8_t* far_in;              // as in HtParams, for the LL buffer
  GpuErrorRecord* err;
  GpuErrorClaims* claims;
  GpuElastic* el;
  uint64_t timeout_ns;
  int T, M, H, K, E, L, dtype, use_fp8, layout;
  size_t xrow;  // bytes of a row of x / y / out (H * dtype size)
  size_t srow;  // bytes of a row's fp8 scales (0 without fp8)
  size_t drow;  // bytes of a dispatched row (H with fp8, else xrow)
  const void* x;
  const int64_t* topk_idx;
  const float* topk_weights;
  void* recv_x;
  float* recv_x_scales;
  int* recv_count;
  int* recv_src_info;
  int64_t* recv_layout_range;
  int64_t* recv_topk_idx;
  const void* y;
  void* out;
  int zero_copy;     // combine: y is a region of this rank's LL buffer at y_off; peers read the rows from it
  int zc_guard;      // dispatch receive: wait until peers have read every earlier zero-copy combine's rows
  int own_in_y;      // combine, both halves in one call, not zero-copy: this rank's rows of its own tokens are read
                     // in y by the receive half instead of being copied by the send half (y is the call's, unchanged)
  int pdl;           // receive kernels may start while the send kernel before them runs (one rank per GPU)
  int gpu_scope;     // every rank runs on this GPU (ranks under MPS): GPU-scope fences suffice
  int pdl_chain;     // fused kernels launched as programmatic dependents of the kernel before them
  uint64_t y_off;
  int zd;            // dispatch: a zero-copy dispatch (recv_x, recv_x_scales: this rank's region at zd_x_off,
  uint64_t zd_x_off;  // of its LL buffer, scales zd_x_bytes further; senders write the final rows there)
  int zd_parts;       // zero-copy dispatch: at most this many parts (warps) a row where rows are fewer than warps
  int zd_rside;       // fused zero-copy dispatch: the last zd_rside blocks write no rows, only the receive side
};

// alltoallv through the HT dispatch queues (slots used as byte chunks): per peer the bytes and offsets of
// each side, from the host (host counts) or from device memory (device counts, exchanged by the notify step).
struct A2aParams {
  HtParams ht;                       // queues, mailboxes, epoch, error record
  uint64_t send_bytes[kGpuMaxRanks];  // host counts; device counts: unused
  uint64_t send_off[kGpuMaxRanks];
  uint64_t recv_bytes[kGpuMaxRanks];
  uint64_t recv_off[kGpuMaxRanks];
  const uint8_t* sendbuf;
  uint8_t* recvbuf;
  const int64_t* dev_send_counts;    // device counts (elements), else nullptr
  int64_t* dev_recv_counts;
  int64_t* dev_dropped;
  uint64_t capacity_bytes;
  uint64_t elem;
};

}  // namespace epcomm
