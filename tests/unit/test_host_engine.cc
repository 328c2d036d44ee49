// Property tests of the host engine against the single-process reference (reference.h).
//
// Each test forks one process per rank (multiproc.h). Every child generates ALL ranks' inputs from the same
// seed, runs the operation on its own, computes its expected outputs with the reference and compares them
// bit for bit. Output buffers are poisoned (0xA5) before each call, with a guard tail, so unwritten rows and
// out-of-bounds writes show. The seed is fresh per run and printed; EPCOMM_TEST_SEED=<n> reproduces a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <dirent.h>
#include <unistd.h>

#include "epcomm/epcomm.h"
#include "multiproc.h"
#include "transport/net/net.h"
#include "reference.h"

namespace {

using epref::RankInput;
using epref::Shape;

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 64;
constexpr int kTimeoutMs = 20000;          // per wait, inside the engine
constexpr int kRunTimeoutMs = 240000;      // per forked test run
constexpr int kLlMaxTokens = 16;           // config capacity of the LL cases
constexpr int kHtMaxTokens = 128;          // handle capacity of the HT cases

// ---------------------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------------------
uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a + 0x9e3779b97f4a7c15ull * (b + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t baseSeed() {
  static uint64_t seed = [] {
    const char* env = std::getenv("EPCOMM_TEST_SEED");
    uint64_t s = env ? std::strtoull(env, nullptr, 0)
                     : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::printf("test_host_engine seed: EPCOMM_TEST_SEED=%" PRIu64 "\n", s);
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

uint64_t nameSeed(const char* name, int R) {
  uint64_t h = baseSeed();
  for (const char* p = name; *p; ++p) h = mix(h, static_cast<uint8_t>(*p));
  return mix(h, static_cast<uint64_t>(R));
}

// ---------------------------------------------------------------------------------------------------------
// Buffers and comparisons
// ---------------------------------------------------------------------------------------------------------
// A caller buffer of `bytes`, poisoned, followed by a poisoned guard.
struct Buf {
  std::vector<uint8_t> mem;
  size_t bytes = 0;
  void reset(size_t n) {
    bytes = n;
    mem.assign(n + kGuard, kPoison);
  }
  uint8_t* p() { return mem.data(); }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(mem.data());
  }
};

template <class T>
const T* nz(const std::vector<T>& v) {  // never NULL, also for empty inputs
  static T dummy[16] = {};
  return v.empty() ? dummy : v.data();
}

struct Ctx {
  int rank = 0;
  uint64_t seed = 0;
  std::string cas;  // case description
  int failures = 0;
  int calls = 0;       // engine calls checked
  size_t compared = 0; // output bytes compared

  void fail(const char* op, const char* fmt, ...) __attribute__((format(printf, 3, 4))) {
    ++failures;
    if (failures > 12) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "MISMATCH [seed %" PRIu64 "] rank %d op %s case {%s}: %s\n", seed, rank, op, cas.c_str(),
                 msg);
  }
  bool ok(epResult_t rc, const char* op, epComm_t comm, epResult_t want = epSuccess) {
    ++calls;
    if (rc == want) return true;
    fail(op, "returned %d (%s), want %d (%s); last error: %s", rc, epGetErrorString(rc), want,
         epGetErrorString(want), epGetLastError(comm));
    return false;
  }
};

std::string hexElem(const uint8_t* p, size_t esz) {
  char s[40];
  uint64_t v = 0;
  std::memcpy(&v, p, esz > 8 ? 8 : esz);
  std::snprintf(s, sizeof s, "0x%0*" PRIx64, static_cast<int>(2 * esz), v);
  return s;
}

std::string showElem(const uint8_t* p, size_t esz, int dtype) {
  std::string s = hexElem(p, esz);
  if (dtype >= 0 && dtype <= epFloat8E4M3) {
    char f[48];
    std::snprintf(f, sizeof f, " (%.9g)", static_cast<double>(epcomm::loadAsFloat(p, 0, dtype)));
    s += f;
  } else if (dtype == epInt32 || dtype == epInt64) {
    int64_t v = dtype == epInt32 ? *reinterpret_cast<const int32_t*>(p) : *reinterpret_cast<const int64_t*>(p);
    s += " (" + std::to_string(v) + ")";
  }
  return s;
}

// Compares rows x row_bytes of got and want, element by element (esz bytes, dtype for printing); rows whose
// mask is 0 are skipped. Reports the first mismatch.
bool cmpRows(Ctx& c, const char* op, const char* what, const void* got_v, const void* want_v, size_t rows,
             size_t row_bytes, size_t esz, int dtype, const std::vector<uint8_t>* mask = nullptr) {
  const uint8_t* got = static_cast<const uint8_t*>(got_v);
  const uint8_t* want = static_cast<const uint8_t*>(want_v);
  for (size_t r = 0; r < rows; ++r) {
    if (mask && !(*mask)[r]) continue;
    c.compared += row_bytes;
    if (std::memcmp(got + r * row_bytes, want + r * row_bytes, row_bytes) == 0) continue;
    for (size_t col = 0; col < row_bytes / esz; ++col) {
      const uint8_t* g = got + r * row_bytes + col * esz;
      const uint8_t* w = want + r * row_bytes + col * esz;
      if (std::memcmp(g, w, esz) != 0) {
        c.fail(op, "%s row %zu col %zu: got %s want %s", what, r, col, showElem(g, esz, dtype).c_str(),
               showElem(w, esz, dtype).c_str());
        return false;
      }
    }
  }
  return true;
}

// Bytes [from, mem.size()) must still be poison (nothing written past the expected size / in the guard).
bool checkTail(Ctx& c, const char* op, const char* what, const Buf& b, size_t from) {
  for (size_t i = from; i < b.mem.size(); ++i)
    if (b.mem[i] != kPoison) {
      c.fail(op, "%s: byte %zu written past the %zu bytes of output (buffer %zu bytes)", what, i, from, b.bytes);
      return false;
    }
  return true;
}

// Rows [first, rows) of b (row_bytes each) must still hold the poison.
bool checkPoisonRows(Ctx& c, const char* op, const char* what, const Buf& b, size_t first, size_t rows,
                     size_t row_bytes) {
  for (size_t r = first; r < rows; ++r)
    for (size_t i = 0; i < row_bytes; ++i)
      if (b.mem[r * row_bytes + i] != kPoison) {
        c.fail(op, "%s row %zu byte %zu: written (0x%02x), must keep its old contents", what, r, i,
               b.mem[r * row_bytes + i]);
        return false;
      }
  return true;
}

void checkSize(Ctx& c, const char* op, const char* what, size_t helper, size_t need) {
  if (helper < need) c.fail(op, "size helper %s = %zu bytes < %zu needed", what, helper, need);
}

// ---------------------------------------------------------------------------------------------------------
// Input generation (deterministic in (seed, rank); every child builds every rank's inputs)
// ---------------------------------------------------------------------------------------------------------
// Token counts: mode 0 = uneven, one rank (R > 1) with zero tokens; mode 1 = all tmax.
std::vector<int> genCounts(uint64_t seed, int R, int tmax, int mode) {
  std::mt19937_64 g(mix(seed, 0xc0));
  std::vector<int> counts(R, tmax);
  if (mode == 1) return counts;
  std::uniform_int_distribution<int> d(0, tmax);
  for (int r = 0; r < R; ++r) counts[r] = d(g);
  if (R > 1) counts[g() % R] = 0;
  if (R > 2 && g() % 2) counts[g() % R] = tmax;
  return counts;
}

// Random values of dtype, never zero (fp8: any finite non-zero code).
void genValues(std::mt19937_64& g, int dtype, int rows, int H, std::vector<uint8_t>* x) {
  x->assign(static_cast<size_t>(rows) * H * epref::elemSize(dtype), 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> sc(-6, 6);
  for (int r = 0; r < rows; ++r) {
    float scale = std::ldexp(1.0f, sc(g));
    for (int h = 0; h < H; ++h) {
      size_t i = static_cast<size_t>(r) * H + h;
      if (dtype == epFloat8E4M3) {
        uint8_t v;
        do v = static_cast<uint8_t>(g()); while ((v & 0x7f) == 0 || (v & 0x7f) == 0x7f);
        (*x)[i] = v;
        continue;
      }
      for (;;) {
        epcomm::storeFromFloat(x->data(), i, dtype, nd(g) * scale);
        if (epcomm::loadAsFloat(x->data(), i, dtype) != 0.0f) break;
      }
    }
  }
}

void genScales(std::mt19937_64& g, int rows, int H, std::vector<float>* s) {
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  std::uniform_int_distribution<int> e(-8, 2);
  s->resize(static_cast<size_t>(rows) * (H / EP_FP8_BLOCK));
  for (float& v : *s) v = std::ldexp(u(g), e(g));
}

// Routing: K experts per token, mostly distinct, some -1, occasional duplicates, a few tokens with none.
void genRouting(std::mt19937_64& g, const Shape& s, int T, std::vector<int64_t>* idx, std::vector<float>* w) {
  int K = s.topk, E = s.num_experts;
  idx->assign(static_cast<size_t>(T) * K, -1);
  w->assign(static_cast<size_t>(T) * K, 0.0f);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int> ed(0, E - 1);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (int t = 0; t < T; ++t) {
    int64_t* row = &(*idx)[static_cast<size_t>(t) * K];
    for (int k = 0; k < K; ++k) (*w)[static_cast<size_t>(t) * K + k] = (g() % 8 == 0 ? -1.0f : 1.0f) * wd(g);
    if (u(g) < 0.03) continue;  // no expert at all
    for (int k = 0; k < K; ++k) {
      double p = u(g);
      if (p < 0.08) {
        row[k] = -1;
      } else if (p < 0.12 && k > 0) {
        row[k] = row[g() % k];  // duplicate (or -1)
      } else {
        int e = ed(g);
        for (int tries = 0; tries < 16; ++tries) {
          bool dup = false;
          for (int j = 0; j < k; ++j) dup |= row[j] == e;
          if (!dup) break;
          e = ed(g);
        }
        row[k] = e;
      }
    }
  }
}

std::vector<RankInput> genInputs(uint64_t seed, const Shape& s, int dtype, const std::vector<int>& counts) {
  std::vector<RankInput> all(s.nranks);
  for (int r = 0; r < s.nranks; ++r) {
    std::mt19937_64 g(mix(seed, 0x1000 + r));
    RankInput& in = all[r];
    in.num_tokens = counts[r];
    genValues(g, dtype, in.num_tokens, s.hidden, &in.x);
    if (dtype == epFloat8E4M3) genScales(g, in.num_tokens, s.hidden, &in.x_scales);
    genRouting(g, s, in.num_tokens, &in.topk_idx, &in.topk_weights);
  }
  return all;
}

// Fresh x (and scales) with the same routing.
void regenX(uint64_t seed, const Shape& s, int dtype, std::vector<RankInput>* all) {
  for (int r = 0; r < s.nranks; ++r) {
    std::mt19937_64 g(mix(seed, 0x2000 + r));
    RankInput& in = (*all)[r];
    genValues(g, dtype, in.num_tokens, s.hidden, &in.x);
    if (dtype == epFloat8E4M3) genScales(g, in.num_tokens, s.hidden, &in.x_scales);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Stand-in experts
// ---------------------------------------------------------------------------------------------------------
// HT: combine input of rank `rank` = received rows (dequantized for fp8) times (rank + 1), in out_dtype.
std::vector<uint8_t> htExpert(const uint8_t* rx, const float* scales, int rows, int H, int in_dtype, int out_dtype,
                              int rank) {
  std::vector<uint8_t> y(static_cast<size_t>(rows) * H * epref::elemSize(out_dtype));
  int nb = H / EP_FP8_BLOCK;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < H; ++h) {
      size_t i = static_cast<size_t>(r) * H + h;
      float f = epcomm::loadAsFloat(rx, i, in_dtype);
      if (in_dtype == epFloat8E4M3) f = f * scales[static_cast<size_t>(r) * nb + h / EP_FP8_BLOCK];
      f = f * static_cast<float>(rank + 1);
      epcomm::storeFromFloat(y.data(), i, out_dtype, f);
    }
  return y;
}

// LL: y [L, R*M, H] of rank `rank`: each received row (dequantized for fp8) times an expert factor; rows
// that were not received hold 1000 + e, so a wrong row read shows.
std::vector<uint8_t> llExpert(const uint8_t* rx, const float* scales, const std::vector<uint8_t>& written,
                              int layout, const Shape& s, int M, int dtype, bool fp8, int rank) {
  int R = s.nranks, L = s.local(), H = s.hidden, nb = H / EP_FP8_BLOCK;
  std::vector<uint8_t> y(static_cast<size_t>(L) * R * M * H * epref::elemSize(dtype));
  for (int le = 0; le < L; ++le) {
    float factor = 1.0f + 0.25f * static_cast<float>(le) + 0.5f * static_cast<float>(rank);
    for (int j = 0; j < R * M; ++j) {
      size_t src = layout == EP_LL_EXPERT_MAJOR ? static_cast<size_t>(le) * R * M + j : static_cast<size_t>(j);
      size_t dst = static_cast<size_t>(le) * R * M + j;
      for (int h = 0; h < H; ++h) {
        float v;
        if (!written[src]) {
          v = 1000.0f + static_cast<float>(le);
        } else if (fp8) {
          v = epcomm::fp8ToFloat(rx[src * H + h]) * scales[src * nb + h / EP_FP8_BLOCK];
          v = v * factor;
        } else {
          v = epcomm::loadAsFloat(rx, src * H + h, dtype) * factor;
        }
        epcomm::storeFromFloat(y.data(), dst * H + h, dtype, v);
      }
    }
  }
  return y;
}

// ---------------------------------------------------------------------------------------------------------
// Per-rank harness
// ---------------------------------------------------------------------------------------------------------
// Small queues (down to the 64 KiB minimum) make big rows wrap around the rings; the channel count varies
// too. Both are drawn from the test's seed, the same on every rank.
epConfig_t hostConfig(uint64_t seed) {
  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_HOST;
  cfg.timeout_ms = kTimeoutMs;
  cfg.ll_max_tokens_per_rank = kLlMaxTokens;
  const size_t queues[] = {0, 64 << 10, 96 << 10};
  cfg.queue_bytes = queues[mix(seed, 0x9) % 3];
  cfg.num_channels = static_cast<int>(mix(seed, 0xa) % 4);
  return cfg;
}

// Virtual hosts of the cross-host tests: 0 = every rank on this host; H = ranks split into H contiguous groups,
// each with its own EPCOMM_HOSTID (what epcomm-run --hosts H does), reached over EPCOMM_NET = gNet.
int gHosts = 0;
int gFirstHostRanks = 0;  // > 0: the first host's ranks, where hosts differ in size (the others have the rest evenly)
const char* gNet = "socket";
// The ranks of the first virtual host and of each other one, of R ranks.
int firstHostRanks(int R) { return gFirstHostRanks > 0 ? gFirstHostRanks : R / gHosts; }
int ranksPerHost(int R) { return gHosts > 1 ? (R - firstHostRanks(R)) / (gHosts - 1) : R; }
// The ranks of `rank`'s virtual host.
int hostRanks(int R, int rank) { return rank < firstHostRanks(R) ? firstHostRanks(R) : ranksPerHost(R); }

// Forks R ranks, each creating a host communicator and running body(comm, rank, ctx); asserts every exit 0.
void runOnComm(int R, uint64_t seed, const std::function<void(epComm_t, int, Ctx&)>& body) {
  epUniqueId id;
  ASSERT_EQ(epGetUniqueId(&id), epSuccess) << epGetLastError(nullptr);
  std::vector<int> codes = epcomm::test::runRanks(
      R,
      [&](int rank) -> int {
        Ctx ctx;
        ctx.rank = rank;
        ctx.seed = baseSeed();
        epConfig_t cfg = hostConfig(seed);
        if (gHosts > 0) {
          const int first = firstHostRanks(R), per_host = ranksPerHost(R);
          const int host = rank < first ? 0 : 1 + (rank - first) / per_host;
          setenv("EPCOMM_HOSTID", ("vhost" + std::to_string(host)).c_str(), 1);
          setenv("EPCOMM_NET", gNet, 1);
          epref::gRefRanksPerHost = per_host;  // HT combine's order across hosts (reference.h)
          epref::gRefFirstHostRanks = first;
        }
        epComm_t comm = nullptr;
        epResult_t rc = epCommInitRank(&comm, R, &id, rank, &cfg);
        if (rc != epSuccess) {
          std::fprintf(stderr, "rank %d: epCommInitRank: %s: %s\n", rank, epGetErrorString(rc),
                       epGetLastError(nullptr));
          return 2;
        }
        body(comm, rank, ctx);
        epResult_t async = epSuccess;
        epErrorInfo_t info = EP_ERROR_INFO_INIT;
        if (epCommGetAsyncError(comm, &async, &info) != epSuccess || async != epSuccess)
          ctx.fail("async_error", "epCommGetAsyncError reports %d (%s): op %d epoch %llu peer %d phase %d", async,
                   epGetErrorString(async), info.op, static_cast<unsigned long long>(info.epoch), info.peer,
                   info.phase);
        if (rank == 0)
          std::printf("  rank 0: %d engine calls, %zu output bytes compared, %d failures (queue_bytes %zu, "
                      "num_channels %d)\n",
                      ctx.calls, ctx.compared, ctx.failures, cfg.queue_bytes, cfg.num_channels);
        // Every rank destroys at about the same time (the bodies end alike): across hosts each flush must end with
        // the peers' goodbyes, not at its deadline (timeout_ms), which a flush waiting for a peer that already said
        // goodbye ran to (fixed in b34313f).
        const auto t0 = std::chrono::steady_clock::now();
        rc = epCommDestroy(comm);
        if (rc != epSuccess) {
          std::fprintf(stderr, "rank %d: epCommDestroy: %s\n", rank, epGetErrorString(rc));
          return 3;
        }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (gHosts > 0 && ms > cfg.timeout_ms / 2) {
          std::fprintf(stderr, "rank %d: epCommDestroy took %.0f ms of the %d ms deadline\n", rank, ms, cfg.timeout_ms);
          return 4;
        }
        return ctx.failures == 0 ? 0 : 1;
      },
      kRunTimeoutMs);
  for (int r = 0; r < R; ++r)
    EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << R << " failed (-1 = timed out, 2 = init failed, 4 = slow destroy); "
                           << "reproduce with EPCOMM_TEST_SEED=" << baseSeed() << " (case seed " << seed << ")";
}

// ---------------------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------------------
void checkLayout(epComm_t comm, Ctx& c, const std::vector<RankInput>& all, const Shape& s) {
  const RankInput& me = all[c.rank];
  int T = me.num_tokens, R = s.nranks, E = s.num_experts;
  Buf tpr, tpe, itr;
  tpr.reset(R * 4);
  tpe.reset(E * 4);
  itr.reset(static_cast<size_t>(T) * R);
  epResult_t rc = epGetDispatchLayout(comm, nz(me.topk_idx), T, s.topk, E, tpr.as<int>(), tpe.as<int>(), itr.p(),
                                      nullptr);
  if (!c.ok(rc, "layout", comm)) return;
  epref::Layout want = epref::layout(me, s);
  cmpRows(c, "layout", "num_tokens_per_rank", tpr.p(), want.tokens_per_rank.data(), 1, R * 4, 4, epInt32);
  cmpRows(c, "layout", "num_tokens_per_expert", tpe.p(), want.tokens_per_expert.data(), 1, E * 4, 4, epInt32);
  cmpRows(c, "layout", "is_token_in_rank", itr.p(), want.is_token_in_rank.data(), T, R, 1, epUint8);
  checkTail(c, "layout", "num_tokens_per_rank", tpr, R * 4);
  checkTail(c, "layout", "num_tokens_per_expert", tpe, E * 4);
  checkTail(c, "layout", "is_token_in_rank", itr, static_cast<size_t>(T) * R);
}

// ---------------------------------------------------------------------------------------------------------
// HT
// ---------------------------------------------------------------------------------------------------------
struct HtCase {
  int E, H, K, dtype, tmax;
};

std::string describe(const HtCase& h, int R) {
  char s[160];
  std::snprintf(s, sizeof s, "HT R=%d E=%d H=%d K=%d dtype=%s tmax=%d", R, h.E, h.H, h.K, epcomm::dtypeName(h.dtype),
                h.tmax);
  return s;
}

struct HtOut {  // the recv buffers of one dispatch
  Buf x, scales, idx, w, tpe, nrecv;
};

// Allocates the HT recv buffers for `rows` rows at the size helper's sizes (at least what is needed).
void allocHt(epComm_t comm, Ctx& c, const char* op, epHtDispatchArgs_t* a, int rows, HtOut* o) {
  int nranks = 1;
  epCommSize(comm, &nranks);
  int H = a->hidden, K = a->topk, L = a->num_experts / nranks;
  size_t esz = epref::elemSize(a->dtype);
  bool fp8 = a->dtype == epFloat8E4M3;
  size_t need_x = static_cast<size_t>(rows) * H * esz;
  size_t need_s = fp8 ? static_cast<size_t>(rows) * (H / EP_FP8_BLOCK) * 4 : 0;
  size_t need_i = static_cast<size_t>(rows) * K * 8, need_w = static_cast<size_t>(rows) * K * 4;
  epBufferSizes_t sz = EP_BUFFER_SIZES_INIT;
  epResult_t rc = epHtDispatchSizes(comm, a, rows, &sz);
  if (c.ok(rc, op, comm)) {
    checkSize(c, op, "recv_x", sz.recv_x, need_x);
    checkSize(c, op, "recv_x_scales", sz.recv_x_scales, need_s);
    checkSize(c, op, "recv_topk_idx", sz.recv_topk_idx, need_i);
    checkSize(c, op, "recv_topk_weights", sz.recv_topk_weights, need_w);
    checkSize(c, op, "recv_tokens_per_expert", sz.recv_tokens_per_expert, static_cast<size_t>(L) * 4);
  } else {
    sz.recv_x = sz.recv_x_scales = sz.recv_topk_idx = sz.recv_topk_weights = 0;
  }
  o->x.reset(std::max(sz.recv_x, need_x));
  o->scales.reset(std::max(sz.recv_x_scales, need_s));
  o->idx.reset(std::max(sz.recv_topk_idx, need_i));
  o->w.reset(std::max(sz.recv_topk_weights, need_w));
  o->tpe.reset(static_cast<size_t>(L) * 4);
  o->nrecv.reset(4);
  a->recv_x = o->x.p();
  a->recv_x_bytes = o->x.bytes;
  a->recv_x_scales = fp8 ? o->scales.as<float>() : nullptr;
  a->recv_x_scales_bytes = fp8 ? o->scales.bytes : 0;
  a->recv_topk_idx = o->idx.as<int64_t>();
  a->recv_topk_idx_bytes = o->idx.bytes;
  a->recv_topk_weights = o->w.as<float>();
  a->recv_topk_weights_bytes = o->w.bytes;
  a->recv_tokens_per_expert = o->tpe.as<int>();
  a->num_recv_tokens = o->nrecv.as<int>();
}

// Compares recv_x (+scales) rows [0, n) and, if with_meta, the topk/count outputs (padded to `rows`).
void checkHtRecv(Ctx& c, const char* op, HtOut& o, const epref::HtRecv& want, const Shape& s, int dtype, int rows,
                 bool with_x_tail, bool with_meta) {
  int H = s.hidden, K = s.topk, L = s.local(), n = want.num_recv;
  size_t rb = static_cast<size_t>(H) * epref::elemSize(dtype);
  cmpRows(c, op, "recv_x", o.x.p(), want.x.data(), n, rb, epref::elemSize(dtype), dtype);
  if (with_x_tail) {
    checkPoisonRows(c, op, "recv_x (past the received rows)", o.x, n, rows, rb);
    checkTail(c, op, "recv_x", o.x, static_cast<size_t>(rows) * rb);
  }
  if (dtype == epFloat8E4M3)
    cmpRows(c, op, "recv_x_scales", o.scales.p(), want.x_scales.data(), n, (H / EP_FP8_BLOCK) * 4, 4, epFloat32);
  if (!with_meta) return;
  std::vector<int64_t> idx;
  std::vector<float> w;
  epref::htPadToWorst(want, K, rows, &idx, &w);
  cmpRows(c, op, "recv_topk_idx", o.idx.p(), idx.data(), rows, K * 8, 8, epInt64);
  cmpRows(c, op, "recv_topk_weights", o.w.p(), w.data(), rows, K * 4, 4, epFloat32);
  checkTail(c, op, "recv_topk_idx", o.idx, static_cast<size_t>(rows) * K * 8);
  checkTail(c, op, "recv_topk_weights", o.w, static_cast<size_t>(rows) * K * 4);
  cmpRows(c, op, "recv_tokens_per_expert", o.tpe.p(), want.tokens_per_expert.data(), 1, L * 4, 4, epInt32);
  cmpRows(c, op, "num_recv_tokens", o.nrecv.p(), &want.num_recv, 1, 4, 4, epInt32);
}

// Runs HT combine on this rank's received rows (stand-in expert applied) and compares with the reference.
void htCombineAndCheck(epComm_t comm, epHtHandle_t handle, Ctx& c, const char* op,
                       const std::vector<RankInput>& all, const Shape& s, int dtype, HtOut& o, int rows) {
  int H = s.hidden, R = s.nranks, T = all[c.rank].num_tokens;
  int cdt = dtype == epFloat8E4M3 ? epBfloat16 : dtype;
  size_t cesz = epref::elemSize(cdt);
  std::vector<uint8_t> y = htExpert(o.x.p(), o.scales.as<float>(), rows, H, dtype, cdt, c.rank);
  Buf in, out;
  in.reset(y.size());
  std::memcpy(in.p(), y.data(), y.size());
  out.reset(static_cast<size_t>(T) * H * cesz);
  epHtCombineArgs_t a = EP_HT_COMBINE_ARGS_INIT;
  a.num_tokens = T;
  a.hidden = H;
  a.dtype = cdt;
  a.x = in.p();
  a.x_bytes = in.bytes;
  a.combined_x = out.p();
  a.combined_x_bytes = out.bytes;
  epResult_t rc = epHtCombine(comm, &a, handle, nullptr);
  if (!c.ok(rc, op, comm)) return;
  std::vector<std::vector<uint8_t>> ys(R);
  for (int r = 0; r < R; ++r) {
    epref::HtRecv rr = epref::htDispatch(all, s, dtype, r);
    ys[r] = htExpert(rr.x.data(), rr.x_scales.data(), rr.num_recv, H, dtype, cdt, r);
  }
  std::vector<uint8_t> want = epref::htCombine(all, s, ys, cdt, c.rank);
  cmpRows(c, op, "combined_x", out.p(), want.data(), T, H * cesz, cesz, cdt);
  checkTail(c, op, "combined_x", out, out.bytes);
}

// One HT case: layout, exact dispatch + combine, cached dispatch + combine, worst-token dispatch + combine.
void runHtCase(epComm_t comm, epHtHandle_t handle, Ctx& c, int R, uint64_t seed, const HtCase& hc) {
  c.cas = describe(hc, R);
  Shape s{R, hc.E, hc.H, hc.K};
  int L = s.local(), dtype = hc.dtype;
  bool fp8 = dtype == epFloat8E4M3;
  std::vector<int> counts = genCounts(seed, R, hc.tmax, static_cast<int>(seed % 4 == 0));
  std::vector<RankInput> all = genInputs(seed, s, dtype, counts);
  const RankInput& me = all[c.rank];
  int T = me.num_tokens;

  checkLayout(comm, c, all, s);

  // --- exact mode: notify, sizes, dispatch, combine
  epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
  a.num_tokens = T;
  a.hidden = s.hidden;
  a.topk = s.topk;
  a.num_experts = s.num_experts;
  a.dtype = dtype;
  a.x = nz(me.x);
  a.x_scales = fp8 ? nz(me.x_scales) : nullptr;
  a.topk_idx = nz(me.topk_idx);
  a.topk_weights = nz(me.topk_weights);
  epref::HtRecv want = epref::htDispatch(all, s, dtype, c.rank);
  int nrecv_host = -12345;
  std::vector<int> tpe_host(L, -12345);
  epResult_t rc = epHtDispatchNotify(comm, &a, handle, &nrecv_host, tpe_host.data(), nullptr);
  if (c.ok(rc, "ht_notify", comm)) {
    if (nrecv_host != want.num_recv) c.fail("ht_notify", "num_recv_tokens_host %d want %d", nrecv_host, want.num_recv);
    cmpRows(c, "ht_notify", "recv_tokens_per_expert_host", tpe_host.data(), want.tokens_per_expert.data(), 1, L * 4,
            4, epInt32);
    int ht = -1, hn = -1;
    if (c.ok(epHtHandleGetCounts(handle, &ht, &hn), "ht_handle_counts", comm) && (ht != T || hn != want.num_recv))
      c.fail("ht_handle_counts", "num_tokens %d num_recv %d, want %d %d", ht, hn, T, want.num_recv);
    std::vector<int> per_src(R, -1), want_src(R, 0);
    for (const epref::SrcRow& sr : want.src) ++want_src[sr.rank];
    if (c.ok(epHtHandleGetRecvCounts(handle, per_src.data()), "ht_handle_recv_counts", comm) && per_src != want_src)
      c.fail("ht_handle_recv_counts", "rows per source rank differ from the reference");
  }
  int n = want.num_recv;
  HtOut o;
  allocHt(comm, c, "ht_sizes", &a, n, &o);
  rc = epHtDispatch(comm, &a, handle, nullptr);
  if (c.ok(rc, "ht_dispatch", comm)) checkHtRecv(c, "ht_dispatch", o, want, s, dtype, n, true, true);
  htCombineAndCheck(comm, handle, c, "ht_combine", all, s, dtype, o, n);

  // --- cached layout: same routing, fresh x; no topk inputs or outputs
  std::vector<RankInput> all2 = all;
  regenX(mix(seed, 2), s, dtype, &all2);
  epHtDispatchArgs_t a2 = a;
  a2.flags = EP_HT_USE_HANDLE_LAYOUT;
  a2.x = nz(all2[c.rank].x);
  a2.x_scales = fp8 ? nz(all2[c.rank].x_scales) : nullptr;
  a2.topk_idx = nullptr;
  a2.topk_weights = nullptr;
  HtOut o2;
  allocHt(comm, c, "ht_sizes", &a2, n, &o2);
  a2.recv_topk_idx = nullptr;
  a2.recv_topk_idx_bytes = 0;
  a2.recv_topk_weights = nullptr;
  a2.recv_topk_weights_bytes = 0;
  a2.recv_tokens_per_expert = nullptr;
  a2.num_recv_tokens = nullptr;
  epref::HtRecv want2 = epref::htDispatch(all2, s, dtype, c.rank);
  rc = epHtDispatch(comm, &a2, handle, nullptr);
  if (c.ok(rc, "ht_dispatch_cached", comm)) {
    checkHtRecv(c, "ht_dispatch_cached", o2, want2, s, dtype, n, true, false);
    checkPoisonRows(c, "ht_dispatch_cached", "recv_topk_idx (NULL topk_idx: must not be written)", o2.idx, 0,
                    o2.idx.bytes / 8, 8);
  }
  htCombineAndCheck(comm, handle, c, "ht_combine_cached", all2, s, dtype, o2, n);

  // --- worst-token mode: W > every rank's received count, one dispatch call, padded outputs
  int maxrecv = 0;
  for (int r = 0; r < R; ++r) maxrecv = std::max(maxrecv, static_cast<int>(epref::htRecvRows(all, s, r).size()));
  int W = std::max(1, maxrecv + static_cast<int>(mix(seed, 3) % 4));  // may equal the largest count
  std::vector<RankInput> all3 = all;
  regenX(mix(seed, 4), s, dtype, &all3);
  epHtDispatchArgs_t a3 = a;
  a3.num_worst_tokens = W;
  a3.x = nz(all3[c.rank].x);
  a3.x_scales = fp8 ? nz(all3[c.rank].x_scales) : nullptr;
  HtOut o3;
  allocHt(comm, c, "ht_sizes_worst", &a3, W, &o3);
  epref::HtRecv want3 = epref::htDispatch(all3, s, dtype, c.rank);
  rc = epHtDispatch(comm, &a3, handle, nullptr);
  if (c.ok(rc, "ht_dispatch_worst", comm)) checkHtRecv(c, "ht_dispatch_worst", o3, want3, s, dtype, W, true, true);
  htCombineAndCheck(comm, handle, c, "ht_combine_worst", all3, s, dtype, o3, W);
}

std::vector<HtCase> htCases(int R) {
  switch (R) {
    case 1:
      return {{4, 8, 1, epBfloat16, 100},
              {8, 56, 3, epFloat16, 60},
              {16, 128, 9, epFloat8E4M3, 24},
              {4, 1024, 2, epFloat32, 10},
              {8, 7168, 8, epBfloat16, 3}};
    case 2:
      return {{2, 8, 1, epBfloat16, 120},
              {8, 56, 4, epFloat32, 60},
              {32, 128, 9, epFloat8E4M3, 24},
              {16, 1024, 6, epFloat16, 10},
              {16, 7168, 8, epBfloat16, 3}};
    case 3:
      return {{3, 8, 2, epFloat16, 100},
              {12, 128, 5, epFloat8E4M3, 20},
              {6, 1024, 3, epBfloat16, 8},
              {9, 56, 9, epFloat32, 24},
              {6, 7168, 4, epFloat8E4M3, 2}};
    case 4:
      return {{4, 8, 4, epBfloat16, 100},
              {8, 56, 1, epFloat16, 64},
              {32, 128, 8, epBfloat16, 20},
              {16, 7168, 8, epFloat8E4M3, 3},
              {64, 1024, 9, epFloat32, 6}};
    default:
      return {{8, 8, 2, epFloat32, 64},
              {16, 56, 7, epBfloat16, 32},
              {64, 128, 9, epFloat8E4M3, 12},
              {32, 1024, 8, epFloat16, 4},
              {8, 7168, 4, epBfloat16, 2}};
  }
}

// ---------------------------------------------------------------------------------------------------------
// LL
// ---------------------------------------------------------------------------------------------------------
struct LlCase {
  int E, H, K, dtype, M, layout;
  bool fp8;
  int counts_mode;  // 0 uneven (with a zero), 1 full (T == M everywhere)
  int split;        // 0: SEND_RECV; 1: SEND then RECV; 2: odd ranks split, even ranks one call
};

std::string describe(const LlCase& l, int R) {
  char s[200];
  std::snprintf(s, sizeof s, "LL R=%d E=%d H=%d K=%d dtype=%s M=%d layout=%s fp8=%d counts=%s split=%d", R, l.E, l.H,
                l.K, epcomm::dtypeName(l.dtype), l.M, l.layout == EP_LL_EXPERT_MAJOR ? "expert" : "rank", l.fp8,
                l.counts_mode ? "full" : "uneven", l.split);
  return s;
}

// One LL dispatch + combine, in stages so that tests can interleave the halves of two of them.
struct LlRun {
  epComm_t comm;
  Ctx& c;
  int R;
  LlCase lc;
  Shape s;
  bool em;
  std::vector<RankInput> all;
  epref::LlRecv want;
  size_t need_x = 0, need_s = 0, need_c = 0, need_si = 0, need_lr = 0, need_ti = 0;
  Buf xb, rx, rs, rc_, si, lr, ti, yb, out;
  epLlDispatchArgs_t a = EP_LL_DISPATCH_ARGS_INIT;
  epLlCombineArgs_t b = EP_LL_COMBINE_ARGS_INIT;
  std::vector<std::vector<uint8_t>> ys;
  bool dispatch_ok = true, combine_ok = true;

  LlRun(epComm_t comm_, Ctx& c_, int R_, uint64_t seed, const LlCase& lc_)
      : comm(comm_), c(c_), R(R_), lc(lc_), s{R_, lc_.E, lc_.H, lc_.K}, em(lc_.layout == EP_LL_EXPERT_MAJOR) {
    int L = s.local(), M = lc.M, K = lc.K;
    std::vector<int> counts = genCounts(seed, R, M, lc.counts_mode);
    all = genInputs(seed, s, lc.dtype, counts);
    const RankInput& me = all[c.rank];
    a.num_tokens = me.num_tokens;
    a.max_tokens_per_rank = M;
    a.hidden = lc.H;
    a.topk = K;
    a.num_experts = lc.E;
    a.dtype = lc.dtype;
    a.use_fp8 = lc.fp8 ? 1 : 0;
    a.layout = lc.layout;
    xb.reset(me.x.size());
    a.x = me.x.empty() ? nz(me.x) : xb.p();
    a.topk_idx = nz(me.topk_idx);
    want = epref::llDispatch(all, s, M, lc.dtype, lc.fp8, lc.layout, c.rank, kPoison);
    need_x = want.x.size();
    need_s = want.x_scales.size() * 4;
    need_c = want.count.size() * 4;
    need_si = em ? static_cast<size_t>(L) * R * M * 4 : 0;
    need_lr = em ? static_cast<size_t>(L) * R * 8 : 0;
    need_ti = em ? 0 : static_cast<size_t>(R) * M * K * 8;
    epBufferSizes_t sz = EP_BUFFER_SIZES_INIT;
    if (c.ok(epLlDispatchSizes(comm, &a, &sz), "ll_sizes", comm)) {
      checkSize(c, "ll_sizes", "recv_x", sz.recv_x, need_x);
      checkSize(c, "ll_sizes", "recv_x_scales", sz.recv_x_scales, need_s);
      checkSize(c, "ll_sizes", "recv_count", sz.recv_count, need_c);
      checkSize(c, "ll_sizes", "recv_src_info", sz.recv_src_info, need_si);
      checkSize(c, "ll_sizes", "recv_layout_range", sz.recv_layout_range, need_lr);
      checkSize(c, "ll_sizes", "recv_topk_idx", sz.recv_topk_idx, need_ti);
    } else {
      sz = EP_BUFFER_SIZES_INIT;
    }
    rx.reset(std::max(sz.recv_x, need_x));
    rs.reset(lc.fp8 ? std::max(sz.recv_x_scales, need_s) : 0);
    rc_.reset(std::max(sz.recv_count, need_c));
    si.reset(em ? std::max(sz.recv_src_info, need_si) : 0);
    lr.reset(em ? std::max(sz.recv_layout_range, need_lr) : 0);
    ti.reset(em ? 0 : std::max(sz.recv_topk_idx, need_ti));
    a.recv_x = rx.p();
    a.recv_x_bytes = rx.bytes;
    a.recv_x_scales = lc.fp8 ? rs.as<float>() : nullptr;
    a.recv_x_scales_bytes = lc.fp8 ? rs.bytes : 0;
    a.recv_count = rc_.as<int>();
    a.recv_count_bytes = rc_.bytes;
    if (em) {
      a.recv_src_info = si.as<int>();
      a.recv_src_info_bytes = si.bytes;
      a.recv_layout_range = lr.as<int64_t>();
      a.recv_layout_range_bytes = lr.bytes;
    } else {
      a.recv_topk_idx = ti.as<int64_t>();
      a.recv_topk_idx_bytes = ti.bytes;
    }
  }

  void dispatch(unsigned phases) {
    c.cas = describe(lc, R);
    a.phases = phases;
    const char* op = phases == EP_LL_SEND ? "ll_dispatch_send" : phases == EP_LL_RECV ? "ll_dispatch_recv" : "ll_dispatch";
    const std::vector<uint8_t>& x = all[c.rank].x;
    if ((phases & EP_LL_SEND) && !x.empty()) std::memcpy(xb.p(), x.data(), x.size());
    dispatch_ok = c.ok(epLlDispatch(comm, &a, nullptr), op, comm) && dispatch_ok;
    // A call with a send half is done with x when it returns (x may be reused at once): a row read from it later
    // would reach a peer poisoned and fail that peer's check.
    if ((phases & EP_LL_SEND) && !x.empty()) std::memset(xb.p(), 0x5a, x.size());
  }

  void checkDispatch() {
    c.cas = describe(lc, R);
    if (!dispatch_ok) return;
    const char* op = "ll_dispatch";
    int L = s.local(), M = lc.M, K = lc.K;
    size_t esz = lc.fp8 ? 1 : epref::elemSize(lc.dtype);
    cmpRows(c, op, "recv_x", rx.p(), want.x.data(), want.rows, want.row_bytes, esz, lc.fp8 ? epFloat8E4M3 : lc.dtype);
    checkTail(c, op, "recv_x", rx, need_x);
    if (lc.fp8)
      cmpRows(c, op, "recv_x_scales", rs.p(), want.x_scales.data(), want.rows, want.blocks * 4, 4, epFloat32,
              &want.row_written);
    cmpRows(c, op, "recv_count", rc_.p(), want.count.data(), 1, need_c, 4, epInt32);
    checkTail(c, op, "recv_count", rc_, need_c);
    if (em) {
      std::vector<uint8_t> mask(static_cast<size_t>(L) * R * M, 0);
      for (int le = 0; le < L; ++le)
        for (int j = 0; j < want.count[le]; ++j) mask[static_cast<size_t>(le) * R * M + j] = 1;
      cmpRows(c, op, "recv_src_info", si.p(), want.src_info.data(), mask.size(), 4, 4, epInt32, &mask);
      cmpRows(c, op, "recv_layout_range", lr.p(), want.layout_range.data(), L, R * 8, 8, epInt64);
    } else {
      cmpRows(c, op, "recv_topk_idx", ti.p(), want.topk_idx.data(), static_cast<size_t>(R) * M, K * 8, 8, epInt64);
      checkTail(c, op, "recv_topk_idx", ti, need_ti);
    }
  }

  // Stand-in expert on every rank (this rank's from its actual recv buffers), combine args.
  void prepareCombine() {
    int M = lc.M, H = lc.H;
    std::vector<uint8_t> y_me =
        llExpert(rx.p(), rs.as<float>(), want.row_written, lc.layout, s, M, lc.dtype, lc.fp8, c.rank);
    ys.assign(R, {});
    for (int r = 0; r < R; ++r) {
      if (r == c.rank) {
        ys[r] = y_me;
        continue;
      }
      epref::LlRecv rr = epref::llDispatch(all, s, M, lc.dtype, lc.fp8, lc.layout, r, kPoison);
      ys[r] = llExpert(rr.x.data(), rr.x_scales.data(), rr.row_written, lc.layout, s, M, lc.dtype, lc.fp8, r);
    }
    const RankInput& me = all[c.rank];
    size_t esz = epref::elemSize(lc.dtype);
    yb.reset(y_me.size());
    std::memcpy(yb.p(), y_me.data(), y_me.size());
    out.reset(static_cast<size_t>(me.num_tokens) * H * esz);
    b.num_tokens = me.num_tokens;
    b.max_tokens_per_rank = M;
    b.hidden = H;
    b.topk = lc.K;
    b.num_experts = lc.E;
    b.dtype = lc.dtype;
    b.layout = lc.layout;
    b.y = yb.p();
    b.y_bytes = yb.bytes;
    b.recv_count = rc_.as<int>();
    if (em) {
      b.recv_src_info = si.as<int>();
      b.recv_layout_range = lr.as<int64_t>();
    } else {
      b.recv_topk_idx = ti.as<int64_t>();
    }
    b.topk_idx = nz(me.topk_idx);
    b.topk_weights = nz(me.topk_weights);
    b.out = out.p();
    b.out_bytes = out.bytes;
  }

  void combine(unsigned phases) {
    c.cas = describe(lc, R);
    b.phases = phases;
    const char* op = phases == EP_LL_SEND ? "ll_combine_send" : phases == EP_LL_RECV ? "ll_combine_recv" : "ll_combine";
    combine_ok = c.ok(epLlCombine(comm, &b, nullptr), op, comm) && combine_ok;
  }

  void checkCombine() {
    c.cas = describe(lc, R);
    if (!combine_ok) return;
    size_t esz = epref::elemSize(lc.dtype);
    std::vector<uint8_t> wantc = epref::llCombine(all, s, lc.M, lc.layout, ys, lc.dtype, c.rank);
    cmpRows(c, "ll_combine", "out", out.p(), wantc.data(), all[c.rank].num_tokens, static_cast<size_t>(lc.H) * esz,
            esz, lc.dtype);
    checkTail(c, "ll_combine", "out", out, out.bytes);
  }
};

void runLlCase(epComm_t comm, Ctx& c, int R, uint64_t seed, const LlCase& lc) {
  LlRun run(comm, c, R, seed, lc);
  const bool split = lc.split == 1 || (lc.split == 2 && c.rank % 2 == 1);
  if (split) {
    run.dispatch(EP_LL_SEND);
    run.dispatch(EP_LL_RECV);
  } else {
    run.dispatch(EP_LL_SEND_RECV);
  }
  run.checkDispatch();
  run.prepareCombine();
  if (split) {
    run.combine(EP_LL_SEND);
    run.combine(EP_LL_RECV);
  } else {
    run.combine(EP_LL_SEND_RECV);
  }
  run.checkCombine();
}

// Two LL steps with overlapped halves: A's combine is between its halves while B's dispatch is issued
// (at most one dispatch and one combine between halves at a time). With la.split == 2 the even ranks issue
// every operation in one call meanwhile.
void runLlOverlap(epComm_t comm, Ctx& c, int R, uint64_t seed, const LlCase& la, const LlCase& lb) {
  LlRun A(comm, c, R, mix(seed, 1), la), B(comm, c, R, mix(seed, 2), lb);
  if (la.split == 2 && c.rank % 2 == 0) {  // even ranks issue each operation in one call meanwhile
    A.dispatch(EP_LL_SEND_RECV);
    A.checkDispatch();
    A.prepareCombine();
    A.combine(EP_LL_SEND_RECV);
    A.checkCombine();
    B.dispatch(EP_LL_SEND_RECV);
    B.checkDispatch();
    B.prepareCombine();
    B.combine(EP_LL_SEND_RECV);
    B.checkCombine();
    return;
  }
  A.dispatch(EP_LL_SEND);
  A.dispatch(EP_LL_RECV);
  A.checkDispatch();
  A.prepareCombine();
  A.combine(EP_LL_SEND);
  B.dispatch(EP_LL_SEND);
  A.combine(EP_LL_RECV);
  A.checkCombine();
  B.dispatch(EP_LL_RECV);
  B.checkDispatch();
  B.prepareCombine();
  B.combine(EP_LL_SEND);
  B.combine(EP_LL_RECV);
  B.checkCombine();
}

std::vector<LlCase> llCases(int R) {
  const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
  int e1 = R, e2 = 2 * R, e4 = 4 * R, e8 = 8 * R;
  std::vector<LlCase> v = {
      // E,  H,    K, dtype,        M, layout, fp8,  counts, split
      {e2, 128, 1, epBfloat16, 1, EM, false, 1, false},
      {e4, 128, 3, epBfloat16, 1, RM, true, 1, false},
      {e2, 256, 2, epFloat16, 2, RM, true, 1, false},
      {e8, 256, 9, epFloat32, 2, EM, true, 1, true},
      {e1, 56, 4, epFloat32, 8, EM, false, 1, false},
      {e4, 8, 5, epFloat16, 8, RM, false, 1, false},
      {e4, 1024, 8, epBfloat16, 8, RM, false, 0, 2},
      {e8, 384, 7, epBfloat16, 8, EM, true, 0, true},
      {e2, 128, 6, epFloat32, 4, RM, true, 0, true},
      {e4, 56, 9, epBfloat16, 8, EM, false, 0, 2},
      {e1, 8, 2, epFloat16, 6, EM, false, 0, true},
      {e4, 128, 8, epBfloat16, 16, EM, true, 1, false},
      {e8, 64, 9, epFloat16, 16, RM, false, 0, true},
      {e2, 256, 4, epFloat32, 16, EM, false, 0, false},
  };
  if (R <= 4) {
    // Messages of up to 224 KiB per destination: more than the smallest queues hold (host_engine_queues), so that a
    // call's sends are still queued when its receives are done.
    v.push_back({e4, 7168, 4, epBfloat16, 16, RM, false, 0, false});
    v.push_back({e4, 7168, 8, epBfloat16, 2, EM, true, 0, false});
    v.push_back({e2, 7168, 4, epBfloat16, 2, RM, false, 1, true});
  } else {
    v.push_back({e2, 7168, 4, epBfloat16, 1, EM, true, 1, 2});
  }
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// Random shapes (the same on every rank: drawn from the case seed)
// ---------------------------------------------------------------------------------------------------------
int randomHidden(std::mt19937_64& g, bool fp8) {
  const int any[] = {8, 16, 24, 56, 128, 200, 256, 512, 1024, 2056, 4096, 7168};
  const int f8[] = {128, 256, 384, 1024, 2048, 7168};
  return fp8 ? f8[g() % 6] : any[g() % 12];
}
int tokensFor(int H, int cap) { return std::max(1, std::min(cap, 16384 / H)); }

HtCase randomHtCase(uint64_t seed, int R) {
  std::mt19937_64 g(mix(seed, 0x7c));
  const int dts[] = {epBfloat16, epFloat16, epFloat32, epFloat8E4M3};
  int dtype = dts[g() % 4];
  int H = randomHidden(g, dtype == epFloat8E4M3);
  int E = R * static_cast<int>(1 + g() % 8);
  int K = static_cast<int>(1 + g() % 9);
  return {E, H, K, dtype, tokensFor(H, 96)};
}

LlCase randomLlCase(uint64_t seed, int R) {
  std::mt19937_64 g(mix(seed, 0x11));
  const int dts[] = {epBfloat16, epFloat16, epFloat32};
  int dtype = dts[g() % 3];
  bool fp8 = g() % 2;
  int H = randomHidden(g, fp8);
  int E = R * static_cast<int>(1 + g() % 8);
  int K = static_cast<int>(1 + g() % 9);
  int M = std::min(kLlMaxTokens, static_cast<int>(1 + g() % kLlMaxTokens));
  if (H >= 2048) M = std::min(M, 2);
  int layout = g() % 2 ? EP_LL_RANK_MAJOR : EP_LL_EXPERT_MAJOR;
  return {E, H, K, dtype, M, layout, fp8, static_cast<int>(g() % 3 == 0), static_cast<int>(g() % 3)};
}

// ---------------------------------------------------------------------------------------------------------
// alltoallv
// ---------------------------------------------------------------------------------------------------------
void runAlltoallvCase(epComm_t comm, Ctx& c, int R, uint64_t seed, int dtype, int maxcount) {
  char d[128];
  std::snprintf(d, sizeof d, "alltoallv R=%d dtype=%s maxcount=%d", R, epcomm::dtypeName(dtype), maxcount);
  c.cas = d;
  size_t esz = epref::elemSize(dtype);
  std::mt19937_64 g(mix(seed, 0xa2a));
  std::vector<std::vector<size_t>> counts(R, std::vector<size_t>(R)), sd(R, std::vector<size_t>(R)),
      rd(R, std::vector<size_t>(R));
  std::uniform_int_distribution<int> cd(0, maxcount), gap(0, 3);
  for (int p = 0; p < R; ++p)
    for (int q = 0; q < R; ++q) counts[p][q] = g() % 5 == 0 ? 0 : static_cast<size_t>(cd(g));
  std::vector<size_t> send_total(R), recv_total(R);
  for (int p = 0; p < R; ++p) {  // send displacements: peers in a random order, with gaps
    std::vector<int> perm(R);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    size_t off = static_cast<size_t>(gap(g));
    for (int q : perm) {
      sd[p][q] = off;
      off += counts[p][q] + static_cast<size_t>(gap(g));
    }
    send_total[p] = off;
  }
  for (int q = 0; q < R; ++q) {  // receive displacements likewise
    std::vector<int> perm(R);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), g);
    size_t off = static_cast<size_t>(gap(g));
    for (int p : perm) {
      rd[q][p] = off;
      off += counts[p][q] + static_cast<size_t>(gap(g));
    }
    recv_total[q] = off;
  }
  std::vector<std::vector<uint8_t>> sends(R);
  for (int p = 0; p < R; ++p) {
    std::mt19937_64 gp(mix(seed, 0xb00 + p));
    sends[p].resize(send_total[p] * esz);
    for (auto& b : sends[p]) b = static_cast<uint8_t>(gp());
  }
  int me = c.rank;
  std::vector<size_t> rcounts(R);
  for (int p = 0; p < R; ++p) rcounts[p] = counts[p][me];
  Buf sb, rb;
  sb.reset(sends[me].size());
  std::memcpy(sb.p(), sends[me].data(), sends[me].size());
  rb.reset(recv_total[me] * esz);
  epResult_t rc = epAlltoallv(comm, sb.p(), counts[me].data(), sd[me].data(), rb.p(), rcounts.data(), rd[me].data(),
                              static_cast<epDataType_t>(dtype), nullptr);
  if (c.ok(rc, "alltoallv", comm)) {
    std::vector<uint8_t> want = epref::alltoallv(sends, counts, sd, rd, esz, me, recv_total[me], kPoison);
    cmpRows(c, "alltoallv", "recvbuf", rb.p(), want.data(), 1, want.size(), esz, -1);
    checkTail(c, "alltoallv", "recvbuf", rb, want.size());
  }
}

// Device counts. mode 0: one rank overflows its capacity; 1: capacities with slack; 2: exactly full.
void runAlltoallvDeviceCase(epComm_t comm, Ctx& c, int R, uint64_t seed, int dtype, int maxcount, int mode) {
  char d[128];
  std::snprintf(d, sizeof d, "alltoallv_device R=%d dtype=%s maxcount=%d mode=%d", R, epcomm::dtypeName(dtype),
                maxcount, mode);
  c.cas = d;
  size_t esz = epref::elemSize(dtype);
  std::mt19937_64 g(mix(seed, 0xde5));
  std::vector<std::vector<int64_t>> counts(R, std::vector<int64_t>(R));
  std::uniform_int_distribution<int> cd(0, maxcount);
  for (int p = 0; p < R; ++p)
    for (int q = 0; q < R; ++q) counts[p][q] = g() % 5 == 0 ? 0 : cd(g);
  std::vector<size_t> total(R, 0);
  for (int q = 0; q < R; ++q)
    for (int p = 0; p < R; ++p) total[q] += static_cast<size_t>(counts[p][q]);
  int over = static_cast<int>(g() % R);
  if (mode == 0 && total[over] == 0) {  // make sure the overflowing rank receives something
    counts[(over + 1) % R][over] = 3;
    total[over] = 3;
  }
  std::vector<size_t> cap(R);
  for (int q = 0; q < R; ++q) {
    if (mode == 0 && q == over) cap[q] = static_cast<size_t>(g() % total[q]);  // < total
    else if (mode == 2) cap[q] = total[q];
    else cap[q] = total[q] + g() % 4;
  }
  std::vector<std::vector<uint8_t>> sends(R);
  for (int p = 0; p < R; ++p) {
    size_t n = 0;
    for (int q = 0; q < R; ++q) n += static_cast<size_t>(counts[p][q]);
    std::mt19937_64 gp(mix(seed, 0xc00 + p));
    sends[p].resize(n * esz);
    for (auto& b : sends[p]) b = static_cast<uint8_t>(gp());
  }
  int me = c.rank;
  Buf sb, scb, rb, rcb, db;
  sb.reset(sends[me].size());
  std::memcpy(sb.p(), sends[me].data(), sends[me].size());
  scb.reset(R * 8);
  std::memcpy(scb.p(), counts[me].data(), R * 8);
  rb.reset(cap[me] * esz);
  rcb.reset(R * 8);
  db.reset(8);
  epref::AlltoallvDeviceResult want = epref::alltoallvDevice(sends, counts, esz, cap[me], me, kPoison);
  epResult_t rc = epAlltoallvDevice(comm, sb.p(), scb.as<int64_t>(), rb.p(), cap[me], rcb.as<int64_t>(),
                                    db.as<int64_t>(), static_cast<epDataType_t>(dtype), nullptr);
  if (!c.ok(rc, "alltoallv_device", comm, want.result)) return;
  cmpRows(c, "alltoallv_device", "recvbuf", rb.p(), want.recv.data(), 1, want.recv.size(), esz, -1);
  checkTail(c, "alltoallv_device", "recvbuf", rb, want.recv.size());
  cmpRows(c, "alltoallv_device", "recv_counts", rcb.p(), want.recv_counts.data(), 1, R * 8, 8, epInt64);
  cmpRows(c, "alltoallv_device", "num_dropped", db.p(), &want.num_dropped, 1, 8, 8, epInt64);
}

// ---------------------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------------------
class HostEngine : public ::testing::TestWithParam<int> {};

TEST_P(HostEngine, HtDispatchCombine) {
  int R = GetParam();
  uint64_t seed = nameSeed("ht", R);
  runOnComm(R, seed, [&](epComm_t comm, int rank, Ctx& c) {
    epHtHandle_t handle = nullptr;
    if (!c.ok(epHtHandleCreate(comm, kHtMaxTokens, &handle), "ht_handle_create", comm)) return;
    std::vector<HtCase> cases = htCases(R);
    for (int round = 0; round < 3 && c.failures == 0; ++round)
      for (size_t i = 0; i < cases.size(); ++i) runHtCase(comm, handle, c, R, mix(seed, round * 100 + i), cases[i]);
    for (int i = 0; i < 12 && c.failures == 0; ++i) {
      uint64_t cs = mix(seed, 5000 + i);
      runHtCase(comm, handle, c, R, cs, randomHtCase(cs, R));
    }
    c.ok(epHtHandleDestroy(handle), "ht_handle_destroy", comm);
    (void)rank;
  });
}

TEST_P(HostEngine, LlDispatchCombine) {
  int R = GetParam();
  uint64_t seed = nameSeed("ll", R);
  runOnComm(R, seed, [&](epComm_t comm, int, Ctx& c) {
    std::vector<LlCase> cases = llCases(R);
    for (int round = 0; round < 3 && c.failures == 0; ++round)
      for (size_t i = 0; i < cases.size(); ++i) runLlCase(comm, c, R, mix(seed, round * 100 + i), cases[i]);
    for (int i = 0; i < 16 && c.failures == 0; ++i) {
      uint64_t cs = mix(seed, 5000 + i);
      runLlCase(comm, c, R, cs, randomLlCase(cs, R));
    }
    // overlapped halves: expert-major then rank-major (and the reverse), with and without fp8
    const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
    for (int round = 0; round < 2; ++round) {
      runLlOverlap(comm, c, R, mix(seed, 1000 + round), {2 * R, 128, 4, epBfloat16, 8, EM, round == 0, 0, 1 + round},
                   {4 * R, 256, 6, epFloat16, 5, RM, round == 1, 0, true});
      runLlOverlap(comm, c, R, mix(seed, 2000 + round), {4 * R, 128, 3, epFloat32, 4, RM, round == 1, 1, true},
                   {2 * R, 128, 8, epBfloat16, 16, EM, round == 0, 0, true});
    }
  });
}

TEST_P(HostEngine, Alltoallv) {
  int R = GetParam();
  uint64_t seed = nameSeed("a2a", R);
  runOnComm(R, seed, [&](epComm_t comm, int, Ctx& c) {
    const int dtypes[] = {epFloat32, epBfloat16, epUint8, epInt64, epFloat8E4M3};
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < 5; ++i)
        runAlltoallvCase(comm, c, R, mix(seed, round * 10 + i), dtypes[i], i == 3 && round == 0 ? 0 : 40 + 200 * i);
      for (int i = 0; i < 6; ++i)
        runAlltoallvDeviceCase(comm, c, R, mix(seed, 100 + round * 10 + i), dtypes[(i + round) % 5], 50 + 100 * i,
                               i % 3);
    }
    runAlltoallvCase(comm, c, R, mix(seed, 200), epInt32, 30);  // still fine after an overflow
  });
}

// A mixed sequence of every operation, several rounds, on one communicator (epochs advance correctly).
TEST_P(HostEngine, MixedSequence) {
  int R = GetParam();
  uint64_t seed = nameSeed("mixed", R);
  runOnComm(R, seed, [&](epComm_t comm, int, Ctx& c) {
    epHtHandle_t handle = nullptr;
    if (!c.ok(epHtHandleCreate(comm, kHtMaxTokens, &handle), "ht_handle_create", comm)) return;
    int E = 4 * R;
    for (int round = 0; round < 4; ++round) {
      uint64_t s = mix(seed, round);
      runHtCase(comm, handle, c, R, mix(s, 1), {E, 128, 4, round % 2 ? epFloat8E4M3 : epBfloat16, 12});
      runLlCase(comm, c, R, mix(s, 2), {E, 128, 4, epBfloat16, 4, EP_LL_EXPERT_MAJOR, round % 2 == 1, 0, true});
      runAlltoallvCase(comm, c, R, mix(s, 3), epFloat16, 20);
      runLlCase(comm, c, R, mix(s, 4), {2 * R, 256, 3, epFloat16, 3, EP_LL_RANK_MAJOR, round % 2 == 0, 0, false});
      runAlltoallvDeviceCase(comm, c, R, mix(s, 5), epBfloat16, 20, round % 3);
      runHtCase(comm, handle, c, R, mix(s, 6), {2 * R, 56, 2, epFloat32, 8});
      if (c.failures) break;
    }
    c.ok(epHtHandleDestroy(handle), "ht_handle_destroy", comm);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostEngine, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) { return "R" + std::to_string(i.param); });

// ---------------------------------------------------------------------------------------------------------
// Across (virtual) hosts: every operation bit-exact against the same reference when the ranks sit on H hosts, of
// equal size or not (a first host of 3 ranks then one of 2; a lone rank then two hosts of 2), and reach the ranks of
// other hosts over the net transport (socket, and ofi where libfabric is installed).
// The meson test "cross_host" runs only these (GTEST_FILTER=*CrossHost*); the others exclude them.
// ---------------------------------------------------------------------------------------------------------
struct CrossHostParam {
  int hosts, per_host;
  const char* net;
  int first = 0;  // > 0: the first host has this many ranks instead of per_host (hosts of unequal size)
  int ranks() const { return (first > 0 ? first : per_host) + (hosts - 1) * per_host; }
};

class CrossHost : public ::testing::TestWithParam<CrossHostParam> {
 protected:
  void SetUp() override {
    if (strcmp(GetParam().net, "ofi") == 0) {
      setenv("EPCOMM_NET", "ofi", 1);
      std::string why;
      if (epcomm::net::netOfiBackend(&why) == nullptr) GTEST_SKIP() << "EPCOMM_NET=ofi is not offered: " << why;
      unsetenv("EPCOMM_NET");
    }
    gHosts = GetParam().hosts;
    gFirstHostRanks = GetParam().first;
    gNet = GetParam().net;
  }
  void TearDown() override { gHosts = gFirstHostRanks = 0; }
};

TEST_P(CrossHost, EveryOperation) {
  const int R = GetParam().ranks();
  uint64_t seed = nameSeed(GetParam().net, R * 16 + GetParam().hosts);
  runOnComm(R, seed, [&](epComm_t comm, int rank, Ctx& c) {
    epHtHandle_t handle = nullptr;
    if (!c.ok(epHtHandleCreate(comm, kHtMaxTokens, &handle), "ht_handle_create", comm)) return;
    const int EM = EP_LL_EXPERT_MAJOR, RM = EP_LL_RANK_MAJOR;
    for (int round = 0; round < 2 && c.failures == 0; ++round) {
      uint64_t s = mix(seed, round);
      // HT exact / cached / worst-token (with the layout), bf16 and fp8, rows that wrap the small queues
      runHtCase(comm, handle, c, R, mix(s, 1), {4 * R, 128, 4, round ? epFloat8E4M3 : epBfloat16, 24});
      runHtCase(comm, handle, c, R, mix(s, 2), {2 * R, 1024, 3, round ? epFloat32 : epFloat16, 40});
      // Rows of half the smallest queue, every token on every rank: a combine's fp32 partial of such a row fills a
      // whole 64 KiB queue
      if (round == 0) runHtCase(comm, handle, c, R, mix(s, 10), {R, 16384, 4, epBfloat16, 6});
      // LL: both layouts, fp8, one call and split halves (also mixed between ranks), two interleaved
      runLlCase(comm, c, R, mix(s, 3), {4 * R, 128, 4, epBfloat16, 8, EM, round == 1, 0, 0});
      runLlCase(comm, c, R, mix(s, 4), {2 * R, 256, 3, epFloat16, 6, RM, round == 0, 1, 1});
      runLlCase(comm, c, R, mix(s, 5), {8 * R, 128, 6, epFloat32, 5, round ? RM : EM, false, 0, 2});
      runLlOverlap(comm, c, R, mix(s, 6), {2 * R, 128, 4, epBfloat16, 8, EM, round == 0, 0, 1},
                   {4 * R, 256, 6, epFloat16, 5, RM, round == 1, 0, 2});
      // alltoallv, host counts and device counts (with an overflow mode)
      runAlltoallvCase(comm, c, R, mix(s, 7), round ? epFloat16 : epInt64, 300);
      runAlltoallvDeviceCase(comm, c, R, mix(s, 8), epBfloat16, 200, round);
      runAlltoallvDeviceCase(comm, c, R, mix(s, 9), epUint8, 500, 2);
      c.ok(epCommBarrier(comm, nullptr), "barrier", comm);
    }
    uint64_t cs = mix(seed, 77);
    uint64_t before = 0, after = 0;
    c.ok(epCommGetNetBytes(comm, &before), "get_net_bytes", comm);
    runHtCase(comm, handle, c, R, cs, randomHtCase(cs, R));
    cs = mix(seed, 78);
    runLlCase(comm, c, R, cs, randomLlCase(cs, R));
    c.ok(epCommGetNetBytes(comm, &after), "get_net_bytes", comm);
    // Every rank has peers on another host and every operation exchanges headers with them.
    if (after <= before) c.fail("get_net_bytes", "did not grow across operations with other hosts (%llu, %llu)",
                                static_cast<unsigned long long>(before), static_cast<unsigned long long>(after));
    // Raw net throughput (epCommNetRawBandwidth): connections of its own, set up twice (the second set-up must not
    // take the first one's), a short last message; then operations over the engine's connections as before.
    for (int rep = 0; rep < 2 && c.failures == 0; ++rep) {
      const size_t per_peer = (size_t{1} << 20) + 4097 * static_cast<size_t>(rep);
      uint64_t sent = 0;
      double secs = 0;
      if (!c.ok(epCommNetRawBandwidth(comm, per_peer, 256 << 10, 3 - rep, &sent, &secs), "net_raw_bandwidth", comm))
        break;
      const uint64_t want = per_peer * static_cast<uint64_t>(R - hostRanks(R, rank));
      if (sent != want || !(secs > 0))
        c.fail("net_raw_bandwidth", "sent %llu bytes in %g s, want %llu bytes in a positive time",
               static_cast<unsigned long long>(sent), secs, static_cast<unsigned long long>(want));
    }
    cs = mix(seed, 79);
    runHtCase(comm, handle, c, R, cs, randomHtCase(cs, R));
    c.ok(epCommBarrier(comm, nullptr), "barrier", comm);
    c.ok(epHtHandleDestroy(handle), "ht_handle_destroy", comm);
  });
}

INSTANTIATE_TEST_SUITE_P(Hosts, CrossHost,
                         ::testing::Values(CrossHostParam{2, 2, "socket"}, CrossHostParam{3, 2, "socket"},
                                           CrossHostParam{4, 1, "socket"}, CrossHostParam{2, 2, "ofi"},
                                           CrossHostParam{3, 2, "ofi"}, CrossHostParam{4, 1, "ofi"},
                                           // hosts of unequal size: 3 + 2 ranks, 1 + 2 + 2
                                           CrossHostParam{2, 2, "socket", 3}, CrossHostParam{3, 2, "socket", 1},
                                           CrossHostParam{2, 2, "ofi", 3}),
                         [](const ::testing::TestParamInfo<CrossHostParam>& i) {
                           const std::string sizes = i.param.first > 0
                                                         ? std::to_string(i.param.first) + "then" +
                                                               std::to_string(i.param.hosts - 1) + "x" +
                                                               std::to_string(i.param.per_host)
                                                         : std::to_string(i.param.hosts) + "x" +
                                                               std::to_string(i.param.per_host);
                           return sizes + "_" + i.param.net;
                         });

// Worst-token mode with fewer rows than a rank receives: epCapacityExceeded there; the communicator stays
// usable (a following correct call succeeds everywhere).
TEST(HostEngineErrors, HtWorstTokenCapacityExceeded) {
  const int R = 3;
  uint64_t seed = nameSeed("ht_capacity", R);
  runOnComm(R, seed, [&](epComm_t comm, int rank, Ctx& c) {
    Shape s{R, 6, 64, 3};
    c.cas = "HT worst-token overflow R=3 E=6 H=64 K=3";
    std::vector<int> counts = {10, 3, 7};
    std::vector<RankInput> all = genInputs(seed, s, epBfloat16, counts);
    int maxrecv = 0;
    std::vector<int> nrecv(R);
    for (int r = 0; r < R; ++r) {
      nrecv[r] = static_cast<int>(epref::htRecvRows(all, s, r).size());
      maxrecv = std::max(maxrecv, nrecv[r]);
    }
    epHtHandle_t handle = nullptr;
    if (!c.ok(epHtHandleCreate(comm, kHtMaxTokens, &handle), "ht_handle_create", comm)) return;
    const RankInput& me = all[rank];
    epHtDispatchArgs_t a = EP_HT_DISPATCH_ARGS_INIT;
    a.num_tokens = me.num_tokens;
    a.hidden = s.hidden;
    a.topk = s.topk;
    a.num_experts = s.num_experts;
    a.dtype = epBfloat16;
    a.x = nz(me.x);
    a.topk_idx = nz(me.topk_idx);
    a.topk_weights = nz(me.topk_weights);
    a.num_worst_tokens = maxrecv - 1;
    HtOut o;
    allocHt(comm, c, "ht_sizes_worst", &a, maxrecv - 1, &o);
    epResult_t rc = epHtDispatch(comm, &a, handle, nullptr);
    if (nrecv[rank] > maxrecv - 1) {
      c.ok(rc, "ht_dispatch_worst_overflow", comm, epCapacityExceeded);
    } else {
      std::fprintf(stderr, "rank %d (receives %d <= %d rows): overflow call returned %s\n", rank, nrecv[rank],
                   maxrecv - 1, epGetErrorString(rc));
    }
    checkTail(c, "ht_dispatch_worst_overflow", "recv_x", o.x, static_cast<size_t>(maxrecv - 1) * s.hidden * 2);
    // then a correct call
    a.num_worst_tokens = maxrecv;
    HtOut o2;
    allocHt(comm, c, "ht_sizes_worst", &a, maxrecv, &o2);
    rc = epHtDispatch(comm, &a, handle, nullptr);
    if (c.ok(rc, "ht_dispatch_worst_after_overflow", comm)) {
      epref::HtRecv want = epref::htDispatch(all, s, epBfloat16, rank);
      checkHtRecv(c, "ht_dispatch_worst_after_overflow", o2, want, s, epBfloat16, maxrecv, true, true);
    }
    htCombineAndCheck(comm, handle, c, "ht_combine_after_overflow", all, s, epBfloat16, o2, maxrecv);
    c.ok(epHtHandleDestroy(handle), "ht_handle_destroy", comm);
  });
}

// Channel threads of this process (named epcomm-chan1 .. epcomm-chanC-1; channel 0 is the caller's thread).
int channelThreads() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char path[320], name[32] = {0};  // d_name is at most 255 bytes
      snprintf(path, sizeof(path), "/proc/self/task/%s/comm", e->d_name);
      if (FILE* f = fopen(path, "r")) {
        if (fgets(name, sizeof(name), f) && strncmp(name, "epcomm-chan", 11) == 0) ++n;
        fclose(f);
      }
    }
    closedir(d);
  }
  return n;
}

// config.num_channels = 0 means EPCOMM_HOST_CHANNELS, else the machine's cores shared by the ranks on it, virtual
// hosts included (epcomm.h); an explicit count wins over both, and all ranks use the smallest wish. (Until s29 the
// API turned 0 into 1, so neither the variable nor the cores were ever used.)
TEST(HostEngineChannels, ZeroTakesTheEnvironmentThenTheCores) {
  struct Case {
    const char* env;  // EPCOMM_HOST_CHANNELS, or nullptr
    int config;       // config.num_channels of every rank
    int want;         // channels
    bool vhosts;      // each rank its own virtual host (EPCOMM_HOSTID): they still share this machine's cores
  };
  const int R = 2;
  const long cores = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
  const int by_cores = static_cast<int>(std::min<long>(8, std::max<long>(1, cores / R)));  // kMaxChannels = 8
  const Case cases[] = {{"3", 0, 3, false}, {"3", 2, 2, false}, {nullptr, 0, by_cores, false},
                        {nullptr, 0, by_cores, true}};
  for (const Case& k : cases) {
    epUniqueId id;
    ASSERT_EQ(epGetUniqueId(&id), epSuccess) << epGetLastError(nullptr);
    std::vector<int> codes = epcomm::test::runRanks(
        R,
        [&](int rank) -> int {
          if (k.env) setenv("EPCOMM_HOST_CHANNELS", k.env, 1);
          else unsetenv("EPCOMM_HOST_CHANNELS");
          if (k.vhosts) {
            setenv("EPCOMM_HOSTID", ("vhost" + std::to_string(rank)).c_str(), 1);
            setenv("EPCOMM_NET", "socket", 1);
          }
          epConfig_t cfg = EP_CONFIG_INIT;
          cfg.engine = EP_ENGINE_HOST;
          cfg.timeout_ms = kTimeoutMs;
          cfg.num_channels = k.config;
          epComm_t comm = nullptr;
          if (epCommInitRank(&comm, R, &id, rank, &cfg) != epSuccess) {
            std::fprintf(stderr, "rank %d: epCommInitRank: %s\n", rank, epGetLastError(nullptr));
            return 2;
          }
          int have = channelThreads() + 1;  // a thread names itself once it runs: give them a moment
          for (int i = 0; i < 200 && have < k.want; ++i, usleep(5000)) have = channelThreads() + 1;
          if (have != k.want)
            std::fprintf(stderr, "rank %d: EPCOMM_HOST_CHANNELS=%s, num_channels %d%s: %d channels, want %d\n",
                         rank, k.env ? k.env : "(unset)", k.config, k.vhosts ? ", virtual hosts" : "", have, k.want);
          return epCommDestroy(comm) == epSuccess && have == k.want ? 0 : 1;
        },
        kRunTimeoutMs);
    for (int r = 0; r < R; ++r)
      EXPECT_EQ(codes[r], 0) << "rank " << r << ", EPCOMM_HOST_CHANNELS=" << (k.env ? k.env : "(unset)")
                             << ", num_channels " << k.config;
  }
}

// ---------------------------------------------------------------------------------------------------------
// The reference against itself (no engine): simple cases whose answer is known.
// ---------------------------------------------------------------------------------------------------------
TEST(Reference, IdentityRoundTrips) {
  uint64_t seed = nameSeed("reference", 0);
  for (int R : {1, 3}) {
    for (int dtype : {epBfloat16, epFloat16, epFloat32}) {
      Shape s{R, 2 * R, 128, 1};
      std::vector<int> counts = genCounts(seed, R, 6, 0);
      std::vector<RankInput> all = genInputs(mix(seed, R * 10 + dtype), s, dtype, counts);
      for (auto& in : all)  // top-1 with weight 1; tokens without expert stay (-1)
        for (float& w : in.topk_weights) w = 1.0f;
      size_t esz = epref::elemSize(dtype);
      // HT identity expert: combine(dispatch(x)) == x for routed tokens, 0 for the others
      std::vector<std::vector<uint8_t>> ys(R);
      int total_recv = 0, total_routed = 0;
      for (int r = 0; r < R; ++r) {
        epref::HtRecv rr = epref::htDispatch(all, s, dtype, r);
        ys[r] = rr.x;
        total_recv += rr.num_recv;
        int tpe_sum = 0;
        for (int v : rr.tokens_per_expert) tpe_sum += v;
        EXPECT_EQ(tpe_sum, rr.num_recv);  // top-1: each row names exactly one local expert
      }
      for (int r = 0; r < R; ++r) {
        epref::Layout lay = epref::layout(all[r], s);
        for (int v : lay.tokens_per_rank) total_routed += v;
        std::vector<uint8_t> got = epref::htCombine(all, s, ys, dtype, r);
        for (int t = 0; t < all[r].num_tokens; ++t) {
          bool routed = all[r].topk_idx[t] >= 0;
          std::vector<uint8_t> zero(s.hidden * esz, 0);
          const uint8_t* want = routed ? &all[r].x[t * s.hidden * esz] : zero.data();
          EXPECT_EQ(std::memcmp(&got[t * s.hidden * esz], want, s.hidden * esz), 0)
              << "HT R=" << R << " dtype " << dtype << " rank " << r << " token " << t;
        }
      }
      EXPECT_EQ(total_recv, total_routed);
      // LL identity expert with weight 1 (both layouts): out == x for routed tokens
      for (int layout : {EP_LL_EXPERT_MAJOR, EP_LL_RANK_MAJOR}) {
        int M = 6;
        std::vector<std::vector<uint8_t>> ly(R);
        for (int r = 0; r < R; ++r) {
          epref::LlRecv lr = epref::llDispatch(all, s, M, dtype, false, layout, r, 0);
          // y[le][j] = recv row (expert-major: same index; rank-major: row j of the shared [R, M] block)
          ly[r].assign(static_cast<size_t>(s.local()) * R * M * s.hidden * esz, 0);
          for (int le = 0; le < s.local(); ++le)
            for (int j = 0; j < R * M; ++j) {
              size_t src = layout == EP_LL_EXPERT_MAJOR ? static_cast<size_t>(le) * R * M + j : j;
              std::memcpy(&ly[r][(static_cast<size_t>(le) * R * M + j) * s.hidden * esz],
                          &lr.x[src * s.hidden * esz], s.hidden * esz);
            }
        }
        for (int r = 0; r < R; ++r) {
          std::vector<uint8_t> got = epref::llCombine(all, s, M, layout, ly, dtype, r);
          for (int t = 0; t < all[r].num_tokens; ++t) {
            bool routed = all[r].topk_idx[t] >= 0;
            std::vector<uint8_t> zero(s.hidden * esz, 0);
            const uint8_t* want = routed ? &all[r].x[t * s.hidden * esz] : zero.data();
            EXPECT_EQ(std::memcmp(&got[t * s.hidden * esz], want, s.hidden * esz), 0)
                << "LL layout " << layout << " R=" << R << " rank " << r << " token " << t;
          }
        }
      }
    }
  }
}

TEST(Reference, LlFp8AndAlltoallvConsistency) {
  // fp8 quantization: dequantized values are within half an fp8 ulp-ish of the input (relative 1/16)
  uint64_t seed = nameSeed("reference_fp8", 0);
  std::mt19937_64 g(seed);
  std::vector<uint8_t> x;
  int H = 256;
  genValues(g, epBfloat16, 4, H, &x);
  for (int r = 0; r < 4; ++r) {
    std::vector<uint8_t> q(H);
    std::vector<float> sc(H / 128);
    epref::llQuantizeRow(&x[r * H * 2], H, epBfloat16, q.data(), sc.data());
    for (int h = 0; h < H; ++h) {
      float v = epcomm::loadAsFloat(&x[r * H * 2], h, epBfloat16);
      float d = epcomm::fp8ToFloat(q[h]) * sc[h / 128];
      float amax = sc[h / 128] * 448.0f;
      EXPECT_LE(std::fabs(d - v), std::fabs(v) / 16 + amax * std::ldexp(1.0f, -9) / 448.0f * 2)
          << "row " << r << " col " << h;
    }
  }
  // device-count alltoallv with enough capacity == host-count alltoallv with packed displacements
  int R = 3;
  std::vector<std::vector<int64_t>> c64(R, std::vector<int64_t>(R));
  std::vector<std::vector<size_t>> c(R, std::vector<size_t>(R)), sd(R, std::vector<size_t>(R)),
      rd(R, std::vector<size_t>(R));
  for (int p = 0; p < R; ++p)
    for (int q = 0; q < R; ++q) c[p][q] = static_cast<size_t>(c64[p][q] = static_cast<int64_t>(g() % 7));
  std::vector<std::vector<uint8_t>> sends(R);
  for (int p = 0; p < R; ++p) {
    size_t off = 0;
    for (int q = 0; q < R; ++q) sd[p][q] = off, off += c[p][q];
    sends[p].resize(off * 4);
    for (auto& b : sends[p]) b = static_cast<uint8_t>(g());
  }
  for (int q = 0; q < R; ++q) {
    size_t off = 0;
    for (int p = 0; p < R; ++p) rd[q][p] = off, off += c[p][q];
    std::vector<uint8_t> host = epref::alltoallv(sends, c, sd, rd, 4, q, off, 0);
    epref::AlltoallvDeviceResult dev = epref::alltoallvDevice(sends, c64, 4, off, q, 0);
    EXPECT_EQ(host, dev.recv);
    EXPECT_EQ(dev.num_dropped, 0);
    if (off > 0) {
      epref::AlltoallvDeviceResult small = epref::alltoallvDevice(sends, c64, 4, off - 1, q, 0);
      EXPECT_EQ(small.num_dropped, 1);
      EXPECT_EQ(small.result, epCapacityExceeded);
      EXPECT_EQ(std::memcmp(small.recv.data(), host.data(), (off - 1) * 4), 0);
    }
  }
}

}  // namespace
