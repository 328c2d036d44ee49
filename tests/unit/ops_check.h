// Every operation of the C API once, checked bit for bit against tests/unit/reference.h in the "masked world" (a
// masked rank has no tokens and every routing entry to it reads -1), with the drop counters the calls should add:
// shared by the elastic tests (test_elastic.cc) and the fault soak (tests/soak/soak.cc).
#pragma once
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "api_world.h"
#include "epcomm/epcomm.h"
#include "reference.h"

namespace epcomm::test::ops {

using epcomm::test::fmt;
using epcomm::test::hashOf;

constexpr uint8_t kPoison = 0x5A;

inline double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One step's inputs, the same computation on every rank (seeded), and the reference in the masked world.
struct Step {
  int R, E, H = 256, K = 3, M = 16, dtype = epBfloat16;
  uint64_t seed;
  std::vector<uint8_t> active;
  std::vector<epref::RankInput> all, masked;  // real inputs; the masked world
  std::vector<std::vector<size_t>> a2a;      // [p][q] elements p sends q

  epref::Shape shape() const {
    epref::Shape s;
    s.nranks = R;
    s.num_experts = E;
    s.hidden = H;
    s.topk = K;
    return s;
  }
  size_t row() const { return static_cast<size_t>(H) * 2; }

  Step(int nranks, uint64_t sd, const std::vector<uint8_t>& act) : R(nranks), E(2 * nranks), seed(sd), active(act) {
    const int L = E / R;
    all.resize(R);
    for (int s = 0; s < R; ++s) {
      epref::RankInput& in = all[s];
      in.num_tokens = static_cast<int>(hashOf({seed, 10, uint64_t(s)}) % (M + 1));
      const int T = in.num_tokens;
      in.x.resize(static_cast<size_t>(T) * row());
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < H; ++j) {
          float v = 0.25f * static_cast<float>(hashOf({seed, 11, uint64_t(s), uint64_t(t), uint64_t(j)}) % 16) - 2.0f;
          uint16_t b = epcomm::floatToBf16(v);
          memcpy(&in.x[t * row() + j * 2], &b, 2);
        }
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k) {
          uint64_t h = hashOf({seed, 12, uint64_t(s), uint64_t(t), uint64_t(k)});
          int64_t e = h % 7 == 0 ? -1 : static_cast<int64_t>((h >> 8) % E);
          if (k > 0 && h % 11 == 0) e = in.topk_idx.back();  // a repeated expert now and then
          in.topk_idx.push_back(e);
          in.topk_weights.push_back(0.125f * static_cast<float>(1 + (h >> 20) % 8));
        }
    }
    masked = all;
    for (int s = 0; s < R; ++s) {
      if (!active[s]) {
        masked[s] = epref::RankInput();
        continue;
      }
      for (int64_t& e : masked[s].topk_idx)
        if (e >= 0 && !active[e / L]) e = -1;
    }
    a2a.assign(R, std::vector<size_t>(R));
    for (int p = 0; p < R; ++p)
      for (int q = 0; q < R; ++q) a2a[p][q] = hashOf({seed, 13, uint64_t(p), uint64_t(q)}) % 40;
  }

  // Tokens of rank me not sent to each masked rank (one per token and rank).
  std::vector<int64_t> tokenDrops(int me) const {
    std::vector<int64_t> d(R, 0);
    for (int r = 0; r < R; ++r)
      if (!active[r])
        for (int t = 0; t < all[me].num_tokens; ++t) d[r] += epref::namesRank(all[me], shape(), t, r);
    return d;
  }
  uint8_t a2aByte(int p, int q, size_t i) const { return static_cast<uint8_t>(hashOf({seed, 14, uint64_t(p), uint64_t(q), i})); }
};

// A byte buffer pre-filled with poison.
inline std::vector<uint8_t> poisoned(size_t n) { return std::vector<uint8_t>(n, kPoison); }

// Runs every operation once on the survivors (layout, HT exact / worst-token / cached + combine, LL both layouts
// with both halves and split halves + combine, alltoallv host and device counts, barrier) and checks each.
// drops_rows / drops_a2a accumulate what this rank's calls should have counted. "" when all is right.
inline std::string runAll(epComm_t comm, int me, const Step& st, std::vector<int64_t>& drops_rows,
                   std::vector<int64_t>& drops_a2a, double* slowest_ms = nullptr) {
  const int R = st.R, E = st.E, H = st.H, K = st.K, M = st.M, L = E / R, dt = st.dtype;
  const epref::Shape sh = st.shape();
  const epref::RankInput& in = st.all[me];
  const int T = in.num_tokens;
  const std::vector<int64_t> tdrop = st.tokenDrops(me);
  auto t0 = std::chrono::steady_clock::now();
  auto lap = [&]() {
    double ms = msSince(t0);
    if (slowest_ms && ms > *slowest_ms) *slowest_ms = ms;
    t0 = std::chrono::steady_clock::now();
  };
  epResult_t r;
#define OP(call, what)                                                                                        \
  do {                                                                                                        \
    t0 = std::chrono::steady_clock::now();                                                                    \
    r = (call);                                                                                               \
    lap();                                                                                                    \
    if (r != epSuccess) return fmt("%s: %s (%s)", what, epGetErrorString(r), epGetLastError(comm));           \
  } while (0)
  const void* xp = T ? in.x.data() : nullptr;
  const int64_t* ip = T ? in.topk_idx.data() : nullptr;
  const float* wp = T ? in.topk_weights.data() : nullptr;

  // ---- layout ----
  {
    std::vector<int> per_rank(R, -1), per_expert(E, -1);
    std::vector<uint8_t> in_rank(static_cast<size_t>(T) * R + 1, 9);
    OP(epGetDispatchLayout(comm, ip, T, K, E, per_rank.data(), per_expert.data(), in_rank.data(), nullptr), "layout");
    epref::Layout want = epref::layout(st.masked[me], sh);
    if (per_rank != want.tokens_per_rank) return "layout: num_tokens_per_rank";
    if (per_expert != want.tokens_per_expert) return "layout: num_tokens_per_expert";
    if (memcmp(in_rank.data(), want.is_token_in_rank.data(), static_cast<size_t>(T) * R) != 0)
      return "layout: is_token_in_rank";
  }

  // ---- HT ----
  std::vector<epref::HtRecv> ref(R);
  std::vector<std::vector<uint8_t>> ys(R);
  for (int r2 = 0; r2 < R; ++r2) {
    ref[r2] = epref::htDispatch(st.masked, sh, dt, r2);
    ys[r2] = ref[r2].x;
  }
  const epref::HtRecv& want = ref[me];
  const std::vector<uint8_t> want_combined = epref::htCombine(st.masked, sh, ys, dt, me);
  epHtHandle_t h;
  if (epHtHandleCreate(comm, M, &h) != epSuccess) return "handle create";
  struct Free {
    epHtHandle_t h;
    ~Free() { epHtHandleDestroy(h); }
  } free_h{h};
  int worst = 0;
  for (const auto& a : st.all) worst += a.num_tokens;
  for (int mode = 0; mode < 3; ++mode) {  // exact, worst-token, cached worst-token
    epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
    a.num_tokens = T;
    a.hidden = H;
    a.topk = K;
    a.num_experts = E;
    a.dtype = dt;
    a.x = xp;
    a.topk_idx = ip;
    a.topk_weights = wp;
    int rows = want.num_recv;
    if (mode == 0) {
      int n = -1;
      std::vector<int> pe(L, -1);
      OP(epHtDispatchNotify(comm, &a, h, &n, pe.data(), nullptr), "HT notify");
      if (n != want.num_recv || pe != want.tokens_per_expert) return fmt("HT notify counts: %d rows, want %d", n, want.num_recv);
    } else {
      a.num_worst_tokens = worst;
      rows = worst;
      if (mode == 2) a.flags = EP_HT_USE_HANDLE_LAYOUT;
    }
    std::vector<uint8_t> rx = poisoned(rows * st.row() + 1);
    std::vector<int64_t> ri(static_cast<size_t>(rows) * K + 1, 77);
    std::vector<float> rw(static_cast<size_t>(rows) * K + 1, 77.0f);
    std::vector<int> rpe(L, -1), nrecv(1, -1);
    a.recv_x = rows ? rx.data() : nullptr;
    a.recv_x_bytes = rows * st.row();
    a.recv_topk_idx = rows ? ri.data() : nullptr;
    a.recv_topk_idx_bytes = sizeof(int64_t) * rows * K;
    a.recv_topk_weights = rows ? rw.data() : nullptr;
    a.recv_topk_weights_bytes = sizeof(float) * rows * K;
    a.recv_tokens_per_expert = rpe.data();
    a.num_recv_tokens = nrecv.data();
    OP(epHtDispatch(comm, &a, h, nullptr), fmt("HT dispatch mode %d", mode).c_str());
    for (int p = 0; p < R; ++p) drops_rows[p] += tdrop[p];
    if (nrecv[0] != want.num_recv) return fmt("HT dispatch mode %d: %d rows, want %d", mode, nrecv[0], want.num_recv);
    if (memcmp(rx.data(), want.x.data(), want.x.size()) != 0) return fmt("HT dispatch mode %d: recv_x", mode);
    if (rpe != want.tokens_per_expert) return fmt("HT dispatch mode %d: recv_tokens_per_expert", mode);
    if (mode < 2) {  // cached dispatch leaves recv_topk_* alone
      std::vector<int64_t> wi = want.topk_idx;
      std::vector<float> ww = want.topk_weights;
      if (mode == 1) epref::htPadToWorst(want, K, worst, &wi, &ww);
      if (memcmp(ri.data(), wi.data(), wi.size() * 8) != 0) return fmt("HT dispatch mode %d: recv_topk_idx", mode);
      if (memcmp(rw.data(), ww.data(), ww.size() * 4) != 0) return fmt("HT dispatch mode %d: recv_topk_weights", mode);
    }
    // Combine with the identity expert: x = the received rows.
    epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
    c.num_tokens = T;
    c.hidden = H;
    c.dtype = dt;
    c.x = want.num_recv ? rx.data() : nullptr;
    c.x_bytes = want.num_recv * st.row();
    std::vector<uint8_t> out = poisoned(T * st.row() + 1);
    c.combined_x = T ? out.data() : nullptr;
    c.combined_x_bytes = T * st.row();
    OP(epHtCombine(comm, &c, h, nullptr), fmt("HT combine after mode %d", mode).c_str());
    if (memcmp(out.data(), want_combined.data(), want_combined.size()) != 0)
      return fmt("HT combine after mode %d: combined_x", mode);
  }

  // ---- LL ----
  for (int lay = 0; lay < 2; ++lay) {
    const bool em = lay == EP_LL_EXPERT_MAJOR;
    std::vector<epref::LlRecv> lref(R);
    for (int r2 = 0; r2 < R; ++r2) lref[r2] = epref::llDispatch(st.masked, sh, M, dt, false, lay, r2, kPoison);
    // Each rank's expert output y [L, R*M, H] with the identity expert.
    std::vector<std::vector<uint8_t>> ly(R);
    for (int r2 = 0; r2 < R; ++r2) {
      if (em) {
        ly[r2] = lref[r2].x;
      } else {
        ly[r2].assign(static_cast<size_t>(L) * R * M * st.row(), 0);
        for (int le = 0; le < L; ++le)
          memcpy(&ly[r2][static_cast<size_t>(le) * R * M * st.row()], lref[r2].x.data(), lref[r2].x.size());
      }
    }
    const std::vector<uint8_t> want_out = epref::llCombine(st.masked, sh, M, lay, ly, dt, me);
    const epref::LlRecv& lw = lref[me];
    for (int split = 0; split < 2; ++split) {
      std::vector<uint8_t> rx = poisoned(lw.x.size());
      std::vector<int> cnt(em ? L : R, -1), src(em ? L * R * M : 1, -1);
      std::vector<int64_t> range(em ? L * R : 1, -1), topk(em ? 1 : R * M * K, -7);
      epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
      a.num_tokens = T;
      a.max_tokens_per_rank = M;
      a.hidden = H;
      a.topk = K;
      a.num_experts = E;
      a.dtype = dt;
      a.layout = lay;
      a.x = xp;
      a.topk_idx = ip;
      a.recv_x = rx.data();
      a.recv_x_bytes = rx.size();
      a.recv_count = cnt.data();
      a.recv_count_bytes = sizeof(int) * cnt.size();
      if (em) {
        a.recv_src_info = src.data();
        a.recv_src_info_bytes = sizeof(int) * src.size();
        a.recv_layout_range = range.data();
        a.recv_layout_range_bytes = sizeof(int64_t) * range.size();
      } else {
        a.recv_topk_idx = topk.data();
        a.recv_topk_idx_bytes = sizeof(int64_t) * topk.size();
      }
      const std::string what = fmt("LL %s %s", em ? "expert-major" : "rank-major", split ? "split" : "joined");
      if (split) {
        a.phases = EP_LL_SEND;
        OP(epLlDispatch(comm, &a, nullptr), (what + " dispatch send").c_str());
        a.phases = EP_LL_RECV;
        OP(epLlDispatch(comm, &a, nullptr), (what + " dispatch recv").c_str());
      } else {
        OP(epLlDispatch(comm, &a, nullptr), (what + " dispatch").c_str());
      }
      for (int p = 0; p < R; ++p) drops_rows[p] += tdrop[p];
      if (rx != lw.x) return what + ": recv_x";
      if (cnt != lw.count) return what + ": recv_count";
      if (em) {
        if (range != lw.layout_range) return what + ": recv_layout_range";
        for (int le = 0; le < L; ++le)
          for (int i = 0; i < lw.count[le]; ++i)
            if (src[le * R * M + i] != lw.src_info[le * R * M + i]) return what + ": recv_src_info";
      } else if (topk != lw.topk_idx) {
        return what + ": recv_topk_idx";
      }
      // Combine with this rank's y (the identity expert on what it received).
      std::vector<uint8_t> y = em ? rx : ly[me];
      std::vector<uint8_t> out = poisoned(T * st.row() + 1);
      epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
      c.num_tokens = T;
      c.max_tokens_per_rank = M;
      c.hidden = H;
      c.topk = K;
      c.num_experts = E;
      c.dtype = dt;
      c.layout = lay;
      c.y = y.data();
      c.y_bytes = y.size();
      c.recv_count = cnt.data();
      c.recv_src_info = em ? src.data() : nullptr;
      c.recv_layout_range = em ? range.data() : nullptr;
      c.recv_topk_idx = em ? nullptr : topk.data();
      c.topk_idx = ip;
      c.topk_weights = wp;
      c.out = T ? out.data() : nullptr;
      c.out_bytes = T * st.row();
      if (split) {
        c.phases = EP_LL_SEND;
        OP(epLlCombine(comm, &c, nullptr), (what + " combine send").c_str());
        c.phases = EP_LL_RECV;
        OP(epLlCombine(comm, &c, nullptr), (what + " combine recv").c_str());
      } else {
        OP(epLlCombine(comm, &c, nullptr), (what + " combine").c_str());
      }
      if (memcmp(out.data(), want_out.data(), want_out.size()) != 0) return what + ": combine out";
    }
  }

  // ---- alltoallv, host counts (recv_counts of a masked source may be anything: it is not compared) ----
  {
    std::vector<size_t> sc(R), sd(R), rc(R), rd(R);
    size_t so = 0, ro = 0;
    for (int q = 0; q < R; ++q) {
      sc[q] = st.a2a[me][q], sd[q] = so, so += sc[q];
      rc[q] = st.active[q] ? st.a2a[q][me] : 1000 + q, rd[q] = ro, ro += rc[q];
    }
    std::vector<uint8_t> sb(so + 1), rb = poisoned(ro + 1), wb = poisoned(ro + 1);
    for (int q = 0; q < R; ++q)
      for (size_t i = 0; i < sc[q]; ++i) sb[sd[q] + i] = st.a2aByte(me, q, i);
    for (int p = 0; p < R; ++p)
      if (st.active[p])
        for (size_t i = 0; i < rc[p]; ++i) wb[rd[p] + i] = st.a2aByte(p, me, i);
    OP(epAlltoallv(comm, sb.data(), sc.data(), sd.data(), rb.data(), rc.data(), rd.data(), epUint8, nullptr),
       "alltoallv");
    for (int q = 0; q < R; ++q)
      if (!st.active[q]) drops_a2a[q] += static_cast<int64_t>(sc[q]);
    if (rb != wb) return "alltoallv: recvbuf";
  }
  // ---- alltoallv, device counts ----
  {
    std::vector<int64_t> sc(R), rc(R, -5), dropped(1, -5);
    size_t so = 0, cap = 0;
    for (int q = 0; q < R; ++q) sc[q] = static_cast<int64_t>(st.a2a[me][q]), so += sc[q];
    std::vector<uint8_t> sb(so + 1);
    so = 0;
    for (int q = 0; q < R; ++q)
      for (int64_t i = 0; i < sc[q]; ++i) sb[so++] = st.a2aByte(me, q, static_cast<size_t>(i));
    std::vector<uint8_t> want_rb;
    std::vector<int64_t> want_rc(R, 0);
    for (int p = 0; p < R; ++p)
      if (st.active[p]) {
        want_rc[p] = static_cast<int64_t>(st.a2a[p][me]);
        for (size_t i = 0; i < st.a2a[p][me]; ++i) want_rb.push_back(st.a2aByte(p, me, i));
      }
    cap = want_rb.size() + 8;
    std::vector<uint8_t> rb = poisoned(cap);
    want_rb.resize(cap, kPoison);
    OP(epAlltoallvDevice(comm, sb.data(), sc.data(), rb.data(), cap, rc.data(), dropped.data(), epUint8, nullptr),
       "alltoallv (device counts)");
    for (int q = 0; q < R; ++q)
      if (!st.active[q]) drops_a2a[q] += sc[q];
    if (rb != want_rb) return "alltoallv (device counts): recvbuf";
    if (rc != want_rc) return "alltoallv (device counts): recv_counts";
    if (dropped[0] != 0) return "alltoallv (device counts): num_dropped";
  }
  OP(epCommBarrier(comm, nullptr), "barrier");
#undef OP
  return "";
}

// The drop counters equal what the calls should have counted.
inline std::string checkDrops(epComm_t comm, const std::vector<int64_t>& rows, const std::vector<int64_t>& a2a) {
  const int R = static_cast<int>(rows.size());
  std::vector<int64_t> got_rows(R, -1), got_a2a(R, -1);
  epResult_t r = epCommGetMaskedDrops(comm, got_rows.data(), got_a2a.data(), nullptr);
  if (r != epSuccess) return fmt("epCommGetMaskedDrops: %s", epGetLastError(comm));
  for (int p = 0; p < R; ++p)
    if (got_rows[p] != rows[p] || got_a2a[p] != a2a[p])
      return fmt("drops to rank %d: %lld rows, %lld elements; want %lld, %lld", p, (long long)got_rows[p],
                 (long long)got_a2a[p], (long long)rows[p], (long long)a2a[p]);
  return "";
}

// Arguments of single operations on rank me's inputs of a step (outside runAll's checked mix): HT dispatch without
// outputs or weights (the caller adds what its mode needs), and an expert-major LL dispatch into / combine of `b`.
struct LlBufs {
  std::vector<uint8_t> rx, out;
  std::vector<int> cnt, src;
  std::vector<int64_t> range;
};
// The input fields HT and LL dispatch args share (they name them alike): rank me's tokens of the step.
template <typename Args>
Args dispatchInput(Args a, const Step& st, int me) {
  const epref::RankInput& in = st.all[me];
  const int T = in.num_tokens;
  a.num_tokens = T;
  a.hidden = st.H;
  a.topk = st.K;
  a.num_experts = st.E;
  a.dtype = st.dtype;
  a.x = T ? in.x.data() : nullptr;
  a.topk_idx = T ? in.topk_idx.data() : nullptr;
  return a;
}
inline epHtDispatchArgs_t htArgs(const Step& st, int me) {
  return dispatchInput<epHtDispatchArgs_t>(EP_HT_DISPATCH_ARGS_INIT, st, me);
}
inline epLlDispatchArgs_t llDispatchArgs(const Step& st, int me, LlBufs& b) {
  const int R = st.R, L = st.E / R, M = st.M;
  b.rx.assign(static_cast<size_t>(L) * R * M * st.row(), 0);
  b.cnt.assign(L, 0);
  b.src.assign(static_cast<size_t>(L) * R * M, 0);
  b.range.assign(static_cast<size_t>(L) * R, 0);
  epLlDispatchArgs_t a = dispatchInput<epLlDispatchArgs_t>(EP_LL_DISPATCH_ARGS_INIT, st, me);
  a.max_tokens_per_rank = M;
  a.recv_x = b.rx.data();
  a.recv_x_bytes = b.rx.size();
  a.recv_count = b.cnt.data();
  a.recv_count_bytes = sizeof(int) * b.cnt.size();
  a.recv_src_info = b.src.data();
  a.recv_src_info_bytes = sizeof(int) * b.src.size();
  a.recv_layout_range = b.range.data();
  a.recv_layout_range_bytes = sizeof(int64_t) * b.range.size();
  return a;
}
// Combines what llDispatchArgs' dispatch left in b (its rows as the expert outputs) into b.out.
inline epLlCombineArgs_t llCombineArgs(const Step& st, int me, LlBufs& b) {
  const epref::RankInput& in = st.all[me];
  const int T = in.num_tokens;
  b.out.assign(static_cast<size_t>(T) * st.row() + 1, 0);
  epLlCombineArgs_t c = EP_LL_COMBINE_ARGS_INIT;
  c.num_tokens = T;
  c.max_tokens_per_rank = st.M;
  c.hidden = st.H;
  c.topk = st.K;
  c.num_experts = st.E;
  c.dtype = st.dtype;
  c.y = b.rx.data();
  c.y_bytes = b.rx.size();
  c.recv_count = b.cnt.data();
  c.recv_src_info = b.src.data();
  c.recv_layout_range = b.range.data();
  c.topk_idx = T ? in.topk_idx.data() : nullptr;
  c.topk_weights = T ? in.topk_weights.data() : nullptr;
  c.out = T ? b.out.data() : nullptr;
  c.out_bytes = static_cast<size_t>(T) * st.row();
  return c;
}

}  // namespace epcomm::test::ops
