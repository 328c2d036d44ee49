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
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"
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
  cur_op_ = epOpSetActiveRanks;
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
    if (ps != epSuccess)
      st = EP_ERROR(epRemoteError,
                    "rank %d rejected its epCommSetActiveRanks arguments (%s); the mask is unchanged on every rank", r,
                    epGetErrorString(static_cast<epResult_t>(ps)));
    else if (p->rs_hash.load(std::memory_order_relaxed) != hash)
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
  w = resyncWait(part, round, kDone, false, &failed_peer);
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
  return epSuccess;
}

}  // namespace epcomm
