// The project's own fuzz test of the C API (issue 13), on the host engine. Each round all ranks agree (from the
// seed) on an operation, its shapes, and whether and how to break one argument: on every rank or on one. Every
// call's result is checked: the mutated rank gets its argument's code, the others epRemoteError (or the code
// the mismatch class states); every failure leaves a message in epGetLastError(comm) that equals the thread's;
// outputs are poisoned and guarded (a call writes only inside its buffers, a failed call none of them); and
// after every rejected call the next valid call must succeed with outputs checked against the reference.
//
//   EPCOMM_FUZZ_SEEDS=first-last   seeds to run (default: the fixed CI set)
//   EPCOMM_FUZZ_ROUNDS=n           rounds per seed
//   EPCOMM_FUZZ_RANKS=2,3          rank counts
// Each seed runs on a fresh communicator; a problem prints the seed, round, rank and call, and fails the test.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <functional>
#include <new>
#include <type_traits>
#include <string>
#include <vector>

#include "api_world.h"
#include "epcomm/epcomm.h"
#include "multiproc.h"

namespace {

using namespace epcomm::test;

// Expectations besides a plain code.
constexpr epResult_t kAnyError = static_cast<epResult_t>(-1);
constexpr epResult_t kOkOrCapacity = static_cast<epResult_t>(-2);

struct Stats {
  std::atomic<uint64_t> calls{0}, mutated{0};
};

// Which halves of an LL call a mutation concerns.
enum Side : unsigned { kSend = EP_LL_SEND, kRecv = EP_LL_RECV, kBoth = EP_LL_SEND_RECV };
// How the rejecting rank learns of its mutation: `code` for itself; a header-level mutation (args unreadable)
// leaves the LL phases to the engine.
template <typename A>
struct Mut {
  const char* name;
  epResult_t code;
  unsigned side;  // LL: the halves whose checks see this field
  std::function<bool(const World&, int rank)> applies;
  std::function<void(A&, std::vector<int64_t>& scratch)> apply;
  bool header = false;  // args unreadable: NULL, or not from *_INIT
};

template <typename A>
bool always(const World&, int) { return true; }
bool hasTokens(const World& w, int r) { return w.T[r] > 0; }

// ---- the argument mutations of each args struct ----
std::vector<Mut<epHtDispatchArgs_t>> htDispatchMuts(bool notify) {
  using A = epHtDispatchArgs_t;
  auto any = always<A>;
  std::vector<Mut<A>> m = {
      {"magic", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.magic = 0; }, true},
      {"size", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.size = 12; }, true},
      {"dtype int32", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = epInt32; }},
      {"dtype 99", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = 99; }},
      {"hidden -8", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = -8; }},
      {"hidden 12", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 12; }},
      {"hidden huge", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 0x7ffffff8; }},
      {"topk 0", epInvalidTopk, kBoth, any, [](A& a, auto&) { a.topk = 0; }},
      {"topk 33", epInvalidTopk, kBoth, any, [](A& a, auto&) { a.topk = EP_MAX_TOPK + 1; }},
      {"num_experts 0", epInvalidNumExperts, kBoth, any, [](A& a, auto&) { a.num_experts = 0; }},
      {"num_experts E+1", epInvalidNumExperts, kBoth, any, [](A& a, auto&) { a.num_experts += 1; }},
      {"num_experts huge", epInvalidNumExperts, kBoth, any, [](A& a, auto&) { a.num_experts = INT_MAX; }},
      {"num_experts over EP_MAX_EXPERTS", epInvalidNumExperts, kBoth, any, [](A& a, auto&) { a.num_experts = 3 << 28; }},
      {"num_tokens -1", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.num_tokens = -1; }},
      {"num_tokens over the handle", epCapacityExceeded, kBoth, any, [](A& a, auto&) { a.num_tokens = INT_MAX; }},
      {"num_worst_tokens -1", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.num_worst_tokens = -1; }},
      {"expert id E", epExpertOutOfRange, kBoth, hasTokens, [](A& a, auto& sc) {
         sc.assign(a.topk_idx, a.topk_idx + static_cast<size_t>(a.num_tokens) * a.topk);
         sc.back() = a.num_experts;
         a.topk_idx = sc.data();
       }},
      {"expert id -2", epExpertOutOfRange, kBoth, hasTokens, [](A& a, auto& sc) {
         sc.assign(a.topk_idx, a.topk_idx + static_cast<size_t>(a.num_tokens) * a.topk);
         sc[0] = -2;
         a.topk_idx = sc.data();
       }},
      {"topk_idx NULL", epNullPointer, kBoth, hasTokens, [](A& a, auto&) { a.topk_idx = nullptr; }},
  };
  if (!notify) {
    m.push_back({"x NULL", epNullPointer, kBoth, hasTokens, [](A& a, auto&) { a.x = nullptr; }});
    m.push_back({"recv_x NULL", epNullPointer, kBoth, [](const World&, int) { return true; },
                 [](A& a, auto&) { a.recv_x = nullptr; }});
    m.push_back({"recv_x_bytes short", epBufferTooSmall, kBoth, [](const World&, int) { return true; },
                 [](A& a, auto&) { a.recv_x_bytes -= 1; }});
    m.push_back({"recv_topk_idx_bytes short", epBufferTooSmall, kBoth, [](const World&, int) { return true; },
                 [](A& a, auto&) { a.recv_topk_idx_bytes -= 1; }});
  }
  return m;
}

std::vector<Mut<epHtCombineArgs_t>> htCombineMuts() {
  using A = epHtCombineArgs_t;
  auto any = always<A>;
  return {
      {"magic", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.magic = 1; }, true},
      {"dtype fp8", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = epFloat8E4M3; }},
      {"dtype -1", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = -1; }},
      {"hidden 12", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 12; }},
      {"hidden -8", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = -8; }},
      {"num_tokens not the handle's", epInvalidUsage, kBoth, any, [](A& a, auto&) { a.num_tokens += 1; }},
      {"combined_x NULL", epNullPointer, kBoth, hasTokens, [](A& a, auto&) { a.combined_x = nullptr; }},
      {"combined_x_bytes short", epBufferTooSmall, kBoth, hasTokens, [](A& a, auto&) { a.combined_x_bytes -= 1; }},
  };
}

std::vector<Mut<epLlDispatchArgs_t>> llDispatchMuts() {
  using A = epLlDispatchArgs_t;
  auto any = always<A>;
  return {
      {"magic", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.magic = 7; }, true},
      {"phases 0", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.phases = 0; }, true},
      {"phases 4", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.phases = 4; }, true},
      {"dtype int64", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = epInt64; }},
      {"hidden -8", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = -8; }},
      {"hidden 12", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 12; }},
      {"hidden over ll_max_hidden", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 512; }},
      {"fp8 hidden not a multiple of 128", epInvalidHidden, kBoth, [](const World& w, int) { return w.H % 128 != 0; },
       [](A& a, auto&) { a.use_fp8 = 1; }},
      {"topk 0", epInvalidTopk, kBoth, any, [](A& a, auto&) { a.topk = 0; }},
      {"num_experts E+1", epInvalidNumExperts, kBoth, any, [](A& a, auto&) { a.num_experts += 1; }},
      {"max_tokens_per_rank 0", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.max_tokens_per_rank = 0; }},
      {"max_tokens_per_rank over the config", epCapacityExceeded, kBoth, any,
       [](A& a, auto&) { a.max_tokens_per_rank = INT_MAX; }},
      {"num_tokens over max_tokens_per_rank", epCapacityExceeded, kBoth, any,
       [](A& a, auto&) { a.num_tokens = a.max_tokens_per_rank + 1; }},
      {"layout 2", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.layout = 2; }},
      {"expert id E", epExpertOutOfRange, kSend, hasTokens, [](A& a, auto& sc) {
         sc.assign(a.topk_idx, a.topk_idx + static_cast<size_t>(a.num_tokens) * a.topk);
         sc.back() = a.num_experts;
         a.topk_idx = sc.data();
       }},
      {"x NULL", epNullPointer, kSend, hasTokens, [](A& a, auto&) { a.x = nullptr; }},
      {"recv_x NULL", epNullPointer, kRecv, any, [](A& a, auto&) { a.recv_x = nullptr; }},
      {"recv_x_bytes short", epBufferTooSmall, kRecv, any, [](A& a, auto&) { a.recv_x_bytes -= 1; }},
      {"recv_count NULL", epNullPointer, kRecv, any, [](A& a, auto&) { a.recv_count = nullptr; }},
      {"recv_count_bytes short", epBufferTooSmall, kRecv, any, [](A& a, auto&) { a.recv_count_bytes -= 1; }},
  };
}

std::vector<Mut<epLlCombineArgs_t>> llCombineMuts() {
  using A = epLlCombineArgs_t;
  auto any = always<A>;
  return {
      {"size", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.size = 0; }, true},
      {"dtype fp8", epUnsupportedDtype, kBoth, any, [](A& a, auto&) { a.dtype = epFloat8E4M3; }},
      {"hidden 12", epInvalidHidden, kBoth, any, [](A& a, auto&) { a.hidden = 12; }},
      {"topk 33", epInvalidTopk, kBoth, any, [](A& a, auto&) { a.topk = 33; }},
      {"max_tokens_per_rank 0", epInvalidArgument, kBoth, any, [](A& a, auto&) { a.max_tokens_per_rank = 0; }},
      {"y NULL", epNullPointer, kSend, any, [](A& a, auto&) { a.y = nullptr; }},
      {"y_bytes short", epBufferTooSmall, kSend, any, [](A& a, auto&) { a.y_bytes -= 1; }},
      {"recv_count NULL", epNullPointer, kSend, any, [](A& a, auto&) { a.recv_count = nullptr; }},
      {"layout range out of bounds", epInvalidArgument, kSend,
       [](const World&, int) { return true; },
       [](A& a, auto& sc) {  // copies: the dispatch outputs stay as they were
         if (a.layout == EP_LL_EXPERT_MAJOR) {
           sc.assign(a.recv_layout_range, a.recv_layout_range + 1);
           sc[0] = (static_cast<int64_t>(a.max_tokens_per_rank + 1) << 32);
           a.recv_layout_range = sc.data();
         } else {
           static thread_local std::vector<int> counts;
           counts.assign(a.recv_count, a.recv_count + 1);
           counts[0] = a.max_tokens_per_rank + 1;
           a.recv_count = counts.data();
         }
       }},
      {"out NULL", epNullPointer, kRecv, hasTokens, [](A& a, auto&) { a.out = nullptr; }},
      {"out_bytes short", epBufferTooSmall, kRecv, hasTokens, [](A& a, auto&) { a.out_bytes -= 1; }},
      {"topk_weights NULL", epNullPointer, kRecv, hasTokens, [](A& a, auto&) { a.topk_weights = nullptr; }},
      {"expert id -5", epExpertOutOfRange, kRecv, hasTokens, [](A& a, auto& sc) {
         sc.assign(a.topk_idx, a.topk_idx + static_cast<size_t>(a.num_tokens) * a.topk);
         sc[0] = -5;
         a.topk_idx = sc.data();
       }},
  };
}

// One rank's fuzzing of one communicator.
class Fuzzer {
 public:
  Fuzzer(int R, int rank, uint64_t seed, int rounds, Stats* stats)
      : R_(R), rank_(rank), seed_(seed), rounds_(rounds), stats_(stats), g_(hashOf({seed, static_cast<uint64_t>(R)})) {}

  int run() {
    epUniqueId& solo_id = solo_id_;
    if (epGetUniqueId(&solo_id) != epSuccess) return problem("epGetUniqueId for the solo communicator failed");
    epConfig_t solo_cfg = EP_CONFIG_INIT;
    solo_cfg.engine = EP_ENGINE_HOST;
    if (epCommInitRank(&solo_, 1, &solo_id, 0, &solo_cfg) != epSuccess) return problem("solo communicator: %s", epGetLastError(nullptr));
    if (epHtHandleCreate(solo_, 8, &foreign_h_) != epSuccess) return problem("solo handle");
    // A destroyed handle and a made-up communicator: refused without being read.
    fake_comm_ = reinterpret_cast<epComm_t>(&fake_storage_);
    if (epHtHandleCreate(comm_, 8, &h_) != epSuccess) return problem("handle: %s", epGetLastError(comm_));
    for (round_ = 0; round_ < rounds_; ++round_) {
      if (roundOnce()) return 1;
    }
    epHtHandleDestroy(h_);
    epHtHandleDestroy(foreign_h_);
    epCommDestroy(solo_);
    return 0;
  }
  epComm_t comm_ = nullptr;

 private:
  template <typename... Args>
  int problem(const char* f, Args... args) {
    fprintf(stderr, "PROBLEM seed %llu R %d round %d rank %d op %s mutation '%s' (%s): ",
            static_cast<unsigned long long>(seed_), R_, round_, rank_, op_, mut_, scope_);
    fprintf(stderr, f, args...);
    fprintf(stderr, "\n");
    return 1;
  }
  // Checks one call's result; `mutated`: this rank's arguments carried the mutation.
  int check(const char* what, epResult_t r, epResult_t want, bool mutated, epComm_t c) {
    stats_->calls.fetch_add(1, std::memory_order_relaxed);
    if (mutated) stats_->mutated.fetch_add(1, std::memory_order_relaxed);
    const bool ok = want == kAnyError     ? r != epSuccess
                    : want == kOkOrCapacity ? (r == epSuccess || r == epCapacityExceeded)
                                            : r == want;
    const std::string thread_msg = epGetLastError(nullptr);
    if (!ok)
      return problem("%s returned %s (%s), want %s", what, epGetErrorString(r), thread_msg.c_str(),
                     want == kAnyError ? "an error" : want == kOkOrCapacity ? "success or capacity exceeded" : epGetErrorString(want));
    if (r != epSuccess) {
      if (thread_msg.empty()) return problem("%s failed with %s but left no message", what, epGetErrorString(r));
      if (c != nullptr && c != fake_comm_ && thread_msg != epGetLastError(c))
        return problem("%s: epGetLastError(comm) = '%s' but the call's message is '%s'", what, epGetLastError(c),
                       thread_msg.c_str());
    }
    return 0;
  }
#define FZ_CHECK(what, call, want, mutated, c) \
  do {                                         \
    if (check((what), (call), (want), (mutated), (c))) return 1; \
  } while (0)
#define FZ_OUT(expr)                          \
  do {                                        \
    std::string e_ = (expr);                  \
    if (!e_.empty()) return problem("%s", e_.c_str()); \
  } while (0)

  // All ranks draw the same numbers from g_.
  World drawWorld() {
    World w;
    w.seed = hashOf({seed_, static_cast<uint64_t>(round_), 77});
    w.R = R_;
    static const int kH[] = {8, 16, 64, 128, 256};
    w.H = kH[g_.range(0, 4)];
    w.E = R_ * g_.range(1, 3);
    w.K = g_.range(1, 4);
    w.M = 8;
    static const int kDt[] = {epBfloat16, epFloat16, epFloat32};
    w.dtype = kDt[g_.range(0, 2)];
    const bool none = g_.chance(8);
    for (int r = 0; r < R_; ++r) w.T.push_back(none || g_.chance(20) ? 0 : g_.range(1, 8));
    return w;
  }
  // Draws a mutation from `muts` (or none) and the ranks it is on; every rank draws the same.
  template <typename A>
  const Mut<A>* drawMut(const std::vector<Mut<A>>& muts, const World& w, unsigned side, std::vector<bool>& on) {
    on.assign(R_, false);
    if (!g_.chance(45) || muts.empty()) return nullptr;
    const Mut<A>& m = muts[g_.range(0, static_cast<int>(muts.size()) - 1)];
    const bool all = g_.chance(50);
    const int one = g_.range(0, R_ - 1);
    if (!(m.side & side)) return nullptr;
    bool any = false;
    for (int r = 0; r < R_; ++r) {
      on[r] = (all || r == one) && m.applies(w, r);
      any = any || on[r];
    }
    if (!any) return nullptr;
    mut_ = m.name;
    scope_ = all ? "all ranks" : "one rank";
    return &m;
  }
  bool anyOn(const std::vector<bool>& on) const {
    for (bool b : on)
      if (b) return true;
    return false;
  }
  // What a collective returns on this rank when `on` ranks carried mutation m.
  template <typename A>
  epResult_t wantCollective(const Mut<A>* m, const std::vector<bool>& on) const {
    if (m == nullptr || !anyOn(on)) return epSuccess;
    return on[rank_] ? m->code : epRemoteError;
  }

  // A destroyed handle; made again when the allocator has since given its address to a live one of ours.
  void refreshDeadHandle() {
    while (dead_h_ == nullptr || dead_h_ == h_ || dead_h_ == foreign_h_) {
      epHtHandle_t keep = nullptr, dead = nullptr;
      epHtHandleCreate(solo_, 1, &keep);  // held while `dead` is freed, so the next one lands elsewhere
      epHtHandleCreate(solo_, 1, &dead);
      epHtHandleDestroy(dead);
      epHtHandleDestroy(keep);
      dead_h_ = dead;
    }
  }

  int roundOnce() {
    refreshDeadHandle();
    op_ = "?";
    mut_ = "";
    scope_ = "";
    World w = drawWorld();
    RankIo io(w, rank_, comm_);
    io.h = h_;
    const int op = g_.range(0, 11);
    switch (op) {
      case 0: return fuzzLayout(w, io);
      case 1: case 2: return fuzzHt(w, io, true);
      case 3: return fuzzHt(w, io, false);
      case 4: case 5: case 6: return fuzzLl(w, io);
      case 7: return fuzzAlltoallv(w, io);
      case 8: return fuzzAlltoallvDevice(w, io);
      case 9: return fuzzSizes(w, io);
      case 10: return fuzzOrder(w, io);
      default: return fuzzLocal(w, io);
    }
  }

  // ---- layout (local) ----
  int fuzzLayout(const World& w, RankIo& io) {
    op_ = "layout";
    const int which = g_.range(0, 7);
    const bool all = g_.chance(50);
    const bool mine = all || g_.range(0, R_ - 1) == rank_;
    if (mine && which < 6) {
      mut_ = "layout argument";
      std::vector<int64_t> bad = io.idx;
      int T = io.T(), K = w.K, E = w.E;
      const int64_t* idx = io.idxp();
      epResult_t want = epSuccess;
      switch (which) {
        case 0: T = -1, want = epInvalidArgument; break;
        case 1: K = 0, want = epInvalidTopk; break;
        case 2: E = E + 1, want = epInvalidNumExperts; break;
        case 3: if (T > 0) idx = nullptr, want = epNullPointer; break;
        case 4: if (T > 0) bad[0] = E, idx = bad.data(), want = epExpertOutOfRange; break;
        default: E = -R_, want = epInvalidNumExperts; break;
      }
      io.layout();  // fresh buffers
      io.lay_rank.poison();
      epResult_t r = epGetDispatchLayout(comm_, idx, T, K, E, io.lay_rank.as<int>(), io.lay_expert.as<int>(),
                                         io.lay_in.as<uint8_t>(), nullptr);
      FZ_CHECK("epGetDispatchLayout", r, want, want != epSuccess, comm_);
      if (want != epSuccess && !io.lay_rank.poisoned()) return problem("a rejected layout wrote num_tokens_per_rank");
    }
    FZ_CHECK("epGetDispatchLayout", io.layout(), epSuccess, false, comm_);
    FZ_OUT(io.checkLayout());
    return 0;
  }

  // ---- HT: worst-token mode (dispatch, combine) or exact mode (notify, dispatch, combine) ----
  int htValid(const World& w, RankIo& io, bool worst) {
    epHtDispatchArgs_t a;
    if (worst) {
      a = io.htDispatchArgs(std::max(1, w.sumT()));
    } else {
      a = io.htDispatchArgs(0);
      FZ_CHECK("epHtDispatchNotify", io.htNotify(a), epSuccess, false, comm_);
      FZ_OUT(io.checkHtNotify());
      a = io.htDispatchArgs(0);
    }
    FZ_CHECK("epHtDispatch", epHtDispatch(comm_, &a, io.h, nullptr), epSuccess, false, comm_);
    FZ_OUT(io.checkHtDispatch());
    epHtCombineArgs_t c = io.htCombineArgs();
    FZ_CHECK("epHtCombine", epHtCombine(comm_, &c, io.h, nullptr), epSuccess, false, comm_);
    FZ_OUT(io.checkHtCombine());
    return 0;
  }

  int fuzzHt(const World& w, RankIo& io, bool worst) {
    op_ = worst ? "HT worst-token" : "HT exact";
    std::vector<int64_t> scratch;
    std::vector<bool> on;
    const int where = g_.range(0, 3);  // 0: dispatch (or notify), 1: combine, 2: handles, 3: across-rank classes
    if (where == 0) {
      auto muts = htDispatchMuts(!worst);
      const auto* m = drawMut(muts, w, kBoth, on);
      if (m) {
        epHtDispatchArgs_t a = io.htDispatchArgs(worst ? std::max(1, w.sumT()) : 0), b = a;
        if (on[rank_]) m->apply(b, scratch);
        epResult_t r;
        if (worst) {
          r = epHtDispatch(comm_, &b, io.h, nullptr);
        } else {
          io.ht_per_expert_host.assign(w.L() + 1, -7);
          r = epHtDispatchNotify(comm_, &b, io.h, &io.ht_num_recv_host, io.ht_per_expert_host.data(), nullptr);
        }
        FZ_CHECK(worst ? "epHtDispatch" : "epHtDispatchNotify", r, wantCollective(m, on), on[rank_], comm_);
        if (worst && !io.htDispatchUntouched()) return problem("a failed HT dispatch wrote its outputs");
      }
    } else if (where == 1) {
      if (htValid(w, io, worst)) return 1;
      auto muts = htCombineMuts();
      const auto* m = drawMut(muts, w, kBoth, on);
      if (m) {
        epHtCombineArgs_t c = io.htCombineArgs(), b = c;
        if (on[rank_]) m->apply(b, scratch);
        FZ_CHECK("epHtCombine", epHtCombine(comm_, &b, io.h, nullptr), wantCollective(m, on), on[rank_], comm_);
        if (!io.ht_out.poisoned()) return problem("a failed HT combine wrote combined_x");
        c = io.htCombineArgs();  // the next valid call: the same combine
        FZ_CHECK("epHtCombine", epHtCombine(comm_, &c, io.h, nullptr), epSuccess, false, comm_);
        FZ_OUT(io.checkHtCombine());
        return 0;
      }
    } else if (where == 2) {
      // NULL, destroyed and foreign handles, and NULL args, on one rank or all.
      const int kind = g_.range(0, 3);
      const bool all = g_.chance(50);
      const int one = g_.range(0, R_ - 1);
      on.assign(R_, false);
      for (int r = 0; r < R_; ++r) on[r] = all || r == one;
      static const char* kNames[] = {"handle NULL", "handle destroyed", "handle of another communicator", "args NULL"};
      static const epResult_t kCodes[] = {epNullPointer, epInvalidArgument, epInvalidUsage, epNullPointer};
      mut_ = kNames[kind];
      scope_ = all ? "all ranks" : "one rank";
      epHtDispatchArgs_t a = io.htDispatchArgs(std::max(1, w.sumT()));
      epHtHandle_t h = io.h;
      const epHtDispatchArgs_t* ap = &a;
      if (on[rank_]) {
        if (kind == 0) h = nullptr;
        if (kind == 1) h = dead_h_;
        if (kind == 2) h = foreign_h_;
        if (kind == 3) ap = nullptr;
      }
      const epResult_t want = on[rank_] ? kCodes[kind] : epRemoteError;
      FZ_CHECK("epHtDispatch", epHtDispatch(comm_, ap, h, nullptr), want, on[rank_], comm_);
      if (!io.htDispatchUntouched()) return problem("a failed HT dispatch wrote its outputs");
    } else {
      // Classes across ranks: mismatched num_experts on one rank (every rank: epInvalidUsage), and a worst-token
      // capacity too small for what arrives (epCapacityExceeded where it overflows, success elsewhere).
      if (g_.chance(50)) {
        const int one = g_.range(0, R_ - 1);
        mut_ = "num_experts differs on one rank";
        scope_ = "one rank";
        epHtDispatchArgs_t a = io.htDispatchArgs(worst ? std::max(1, w.sumT()) : 0);
        if (rank_ == one) a.num_experts *= 2;
        epResult_t r = worst ? epHtDispatch(comm_, &a, io.h, nullptr)
                             : epHtDispatchNotify(comm_, &a, io.h, &io.ht_num_recv_host, nullptr, nullptr);
        FZ_CHECK(worst ? "epHtDispatch" : "epHtDispatchNotify", r, R_ > 1 ? epInvalidUsage : epSuccess,
                 rank_ == one, comm_);
        if (worst && !io.htDispatchUntouched()) return problem("a failed HT dispatch wrote its outputs");
      } else if (worst) {
        mut_ = "num_worst_tokens = 1";
        scope_ = "all ranks";
        epHtDispatchArgs_t a = io.htDispatchArgs(1);
        const bool overflows = w.htRows(rank_).size() > 1;
        epResult_t r = epHtDispatch(comm_, &a, io.h, nullptr);
        FZ_CHECK("epHtDispatch", r, overflows ? epCapacityExceeded : epSuccess, true, comm_);
        if (r == epSuccess) FZ_OUT(io.checkHtDispatch());
        else if (!io.htDispatchUntouched()) return problem("a failed HT dispatch wrote its outputs");
      }
    }
    return htValid(w, io, worst);
  }

  // ---- LL: dispatch then combine, each in one call or in two halves; one call may carry a mutation ----
  template <typename A>
  int llCall(const char* what, A& a, epResult_t want, bool mutated) {
    epResult_t r;
    if constexpr (std::is_same_v<A, epLlDispatchArgs_t>) r = epLlDispatch(comm_, &a, nullptr);
    else r = epLlCombine(comm_, &a, nullptr);
    return check(what, r, want, mutated, comm_);
  }
  // One LL operation (dispatch if Disp, else combine) with an optional mutation at one of its calls.
  template <bool Disp>
  int llStep(const World& w, RankIo& io, int layout) {
    using A = std::conditional_t<Disp, epLlDispatchArgs_t, epLlCombineArgs_t>;
    const char* name = Disp ? "epLlDispatch" : "epLlCombine";
    auto args = [&](unsigned phases, bool fresh) -> A {
      if constexpr (Disp) return io.llDispatchArgs(layout, phases, fresh);
      else return io.llCombineArgs(phases, fresh);
    };
    auto checkOut = [&]() { return Disp ? io.checkLlDispatch() : io.checkLlCombine(); };
    auto untouched = [&]() { return Disp ? io.llDispatchUntouched() : io.ll_out.poisoned(); };
    std::vector<Mut<A>> muts;
    if constexpr (Disp) muts = llDispatchMuts();
    else muts = llCombineMuts();
    std::vector<int64_t> scratch;
    std::vector<bool> on;
    const bool split = g_.chance(50);
    const bool at_recv = g_.chance(50);
    const unsigned side = !split ? kBoth : at_recv ? kRecv : kSend;
    const Mut<A>* m = drawMut(muts, w, side, on);
    // Mismatched capacity on one rank (dispatch in one call): every rank fails with epInvalidUsage.
    if (Disp && !split && m == nullptr && R_ > 1 && g_.chance(10)) {
      const int one = g_.range(0, R_ - 1);
      mut_ = "max_tokens_per_rank differs on one rank";
      scope_ = "one rank";
      A a = args(EP_LL_SEND_RECV, true);
      if (w.T[one] < w.M) {  // its tokens still fit
        if (rank_ == one) a.max_tokens_per_rank = w.M - 1;
        if (llCall(name, a, epInvalidUsage, rank_ == one)) return 1;
        if (!untouched()) return problem("a failed LL call wrote its outputs");
      }
      m = nullptr;
    }
    const bool mine = m != nullptr && on[rank_];
    if (!split) {
      A a = args(EP_LL_SEND_RECV, true);
      if (m != nullptr) {
        A b = a;
        if (mine) m->apply(b, scratch);
        if (llCall(name, b, wantCollective(m, on), mine)) return 1;
        if (!untouched()) return problem("a failed LL call wrote its outputs");
        a = args(EP_LL_SEND_RECV, true);
      }
      if (llCall(name, a, epSuccess, false)) return 1;
      FZ_OUT(checkOut());
      return 0;
    }
    A send = args(EP_LL_SEND, true);
    if (m != nullptr && !at_recv) {
      // A rejected send half: the peers' receive returns epRemoteError, the rank's own its code. A rejected
      // call whose args cannot be read stands for both halves (nothing is outstanding): its own later receive
      // finds no send half.
      A b = send;
      if (mine) m->apply(b, scratch);
      if (llCall(name, b, mine ? m->code : epSuccess, mine)) return 1;
      A recv = args(EP_LL_RECV, false);
      epResult_t want = mine ? (m->header ? epInvalidUsage : m->code) : epRemoteError;
      if (llCall(name, recv, want, false)) return 1;
      if (!untouched()) return problem("a failed LL receive half wrote its outputs");
      send = args(EP_LL_SEND, true);
      m = nullptr;
    }
    if (llCall(name, send, epSuccess, false)) return 1;
    A recv = args(EP_LL_RECV, false);
    if (m != nullptr) {
      // A rejected receive half posts nothing and stays outstanding: the others complete; the rank retries.
      A b = recv;
      if (mine) m->apply(b, scratch);
      if (mine) {
        if (llCall(name, b, m->code, true)) return 1;
        if (!untouched()) return problem("a rejected LL receive half wrote its outputs");
      }
    }
    if (llCall(name, recv, epSuccess, false)) return 1;
    FZ_OUT(checkOut());
    return 0;
  }

  int fuzzLl(const World& w, RankIo& io) {
    const int layout = g_.chance(50) ? EP_LL_EXPERT_MAJOR : EP_LL_RANK_MAJOR;
    op_ = "LL dispatch";
    if (llStep<true>(w, io, layout)) return 1;
    op_ = "LL combine";
    return llStep<false>(w, io, layout);
  }

  // ---- alltoallv ----
  int fuzzAlltoallv(const World&, RankIo& io) {
    op_ = "alltoallv";
    static const int kDt[] = {epFloat32, epBfloat16, epInt64, epUint8, epFloat8E4M3};
    io.a2aPrepare(kDt[g_.range(0, 4)]);
    const int kind = g_.range(0, 9);
    const int one = g_.range(0, R_ - 1), peer = g_.range(0, R_ - 1);
    const bool all = g_.chance(50);
    const bool on = all || rank_ == one;
    if (kind < 6) {
      static const char* kNames[] = {"send_counts NULL", "recv_displs NULL", "dtype 99", "sendbuf NULL",
                                     "recvbuf NULL", "a count over any buffer"};
      mut_ = kNames[kind];
      scope_ = all ? "all ranks" : "one rank";
      auto sc = io.sc, sd = io.sd, rc = io.rc, rd = io.rd;
      const void* sb = io.a2a_send.data();
      void* rb = io.a2a_recv.data();
      int dt = io.a2a_dtype;
      epResult_t want = epSuccess;
      size_t s_total = 0, r_total = 0;
      for (int p = 0; p < R_; ++p) s_total += sc[p], r_total += rc[p];
      bool mine = false;
      if (on) {
        mine = true;
        switch (kind) {
          case 0: want = epNullPointer; break;
          case 1: want = epNullPointer; break;
          case 2: dt = 99, want = epUnsupportedDtype; break;
          case 3: sb = nullptr, want = s_total > 0 ? epNullPointer : epSuccess; break;
          case 4: rb = nullptr, want = r_total > 0 ? epNullPointer : epSuccess; break;
          default: sc[peer] = SIZE_MAX / 2, want = epInvalidArgument; break;
        }
        mine = want != epSuccess;
      }
      // Whether any rank is rejected (each rank can tell from the shared draws and the counts).
      bool any = false;
      for (int r = 0; r < R_; ++r) {
        if (!(all || r == one)) continue;
        size_t s = 0, rr = 0;
        for (int p = 0; p < R_; ++p) s += io.a2aCount(r, p), rr += io.a2aCount(p, r);
        any = any || !((kind == 3 && s == 0) || (kind == 4 && rr == 0));
      }
      if (!mine && any) want = epRemoteError;
      io.a2a_recv.poison();
      epResult_t r = epAlltoallv(comm_, sb, kind == 0 && on ? nullptr : sc.data(), sd.data(), rb, rc.data(),
                                 kind == 1 && on ? nullptr : rd.data(), static_cast<epDataType_t>(dt), nullptr);
      FZ_CHECK("epAlltoallv", r, want, mine, comm_);
      if (r != epSuccess && (!io.a2a_recv.poisoned() || !io.a2a_recv.guardsOk()))
        return problem("a failed alltoallv wrote recvbuf");
    } else if (kind < 9 && R_ > 1) {
      // Counts that disagree: one rank sends or expects more (far more: it would read past its buffer). The two
      // ranks of the pair fail with epInvalidUsage, every other with epRemoteError, before any data moves.
      const bool far = kind == 8;
      const bool on_recv = kind == 7;
      mut_ = on_recv ? "recv_counts disagree" : far ? "send_counts far over the peer's" : "send_counts disagree";
      scope_ = "one rank";
      auto sc = io.sc, rc = io.rc;
      if (rank_ == one) (on_recv ? rc : sc)[peer] += far ? 1000000 : 1;
      const bool involved = rank_ == one || rank_ == peer;
      io.a2a_recv.poison();
      epResult_t r = epAlltoallv(comm_, io.a2a_send.data(), sc.data(), io.sd.data(), io.a2a_recv.data(), rc.data(),
                                 io.rd.data(), static_cast<epDataType_t>(io.a2a_dtype), nullptr);
      FZ_CHECK("epAlltoallv", r, involved ? epInvalidUsage : epRemoteError, rank_ == one, comm_);
      if (!io.a2a_recv.poisoned() || !io.a2a_recv.guardsOk()) return problem("a failed alltoallv wrote recvbuf");
    }
    FZ_CHECK("epAlltoallv", io.alltoallv(), epSuccess, false, comm_);
    FZ_OUT(io.checkAlltoallv());
    return 0;
  }

  int fuzzAlltoallvDevice(const World& w, RankIo& io) {
    op_ = "alltoallv (device counts)";
    static const int kDt[] = {epFloat32, epBfloat16, epInt32, epUint8};
    io.a2aPrepare(kDt[g_.range(0, 3)]);
    const int kind = g_.range(0, 5);
    const int one = g_.range(0, R_ - 1);
    const bool all = g_.chance(50);
    const bool on = all || rank_ == one;
    if (kind < 3) {
      static const char* kNames[] = {"a negative count", "recv_counts NULL", "dtype -3"};
      static const epResult_t kCodes[] = {epInvalidArgument, epNullPointer, epUnsupportedDtype};
      mut_ = kNames[kind];
      scope_ = all ? "all ranks" : "one rank";
      auto dsc = io.dsc;
      int dt = io.a2a_dtype;
      int64_t counts[EP_MAX_RANKS];
      const int at = g_.range(0, R_ - 1);
      if (on && kind == 0) dsc[at] = -1;
      if (on && kind == 2) dt = -3;
      const size_t cap = io.a2aIncoming();
      io.a2a_recv.init(cap * epcomm::dtypeSize(io.a2a_dtype));
      std::vector<uint8_t> packed(io.a2a_send.size() + 1);
      epResult_t r = epAlltoallvDevice(comm_, packed.data(), dsc.data(), io.a2a_recv.data(), cap,
                                       on && kind == 1 ? nullptr : counts, nullptr, static_cast<epDataType_t>(dt), nullptr);
      FZ_CHECK("epAlltoallvDevice", r, on ? kCodes[kind] : epRemoteError, on, comm_);
      if (!io.a2a_recv.poisoned()) return problem("a failed alltoallv (device counts) wrote recvbuf");
    } else if (kind == 3 && [&] {
                 size_t n = 0;  // what rank `one` receives: the same decision on every rank
                 for (int s = 0; s < R_; ++s) n += io.a2aCount(s, one);
                 return n > 0;
               }()) {
      // A capacity too small on one rank: it gets epCapacityExceeded (data past the capacity dropped and
      // counted), the others succeed.
      mut_ = "recv_capacity one short";
      scope_ = "one rank";
      const size_t in = io.a2aIncoming();
      epResult_t r = io.alltoallvDevice(rank_ == one ? in - 1 : in);
      FZ_CHECK("epAlltoallvDevice", r, rank_ == one ? epCapacityExceeded : epSuccess, rank_ == one, comm_);
      if (!io.a2a_recv.guardsOk()) return problem("alltoallv (device counts) wrote past recvbuf");
      if (rank_ == one && io.a2a_dropped.as<int64_t>()[0] != 1) return problem("num_dropped is not 1");
    }
    FZ_CHECK("epAlltoallvDevice", io.alltoallvDevice(io.a2aIncoming()), epSuccess, false, comm_);
    FZ_OUT(io.checkAlltoallvDevice());
    (void)w;
    return 0;
  }

  // ---- size helpers (local) ----
  int fuzzSizes(const World& w, RankIo& io) {
    op_ = "size helpers";
    epHtDispatchArgs_t ha = io.htDispatchArgs(8);
    epLlDispatchArgs_t la = io.llDispatchArgs(g_.chance(50) ? EP_LL_EXPERT_MAJOR : EP_LL_RANK_MAJOR, EP_LL_SEND_RECV, true);
    std::vector<int64_t> scratch;
    std::vector<bool> on;
    auto hm = htDispatchMuts(true);
    const auto* m = drawMut(hm, w, kBoth, on);
    // Only the shape fields matter to the helpers.
    if (m != nullptr && on[rank_] && m->code != epExpertOutOfRange && m->code != epNullPointer &&
        m->code != epCapacityExceeded && std::string(m->name) != "num_worst_tokens -1") {
      epHtDispatchArgs_t b = ha;
      m->apply(b, scratch);
      epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
      FZ_CHECK("epHtDispatchSizes", epHtDispatchSizes(comm_, &b, 8, &s), m->code, true, comm_);
      if (s.recv_x != 0) return problem("a failed size helper wrote sizes");
    }
    auto lm = llDispatchMuts();
    m = nullptr;
    const auto* l = drawMut(lm, w, kBoth, on);
    if (l != nullptr && on[rank_] && l->code != epExpertOutOfRange && l->code != epNullPointer &&
        l->code != epBufferTooSmall && std::string(l->name).rfind("phases", 0) != 0) {
      epLlDispatchArgs_t b = la;
      l->apply(b, scratch);
      epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
      FZ_CHECK("epLlDispatchSizes", epLlDispatchSizes(comm_, &b, &s), l->code, true, comm_);
      if (s.recv_x != 0) return problem("a failed size helper wrote sizes");
    }
    if (g_.chance(30)) {
      mut_ = "NULL or uninitialised sizes";
      epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
      FZ_CHECK("epHtDispatchSizes", epHtDispatchSizes(comm_, &ha, 8, nullptr), epNullPointer, true, comm_);
      FZ_CHECK("epLlDispatchSizes", epLlDispatchSizes(comm_, nullptr, &s), epNullPointer, true, comm_);
      FZ_CHECK("epHtDispatchSizes", epHtDispatchSizes(comm_, &ha, -1, &s), epInvalidArgument, true, comm_);
      s.size = 0;
      FZ_CHECK("epLlDispatchSizes", epLlDispatchSizes(comm_, &la, &s), epInvalidArgument, true, comm_);
    }
    epBufferSizes_t s = EP_BUFFER_SIZES_INIT;
    FZ_CHECK("epHtDispatchSizes", epHtDispatchSizes(comm_, &ha, 8, &s), epSuccess, false, comm_);
    if (s.recv_x != ha.recv_x_bytes || s.recv_topk_idx != ha.recv_topk_idx_bytes)
      return problem("epHtDispatchSizes: recv_x %zu, recv_topk_idx %zu, want %zu, %zu", s.recv_x, s.recv_topk_idx,
                     ha.recv_x_bytes, ha.recv_topk_idx_bytes);
    FZ_CHECK("epLlDispatchSizes", epLlDispatchSizes(comm_, &la, &s), epSuccess, false, comm_);
    if (s.recv_x != la.recv_x_bytes || s.recv_count != la.recv_count_bytes)
      return problem("epLlDispatchSizes: recv_x %zu, recv_count %zu, want %zu, %zu", s.recv_x, s.recv_count,
                     la.recv_x_bytes, la.recv_count_bytes);
    return 0;
  }

  // ---- call-order errors, on every rank (the decisions are local and the same everywhere) ----
  int fuzzOrder(const World& w, RankIo& io) {
    op_ = "call order";
    scope_ = "all ranks";
    const int layout = g_.chance(50) ? EP_LL_EXPERT_MAJOR : EP_LL_RANK_MAJOR;
    const int kind = g_.range(0, 4);
    if (kind == 0) {
      mut_ = "a receive half with no send half";
      epLlDispatchArgs_t d = io.llDispatchArgs(layout, EP_LL_RECV, true);
      FZ_CHECK("epLlDispatch", epLlDispatch(comm_, &d, nullptr), epInvalidUsage, true, comm_);
      if (!io.llDispatchUntouched()) return problem("a refused receive half wrote its outputs");
      epLlCombineArgs_t c = io.llCombineArgs(EP_LL_RECV, true);
      FZ_CHECK("epLlCombine", epLlCombine(comm_, &c, nullptr), epInvalidUsage, true, comm_);
    } else if (kind <= 2) {
      mut_ = "other calls between an LL send half and its receive";
      epLlCombineArgs_t c;
      if (kind == 2) {  // a valid combine, to be refused while the dispatch's receive is outstanding
        epLlDispatchArgs_t d0 = io.llDispatchArgs(layout, EP_LL_SEND_RECV, true);
        FZ_CHECK("epLlDispatch", epLlDispatch(comm_, &d0, nullptr), epSuccess, false, comm_);
        c = io.llCombineArgs(EP_LL_SEND_RECV, true);
      }
      epLlDispatchArgs_t d = io.llDispatchArgs(layout, EP_LL_SEND, kind == 1);  // kind 2: c reads the outputs
      FZ_CHECK("epLlDispatch", epLlDispatch(comm_, &d, nullptr), epSuccess, false, comm_);
      FZ_CHECK("epCommBarrier", epCommBarrier(comm_, nullptr), epInvalidUsage, true, comm_);
      FZ_CHECK("epLlDispatch", epLlDispatch(comm_, &d, nullptr), epInvalidUsage, true, comm_);
      io.a2aPrepare(epFloat32);
      FZ_CHECK("epAlltoallv", io.alltoallv(), epInvalidUsage, true, comm_);
      epHtDispatchArgs_t h = io.htDispatchArgs(std::max(1, w.sumT()));
      FZ_CHECK("epHtDispatch", epHtDispatch(comm_, &h, io.h, nullptr), epInvalidUsage, true, comm_);
      if (kind == 1) c = io.llCombineArgs(EP_LL_RECV, true);
      FZ_CHECK("epLlCombine", epLlCombine(comm_, &c, nullptr), epInvalidUsage, true, comm_);
      d.phases = EP_LL_RECV;
      FZ_CHECK("epLlDispatch", epLlDispatch(comm_, &d, nullptr), epSuccess, false, comm_);
      FZ_OUT(io.checkLlDispatch());
    } else if (kind == 3) {
      mut_ = "HT calls on a handle with no layout";
      epHtHandle_t fresh = nullptr;
      FZ_CHECK("epHtHandleCreate", epHtHandleCreate(comm_, 8, &fresh), epSuccess, false, comm_);
      epHtCombineArgs_t c = io.htCombineArgs();
      FZ_CHECK("epHtCombine", epHtCombine(comm_, &c, fresh, nullptr), epInvalidUsage, true, comm_);
      io.ht_rows = 0;
      epHtDispatchArgs_t a = io.htDispatchArgs(0);  // exact mode needs a notify first
      FZ_CHECK("epHtDispatch", epHtDispatch(comm_, &a, fresh, nullptr), epInvalidUsage, true, comm_);
      int n = -1;
      FZ_CHECK("epHtHandleGetCounts", epHtHandleGetCounts(fresh, &n, &n), epInvalidUsage, true, nullptr);
      if (n != -1) return problem("a failed epHtHandleGetCounts wrote its outputs");
      FZ_CHECK("epHtHandleDestroy", epHtHandleDestroy(fresh), epSuccess, false, nullptr);
      return htValid(w, io, true);
    } else {
      mut_ = "NULL or made-up communicator, on every rank";
      FZ_CHECK("epCommBarrier", epCommBarrier(nullptr, nullptr), epNullPointer, true, nullptr);
      FZ_CHECK("epCommBarrier", epCommBarrier(fake_comm_, nullptr), epInvalidArgument, true, fake_comm_);
      epLlDispatchArgs_t d = io.llDispatchArgs(layout, EP_LL_SEND_RECV, true);
      FZ_CHECK("epLlDispatch", epLlDispatch(fake_comm_, &d, nullptr), epInvalidArgument, true, fake_comm_);
      io.a2aPrepare(epInt32);
      FZ_CHECK("epAlltoallv", epAlltoallv(nullptr, io.a2a_send.data(), io.sc.data(), io.sd.data(), io.a2a_recv.data(),
                                          io.rc.data(), io.rd.data(), epInt32, nullptr), epNullPointer, true, nullptr);
    }
    FZ_CHECK("epCommBarrier", epCommBarrier(comm_, nullptr), epSuccess, false, comm_);
    return 0;
  }

  // ---- local calls: queries, handles, unique ids, another communicator's handle ----
  int fuzzLocal(const World& w, RankIo& io) {
    op_ = "local calls";
    const int kind = g_.range(0, 5);
    int v = -1;
    epEngine_t e = EP_ENGINE_AUTO;
    if (kind == 0) {
      mut_ = "queries with NULL or made-up arguments";
      FZ_CHECK("epCommRank", epCommRank(comm_, nullptr), epNullPointer, true, comm_);
      FZ_CHECK("epCommSize", epCommSize(nullptr, &v), epNullPointer, true, nullptr);
      FZ_CHECK("epCommEngine", epCommEngine(fake_comm_, &e), epInvalidArgument, true, fake_comm_);
      epResult_t ae = static_cast<epResult_t>(-9);
      epErrorInfo_t info = EP_ERROR_INFO_INIT;
      info.magic = 3;
      FZ_CHECK("epCommGetAsyncError", epCommGetAsyncError(comm_, &ae, &info), epInvalidArgument, true, comm_);
      if (ae != static_cast<epResult_t>(-9)) return problem("a failed epCommGetAsyncError wrote *async_error");
      FZ_CHECK("epCommGetAsyncError", epCommGetAsyncError(comm_, nullptr, nullptr), epNullPointer, true, comm_);
    } else if (kind == 1) {
      mut_ = "handle calls with bad arguments";
      epHtHandle_t h = nullptr;
      FZ_CHECK("epHtHandleCreate", epHtHandleCreate(comm_, -1, &h), epInvalidArgument, true, comm_);
      FZ_CHECK("epHtHandleCreate", epHtHandleCreate(comm_, 8, nullptr), epNullPointer, true, comm_);
      FZ_CHECK("epHtHandleDestroy", epHtHandleDestroy(nullptr), epNullPointer, true, nullptr);
      FZ_CHECK("epHtHandleDestroy", epHtHandleDestroy(dead_h_), epInvalidArgument, true, nullptr);
      FZ_CHECK("epHtHandleGetCounts", epHtHandleGetCounts(dead_h_, &v, &v), epInvalidArgument, true, nullptr);
      FZ_CHECK("epHtHandleGetCounts", epHtHandleGetCounts(nullptr, &v, &v), epNullPointer, true, nullptr);
      if (h != nullptr || v != -1) return problem("a failed handle call wrote its outputs");
    } else if (kind == 2) {
      // Destroyed and created again: the old pointer is refused unless the new handle happens to reuse it.
      mut_ = "handle destroyed and created again";
      epHtHandle_t old = h_;
      FZ_CHECK("epHtHandleDestroy", epHtHandleDestroy(h_), epSuccess, false, nullptr);
      FZ_CHECK("epHtHandleCreate", epHtHandleCreate(comm_, 8, &h_), epSuccess, false, comm_);
      io.h = h_;
      if (old != h_) FZ_CHECK("epHtHandleGetCounts", epHtHandleGetCounts(old, &v, &v), epInvalidArgument, true, nullptr);
      return htValid(w, io, true);
    } else if (kind == 3) {
      // This communicator's handle on another communicator (a one-rank one, so only this rank takes part).
      mut_ = "a handle of another communicator";
      epHtDispatchArgs_t a = io.htDispatchArgs(std::max(1, w.sumT()));
      a.num_experts = 1, a.topk = 1;
      FZ_CHECK("epHtDispatch", epHtDispatch(solo_, &a, h_, nullptr), epInvalidUsage, true, solo_);
      epHtCombineArgs_t c = io.htCombineArgs();
      FZ_CHECK("epHtCombine", epHtCombine(solo_, &c, h_, nullptr), epInvalidUsage, true, solo_);
      FZ_CHECK("epCommBarrier", epCommBarrier(solo_, nullptr), epSuccess, false, solo_);
    } else if (kind == 4) {
      mut_ = "unique id text";
      epUniqueId id;
      char text[EP_UNIQUE_ID_STRING_BYTES];
      memset(&id, 0, sizeof(id));
      FZ_CHECK("epUniqueIdFromString", epUniqueIdFromString("0123", &id), epInvalidUniqueId, true, nullptr);
      FZ_CHECK("epUniqueIdFromString", epUniqueIdFromString(nullptr, &id), epNullPointer, true, nullptr);
      FZ_CHECK("epUniqueIdToString", epUniqueIdToString(&id, text, 10), epBufferTooSmall, true, nullptr);
      FZ_CHECK("epGetVersion", epGetVersion(nullptr), epNullPointer, true, nullptr);
    } else {
      // Creation and teardown with bad arguments: refused before any rendezvous, or (a stale id) at once.
      mut_ = "communicator creation and teardown";
      epComm_t c = fake_comm_;
      epConfig_t cfg = EP_CONFIG_INIT;
      FZ_CHECK("epCommInitRank", epCommInitRank(nullptr, 1, &solo_id_, 0, &cfg), epNullPointer, true, nullptr);
      FZ_CHECK("epCommInitRank", epCommInitRank(&c, 1, nullptr, 0, &cfg), epNullPointer, true, nullptr);
      FZ_CHECK("epCommInitRank", epCommInitRank(&c, 0, &solo_id_, 0, &cfg), epRankMismatch, true, nullptr);
      FZ_CHECK("epCommInitRank", epCommInitRank(&c, 2, &solo_id_, 2, &cfg), epRankMismatch, true, nullptr);
      FZ_CHECK("epCommInitRank", epCommInitRank(&c, 1, &solo_id_, 0, &cfg), epInvalidUniqueId, true, nullptr);
      if (c != nullptr) return problem("a failed epCommInitRank did not set *comm to NULL");
      cfg.magic = 0;
      FZ_CHECK("epCommInitRankWithAllgather", epCommInitRankWithAllgather(&c, 1, 0, nullptr, nullptr, &cfg),
               epNullPointer, true, nullptr);
      cfg = EP_CONFIG_INIT;
      cfg.engine = 7;
      FZ_CHECK("epCommInitRankWithAllgather",
               epCommInitRankWithAllgather(&c, 1, 0, [](void*, const void*, void*, size_t) { return 0; }, nullptr, &cfg),
               epInvalidArgument, true, nullptr);
      cfg = EP_CONFIG_INIT;
      cfg.ll_zero_copy_dispatch = 2;
      FZ_CHECK("epCommInitRankWithAllgather",
               epCommInitRankWithAllgather(&c, 1, 0, [](void*, const void*, void*, size_t) { return 0; }, nullptr, &cfg),
               epInvalidArgument, true, nullptr);
      FZ_CHECK("epCommDestroy", epCommDestroy(nullptr), epNullPointer, true, nullptr);
      FZ_CHECK("epCommDestroy", epCommDestroy(fake_comm_), epInvalidArgument, true, nullptr);
      FZ_CHECK("epCommAbort", epCommAbort(fake_comm_), epInvalidArgument, true, nullptr);
      if (epDataTypeSize(static_cast<epDataType_t>(99)) != 0 || epGetErrorString(static_cast<epResult_t>(-4)) == nullptr)
        return problem("epDataTypeSize / epGetErrorString of an unknown value");
    }
    FZ_CHECK("epCommRank", epCommRank(comm_, &v), epSuccess, false, comm_);
    FZ_CHECK("epCommSize", epCommSize(comm_, &v), epSuccess, false, comm_);
    if (v != R_) return problem("epCommSize = %d", v);
    FZ_CHECK("epCommEngine", epCommEngine(comm_, &e), epSuccess, false, comm_);
    if (e != EP_ENGINE_HOST) return problem("epCommEngine = %d", e);
    epResult_t ae = epInternalError;
    FZ_CHECK("epCommGetAsyncError", epCommGetAsyncError(comm_, &ae, nullptr), epSuccess, false, comm_);
    if (ae != epSuccess) return problem("asynchronous error %s", epGetErrorString(ae));
    return 0;
  }

  int R_, rank_;
  uint64_t seed_;
  int rounds_;
  Stats* stats_;
  Rng g_;
  int round_ = 0;
  const char* op_ = "";
  const char* mut_ = "";
  const char* scope_ = "";
  epComm_t solo_ = nullptr;
  epUniqueId solo_id_;  // stale once solo_ was created from it
  epHtHandle_t h_ = nullptr, foreign_h_ = nullptr, dead_h_ = nullptr;
  epComm_t fake_comm_ = nullptr;
  uint64_t fake_storage_[64] = {};
};

std::vector<int> envList(const char* name, std::vector<int> def) {
  const char* s = getenv(name);
  if (s == nullptr || !*s) return def;
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

// Runs seeds [first, last] at R ranks; returns the number of seeds with a problem.
int fuzzSeeds(int R, uint64_t first, uint64_t last, int rounds) {
  auto* stats = static_cast<Stats*>(mmap(nullptr, sizeof(Stats), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  new (stats) Stats();
  int problems = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (uint64_t seed = first; seed <= last; ++seed) {
    epUniqueId id;
    if (epGetUniqueId(&id) != epSuccess) return 1;
    auto codes = runRanks(R, [&](int rank) -> int {
      epConfig_t cfg = EP_CONFIG_INIT;
      cfg.engine = EP_ENGINE_HOST;
      cfg.timeout_ms = 10000;
      cfg.ll_max_tokens_per_rank = 8;
      cfg.ll_max_hidden = 256;
      cfg.num_channels = 1 + static_cast<int>(seed % 2);
      Fuzzer f(R, rank, seed, rounds, stats);
      if (epCommInitRank(&f.comm_, R, &id, rank, &cfg) != epSuccess) {
        fprintf(stderr, "PROBLEM seed %llu R %d rank %d: init: %s\n", static_cast<unsigned long long>(seed), R, rank,
                epGetLastError(nullptr));
        return 1;
      }
      int rc = f.run();
      epCommDestroy(f.comm_);
      return rc;
    }, 120000 + rounds * 100);
    bool bad = false;
    for (int r = 0; r < R; ++r)
      if (codes[r] != 0) {
        fprintf(stderr, "seed %llu R %d: rank %d exited with %d\n", static_cast<unsigned long long>(seed), R, r, codes[r]);
        bad = true;
      }
    problems += bad;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("fuzz R=%d seeds %llu-%llu x %d rounds: %llu calls, %llu mutated, %.1f s, %d problem seed(s)\n", R,
         static_cast<unsigned long long>(first), static_cast<unsigned long long>(last), rounds,
         static_cast<unsigned long long>(stats->calls.load()), static_cast<unsigned long long>(stats->mutated.load()),
         secs, problems);
  fflush(stdout);
  munmap(stats, sizeof(Stats));
  return problems;
}

TEST(ApiFuzz, SeededRounds) {
  // The CI set: fixed seeds, about a minute at R = 2 and 3 on a small machine. EPCOMM_FUZZ_* for long runs.
  uint64_t first = 1, last = 150;
  if (const char* s = getenv("EPCOMM_FUZZ_SEEDS")) {
    unsigned long long a = 0, b = 0;
    int n = sscanf(s, "%llu-%llu", &a, &b);
    ASSERT_GE(n, 1) << "EPCOMM_FUZZ_SEEDS=first-last";
    first = a, last = n == 2 ? b : a;
  }
  const int rounds = envList("EPCOMM_FUZZ_ROUNDS", {2000})[0];
  for (int R : envList("EPCOMM_FUZZ_RANKS", {2, 3})) EXPECT_EQ(fuzzSeeds(R, first, last, rounds), 0) << "R = " << R;
}

}  // namespace
