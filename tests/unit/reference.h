// A plainly written, single-process reference of every operation of include/epcomm/epcomm.h.
//
// It sees all ranks' inputs at once and computes what any one rank must get back. Nothing here is shared
// with src/ except the element conversions of src/common/dtype.h, which define the rounding. It is meant
// to be obviously right rather than fast: vectors and loops, one rule per line, following the header and
// DESIGN.md ("Operations and their exact semantics").
//
// Conventions: R ranks, E experts (E % R == 0), L = E / R local experts per rank; expert e lives on rank
// e / L with local id e % L; topk_idx entries are in [-1, E). Buffers are byte vectors in the operation's
// dtype; "poison" is the byte that rows an operation must not write keep.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "epcomm/epcomm.h"

namespace epref {

// One rank's inputs to dispatch (HT or LL).
struct RankInput {
  int num_tokens = 0;               // T
  std::vector<uint8_t> x;           // [T, H] in the dispatch dtype
  std::vector<float> x_scales;      // [T, H/128] (HT fp8 only)
  std::vector<int64_t> topk_idx;    // [T, K]
  std::vector<float> topk_weights;  // [T, K]
};

struct Shape {
  int nranks = 1;       // R
  int num_experts = 1;  // E
  int hidden = 8;       // H
  int topk = 1;         // K
  int local() const { return num_experts / nranks; }
};

inline size_t elemSize(int dtype) { return epcomm::dtypeSize(dtype); }

// Does token t of `in` name global expert e (at any k)?
inline bool namesExpert(const RankInput& in, const Shape& s, int t, int64_t e) {
  for (int k = 0; k < s.topk; ++k)
    if (in.topk_idx[static_cast<size_t>(t) * s.topk + k] == e) return true;
  return false;
}

// Does token t of `in` name at least one expert that lives on rank r?
inline bool namesRank(const RankInput& in, const Shape& s, int t, int r) {
  int L = s.local();
  for (int k = 0; k < s.topk; ++k) {
    int64_t e = in.topk_idx[static_cast<size_t>(t) * s.topk + k];
    if (e >= 0 && e / L == r) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------------------
// Layout (epGetDispatchLayout) of one rank's routing.
// ---------------------------------------------------------------------------------------------------------
struct Layout {
  std::vector<int> tokens_per_rank;        // [R]
  std::vector<int> tokens_per_expert;      // [E]
  std::vector<uint8_t> is_token_in_rank;   // [T, R]
};

inline Layout layout(const RankInput& in, const Shape& s) {
  Layout out;
  int R = s.nranks, E = s.num_experts;
  out.tokens_per_rank.assign(R, 0);
  out.tokens_per_expert.assign(E, 0);
  out.is_token_in_rank.assign(static_cast<size_t>(in.num_tokens) * R, 0);
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int e = 0; e < E; ++e)
      if (namesExpert(in, s, t, e)) out.tokens_per_expert[e] += 1;
    for (int r = 0; r < R; ++r)
      if (namesRank(in, s, t, r)) {
        out.tokens_per_rank[r] += 1;
        out.is_token_in_rank[static_cast<size_t>(t) * R + r] = 1;
      }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// HT dispatch.
// ---------------------------------------------------------------------------------------------------------
struct SrcRow {
  int rank;
  int token;
};

// The rows rank `rank` receives, in order: source rank ascending, then source token ascending.
inline std::vector<SrcRow> htRecvRows(const std::vector<RankInput>& all, const Shape& s, int rank) {
  std::vector<SrcRow> rows;
  for (int src = 0; src < s.nranks; ++src)
    for (int t = 0; t < all[src].num_tokens; ++t)
      if (namesRank(all[src], s, t, rank)) rows.push_back({src, t});
  return rows;
}

struct HtRecv {
  int num_recv = 0;
  std::vector<SrcRow> src;                 // [num_recv]
  std::vector<uint8_t> x;                  // [num_recv, H] dtype bytes
  std::vector<float> x_scales;             // [num_recv, H/128] (fp8)
  std::vector<int64_t> topk_idx;           // [num_recv, K]
  std::vector<float> topk_weights;         // [num_recv, K]
  std::vector<int> tokens_per_expert;      // [L]
};

// dtype: of x (epFloat8E4M3 copies the scales too).
inline HtRecv htDispatch(const std::vector<RankInput>& all, const Shape& s, int dtype, int rank) {
  HtRecv out;
  int H = s.hidden, K = s.topk, L = s.local();
  size_t row_bytes = static_cast<size_t>(H) * elemSize(dtype);
  int nblocks = H / EP_FP8_BLOCK;
  out.src = htRecvRows(all, s, rank);
  out.num_recv = static_cast<int>(out.src.size());
  out.x.resize(out.src.size() * row_bytes);
  if (dtype == epFloat8E4M3) out.x_scales.resize(out.src.size() * nblocks);
  out.topk_idx.resize(out.src.size() * K);
  out.topk_weights.resize(out.src.size() * K);
  out.tokens_per_expert.assign(L, 0);
  for (size_t row = 0; row < out.src.size(); ++row) {
    const RankInput& in = all[out.src[row].rank];
    int t = out.src[row].token;
    std::memcpy(&out.x[row * row_bytes], &in.x[static_cast<size_t>(t) * row_bytes], row_bytes);
    if (dtype == epFloat8E4M3)
      for (int b = 0; b < nblocks; ++b)
        out.x_scales[row * nblocks + b] = in.x_scales[static_cast<size_t>(t) * nblocks + b];
    for (int k = 0; k < K; ++k) {
      int64_t e = in.topk_idx[static_cast<size_t>(t) * K + k];
      bool local = e >= 0 && e / L == rank;
      out.topk_idx[row * K + k] = local ? e % L : -1;
      out.topk_weights[row * K + k] = local ? in.topk_weights[static_cast<size_t>(t) * K + k] : 0.0f;
    }
    for (int le = 0; le < L; ++le)
      if (namesExpert(in, s, t, static_cast<int64_t>(rank) * L + le)) out.tokens_per_expert[le] += 1;
  }
  return out;
}

// Worst-token mode: the int outputs of W >= num_recv rows (padding rows: idx -1, weight 0). recv_x rows past
// num_recv are not written by the engine, so they are not part of this.
inline void htPadToWorst(const HtRecv& in, int K, int W, std::vector<int64_t>* idx, std::vector<float>* w) {
  idx->assign(static_cast<size_t>(W) * K, -1);
  w->assign(static_cast<size_t>(W) * K, 0.0f);
  for (size_t i = 0; i < in.topk_idx.size(); ++i) {
    (*idx)[i] = in.topk_idx[i];
    (*w)[i] = in.topk_weights[i];
  }
}

// ---------------------------------------------------------------------------------------------------------
// HT combine. ys[r] is rank r's combine input: its received rows (htRecvRows order), [num_recv_r, H] in
// dtype. Returns combined_x [T, H] of rank `rank`.
//
// Order (include/epcomm/epcomm.h): on one host (or flat across hosts, EPCOMM_HT_HIERARCHICAL=0) fp32, ranks
// ascending, from 0. Across hosts, hierarchical: per host (hosts in the order of their lowest rank) an fp32
// partial from 0 over that host's ranks ascending; then the partials of the hosts that hold the token, hosts
// ascending, added to an fp32 accumulator from 0; rounded once. gRefRanksPerHost > 0 says the ranks sit on
// hosts of that many consecutive ranks (as the tests' virtual hosts do), but the first host, which has
// gRefFirstHostRanks where that is > 0 (hosts of unequal size).
// ---------------------------------------------------------------------------------------------------------
inline int gRefRanksPerHost = 0;
inline int gRefFirstHostRanks = 0;
inline int refFirstHostRanks() { return gRefFirstHostRanks > 0 ? gRefFirstHostRanks : gRefRanksPerHost; }
inline bool refHierarchical(int nranks) {
  const char* e = getenv("EPCOMM_HT_HIERARCHICAL");
  return gRefRanksPerHost > 0 && nranks > refFirstHostRanks() && !(e && strcmp(e, "0") == 0);
}

inline std::vector<uint8_t> htCombine(const std::vector<RankInput>& all, const Shape& s,
                                      const std::vector<std::vector<uint8_t>>& ys, int dtype, int rank) {
  int H = s.hidden, T = all[rank].num_tokens;
  std::vector<uint8_t> out(static_cast<size_t>(T) * H * elemSize(dtype));
  // row_of[r][t] = the row of token t (of `rank`) on rank r, or -1
  std::vector<std::vector<int>> row_of(s.nranks, std::vector<int>(T, -1));
  for (int r = 0; r < s.nranks; ++r) {
    std::vector<SrcRow> rows = htRecvRows(all, s, r);
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i].rank == rank) row_of[r][rows[i].token] = static_cast<int>(i);
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      float acc = 0.0f;
      const bool hier = refHierarchical(s.nranks);
      // Host blocks of consecutive ranks: [h0, h1)
      for (int h0 = 0, h1 = hier ? refFirstHostRanks() : s.nranks; h0 < s.nranks;
           h0 = h1, h1 = std::min(s.nranks, h1 + gRefRanksPerHost)) {
        float part = 0.0f;
        bool any = false;
        for (int r = h0; r < h1; ++r) {
          int row = row_of[r][t];
          if (row < 0) continue;
          float v = epcomm::loadAsFloat(ys[r].data(), static_cast<size_t>(row) * H + h, dtype);
          part = part + v;
          any = true;
        }
        if (any) acc = acc + part;
      }
      epcomm::storeFromFloat(out.data(), static_cast<size_t>(t) * H + h, dtype, acc);
    }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// LL fp8 quantization of one row: per 128-column block, amax = max |x|, scale = fp8BlockScale(amax),
// q = floatToFp8(x * fp8BlockScaleInv(amax)).
// ---------------------------------------------------------------------------------------------------------
inline void llQuantizeRow(const uint8_t* x_row, int H, int dtype, uint8_t* q_row, float* scales) {
  for (int b = 0; b < H / EP_FP8_BLOCK; ++b) {
    float amax = 0.0f;
    for (int c = b * EP_FP8_BLOCK; c < (b + 1) * EP_FP8_BLOCK; ++c) {
      float v = epcomm::loadAsFloat(x_row, c, dtype);
      float a = v < 0 ? -v : v;
      if (a > amax) amax = a;
    }
    float inv = epcomm::fp8BlockScaleInv(amax);
    scales[b] = epcomm::fp8BlockScale(amax);
    for (int c = b * EP_FP8_BLOCK; c < (b + 1) * EP_FP8_BLOCK; ++c) {
      float v = epcomm::loadAsFloat(x_row, c, dtype);
      float scaled = v * inv;
      q_row[c] = epcomm::floatToFp8(scaled);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// LL dispatch. Output buffers are full size, pre-filled with `poison`; row_written marks the recv_x rows the
// engine must write (the others must keep their old contents).
// ---------------------------------------------------------------------------------------------------------
struct LlRecv {
  int rows = 0;                       // expert-major: L * R*M; rank-major: R * M
  size_t row_bytes = 0;               // H * (fp8 ? 1 : elemSize(dtype))
  int blocks = 0;                     // H / 128 (fp8)
  std::vector<uint8_t> x;             // [rows, row_bytes]
  std::vector<float> x_scales;        // [rows, blocks] (fp8)
  std::vector<uint8_t> row_written;   // [rows]
  std::vector<int> count;             // expert-major: [L]; rank-major: [R]
  std::vector<int> src_info;          // expert-major: [L, R*M]; meaningful for row < count[e]
  std::vector<int64_t> layout_range;  // expert-major: [L, R]
  std::vector<int64_t> topk_idx;      // rank-major: [R, M, K]
  // expert-major: the source (rank, token) of each packed row of each local expert
  std::vector<std::vector<SrcRow>> expert_rows;  // [L][count[e]]
};

inline LlRecv llDispatch(const std::vector<RankInput>& all, const Shape& s, int M, int dtype, bool use_fp8,
                         int layout_kind, int rank, uint8_t poison) {
  LlRecv out;
  int R = s.nranks, H = s.hidden, K = s.topk, L = s.local();
  size_t in_row_bytes = static_cast<size_t>(H) * elemSize(dtype);
  out.row_bytes = static_cast<size_t>(H) * (use_fp8 ? 1 : elemSize(dtype));
  out.blocks = use_fp8 ? H / EP_FP8_BLOCK : 0;
  out.rows = layout_kind == EP_LL_EXPERT_MAJOR ? L * R * M : R * M;
  out.x.assign(static_cast<size_t>(out.rows) * out.row_bytes, poison);
  float fpoison;
  {
    uint32_t u = 0x01010101u * poison;
    std::memcpy(&fpoison, &u, 4);
  }
  out.x_scales.assign(static_cast<size_t>(out.rows) * out.blocks, fpoison);
  out.row_written.assign(out.rows, 0);

  auto writeRow = [&](int dst_row, const RankInput& in, int t) {
    const uint8_t* src = &in.x[static_cast<size_t>(t) * in_row_bytes];
    uint8_t* dst = &out.x[static_cast<size_t>(dst_row) * out.row_bytes];
    if (use_fp8) {
      llQuantizeRow(src, H, dtype, dst, &out.x_scales[static_cast<size_t>(dst_row) * out.blocks]);
    } else {
      std::memcpy(dst, src, in_row_bytes);
    }
    out.row_written[dst_row] = 1;
  };

  if (layout_kind == EP_LL_EXPERT_MAJOR) {
    out.count.assign(L, 0);
    out.src_info.assign(static_cast<size_t>(L) * R * M, -1);
    out.layout_range.assign(static_cast<size_t>(L) * R, 0);
    out.expert_rows.assign(L, {});
    for (int le = 0; le < L; ++le) {
      int64_t e = static_cast<int64_t>(rank) * L + le;
      int row = 0;
      for (int src = 0; src < R; ++src) {
        int begin = row;
        for (int t = 0; t < all[src].num_tokens; ++t) {
          if (!namesExpert(all[src], s, t, e)) continue;
          writeRow(le * R * M + row, all[src], t);
          out.src_info[static_cast<size_t>(le) * R * M + row] = t;
          out.expert_rows[le].push_back({src, t});
          ++row;
        }
        int cnt = row - begin;
        out.layout_range[static_cast<size_t>(le) * R + src] =
            (static_cast<int64_t>(cnt) << 32) | static_cast<int64_t>(begin);
      }
      out.count[le] = row;
    }
  } else {
    out.count.assign(R, 0);
    out.topk_idx.assign(static_cast<size_t>(R) * M * K, -1);
    for (int src = 0; src < R; ++src) {
      out.count[src] = all[src].num_tokens;
      for (int t = 0; t < all[src].num_tokens; ++t) {
        if (!namesRank(all[src], s, t, rank)) continue;
        writeRow(src * M + t, all[src], t);
        for (int k = 0; k < K; ++k) {
          int64_t e = all[src].topk_idx[static_cast<size_t>(t) * K + k];
          out.topk_idx[(static_cast<size_t>(src) * M + t) * K + k] = (e >= 0 && e / L == rank) ? e % L : -1;
        }
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// LL combine. ys[r] is rank r's expert output y [L, R*M, H] in dtype. Returns out [T, H] of rank `rank`.
//   out[t] = sum over k with topk_idx[t,k] >= 0 of topk_weights[t,k] * y_owner[e%L][row(t,e)], fp32, in k
//   order, acc = acc + w * v (never fused), rounded once.
// ---------------------------------------------------------------------------------------------------------
inline std::vector<uint8_t> llCombine(const std::vector<RankInput>& all, const Shape& s, int M, int layout_kind,
                                      const std::vector<std::vector<uint8_t>>& ys, int dtype, int rank) {
  int R = s.nranks, H = s.hidden, K = s.topk, L = s.local();
  const RankInput& me = all[rank];
  int T = me.num_tokens;
  std::vector<uint8_t> out(static_cast<size_t>(T) * H * elemSize(dtype));
  // expert-major: packed row of (this rank's token t, global expert e) on the expert's owner
  std::vector<std::vector<int>> packed_row;  // [E][T]
  if (layout_kind == EP_LL_EXPERT_MAJOR) {
    packed_row.assign(s.num_experts, std::vector<int>(T, -1));
    for (int e = 0; e < s.num_experts; ++e) {
      int row = 0;
      for (int src = 0; src < R; ++src)
        for (int t = 0; t < all[src].num_tokens; ++t) {
          if (!namesExpert(all[src], s, t, e)) continue;
          if (src == rank) packed_row[e][t] = row;
          ++row;
        }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) {
        int64_t e = me.topk_idx[static_cast<size_t>(t) * K + k];
        if (e < 0) continue;
        int owner = static_cast<int>(e / L), le = static_cast<int>(e % L);
        int row = layout_kind == EP_LL_EXPERT_MAJOR ? packed_row[e][t] : rank * M + t;
        float v = epcomm::loadAsFloat(ys[owner].data(), (static_cast<size_t>(le) * R * M + row) * H + h, dtype);
        volatile float prod = me.topk_weights[static_cast<size_t>(t) * K + k] * v;  // no fused multiply-add
        acc = acc + prod;
      }
      epcomm::storeFromFloat(out.data(), static_cast<size_t>(t) * H + h, dtype, acc);
    }
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// alltoallv, host counts (MPI semantics, counts/displacements in elements).
//   sends[p] = rank p's sendbuf; counts[p][q] = elements p sends to q; sdispls[p][q] = offset in p's sendbuf;
//   rdispls[q][p] = offset in q's recvbuf where p's data lands. Returns rank `rank`'s recvbuf of
//   recv_elems elements, poison where nothing lands.
// ---------------------------------------------------------------------------------------------------------
inline std::vector<uint8_t> alltoallv(const std::vector<std::vector<uint8_t>>& sends,
                                      const std::vector<std::vector<size_t>>& counts,
                                      const std::vector<std::vector<size_t>>& sdispls,
                                      const std::vector<std::vector<size_t>>& rdispls, size_t elem, int rank,
                                      size_t recv_elems, uint8_t poison) {
  std::vector<uint8_t> out(recv_elems * elem, poison);
  for (size_t p = 0; p < sends.size(); ++p) {
    size_t n = counts[p][rank];
    for (size_t i = 0; i < n * elem; ++i)
      out[rdispls[rank][p] * elem + i] = sends[p][sdispls[p][rank] * elem + i];
  }
  return out;
}

// Device-count variant: sendbufs packed by destination in rank order; the receiver packs by source rank
// ascending into a capacity of `capacity` elements; elements past it are dropped and counted.
struct AlltoallvDeviceResult {
  std::vector<uint8_t> recv;          // [capacity] elements, poison where nothing lands
  std::vector<int64_t> recv_counts;   // [R] what each source sent (full count, even if dropped)
  int64_t num_dropped = 0;
  epResult_t result = epSuccess;      // epCapacityExceeded when anything was dropped
};

inline AlltoallvDeviceResult alltoallvDevice(const std::vector<std::vector<uint8_t>>& sends,
                                             const std::vector<std::vector<int64_t>>& counts, size_t elem,
                                             size_t capacity, int rank, uint8_t poison) {
  AlltoallvDeviceResult out;
  size_t R = sends.size();
  out.recv.assign(capacity * elem, poison);
  out.recv_counts.assign(R, 0);
  size_t pos = 0;  // elements placed so far
  for (size_t p = 0; p < R; ++p) {
    size_t offset = 0;  // where p's data for `rank` starts in p's sendbuf
    for (int q = 0; q < rank; ++q) offset += static_cast<size_t>(counts[p][q]);
    size_t n = static_cast<size_t>(counts[p][rank]);
    out.recv_counts[p] = counts[p][rank];
    for (size_t i = 0; i < n; ++i) {
      if (pos < capacity) {
        std::memcpy(&out.recv[pos * elem], &sends[p][(offset + i) * elem], elem);
        ++pos;
      } else {
        out.num_dropped += 1;
      }
    }
  }
  out.result = out.num_dropped > 0 ? epCapacityExceeded : epSuccess;
  return out;
}

}  // namespace epref
