// Host engine: elastic ranks (DESIGN.md R4) — the active-ranks mask, its drop counters, and the
// resynchronization of the survivors (epCommSetActiveRanks). How each operation skips masked ranks is in its own
// file (ht.cc, ll.cc, alltoallv.cc; headers and waits in host_engine.cc).
//
// Resynchronization. After a failure the rings between survivors may hold parts of messages, LL receive halves
// may be outstanding, and epochs may differ (a survivor may have finished the operation another one failed). The
// survivors therefore meet outside the rings, on words each publishes in its own region header (RegionHeader
// rs_*), in three phases of a numbered round:
//   1 STOPPED: the rank dropped its queued sends and outstanding LL receive halves (it will push nothing more)
//     and published its status, the hash of its mask and its epoch. It waits until every rank its mask keeps is
//     at phase 1, then checks that all agree (every status accepted, one mask).
//   2 DISCARDED: having agreed, it dropped everything in flight toward it (head = tail on every ring: every
//     producer has stopped); otherwise it sets the failed bit. It waits until every kept rank is at phase 2; a
//     failed bit there fails this rank's call too, so that all survivors decide alike.
//   3 DONE: nobody reads another rank's round words after this phase, so a rank may overwrite them in its next
//     round once every kept rank is at phase 3. A kept rank that failed the round (its failed bit, or, already in a
//     later round, a last successful round (rs_ok) other than this one) fails this rank's call too.
//   A peer found in a later round during the phase-2 wait left this round failed: it could not have completed it
//   before this rank published phase 3.
// Ranks produce again only after phase 3, so nothing of the next operation is discarded; epochs continue from
// the largest among the survivors. Every wait keeps the communicator's deadline and checks that the kept ranks
// are alive.
#include <errno.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/time.h"
#include "engine/host/host_engine.h"

namespace epcomm {

namespace {

constexpr int kStopped = 1, kDiscarded = 2, kDone = 3;

uint64_t maskHash(const std::vector<uint8_t>& mask) {
  uint64_t h = 1469598103934665603ull ^ mask.size();
  for (uint8_t b : mask) h = (h ^ b) * 1099511628211ull;
  return h | 1;  // never 0, the value of a rejected call
}

}  // namespace

epResult_t HostEngine::checkHandleMask(const epHtHandle* h, const char* what) const {
  EP_REQUIRE(h->mask_gen == mask_gen_, epInvalidUsage,
             "%s: the handle's layout was computed before epCommSetActiveRanks masked a rank; dispatch again "
             "without EP_HT_USE_HANDLE_LAYOUT (or notify again) to refill it",
             what);
  return epSuccess;
}

epResult_t HostEngine::maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t) {
  if (token_rows) std::copy(drop_rows_.begin(), drop_rows_.end(), token_rows);
  if (a2a_elements) std::copy(drop_a2a_.begin(), drop_a2a_.end(), a2a_elements);
  return epSuccess;
}

epResult_t HostEngine::setActiveRanks(const uint8_t* active, epStream_t) { return resync(active, epSuccess); }

// A rejected call still takes its part in the round (with its code as status), so that the other survivors fail
// at once instead of at their deadline. Its own result stays `local`, with the API layer's message, and it does
// not break the communicator even if the others never come.
epResult_t HostEngine::setActiveRanksRejected(epResult_t local, epStream_t) {
  const std::string msg = threadLastError();
  record_async_ = false;
  resync(nullptr, local);
  record_async_ = true;
  setThreadErrorText(msg.c_str());
  return local;
}

epResult_t HostEngine::resync(const uint8_t* proposed, epResult_t local) {
  const int R = nranks_;
  const bool ok = local == epSuccess;
  cur_op_ = recovering_ ? epOpRecover : epOpSetActiveRanks;
  cur_epoch_ = send_epoch_;
  std::vector<uint8_t> part(R);
  for (int r = 0; r < R; ++r) part[r] = (ok ? proposed[r] : active_[r]) ? 1 : 0;
  // Waits check the liveness of the ranks this call keeps (a rank masked now may be dead).
  struct Watch {
    const uint8_t*& w;
    const uint8_t* saved;
    ~Watch() { w = saved; }
  } watch{watch_, watch_};
  watch_ = part.data();

  if (ok) {  // produce nothing more: what a failed operation left queued or outstanding is dropped
    for (auto& ch : outq_)
      for (auto& q : ch) q.clear();
    pending_.clear();
  }
  RegionHeader* me = own_.header();
  uint64_t round = ++rs_round_;
  const uint64_t hash = ok ? maskHash(part) : 0;
  me->rs_hash.store(hash, std::memory_order_relaxed);
  me->rs_epoch.store(send_epoch_, std::memory_order_relaxed);
  me->rs_status.store(local, std::memory_order_relaxed);
  me->rs_word.store(rsWord(round, kStopped, false), std::memory_order_release);
  rs_stage_ = kStopped;
  epResult_t w = resyncWait(part, round, kStopped, true, nullptr);
  if (w != epSuccess) {
    me->rs_word.store(rsWord(round, kDone, true), std::memory_order_release);
    return w;
  }

  epResult_t st = local;
  uint64_t max_epoch = send_epoch_;
  for (int r = 0; r < R && st == epSuccess; ++r) {
    if (!part[r] || r == rank_) continue;
    const RegionHeader* p = peerHeader(r);
    const int ps = p->rs_status.load(std::memory_order_relaxed);
    if (ps != epSuccess) {
      rs_rejected_ = true;
      st = EP_ERROR(epRemoteError,
                    "rank %d rejected its call of epCommSetActiveRanks or epCommRecover (%s); the mask is unchanged "
                    "on every rank", r,
                    epGetErrorString(static_cast<epResult_t>(ps)));
    } else if (p->rs_hash.load(std::memory_order_relaxed) != hash)
      st = EP_ERROR(epInvalidUsage,
                    "active: rank %d called epCommSetActiveRanks with a different mask than rank %d; every survivor "
                    "must pass the same mask (the mask is unchanged)",
                    r, rank_);
    max_epoch = std::max(max_epoch, p->rs_epoch.load(std::memory_order_relaxed));
  }
  if (st == epSuccess) {  // every producer toward this rank has stopped: drop what is in flight
    for (auto& ch : in_)
      for (RingEnd& e : ch) e.discardAll();
    unaligned_ = false;  // what a mismatch left in the rings is gone
  }
  me->rs_word.store(rsWord(round, kDiscarded, st != epSuccess), std::memory_order_release);
  int failed_peer = -1;
  rs_stage_ = kDiscarded;
  w = resyncWait(part, round, kDiscarded, false, &failed_peer);
  if (w != epSuccess) {
    me->rs_word.store(rsWord(round, kDone, true), std::memory_order_release);
    return w;
  }
  if (st == epSuccess && failed_peer >= 0)
    st = EP_ERROR(epRemoteError,
                  "rank %d failed its side of epCommSetActiveRanks (a rejected argument, a different mask, or a "
                  "wait that ended before this rank took part); the mask is unchanged",
                  failed_peer);
  me->rs_word.store(rsWord(round, kDone, st != epSuccess), std::memory_order_release);
  // Phase 3: every kept rank's outcome of this round is final once its word is at phase 3 (or later), and every
  // rank sees the same outcomes, so a failure any of them had fails this rank's call too: all decide alike, also
  // where a rank's phase-2 look at a peer came before that peer failed.
  failed_peer = -1;
  rs_stage_ = kDone;
  w = resyncWait(part, round, kDone, false, &failed_peer);
  // A kept rank that completed this round saw every kept rank at (round, done, ok), this one included: the round
  // succeeded, whatever ended this rank's wait (a word that did not reach it before its owner stopped, a rank that
  // died after publishing). Failing it here would leave this rank alone out of step with the committed ones.
  if (w != epSuccess && st == epSuccess && peerCompleted(part, round)) {
    w = epSuccess;
    failed_peer = -1;
  }
  if (w != epSuccess) {
    me->rs_word.store(rsWord(round, kDone, true), std::memory_order_release);
    return w;
  }
  if (st == epSuccess && failed_peer >= 0) {
    st = EP_ERROR(epRemoteError,
                  "rank %d failed its side of epCommSetActiveRanks (its wait for another rank ended first); the mask "
                  "is unchanged",
                  failed_peer);
    me->rs_word.store(rsWord(round, kDone, true), std::memory_order_release);
  }
  if (st != epSuccess) return st;
  me->rs_ok.store(round, std::memory_order_relaxed);  // ordered before this rank's next word (release)

  send_epoch_ = recv_epoch_ = max_epoch;
  bool changed = false;
  for (int r = 0; r < R; ++r) {
    changed = changed || active_[r] != part[r];
    active_[r] = part[r];
  }
  if (changed) ++mask_gen_;  // HT handles filled before now are stale
  publishSets();            // a rank that comes back learns from it that it is masked (agreedKeep)
  return epSuccess;
}


// ---------------------------------------------------------------------------------------------------------
// Recovery (epCommRecover): the survivors find whom to mask without being told. Each rank keeps a set of ranks it
// holds out for good (accused_): found dead (its process gone from this host), disconnected (a lost connection
// across hosts), gone (it destroyed its communicator), or silent (it did not take part in a recovery round for
// twice the deadline). Each publishes that set and the complement of the mask it last committed (rc_accused,
// rc_masked: region header here, OUT frames across hosts; both only grow). From what all of them published, every
// survivor derives the same mask (agreedKeep) and proposes it in a resynchronization round (resync: one mask, or
// nobody moves). A round that fails adds what it taught (a silent rank, a lost connection) and the next one
// proposes again, until one succeeds or nothing new is learnt.
// ---------------------------------------------------------------------------------------------------------
namespace {

bool testBit(const std::atomic<uint64_t>* words, int r) {
  return (words[r / 64].load(std::memory_order_relaxed) >> (r % 64)) & 1;
}

}  // namespace

void HostEngine::noteLosses() {
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || !active_[r] || certain_[r]) continue;
    bool gone = false, lost = false;
    gone = peerLeft(r) || (!remote_[r] && processGone(pids_[r]));
    lost = !gone && remote_[r] && bridge_->dead(r, nullptr);
    if (!accused_[r]) accused_[r] = gone || lost;
    certain_[r] = certain_[r] || gone;  // also for a rank held out earlier, by a timeout, that has since ended
  }
}

void HostEngine::publishSets() {
  RegionHeader* me = own_.header();
  for (int r = 0; r < nranks_; ++r) {
    const uint64_t bit = 1ull << (r % 64);
    if (accused_[r]) me->rc_accused[r / 64].fetch_or(bit, std::memory_order_relaxed);
    if (!active_[r]) me->rc_masked[r / 64].fetch_or(bit, std::memory_order_relaxed);
  }
  me->rc_gen.fetch_add(1, std::memory_order_release);
}

uint64_t HostEngine::setsGen() const {
  uint64_t g = 0;
  for (int r = 0; r < nranks_; ++r)
    if (active_[r] && r != rank_) g += peerHeader(r)->rc_gen.load(std::memory_order_acquire);
  return g;
}

// The mask every survivor derives alike once they have published the same sets:
// 1. A mask some rank committed is final (that group agreed; a masked rank never rejoins): the ranks any of the
//    ranks this rank's mask keeps has masked are out.
// 2. Then accusations among the rest: while some kept rank is accused by another kept rank, the one with the most
//    accusers (ties: the highest rank) is out, and its own accusations no longer count. A dead or stalled rank is
//    accused by everyone who noticed; a rank that came back after the others gave up on it accuses them in turn
//    (its connections were closed), but fewer of them than accuse it.
std::vector<uint8_t> HostEngine::agreedKeep() const {
  const int R = nranks_;
  std::vector<uint8_t> keep(active_);
  for (int r = 0; r < R; ++r) {
    if (!active_[r] || r == rank_) continue;
    const RegionHeader* h = peerHeader(r);
    for (int q = 0; q < R; ++q)
      if (keep[q] && testBit(h->rc_masked, q)) keep[q] = 0;
  }
  auto accuses = [&](int r, int q) { return r == rank_ ? accused_[q] != 0 : testBit(peerHeader(r)->rc_accused, q); };
  std::vector<int> count(R, 0);
  for (int r = 0; r < R; ++r)
    if (keep[r])
      for (int q = 0; q < R; ++q)
        if (q != r && keep[q] && accuses(r, q)) ++count[q];
  for (;;) {
    int worst = -1;
    for (int q = 0; q < R; ++q)
      if (keep[q] && count[q] > 0 && (worst < 0 || count[q] >= count[worst])) worst = q;
    if (worst < 0) return keep;
    keep[worst] = 0;
    for (int q = 0; q < R; ++q)
      if (keep[q] && q != worst && accuses(worst, q)) --count[q];
  }
}

epResult_t HostEngine::recover(uint8_t* kept, epStream_t) {
  const int R = nranks_;
  struct Mode {
    HostEngine* e;
    ~Mode() {
      e->recovering_ = false;
      e->wait_scale_ = 1;
    }
  } mode{this};
  recovering_ = true;
  wait_scale_ = 2;  // a survivor may come up to one deadline late: its failed operation ends at its own deadline
  rs_rejected_ = false;
  std::vector<uint8_t> last;
  epResult_t res = epSuccess;
  // Every failed round either teaches something (a silent or lost rank, another survivor's sets) or is retried a
  // few times while the others catch up; at most every rank can be learnt about once. No round starts once
  // (2 + the ranks active at the call) x twice the deadline have passed.
  const int64_t t0 = nowNs();
  int64_t budget_ns = 2;
  for (int r = 0; r < R; ++r) budget_ns += active_[r];
  budget_ns *= 2 * static_cast<int64_t>(comm_->config.timeout_ms) * 1000000LL;
  for (int attempt = 0, idle = 0; attempt < 2 * R + 4; ++attempt) {
    if (comm_->aborted.load(std::memory_order_relaxed)) return EP_ERROR(epAborted, "communicator aborted");
    if (attempt > 0 && nowNs() - t0 > budget_ns)
      return EP_ERROR(res, "epCommRecover: no agreement within %lld ms; the last round failed with %s",
                      static_cast<long long>(budget_ns / 1000000), epGetErrorString(res));
    // What the others publish from here on may change the mask; the first phase's wait watches for it.
    rc_seen_ = setsGen();
    noteLosses();
    publishSets();
    std::vector<uint8_t> keep = agreedKeep();
    std::copy(keep.begin(), keep.end(), kept);
    if (!keep[rank_])
      return EP_ERROR(epRemoteError, "epCommRecover: the other survivors hold this rank out (they lost it: it was "
                      "stopped, stalled or cut off past the deadline); it is masked: destroy the communicator");
    int others = 0, uncertain = 0;
    for (int r = 0; r < R; ++r) {
      if (r == rank_ || !active_[r]) continue;
      others += keep[r];
      uncertain += !keep[r] && !certain_[r];
    }
    // Alone, having lost the others only through timeouts or closed connections: this rank cannot tell whether
    // they failed or it was cut off (and they went on without it), so it does not go on by itself.
    if (others == 0 && uncertain > 0) {
      kept[rank_] = 0;  // as for a rank held out: it must leave
      return EP_ERROR(epRemoteError, "epCommRecover: this rank reaches no other rank (%d lost through timeouts or "
                      "closed connections): it cannot tell whether they failed or it was cut off; destroy the "
                      "communicator", uncertain);
    }
    if (keep == last) {
      if (++idle > 3)  // nothing new in several rounds
        return EP_ERROR(res, "epCommRecover: no agreement after %d rounds, the last %d of them proposing the same "
                        "mask; the last round failed with %s", attempt, idle, epGetErrorString(res));
    } else {
      idle = 0;
    }
    last = keep;
    last_fail_peer_ = -1;
    last_fail_code_ = epSuccess;
    res = resync(keep.data(), epSuccess);
    if (res == epSuccess || rs_rejected_ || res == epAborted) return res;
    // A kept rank that did not come to the round within the deadline is held out from now on. Not one that did
    // and then kept another rank waiting (phases 2 and 3): it is alive and may itself wait for a silent rank.
    if (last_fail_code_ == epTimeout && rs_stage_ == kStopped && last_fail_peer_ >= 0 && last_fail_peer_ != rank_ &&
        keep[last_fail_peer_])
      accused_[last_fail_peer_] = 1;
  }
  return EP_ERROR(res, "epCommRecover: no agreement after %d rounds; the last one failed with %s", 2 * R + 4,
                  epGetErrorString(res));
}

}  // namespace epcomm
