// A seeded world of ranks for tests that drive the C API (test_api_contract, test_api_fuzz): every rank can
// compute any rank's inputs, so each rank checks its own outputs against a reference without communication.
// Output buffers are poisoned and guarded: a call may write only inside its buffers, and a failed call writes
// none of them. A buffer of 0 bytes is passed as NULL (the header's zero-size NULL rule).
#pragma once
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/routing.h"
#include "epcomm/epcomm.h"

namespace epcomm::test {

inline uint64_t mix64(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline uint64_t hashOf(std::initializer_list<uint64_t> v) {
  uint64_t h = 0x6570636f6d6dull;
  for (uint64_t x : v) h = mix64(h ^ x);
  return h;
}

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() { return s = mix64(s); }
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }  // [lo, hi]
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }
};

// An output buffer with guard bytes on both sides. data() is NULL when it holds nothing.
struct Guarded {
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kGuardByte = 0xA5, kPoisonByte = 0x5A;
  std::vector<uint8_t> mem;
  size_t n = 0;
  void init(size_t bytes) {
    n = bytes < (size_t{1} << 40) ? bytes : 0;
    mem.assign(bytes + 2 * kGuard, kGuardByte);
    poison();
  }
  void poison() {
    if (n) memset(mem.data() + kGuard, kPoisonByte, n);
  }
  void* data() { return n ? mem.data() + kGuard : nullptr; }
  template <typename T>
  T* as() { return static_cast<T*>(data()); }
  bool guardsOk() const {
    if (mem.empty()) return true;  // never initialised
    for (size_t i = 0; i < kGuard; ++i)
      if (mem[i] != kGuardByte || mem[kGuard + n + i] != kGuardByte) return false;
    return true;
  }
  bool poisoned() const {
    for (size_t i = 0; i < n; ++i)
      if (mem[kGuard + i] != kPoisonByte) return false;
    return true;
  }
};

// Shapes of one operation, the same on every rank except the token counts.
struct World {
  uint64_t seed = 1;
  int R = 2, H = 128, K = 2, E = 4, M = 8;  // M: LL max_tokens_per_rank (>= every T)
  int dtype = epBfloat16;
  std::vector<int> T;  // tokens of each rank

  int L() const { return E / R; }
  size_t es() const { return dtypeSize(dtype); }
  size_t row() const { return static_cast<size_t>(H) * es(); }
  int maxT() const {
    int m = 0;
    for (int t : T) m = t > m ? t : m;
    return m;
  }
  int sumT() const {
    int s = 0;
    for (int t : T) s += t;
    return s;
  }

  // Values are multiples of 1/4 in [-2, 1.75]: sums and weighted sums below are exact in fp32.
  float xval(int s, int t, int j) const {
    return 0.25f * static_cast<float>(hashOf({seed, 1, static_cast<uint64_t>(s), static_cast<uint64_t>(t),
                                               static_cast<uint64_t>(j)}) % 16) - 2.0f;
  }
  int64_t expert(int s, int t, int k) const {
    uint64_t h = hashOf({seed, 2, static_cast<uint64_t>(s), static_cast<uint64_t>(t), static_cast<uint64_t>(k)});
    return h % 8 == 0 ? -1 : static_cast<int64_t>((h >> 8) % static_cast<uint64_t>(E));
  }
  float weight(int s, int t, int k) const {
    return 0.125f * static_cast<float>(1 + hashOf({seed, 3, static_cast<uint64_t>(s), static_cast<uint64_t>(t),
                                                   static_cast<uint64_t>(k)}) % 8);
  }
  bool onRank(int s, int t, int r) const {
    for (int k = 0; k < K; ++k) {
      int64_t e = expert(s, t, k);
      if (e >= 0 && e / L() == r) return true;
    }
    return false;
  }
  bool namesExpert(int s, int t, int64_t e) const {
    for (int k = 0; k < K; ++k)
      if (expert(s, t, k) == e) return true;
    return false;
  }
  // A value in `dtype`'s bytes (exact for the values used here).
  void store(uint8_t* p, float v) const {
    if (dtype == epBfloat16) {
      uint16_t h = floatToBf16(v);
      memcpy(p, &h, 2);
    } else if (dtype == epFloat16) {
      uint16_t h = floatToFp16(v);
      memcpy(p, &h, 2);
    } else {
      memcpy(p, &v, 4);
    }
  }
  std::vector<uint8_t> x(int s) const {
    std::vector<uint8_t> v(static_cast<size_t>(T[s]) * row());
    for (int t = 0; t < T[s]; ++t)
      for (int j = 0; j < H; ++j) store(v.data() + t * row() + j * es(), xval(s, t, j));
    return v;
  }
  std::vector<int64_t> idx(int s) const {
    std::vector<int64_t> v;
    for (int t = 0; t < T[s]; ++t)
      for (int k = 0; k < K; ++k) v.push_back(expert(s, t, k));
    return v;
  }
  std::vector<float> w(int s) const {
    std::vector<float> v;
    for (int t = 0; t < T[s]; ++t)
      for (int k = 0; k < K; ++k) v.push_back(weight(s, t, k));
    return v;
  }
  // Row t of rank s as dtype bytes, scaled by f (exact; + 0 because the operations' sums start from +0).
  bool rowEquals(const uint8_t* got, int s, int t, float f) const {
    std::vector<uint8_t> want(row());
    for (int j = 0; j < H; ++j) store(want.data() + j * es(), xval(s, t, j) * f + 0.0f);
    return memcmp(got, want.data(), row()) == 0;
  }
  // HT receive side of rank me: (source, token) of each received row, in order.
  std::vector<std::pair<int, int>> htRows(int me) const {
    std::vector<std::pair<int, int>> rows;
    for (int s = 0; s < R; ++s)
      for (int t = 0; t < T[s]; ++t)
        if (onRank(s, t, me)) rows.push_back({s, t});
    return rows;
  }
  // Ranks that receive token t of rank s.
  int receivers(int s, int t) const {
    int n = 0;
    for (int r = 0; r < R; ++r) n += onRank(s, t, r);
    return n;
  }
};

// A readable string for a failed check.
inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

// One rank's inputs, output buffers and calls of every operation, with the checks of their outputs. The
// args builders prepare (poison) the buffers; the caller may change a copy of the args before calling. A check
// returns "" when the outputs are right, else what is wrong.
struct RankIo {
  const World& w;
  int me;
  epComm_t comm;
  std::vector<uint8_t> x;
  std::vector<int64_t> idx;
  std::vector<float> wt;
  // LL
  int ll_layout = EP_LL_EXPERT_MAJOR;
  Guarded ll_recv_x, ll_count, ll_src_info, ll_range, ll_topk, ll_out;
  std::vector<uint8_t> ll_y;
  // HT
  epHtHandle_t h = nullptr;
  int ht_rows = 0, ht_worst = 0;
  Guarded ht_recv_x, ht_recv_idx, ht_recv_w, ht_per_expert, ht_num_recv, ht_out;
  int ht_num_recv_host = -1;
  std::vector<int> ht_per_expert_host;
  // layout / alltoallv
  Guarded lay_rank, lay_expert, lay_in;
  int a2a_dtype = epFloat32;
  std::vector<uint8_t> a2a_send;
  std::vector<size_t> sc, sd, rc, rd;
  std::vector<int64_t> dsc;
  Guarded a2a_recv, a2a_counts, a2a_dropped;

  RankIo(const World& world, int rank, epComm_t c) : w(world), me(rank), comm(c) { reset(); }
  // New inputs after the world's shapes changed.
  void reset() {
    x = w.x(me);
    idx = w.idx(me);
    wt = w.w(me);
  }
  const void* xp() const { return x.empty() ? nullptr : x.data(); }
  const int64_t* idxp() const { return idx.empty() ? nullptr : idx.data(); }
  const float* wtp() const { return wt.empty() ? nullptr : wt.data(); }
  int T() const { return w.T[me]; }

  // ---- layout ----
  epResult_t layout() {
    lay_rank.init(sizeof(int) * w.R);
    lay_expert.init(sizeof(int) * w.E);
    lay_in.init(static_cast<size_t>(T()) * w.R);
    return epGetDispatchLayout(comm, idxp(), T(), w.K, w.E, lay_rank.as<int>(), lay_expert.as<int>(),
                               lay_in.as<uint8_t>(), nullptr);
  }
  std::string checkLayout() {
    if (!lay_rank.guardsOk() || !lay_expert.guardsOk() || !lay_in.guardsOk()) return "layout wrote past a buffer";
    for (int r = 0; r < w.R; ++r) {
      int n = 0;
      for (int t = 0; t < T(); ++t) {
        n += w.onRank(me, t, r);
        if (lay_in.as<uint8_t>()[t * w.R + r] != (w.onRank(me, t, r) ? 1 : 0))
          return fmt("is_token_in_rank[%d, %d] is wrong", t, r);
      }
      if (lay_rank.as<int>()[r] != n) return fmt("num_tokens_per_rank[%d] = %d, want %d", r, lay_rank.as<int>()[r], n);
    }
    for (int e = 0; e < w.E; ++e) {
      int n = 0;
      for (int t = 0; t < T(); ++t) n += w.namesExpert(me, t, e);
      if (lay_expert.as<int>()[e] != n) return fmt("num_tokens_per_expert[%d] = %d, want %d", e, lay_expert.as<int>()[e], n);
    }
    return "";
  }

  // ---- LL dispatch / combine (the expert stand-in is the identity: y = recv_x) ----
  epLlDispatchArgs_t llDispatchArgs(int layout, unsigned phases, bool fresh_buffers) {
    ll_layout = layout;
    const size_t L = w.L(), R = w.R, M = w.M;
    const bool em = layout == EP_LL_EXPERT_MAJOR;
    if (fresh_buffers) {
      ll_recv_x.init((em ? L * R * M : R * M) * w.row());
      ll_count.init(sizeof(int) * (em ? L : R));
      ll_src_info.init(em ? sizeof(int) * L * R * M : 0);
      ll_range.init(em ? sizeof(int64_t) * L * R : 0);
      ll_topk.init(em ? 0 : sizeof(int64_t) * R * M * w.K);
    }
    epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
    a.num_tokens = T();
    a.max_tokens_per_rank = w.M;
    a.hidden = w.H;
    a.topk = w.K;
    a.num_experts = w.E;
    a.dtype = w.dtype;
    a.layout = layout;
    a.phases = phases;
    a.x = xp();
    a.topk_idx = idxp();
    a.recv_x = ll_recv_x.data();
    a.recv_x_bytes = ll_recv_x.n;
    a.recv_count = ll_count.as<int>();
    a.recv_count_bytes = ll_count.n;
    a.recv_src_info = ll_src_info.as<int>();
    a.recv_src_info_bytes = ll_src_info.n;
    a.recv_layout_range = ll_range.as<int64_t>();
    a.recv_layout_range_bytes = ll_range.n;
    a.recv_topk_idx = ll_topk.as<int64_t>();
    a.recv_topk_idx_bytes = ll_topk.n;
    return a;
  }
  bool llGuardsOk() const {
    return ll_recv_x.guardsOk() && ll_count.guardsOk() && ll_src_info.guardsOk() && ll_range.guardsOk() &&
           ll_topk.guardsOk() && ll_out.guardsOk();
  }
  bool llDispatchUntouched() const {
    return ll_recv_x.poisoned() && ll_count.poisoned() && ll_src_info.poisoned() && ll_range.poisoned() &&
           ll_topk.poisoned();
  }
  std::string checkLlDispatch() {
    if (!llGuardsOk()) return "LL dispatch wrote past a buffer";
    const int L = w.L(), R = w.R, M = w.M;
    const uint8_t* rx = ll_recv_x.as<uint8_t>();
    if (ll_layout == EP_LL_EXPERT_MAJOR) {
      for (int e = 0; e < L; ++e) {
        const int64_t ge = static_cast<int64_t>(me) * L + e;
        int row = 0;
        for (int s = 0; s < R; ++s) {
          const int begin = row;
          for (int t = 0; t < w.T[s]; ++t) {
            if (!w.namesExpert(s, t, ge)) continue;
            const size_t r = static_cast<size_t>(e) * R * M + row;
            if (ll_src_info.as<int>()[r] != t) return fmt("recv_src_info[%d, %d] = %d, want %d", e, row, ll_src_info.as<int>()[r], t);
            if (!w.rowEquals(rx + r * w.row(), s, t, 1.0f)) return fmt("recv_x[%d, %d] is not token %d of rank %d", e, row, t, s);
            ++row;
          }
          if (ll_range.as<int64_t>()[e * R + s] != packLayoutRange(row - begin, begin))
            return fmt("recv_layout_range[%d, %d] is wrong", e, s);
        }
        if (ll_count.as<int>()[e] != row) return fmt("recv_count[%d] = %d, want %d", e, ll_count.as<int>()[e], row);
      }
    } else {
      for (int s = 0; s < R; ++s) {
        if (ll_count.as<int>()[s] != w.T[s]) return fmt("recv_count[%d] = %d, want %d", s, ll_count.as<int>()[s], w.T[s]);
        for (int t = 0; t < M; ++t) {
          bool here = false;
          for (int k = 0; k < w.K; ++k) {
            int64_t e = t < w.T[s] ? w.expert(s, t, k) : -1;
            int64_t want = (e >= 0 && e / L == me) ? e % L : -1;
            here = here || want >= 0;
            if (ll_topk.as<int64_t>()[(static_cast<size_t>(s) * M + t) * w.K + k] != want)
              return fmt("recv_topk_idx[%d, %d, %d] is wrong", s, t, k);
          }
          if (here && !w.rowEquals(rx + (static_cast<size_t>(s) * M + t) * w.row(), s, t, 1.0f))
            return fmt("recv_x[%d, %d] is not token %d of rank %d", s, t, t, s);
        }
      }
    }
    return "";
  }
  epLlCombineArgs_t llCombineArgs(unsigned phases, bool fresh_buffers) {
    const size_t L = w.L(), R = w.R, M = w.M, row = w.row();
    if (fresh_buffers) {
      ll_y.assign(L * R * M * row, 0);
      for (size_t e = 0; e < L; ++e)  // rank-major rows are [R, M]: the same rows for every expert
        memcpy(ll_y.data() + e * R * M * row,
               ll_recv_x.as<uint8_t>() + (ll_layout == EP_LL_EXPERT_MAJOR ? e * R * M * row : 0), R * M * row);
      ll_out.init(static_cast<size_t>(T()) * row);
    }
    epLlCombineArgs_t a = EP_LL_COMBINE_ARGS_INIT;
    a.num_tokens = T();
    a.max_tokens_per_rank = w.M;
    a.hidden = w.H;
    a.topk = w.K;
    a.num_experts = w.E;
    a.dtype = w.dtype;
    a.layout = ll_layout;
    a.phases = phases;
    a.y = ll_y.data();
    a.y_bytes = ll_y.size();
    a.recv_count = ll_count.as<int>();
    a.recv_src_info = ll_src_info.as<int>();
    a.recv_layout_range = ll_range.as<int64_t>();
    a.recv_topk_idx = ll_topk.as<int64_t>();
    a.topk_idx = idxp();
    a.topk_weights = wtp();
    a.out = ll_out.data();
    a.out_bytes = ll_out.n;
    return a;
  }
  std::string checkLlCombine() {
    if (!llGuardsOk()) return "LL combine wrote past a buffer";
    for (int t = 0; t < T(); ++t) {
      float f = 0.0f;
      for (int k = 0; k < w.K; ++k)
        if (w.expert(me, t, k) >= 0) f += w.weight(me, t, k);
      if (!w.rowEquals(ll_out.as<uint8_t>() + t * w.row(), me, t, f)) return fmt("LL combine out[%d] is wrong", t);
    }
    return "";
  }

  // ---- HT ----
  // worst > 0: worst-token mode with that many rows; 0: exact mode (epHtDispatchNotify first sets ht_rows).
  epHtDispatchArgs_t htDispatchArgs(int worst) {
    ht_worst = worst;
    const int rows = worst > 0 ? worst : ht_rows;
    ht_recv_x.init(static_cast<size_t>(rows) * w.row());
    ht_recv_idx.init(sizeof(int64_t) * rows * w.K);
    ht_recv_w.init(sizeof(float) * rows * w.K);
    ht_per_expert.init(sizeof(int) * w.L());
    ht_num_recv.init(sizeof(int));
    epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
    a.num_tokens = T();
    a.hidden = w.H;
    a.topk = w.K;
    a.num_experts = w.E;
    a.dtype = w.dtype;
    a.num_worst_tokens = worst;
    a.x = xp();
    a.topk_idx = idxp();
    a.topk_weights = wtp();
    a.recv_x = ht_recv_x.data();
    a.recv_x_bytes = ht_recv_x.n;
    a.recv_topk_idx = ht_recv_idx.as<int64_t>();
    a.recv_topk_idx_bytes = ht_recv_idx.n;
    a.recv_topk_weights = ht_recv_w.as<float>();
    a.recv_topk_weights_bytes = ht_recv_w.n;
    a.recv_tokens_per_expert = ht_per_expert.as<int>();
    a.num_recv_tokens = ht_num_recv.as<int>();
    return a;
  }
  epResult_t htNotify(const epHtDispatchArgs_t& a) {
    ht_per_expert_host.assign(w.L() + 1, -7);
    ht_num_recv_host = -7;
    epResult_t r = epHtDispatchNotify(comm, &a, h, &ht_num_recv_host, ht_per_expert_host.data(), nullptr);
    if (r == epSuccess) ht_rows = ht_num_recv_host;
    return r;
  }
  std::string checkHtNotify() {
    const auto rows = w.htRows(me);
    if (ht_num_recv_host != static_cast<int>(rows.size()))
      return fmt("notify: num_recv_tokens_host = %d, want %zu", ht_num_recv_host, rows.size());
    if (ht_per_expert_host[w.L()] != -7) return "notify wrote past recv_tokens_per_expert_host";
    return "";
  }
  bool htDispatchUntouched() const {
    return ht_recv_x.poisoned() && ht_recv_idx.poisoned() && ht_recv_w.poisoned() && ht_per_expert.poisoned() &&
           ht_num_recv.poisoned();
  }
  bool htGuardsOk() const {
    return ht_recv_x.guardsOk() && ht_recv_idx.guardsOk() && ht_recv_w.guardsOk() && ht_per_expert.guardsOk() &&
           ht_num_recv.guardsOk() && ht_out.guardsOk();
  }
  std::string checkHtDispatch() {
    if (!htGuardsOk()) return "HT dispatch wrote past a buffer";
    const auto rows = w.htRows(me);
    const int n = static_cast<int>(rows.size()), L = w.L(), K = w.K;
    if (ht_num_recv.as<int>()[0] != n) return fmt("num_recv_tokens = %d, want %d", ht_num_recv.as<int>()[0], n);
    for (int i = 0; i < n; ++i) {
      const int s = rows[i].first, t = rows[i].second;
      if (!w.rowEquals(ht_recv_x.as<uint8_t>() + i * w.row(), s, t, 1.0f))
        return fmt("recv_x[%d] is not token %d of rank %d", i, t, s);
      for (int k = 0; k < K; ++k) {
        int64_t e = w.expert(s, t, k);
        bool here = e >= 0 && e / L == me;
        if (ht_recv_idx.as<int64_t>()[i * K + k] != (here ? e % L : -1)) return fmt("recv_topk_idx[%d, %d] is wrong", i, k);
        if (ht_recv_w.as<float>()[i * K + k] != (here ? w.weight(s, t, k) : 0.0f))
          return fmt("recv_topk_weights[%d, %d] is wrong", i, k);
      }
    }
    for (int i = n; i < ht_worst; ++i)
      for (int k = 0; k < K; ++k)
        if (ht_recv_idx.as<int64_t>()[i * K + k] != -1 || ht_recv_w.as<float>()[i * K + k] != 0.0f)
          return fmt("padding row %d of recv_topk_idx/weights is not -1/0", i);
    for (int e = 0; e < L; ++e) {
      int c = 0;
      for (const auto& st : rows) c += w.namesExpert(st.first, st.second, static_cast<int64_t>(me) * L + e);
      if (ht_per_expert.as<int>()[e] != c) return fmt("recv_tokens_per_expert[%d] = %d, want %d", e, ht_per_expert.as<int>()[e], c);
    }
    ht_rows = n;
    return "";
  }
  epHtCombineArgs_t htCombineArgs() {
    ht_out.init(static_cast<size_t>(T()) * w.row());
    epHtCombineArgs_t a = EP_HT_COMBINE_ARGS_INIT;
    a.num_tokens = T();
    a.hidden = w.H;
    a.dtype = w.dtype;
    a.x = ht_rows > 0 ? ht_recv_x.data() : nullptr;
    a.x_bytes = static_cast<size_t>(ht_rows) * w.row();
    a.combined_x = ht_out.data();
    a.combined_x_bytes = ht_out.n;
    return a;
  }
  std::string checkHtCombine() {
    if (!htGuardsOk()) return "HT combine wrote past a buffer";
    for (int t = 0; t < T(); ++t)
      if (!w.rowEquals(ht_out.as<uint8_t>() + t * w.row(), me, t, static_cast<float>(w.receivers(me, t))))
        return fmt("HT combined_x[%d] is wrong", t);
    return "";
  }

  // ---- alltoallv: count(s, p) elements from s to p, each byte a function of (s, p, byte) ----
  size_t a2aCount(int s, int p) const { return hashOf({w.seed, 4, static_cast<uint64_t>(s), static_cast<uint64_t>(p)}) % 4; }
  uint8_t a2aByte(int s, int p, size_t i) const {
    return static_cast<uint8_t>(hashOf({w.seed, 5, static_cast<uint64_t>(s), static_cast<uint64_t>(p), i}));
  }
  // Host counts: blocks in rank order with one element of gap before each, so displacements matter.
  void a2aPrepare(int dtype) {
    a2a_dtype = dtype;
    const size_t es = dtypeSize(dtype);
    const int R = w.R;
    sc.assign(R, 0), sd.assign(R, 0), rc.assign(R, 0), rd.assign(R, 0), dsc.assign(R, 0);
    size_t so = 0, ro = 0;
    for (int p = 0; p < R; ++p) {
      sc[p] = a2aCount(me, p), dsc[p] = static_cast<int64_t>(sc[p]);
      sd[p] = ++so, so += sc[p];
      rc[p] = a2aCount(p, me);
      rd[p] = ++ro, ro += rc[p];
    }
    a2a_send.assign(so * es, 0);
    for (int p = 0; p < R; ++p)
      for (size_t i = 0; i < sc[p] * es; ++i) a2a_send[sd[p] * es + i] = a2aByte(me, p, i);
    a2a_recv.init(ro * es);
  }
  epResult_t alltoallv() {
    a2a_recv.poison();
    return epAlltoallv(comm, a2a_send.data(), sc.data(), sd.data(), a2a_recv.data(), rc.data(), rd.data(),
                       static_cast<epDataType_t>(a2a_dtype), nullptr);
  }
  std::string checkAlltoallv() {
    if (!a2a_recv.guardsOk()) return "alltoallv wrote past recvbuf";
    const size_t es = dtypeSize(a2a_dtype);
    for (int s = 0; s < w.R; ++s) {
      const uint8_t* gap = a2a_recv.as<uint8_t>() + (rd[s] - 1) * es;
      for (size_t i = 0; i < es; ++i)
        if (gap[i] != Guarded::kPoisonByte) return fmt("alltoallv wrote into the gap before rank %d's block", s);
      for (size_t i = 0; i < rc[s] * es; ++i)
        if (a2a_recv.as<uint8_t>()[rd[s] * es + i] != a2aByte(s, me, i)) return fmt("alltoallv block from rank %d is wrong", s);
    }
    return "";
  }
  // Device counts: send rows packed by destination, received packed by source, capacity = what arrives + slack.
  epResult_t alltoallvDevice(size_t capacity) {
    const size_t es = dtypeSize(a2a_dtype);
    std::vector<uint8_t> packed;
    for (int p = 0; p < w.R; ++p)
      packed.insert(packed.end(), a2a_send.begin() + sd[p] * es, a2a_send.begin() + (sd[p] + sc[p]) * es);
    a2a_send_packed = packed;
    a2a_recv.init(capacity * es);
    a2a_counts.init(sizeof(int64_t) * w.R);
    a2a_dropped.init(sizeof(int64_t));
    return epAlltoallvDevice(comm, a2a_send_packed.empty() ? nullptr : a2a_send_packed.data(), dsc.data(),
                             a2a_recv.data(), capacity, a2a_counts.as<int64_t>(), a2a_dropped.as<int64_t>(),
                             static_cast<epDataType_t>(a2a_dtype), nullptr);
  }
  size_t a2aIncoming() const {
    size_t n = 0;
    for (int s = 0; s < w.R; ++s) n += a2aCount(s, me);
    return n;
  }
  std::string checkAlltoallvDevice() {
    if (!a2a_recv.guardsOk() || !a2a_counts.guardsOk() || !a2a_dropped.guardsOk())
      return "alltoallv (device counts) wrote past a buffer";
    const size_t es = dtypeSize(a2a_dtype);
    size_t pos = 0;
    for (int s = 0; s < w.R; ++s) {
      if (a2a_counts.as<int64_t>()[s] != static_cast<int64_t>(a2aCount(s, me))) return fmt("recv_counts[%d] is wrong", s);
      for (size_t i = 0; i < a2aCount(s, me) * es; ++i)
        if (a2a_recv.as<uint8_t>()[pos * es + i] != a2aByte(s, me, i)) return fmt("alltoallv (device) block from rank %d is wrong", s);
      pos += a2aCount(s, me);
    }
    if (a2a_dropped.as<int64_t>()[0] != 0) return "num_dropped is not 0";
    return "";
  }
  std::vector<uint8_t> a2a_send_packed;
};

}  // namespace epcomm::test
