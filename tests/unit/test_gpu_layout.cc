// The GPU engine's buffer layout and routing rules are __host__ __device__ code: checked here, on the CPU,
// exactly as the kernels use them.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "common/gpu_layout.h"
#include "common/routing.h"
#ifdef EPCOMM_HAVE_GPU_ENGINE
#include "kernels/ll.h"
#endif

namespace epcomm {
namespace {

TEST(GpuLayout, RegionsAreAlignedOrderedAndLargeEnough) {
  for (int R : {1, 2, 3, 8, 16})
    for (int C : {1, 7, 12, kGpuMaxChannels})
      for (int Q : {32, 64, 1000})
        for (int H : {128, 7168})
          for (int T : {1, 512, 4096}) {
            const GpuBufferLayout l = gpuBufferLayout(R, C, Q, H, T, false);
            SCOPED_TRACE(testing::Message() << "R " << R << " C " << C << " Q " << Q << " H " << H << " T " << T);
            const std::vector<size_t> starts = {l.mailbox, l.qctrl, l.disp_q, l.comb_q, l.comb_stage, l.total};
            EXPECT_TRUE(std::is_sorted(starts.begin(), starts.end()));
            for (size_t s : starts) EXPECT_EQ(s % 256, 0u);
            EXPECT_GE(l.mailbox, sizeof(GpuCtrl));
            EXPECT_GE(l.reg, l.sync + 2 * kGpuSyncSlots * static_cast<size_t>(R) * sizeof(GpuSyncEntry));
            EXPECT_LE(l.reg + 2 * static_cast<size_t>(R) * sizeof(GpuRegEntry), l.auto_exp);  // registration entries
            // Implicit registration: the table, then the acknowledgements [src][slot], before the mailbox.
            EXPECT_EQ(l.auto_exp % 128, 0u);
            EXPECT_LE(l.auto_exp + sizeof(GpuAutoTable), l.auto_ack);
            EXPECT_EQ(l.auto_ack % 8, 0u);
            EXPECT_LE(l.auto_ack + static_cast<size_t>(R) * kGpuAutoRegions * sizeof(uint64_t), l.mailbox);
            // Each region holds what the kernels index in it.
            EXPECT_GE(l.mailbox_entry, sizeof(MailboxHead) + 4 * (R + kGpuMaxExperts / R + 2 * kGpuMaxChannels));
            EXPECT_EQ(l.mailbox_entry % 16, 0u);
            EXPECT_LE(l.mailbox + 2 * R * l.mailbox_entry, l.qctrl);
            EXPECT_GE(l.qctrl_stride, static_cast<size_t>(R) * C * 8);
            EXPECT_LE(l.qctrl + kNumQueueCounters * l.qctrl_stride, l.disp_q);
            EXPECT_GE(l.x_stride, static_cast<size_t>(H) * 2);  // a bf16 row (or an fp32 row of half the hidden)
            EXPECT_EQ(l.x_stride % 16, 0u);                      // 16-byte copies
            EXPECT_GE(l.scale_stride, static_cast<size_t>(H) / 128 * 4);
            EXPECT_GE(l.disp_slot, l.x_stride + l.scale_stride + kGpuMaxTopk * 12);
            // Hierarchical dispatch: a slot grows by the int32 places it names, 16-byte aligned after the metadata.
            EXPECT_EQ(l.fwd_idx, 0);
            EXPECT_EQ(l.disp_slot, l.disp_fwd);
            for (int w : {1, 3, kGpuHierMaxLocal}) {
              const GpuBufferLayout h = gpuBufferLayout(R, C, Q, H, T, false, w);
              EXPECT_EQ(h.fwd_idx, w);
              EXPECT_EQ(h.disp_fwd, l.disp_fwd);
              EXPECT_EQ(h.disp_fwd % 16, 0u);
              EXPECT_GE(h.disp_slot, h.disp_fwd + 4 * static_cast<size_t>(w));
              EXPECT_EQ(h.disp_slot % 16, 0u);
              EXPECT_LE(h.disp_q + static_cast<size_t>(R) * C * Q * h.disp_slot, h.comb_q);
            }
            EXPECT_LE(l.disp_q + static_cast<size_t>(R) * C * Q * l.disp_slot, l.comb_q);
            EXPECT_LE(l.comb_q + static_cast<size_t>(R) * C * Q * l.x_stride, l.comb_stage);
            EXPECT_LE(l.comb_stage + static_cast<size_t>(R) * T * l.x_stride, l.total);
            // Hierarchical combine: comb_out (far_ranks * max_tokens rows) after the staging; empty without it.
            EXPECT_EQ(l.far_ranks, 0);
            EXPECT_EQ(l.comb_out, l.disp_stage);
            for (int far : {1, R}) {
              const GpuBufferLayout h = gpuBufferLayout(R, C, Q, H, T, true, 2, far);
              EXPECT_EQ(h.far_ranks, far);
              EXPECT_EQ(h.comb_out % 65536, 0u);
              EXPECT_LE(h.comb_stage + static_cast<size_t>(R) * T * h.x_stride, h.comb_out);
              EXPECT_LE(h.comb_out + static_cast<size_t>(far) * T * h.x_stride, h.disp_stage);
              const GpuBufferLayout n = gpuBufferLayout(R, C, Q, H, T, true, 2);  // the same without comb_out
              EXPECT_EQ(h.total - h.disp_stage, n.total - n.disp_stage);
            }
            // Without pull dispatch its regions are empty; with it they follow, sized for every token.
            EXPECT_EQ(l.disp_stage, l.total);
            EXPECT_EQ(l.disp_list, l.total);
            const GpuBufferLayout p = gpuBufferLayout(R, C, Q, H, T, true);
            EXPECT_EQ(p.comb_stage, l.comb_stage);
            EXPECT_EQ(p.disp_stage % 256, 0u);
            EXPECT_EQ(p.disp_list % 256, 0u);
            EXPECT_LE(p.comb_stage + static_cast<size_t>(R) * T * p.x_stride, p.disp_stage);
            EXPECT_LE(p.disp_stage + static_cast<size_t>(T) * p.disp_slot, p.disp_list);
            EXPECT_LE(p.disp_list + static_cast<size_t>(R) * T * 4, p.total);
            // Row areas start at multiples of 64 KiB (rowAreaAlign: where they start changed HT speed 1.6x).
            for (size_t s : {p.disp_q, p.comb_q, p.comb_stage, p.disp_stage, p.disp_list, p.total})
              EXPECT_EQ(s % 65536, 0u);
          }
}

// Hierarchical HT dispatch: the forwarder of source s on a host is the (local index of s mod n)-th of its n active
// ranks, ascending (the host engine's rule, HostEngine::forwarder), whatever ranks the host holds and the mask.
TEST(GpuLayout, HierForwarderIsTheHostEnginesChoice) {
  uint64_t x = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  for (int i = 0; i < 2000; ++i) {
    const uint64_t host = next() & next(), active = next() | next();
    const int local = static_cast<int>(next() % 16);
    std::vector<int> ranks;
    for (int r = 0; r < 64; ++r)
      if ((host >> r & 1) && (active >> r & 1)) ranks.push_back(r);
    const int want = ranks.empty() ? -1 : ranks[local % ranks.size()];
    EXPECT_EQ(hierForwarder(host, active, local), want) << std::hex << host << " " << active << " " << local;
  }
  EXPECT_EQ(hierForwarder(0b1100, 0b1111, 0), 2);
  EXPECT_EQ(hierForwarder(0b1100, 0b1111, 1), 3);
  EXPECT_EQ(hierForwarder(0b1100, 0b0111, 1), 2);  // one active rank forwards for everyone
  EXPECT_EQ(hierForwarder(0b1100, 0b0011, 0), -1);
}

// kthRank: the forwarder's choice, and each lane's rank of a host in the hierarchical dispatch kernels.
TEST(GpuLayout, KthRankIsTheKthSetBitAscending) {
  EXPECT_EQ(kthRank(0b101100, 0), 2);
  EXPECT_EQ(kthRank(0b101100, 1), 3);
  EXPECT_EQ(kthRank(0b101100, 2), 5);
  EXPECT_EQ(kthRank(0b101100, 3), -1);
  EXPECT_EQ(kthRank(0, 0), -1);
  EXPECT_EQ(kthRank(1ull << 63, 0), 63);
  EXPECT_EQ(kthRank(~0ull, 40), 40);
}

// EPCOMM_GPU_HT_FWD_SPREAD: channel c of source s goes to hierForwarder(host, active, local(s) + c) (kernels/ht.cu
// forwarderOf); with at least as many channels as the host's active ranks every one of them forwards a channel.
TEST(GpuLayout, HierForwarderMovingWithTheChannelReachesEveryActiveRank) {
  for (uint64_t host : {0x0full, 0xf0ull, 0x5aull, 0xff00ull})
    for (uint64_t active : {~0ull, 0xfff5ull, 0x3cull})
      for (int local = 0; local < 8; ++local) {
        const int n = __builtin_popcountll(host & active);
        if (n == 0) continue;
        for (int C : {n, n + 3, 32}) {
          uint64_t seen = 0;
          for (int c = 0; c < C; ++c) {
            const int f = hierForwarder(host, active, local + c);
            ASSERT_GE(f, 0);
            EXPECT_TRUE((host & active) >> f & 1);
            seen |= 1ull << f;
          }
          EXPECT_EQ(seen, host & active) << std::hex << host << " " << active << " local " << local << " C " << C;
        }
      }
}

// The LL region: areas in order, 256-byte aligned, without overlap, slots large enough for a row of ll_max_hidden
// bf16 values, its metadata and its fp8 scales, combine rows 16-byte aligned.
TEST(GpuLayout, LlRegionAreasAreAlignedAndDisjoint) {
  for (int R : {1, 2, 3, 8, 16})
    for (int M : {1, 2, 128, 1000})
      for (int H : {128, 7168})
        for (int E : {R * 2, 256 / R * R, 4096 / R * R}) {
          const LlLayout l = llLayout(R, M, E, H);
          const size_t areas[] = {l.tag, l.ack, l.counts, l.slots, l.comb, l.total};
          for (size_t i = 0; i + 1 < sizeof(areas) / sizeof(areas[0]); ++i) {
            EXPECT_EQ(areas[i] % 256, 0u);
            EXPECT_LT(areas[i], areas[i + 1]);
          }
          EXPECT_GE(l.tag, sizeof(LlCtrl));
          EXPECT_EQ(l.slots % 65536, 0u);  // row areas at multiples of 64 KiB (rowAreaAlign)
          EXPECT_EQ(l.comb % 65536, 0u);
          EXPECT_LE(l.tag + 4 * static_cast<size_t>(R) * 8, l.ack);
          EXPECT_LE(l.ack + 2 * static_cast<size_t>(R) * 8, l.counts);
          EXPECT_GE(l.count_entry, 16 + 4 * static_cast<size_t>(E / R));
          EXPECT_LE(l.counts + 2 * static_cast<size_t>(R) * l.count_entry, l.slots);
          EXPECT_GE(l.slot_row, sizeof(LlSlotMeta));
          EXPECT_GE(l.slot_scales - l.slot_row, static_cast<size_t>(H) * 2);
          EXPECT_GE(l.slot - l.slot_scales, static_cast<size_t>(H) / 128 * 4);
          EXPECT_EQ(l.slot % 16, 0u);
          EXPECT_LE(l.slots + 2 * static_cast<size_t>(R) * M * l.slot, l.comb);
          EXPECT_EQ(l.comb_row % 16, 0u);
          EXPECT_LE(l.comb + 2 * static_cast<size_t>(E) * M * l.comb_row, l.total);
          EXPECT_EQ(l.zd_region, 0u);  // no zero-copy dispatch areas unless asked for
          // With zero-copy dispatch: the same areas, then entries (header, counts, routing words) and two output
          // regions (rows [E x M] of ll_max_hidden bf16, then fp8 scales), disjoint and at the end.
          const LlLayout z = llLayout(R, M, E, H, true);
          EXPECT_EQ(z.comb, l.comb);
          EXPECT_LE(z.zc + 2 * z.zc_entry, z.zd_ent);
          EXPECT_GE(z.zd_routing, sizeof(LlZdEntry) + 4 * static_cast<size_t>(E));
          EXPECT_EQ(z.zd_routing % 16, 0u);
          EXPECT_GE(z.zd_ent_size, z.zd_routing + 4 * static_cast<size_t>(M) * kGpuMaxTopk);
          EXPECT_EQ(z.zd_ent_size % 16, 0u);
          EXPECT_LE(z.zd_ent + kLlZdSlots * static_cast<size_t>(R) * z.zd_ent_size, z.zd);
          EXPECT_EQ(z.zd % 65536, 0u);
          EXPECT_GE(z.zd_x_bytes, static_cast<size_t>(E) * M * H * 2);
          EXPECT_GE(z.zd_sc_bytes, static_cast<size_t>(E) * M * (H / 128) * 4);
          EXPECT_GE(z.zd_region, z.zd_x_bytes + z.zd_sc_bytes);
          EXPECT_EQ(z.zd_region % 65536, 0u);
          EXPECT_LE(z.zd + 2 * z.zd_region, z.total);
        }
}

// A zero-copy dispatch's routing word (expert, index among the sender's pairs of it) round-trips over the whole
// range the kernels use: expert ids up to kGpuMaxExperts - 1, indices below 2^16; no expert packs to 0.
TEST(GpuLayout, LlZdRoutingWordRoundTrips) {
  EXPECT_EQ(llZdRoutingWord(-1, 12345), 0u);
  EXPECT_EQ(llZdRoutingExpert(0u), -1);
  for (int x : {0, 1, 63, 255, kGpuMaxExperts - 1})
    for (int pos : {0, 1, 127, 40000, 65535}) {
      const uint32_t w = llZdRoutingWord(x, pos);
      EXPECT_EQ(llZdRoutingExpert(w), x);
      EXPECT_EQ(llZdRoutingPos(w), pos);
    }
}

TEST(Routing, ExpertMapLayoutRangeAndRepeats) {
  ExpertMap m{256, 8, 32};
  EXPECT_EQ(m.rankOf(0), 0);
  EXPECT_EQ(m.rankOf(255), 7);
  EXPECT_EQ(m.localOf(33), 1);
  for (int64_t count : {0, 1, 77, 65535})
    for (int64_t begin : {0, 5, 123456}) {
      const int64_t v = packLayoutRange(count, begin);
      EXPECT_EQ(layoutRangeCount(v), count);
      EXPECT_EQ(layoutRangeBegin(v), begin);
    }
  const int64_t row[] = {4, -1, 4, 7, -1};
  EXPECT_FALSE(isRepeatedExpert(row, 0));
  EXPECT_FALSE(isRepeatedExpert(row, 1));
  EXPECT_TRUE(isRepeatedExpert(row, 2));
  EXPECT_FALSE(isRepeatedExpert(row, 3));
  EXPECT_TRUE(isRepeatedExpert(row, 4));  // a repeated -1 is skipped anyway
}

#ifdef EPCOMM_HAVE_GPU_ENGINE
// The LL kernels' shared-memory staging, as include/epcomm/epcomm.h states it: dispatch 12 T K + 4 E bytes,
// combine 20 T K + 16 E + 4 L plus the positions table (ceil(T K / 32) E bytes up to 32 KiB), at most
// kLlMaxSmem; with top-8 and 256 experts about 2100 tokens per dispatch and 1250 per combine.
TEST(GpuLayout, LlSharedMemoryIsWhatTheHeaderStates) {
  for (int T : {1, 64, 128, 1000, 2048})
    for (int K : {1, 8, 9})
      for (int E : {8, 256, 4096}) {
        SCOPED_TRACE(testing::Message() << "T " << T << " K " << K << " E " << E);
        const size_t tk = static_cast<size_t>(T) * K, L = E / 8;
        EXPECT_GE(llSendSmemBytes(T, K, E), 12 * tk + 4 * E);
        EXPECT_LE(llSendSmemBytes(T, K, E), 12 * tk + 4 * E + 15);  // rounded up to 16 bytes
        const size_t table = (tk + 31) / 32 * E <= 32 * 1024 ? (tk + 31) / 32 * E : 0;
        const size_t stated = 20 * tk + 16 * E + 4 * L + table;
        const size_t got = llCombineSmemBytes(T, K, E, static_cast<int>(L));
        EXPECT_GE(got, stated);
        EXPECT_LE(got, stated + 32);  // alignment padding and the prefix's one extra entry
      }
  EXPECT_LE(llSendSmemBytes(2100, 8, 256), kLlMaxSmem);
  EXPECT_LE(llSendSmemBytes(2048, 8, 64), kLlMaxSmem);  // no expert-count-dependent extra (a table) cuts these
  EXPECT_GT(llSendSmemBytes(2200, 8, 256), kLlMaxSmem);
  EXPECT_LE(llCombineSmemBytes(1250, 8, 256, 32), kLlMaxSmem);
  EXPECT_GT(llCombineSmemBytes(1300, 8, 256, 32), kLlMaxSmem);
}
#endif

}  // namespace
}  // namespace epcomm
