// epcomm-soak: the host engine under injected faults, one process per rank under epcomm-run (tests/soak/soak.sh
// starts it next to the fault injector). Each iteration runs every operation of the C API, checked bit for bit
// (tests/unit/ops_check.h), and optionally a large alltoallv through small queues, timing every call. After a
// failure, with SOAK_RECOVER=1, the rank recovers (epCommRecover: the survivors find and agree on whom to mask,
// the driver tells it nothing) and goes on with a seed common to the survivors. It reports, per rank, a SUMMARY line and flags:
//   WRONG     an operation returned success with wrong data, or failed with an error that is not a failure's
//   LATE      a call took longer than the deadline plus slack (a wait without a deadline, or a missed failure)
//   RECOVERY FAILED   no resynchronization succeeded within SOAK_RETRIES attempts
// and exits 1 if any of them happened. Found so far: the four host-engine defects fixed in session s20 (a rank
// stopped inside a resynchronization succeeding alone, ranks mismatched against HT dispatch breaking the
// communicator after a whole deadline, a clean exit taken for a death, a stalled rank of another host).
//
// Environment (besides epcomm-run's and EPCOMM_*):
//   SOAK_DIR       directory for pid.<rank>, log.<rank> (required)
//   SOAK_ITERS     iterations (50)            SOAK_TMO      the communicator's timeout_ms (2000)
//   SOAK_MODE      mix | a2a | both (mix)     SOAK_A2A_N    floats per peer of the large alltoallv (65536)
//   SOAK_QUEUE     queue_bytes (65536)        SOAK_CHANNELS num_channels (2)
//   SOAK_RECOVER   1: resynchronize after a failure (0)     SOAK_RETRIES  resynchronization attempts (8)
//   SOAK_MISMATCH  "X:I:opX:opO": at iteration I, after a matched HT and LL dispatch, rank X issues opX and the
//                  others opO (barrier, a2a, a2ad, htn, htd, htc, lld, llds, llc, llcs: singleOp)
//   SOAK_DESTROY   "X:I": at iteration I rank X destroys its communicator, waits 3 deadlines, exits 0
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ops_check.h"

namespace {

using namespace epcomm::test::ops;

int g_rank = -1, g_R = 0, g_tmo = 2000;
std::string g_dir;
FILE* g_log = nullptr;

double wall() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec % 100000) + ts.tv_nsec * 1e-9;
}

void logLine(const std::string& s) {
  for (FILE* f : {stderr, g_log}) {
    if (f == nullptr) continue;
    fprintf(f, "[r%d %.3f] %s\n", g_rank, wall(), s.c_str());
    fflush(f);
  }
}

int envInt(const char* n, int d) {
  const char* e = getenv(n);
  return e && *e ? atoi(e) : d;
}

// A large alltoallv among the active ranks, checked.
epResult_t bigA2a(epComm_t comm, const std::vector<uint8_t>& act, int tag, size_t n, std::string& err) {
  const int R = g_R;
  std::vector<float> sb(R * n), rb(R * n, -1.0f);
  std::vector<size_t> c(R, n), d(R);
  for (int q = 0; q < R; ++q) d[q] = q * n;
  auto val = [&](int s, int dst, size_t j) {
    return static_cast<float>(((s * 8 + dst) * 16 + tag % 16) * 65536 + (j & 65535));
  };
  for (int q = 0; q < R; ++q)
    for (size_t j = 0; j < n; ++j) sb[q * n + j] = val(g_rank, q, j);
  const epResult_t r = epAlltoallv(comm, sb.data(), c.data(), d.data(), rb.data(), c.data(), d.data(), epFloat32, nullptr);
  if (r != epSuccess) {
    err = fmt("big alltoallv: %s (%s)", epGetErrorString(r), epGetLastError(comm));
    return r;
  }
  for (int s = 0; s < R; ++s)
    for (size_t j = 0; act[s] && j < n; ++j)
      if (rb[s * n + j] != val(s, g_rank, j)) {
        err = fmt("wrong data: big alltoallv from rank %d at %zu", s, j);
        return epInternalError;
      }
  return epSuccess;
}

// After a recovery the survivors may stand one iteration apart (one completed the failed step, another did not):
// they take the furthest one's iteration, so that all of them run the same steps to the end and none waits at the
// last step for a peer that has already destroyed its communicator. False (with err) if the exchange failed.
bool agreeOnIteration(epComm_t comm, const std::vector<uint8_t>& act, int& it, std::string& err) {
  const int R = g_R;
  std::vector<int64_t> sb(R, it), rb(R, -1);
  std::vector<size_t> c(R, 1), d(R);
  for (int q = 0; q < R; ++q) d[q] = q;
  const epResult_t r = epAlltoallv(comm, sb.data(), c.data(), d.data(), rb.data(), c.data(), d.data(), epInt64, nullptr);
  if (r != epSuccess) {
    err = fmt("iteration exchange: %s (%s)", epGetErrorString(r), epGetLastError(comm));
    return false;
  }
  for (int q = 0; q < R; ++q)
    if (act[q] && rb[q] > it) it = static_cast<int>(rb[q]);
  return true;
}

// The mismatch hook's setup, run matched on every rank first: an HT notify + dispatch into a kept handle and an LL
// expert-major dispatch, whose outputs the combines of a mismatched step take.
struct Prelude {
  epHtHandle_t h = nullptr;
  int n = 0;
  std::vector<uint8_t> hrx;  // HT received rows
  LlBufs ll;                 // the LL dispatch's outputs
  ~Prelude() {
    if (h) epHtHandleDestroy(h);
  }
};

epResult_t prelude(epComm_t comm, const Step& st, Prelude& p, std::string& err) {
  if (epHtHandleCreate(comm, st.M, &p.h) != epSuccess) return epInternalError;
  epHtDispatchArgs_t a = htArgs(st, g_rank);
  const int T = a.num_tokens;
  a.topk_weights = T ? st.all[g_rank].topk_weights.data() : nullptr;
  epResult_t r = epHtDispatchNotify(comm, &a, p.h, &p.n, nullptr, nullptr);
  if (r == epSuccess) {
    p.hrx.assign(static_cast<size_t>(p.n) * st.row() + 1, 0);
    a.recv_x = p.n ? p.hrx.data() : nullptr;
    a.recv_x_bytes = p.n * st.row();
    r = epHtDispatch(comm, &a, p.h, nullptr);
  }
  if (r == epSuccess) {
    const epLlDispatchArgs_t b = llDispatchArgs(st, g_rank, p.ll);
    r = epLlDispatch(comm, &b, nullptr);
  }
  if (r != epSuccess) err = fmt("mismatch prelude: %s (%s)", epGetErrorString(r), epGetLastError(comm));
  return r;
}

// One operation for the mismatch hook: barrier, a2a / a2ad (alltoallv, host / device counts), htn (HT notify),
// htd (worst-token HT dispatch), htc (HT combine on the prelude's handle), lld / llds (LL dispatch joined / as
// split halves), llc / llcs (LL combine of the prelude's dispatch, joined / split).
epResult_t singleOp(epComm_t comm, const std::string& op, const Step& st, Prelude& p) {
  const int R = st.R, M = st.M, T = st.all[g_rank].num_tokens;
  if (op == "barrier") return epCommBarrier(comm, nullptr);
  if (op == "a2a") {
    std::vector<size_t> c(R, 4), d(R);
    for (int q = 0; q < R; ++q) d[q] = q * 4;
    std::vector<float> sb(R * 4, 1.0f), rb(R * 4);
    return epAlltoallv(comm, sb.data(), c.data(), d.data(), rb.data(), c.data(), d.data(), epFloat32, nullptr);
  }
  if (op == "a2ad") {
    std::vector<int64_t> c(R, 4), rc(R, -1), dropped(1, -1);
    std::vector<float> sb(R * 4, 1.0f), rb(R * 4 + 8);
    return epAlltoallvDevice(comm, sb.data(), c.data(), rb.data(), rb.size(), rc.data(), dropped.data(), epFloat32,
                             nullptr);
  }
  if (op == "htn" || op == "htd") {
    epHtHandle_t h;
    if (epHtHandleCreate(comm, M, &h) != epSuccess) return epInternalError;
    epHtDispatchArgs_t a = htArgs(st, g_rank);
    std::vector<uint8_t> rx(static_cast<size_t>(R) * M * st.row() + 1);
    epResult_t r;
    if (op == "htn") {
      int n = 0;
      r = epHtDispatchNotify(comm, &a, h, &n, nullptr, nullptr);
    } else {
      a.num_worst_tokens = R * M;
      a.recv_x = rx.data();
      a.recv_x_bytes = rx.size() - 1;
      r = epHtDispatch(comm, &a, h, nullptr);
    }
    epHtHandleDestroy(h);
    return r;
  }
  if (op == "htc") {
    std::vector<uint8_t> out(T * st.row() + 1);
    epHtCombineArgs_t c = EP_HT_COMBINE_ARGS_INIT;
    c.num_tokens = T;
    c.hidden = st.H;
    c.dtype = st.dtype;
    c.x = p.n ? p.hrx.data() : nullptr;
    c.x_bytes = p.n * st.row();
    c.combined_x = T ? out.data() : nullptr;
    c.combined_x_bytes = T * st.row();
    return epHtCombine(comm, &c, p.h, nullptr);
  }
  // An LL call whole (lld, llc) or as its two halves in two calls (llds, llcs): the first error of the two.
  auto ll = [&](auto a, auto call, bool halves) {
    if (!halves) return call(comm, &a, nullptr);
    a.phases = EP_LL_SEND;
    const epResult_t r = call(comm, &a, nullptr);
    a.phases = EP_LL_RECV;
    const epResult_t r2 = call(comm, &a, nullptr);
    return r != epSuccess ? r : r2;
  };
  if (op == "lld" || op == "llds") {
    LlBufs b;
    return ll(llDispatchArgs(st, g_rank, b), epLlDispatch, op == "llds");
  }
  if (op == "llc" || op == "llcs") return ll(llCombineArgs(st, g_rank, p.ll), epLlCombine, op == "llcs");
  return epInvalidArgument;
}

}  // namespace

int main() {
  signal(SIGTERM, SIG_IGN);  // epcomm-run ends the other ranks when one dies: the survivors are what is tested
  g_rank = envInt("EPCOMM_RANK", -1);
  g_R = envInt("EPCOMM_WORLD_SIZE", 0);
  const char* dir = getenv("SOAK_DIR");
  if (dir == nullptr || g_rank < 0 || g_R <= 0) {
    fprintf(stderr, "epcomm-soak: run it under epcomm-run with SOAK_DIR set (tests/soak/soak.sh does)\n");
    return 2;
  }
  g_dir = dir;
  g_log = fopen((g_dir + "/log." + std::to_string(g_rank)).c_str(), "a");
  {
    const std::string p = g_dir + "/pid." + std::to_string(g_rank);
    std::ofstream(p + ".tmp") << getpid() << "\n";
    rename((p + ".tmp").c_str(), p.c_str());  // the injector sees a whole pid or none
  }
  g_tmo = envInt("SOAK_TMO", 2000);
  const int iters = envInt("SOAK_ITERS", 50), retries = envInt("SOAK_RETRIES", 8);
  const std::string mode = getenv("SOAK_MODE") ? getenv("SOAK_MODE") : "mix";
  const size_t a2a_n = static_cast<size_t>(envInt("SOAK_A2A_N", 1 << 16));
  const bool recover = envInt("SOAK_RECOVER", 0) != 0;
  const int local = envInt("EPCOMM_LOCAL_SIZE", 0);
  if (getenv("EPCOMM_HOSTID") && local > 0 && local < g_R) epref::gRefRanksPerHost = local;  // combine order
  int mm_rank = -1, mm_iter = -1, ds_rank = -1, ds_iter = -1;
  char mm_x[32] = "", mm_o[32] = "";
  if (getenv("SOAK_MISMATCH")) sscanf(getenv("SOAK_MISMATCH"), "%d:%d:%31[^:]:%31s", &mm_rank, &mm_iter, mm_x, mm_o);
  if (getenv("SOAK_DESTROY")) sscanf(getenv("SOAK_DESTROY"), "%d:%d", &ds_rank, &ds_iter);

  epConfig_t cfg = EP_CONFIG_INIT;
  cfg.engine = EP_ENGINE_HOST;
  cfg.timeout_ms = g_tmo;
  cfg.ll_max_tokens_per_rank = 16;
  cfg.num_channels = envInt("SOAK_CHANNELS", 2);
  cfg.queue_bytes = static_cast<size_t>(envInt("SOAK_QUEUE", 64 * 1024));
  epComm_t comm;
  auto t0 = std::chrono::steady_clock::now();
  if (epCommInitFromEnv(&comm, &cfg) != epSuccess) {
    logLine(fmt("INIT FAILED (%s) after %.0f ms", epGetLastError(nullptr), msSince(t0)));
    return 3;
  }
  signal(SIGTERM, SIG_IGN);  // again: with EPCOMM_NET=ofi, loading libfabric's providers replaced it (plugin README)
  const int R = g_R;
  std::vector<uint8_t> act(R, 1);
  std::vector<int64_t> rows(R, 0), a2a(R, 0);
  int ok = 0, errs = 0, wrong = 0, late = 0, recov_fail = 0;
  double maxms = 0;
  uint64_t gen = 0, since = 0;  // successful resynchronizations, iterations since the last: the survivors' seed
  const double limit = g_tmo + std::max(1000, g_tmo / 2);
  for (int it = 0; it < iters; ++it) {
    if (it == ds_iter && g_rank == ds_rank) {
      logLine(fmt("destroying the communicator at iteration %d", it));
      std::ofstream(g_dir + "/victim." + std::to_string(g_rank));
      const epResult_t r = epCommDestroy(comm);
      logLine(fmt("destroy: %s", epGetErrorString(r)));
      usleep(3 * g_tmo * 1000);
      return 0;
    }
    const Step st(R, 1000 + 100000 * gen + since++, act);
    std::string e;
    double slowest = 0;
    const auto ti = std::chrono::steady_clock::now();
    if (it == mm_iter) {
      Prelude pre;
      std::string err;
      if (prelude(comm, st, pre, err) != epSuccess) {
        ++wrong;
        logLine("WRONG " + err);
        continue;
      }
      const std::string op = g_rank == mm_rank ? mm_x : mm_o;
      const epResult_t r = singleOp(comm, op, st, pre);
      logLine(fmt("mismatch at iteration %d: my %s -> %s (%s) in %.0f ms", it, op.c_str(), epGetErrorString(r),
                  r ? epGetLastError(comm) : "", msSince(ti)));
      if (msSince(ti) > limit) {
        ++late;
        logLine(fmt("LATE mismatched operation: %.0f ms", msSince(ti)));
      }
      if (r != epSuccess && recover) {  // the header's recovery: every rank resynchronizes with the current mask
        std::vector<int32_t> m(act.begin(), act.end());
        const epResult_t s = epCommSetActiveRanks(comm, m.data(), nullptr);
        logLine(fmt("resynchronization after the mismatch: %s (%s)", epGetErrorString(s), s ? epGetLastError(comm) : ""));
        if (s != epSuccess) ++recov_fail;
      }
      continue;
    }
    if (mode == "mix" || mode == "both") e = runAll(comm, g_rank, st, rows, a2a, &slowest);
    if (e.empty() && (mode == "a2a" || mode == "both")) {
      const auto ta = std::chrono::steady_clock::now();
      bigA2a(comm, act, static_cast<int>(gen * 7 + since), a2a_n, e);
      slowest = std::max(slowest, msSince(ta));
    }
    maxms = std::max(maxms, slowest);
    if (slowest > limit) {
      ++late;
      logLine(fmt("LATE iteration %d: an operation took %.0f ms (deadline %d ms) %s", it, slowest, g_tmo, e.c_str()));
    }
    if (e.empty()) {
      ++ok;
      continue;
    }
    // A failure's errors are timeouts, remote errors, aborts, mismatches; anything else is data or a broken contract.
    const bool failure = e.find("timeout") != std::string::npos || e.find("remote") != std::string::npos ||
                         e.find("aborted") != std::string::npos || e.find("invalid usage") != std::string::npos;
    ++errs;
    epResult_t async = epSuccess;
    epErrorInfo_t info = EP_ERROR_INFO_INIT;
    epCommGetAsyncError(comm, &async, &info);
    logLine(fmt("%s at iteration %d: %s | slowest %.0f ms | async %s op %d epoch %llu peer %d phase %d",
                failure ? "error" : "WRONG", it, e.c_str(), slowest, epGetErrorString(async), info.op,
                static_cast<unsigned long long>(info.epoch), info.peer, info.phase));
    if (!failure) ++wrong;
    if (!recover) continue;
    // The header's recovery: every survivor calls epCommRecover, which finds whom to mask (the dead, the ranks
    // some survivor lost, the silent) and agrees on it with the others; no knowledge of the faults is needed here.
    // A rank the others hold out (it was stopped past the deadline) is told so, and leaves like a masked rank.
    bool done = false;
    for (int attempt = 0; attempt < retries && !done; ++attempt) {
      std::vector<int32_t> m(R, -1);
      const auto ts = std::chrono::steady_clock::now();
      const epResult_t r = epCommRecover(comm, m.data(), nullptr);
      std::string ms;
      for (int q = 0; q < R; ++q) ms += m[q] ? '1' : '0';
      logLine(fmt("resynchronization %d, mask %s: %s (%s) in %.0f ms", attempt, ms.c_str(), epGetErrorString(r),
                  r ? epGetLastError(comm) : "", msSince(ts)));
      if (r != epSuccess && m[g_rank] == 0) {
        logLine("this rank must leave (held out, or cut off from every other rank): leaving");
        epCommDestroy(comm);
        return 0;
      }
      // The header's bound: no round starts after (2 + active ranks) x twice the deadline, and a round's three
      // waits give twice the deadline each.
      if (msSince(ts) > (2 + R) * 2 * g_tmo + 3 * 2 * g_tmo + limit - g_tmo) {
        ++late;
        logLine(fmt("LATE resynchronization: %.0f ms", msSince(ts)));
      }
      if (r == epSuccess) {
        for (int q = 0; q < R; ++q) act[q] = static_cast<uint8_t>(m[q]);
        ++gen;
        since = 0;
        const int was = it;
        std::string ae;
        if (!agreeOnIteration(comm, act, it, ae)) {  // another failure: recover again
          logLine(fmt("error after resynchronization %d: %s", attempt, ae.c_str()));
          usleep(200 * 1000);
          continue;
        }
        if (it != was) logLine(fmt("iteration %d taken from a survivor that stands further (was %d)", it, was));
        rows.assign(R, 0);
        a2a.assign(R, 0);
        // Counted from here on: after the exchange, whose elements for the masked ranks are dropped and counted too.
        epCommGetMaskedDrops(comm, rows.data(), a2a.data(), nullptr);
        done = true;
      } else {
        usleep(200 * 1000);
      }
    }
    if (!done) {
      ++recov_fail;
      logLine(fmt("RECOVERY FAILED after %d attempts", retries));
      break;
    }
  }
  if (!recover) {
    const std::string d = checkDrops(comm, rows, a2a);
    if (!d.empty()) {
      ++wrong;
      logLine("WRONG drop counters: " + d);
    }
  }
  const auto td = std::chrono::steady_clock::now();
  const epResult_t dr = epCommDestroy(comm);
  logLine(fmt("SUMMARY ok=%d err=%d wrong=%d late=%d recov_fail=%d maxms=%.0f destroy=%s (%.0f ms)", ok, errs, wrong,
              late, recov_fail, maxms, epGetErrorString(dr), msSince(td)));
  return wrong || late || recov_fail ? 1 : 0;
}
