// Host engine: LL dispatch and combine (both halves, and the order of halves).
// Transport, waits and agreement checks are in host_engine.cc; the message protocol is in host_engine.h.
#include <sys/uio.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "common/routing.h"
#include "engine/host/host_engine.h"
#include "engine/host/rows.h"
#include "engine/validate.h"

namespace epcomm {

using host::accumulateRowWeighted;
using host::storeRow;

// ------------------------------------------------------------------------------------------------------
// LL dispatch / combine
// ------------------------------------------------------------------------------------------------------

bool HostEngine::llPending(int op) const {
  for (const Pending& p : pending_)
    if (p.op == op) return true;
  return false;
}

epResult_t HostEngine::llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t) {
  const bool ok = local == epSuccess;
  const int R = nranks_;
  const uint64_t sig = ok ? shapeSig({a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype,
                                      a->use_fp8, a->layout})
                          : 0;
  auto send = [&]() -> epResult_t {
    const int T = a->num_tokens, H = a->hidden, K = a->topk, E = a->num_experts, L = E / R;
    // The previous dispatch's staged sends must be out before the staging is reused.
    EPCHECK(flushSends(epPhaseData));
    ExpertMap m{E, R, L};
    const size_t es = dtypeSize(a->dtype);
    const size_t out_row = a->use_fp8 ? static_cast<size_t>(H) : H * es;
    const size_t srow = a->use_fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
    const size_t meta = sizeof(int32_t) * (1 + K);
    // Count tokens per destination.
    std::vector<int> n_to(R, 0), per_expert_to(static_cast<size_t>(R) * L, 0), masked_to;
    std::vector<uint8_t> in_rank;
    computeLayout(a->topk_idx, T, K, E, in_rank, n_to, per_expert_to, &masked_to);
    // In a call with both halves and no fp8 conversion the rows go out of x directly (the receive half flushes the
    // sends before returning), runs of consecutive rows as one piece, and only the metadata is staged; a send half
    // on its own, or fp8, stages the rows too, so that it returns at once and x may be reused.
    const bool rows_from_x = !a->use_fp8 && (a->phases & EP_LL_RECV);
    const size_t staged = meta + (rows_from_x ? 0 : out_row + srow);
    size_t total = 0;
    for (int p = 0; p < R; ++p) total += n_to[p] * staged;
    ll_dispatch_stage_.resize(total);
    std::vector<std::vector<Seg>> row_segs(rows_from_x ? R : 0);
    // Quantize (fp8) once per token, then copy into each destination's block.
    std::vector<uint8_t> qrow(out_row);
    std::vector<float> qscale(H / EP_FP8_BLOCK + 1);
    size_t off = 0;
    std::vector<size_t> base(R);
    for (int p = 0; p < R; ++p) {
      base[p] = off;
      off += n_to[p] * staged;
    }
    std::vector<int> cursor(R, 0);
    for (int t = 0; t < T; ++t) {
      const int64_t* row = a->topk_idx + static_cast<size_t>(t) * K;
      const uint8_t* xr = static_cast<const uint8_t*>(a->x) + t * H * es;
      bool quantized = false;
      for (int p = 0; p < R; ++p) {
        if (!in_rank[static_cast<size_t>(t) * R + p]) continue;
        if (a->use_fp8 && !quantized) {
          for (int b = 0; b < H / EP_FP8_BLOCK; ++b) {
            float amax = 0.0f;
            for (int j = b * EP_FP8_BLOCK; j < (b + 1) * EP_FP8_BLOCK; ++j)
              amax = std::max(amax, std::fabs(loadAsFloat(xr, j, a->dtype)));
            qscale[b] = fp8BlockScale(amax);
            float inv = fp8BlockScaleInv(amax);
            for (int j = b * EP_FP8_BLOCK; j < (b + 1) * EP_FP8_BLOCK; ++j)
              qrow[j] = floatToFp8(loadAsFloat(xr, j, a->dtype) * inv);
          }
          quantized = true;
        }
        const int i = cursor[p]++;
        const int n = n_to[p];
        uint8_t* blk = ll_dispatch_stage_.data() + base[p];
        int32_t* md = reinterpret_cast<int32_t*>(blk + i * meta);
        md[0] = t;
        for (int k = 0; k < K; ++k) md[1 + k] = (row[k] >= 0 && m.rankOf(row[k]) == p) ? m.localOf(row[k]) : -1;
        if (rows_from_x) {
          std::vector<Seg>& segs = row_segs[p];
          if (!segs.empty() && segs.back().p + segs.back().n == xr) segs.back().n += out_row;
          else segs.push_back({xr, out_row});
          continue;
        }
        uint8_t* xo = blk + n * meta + i * out_row;
        memcpy(xo, a->use_fp8 ? qrow.data() : xr, out_row);
        if (srow) memcpy(blk + n * (meta + out_row) + i * srow, qscale.data(), srow);
      }
    }
    for (int p = 0; p < R; ++p) {
      if (!active(p)) {
        drop_rows_[p] += masked_to[p];
        continue;
      }
      MsgHeader hdr = makeHeader(cur_op_, local, sig);
      hdr.v[0] = n_to[p];
      hdr.v[1] = T;
      std::vector<Seg> segs{{ll_dispatch_stage_.data() + base[p], n_to[p] * staged}};
      if (rows_from_x && p == rank_) hdr.flags = kMsgRowsInPlace;  // its own rows: read out of x by its receive half
      else if (rows_from_x) segs.insert(segs.end(), row_segs[p].begin(), row_segs[p].end());
      post(p, hdr, per_expert_to.data() + static_cast<size_t>(p) * L, sizeof(int) * L, std::move(segs));
    }
    return epSuccess;
  };
  return llOp(epOpLlDispatch, llCallPhases(a), local, sig, send,
              [&](const Pending& p) { return llDispatchRecv(a, p); });
}

epResult_t HostEngine::llDispatchRecv(const epLlDispatchArgs_t* a, const Pending& pend) {
  cur_op_ = pend.op;
  cur_epoch_ = pend.epoch;
  const int R = nranks_, H = a->hidden, K = a->topk, L = a->num_experts / R, M = a->max_tokens_per_rank;
  const size_t es = dtypeSize(a->dtype);
  const size_t out_row = a->use_fp8 ? static_cast<size_t>(H) : H * es;
  const size_t srow = a->use_fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
  const size_t meta = sizeof(int32_t) * (1 + K);
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, pend.sig);
  for (int s = 0; s < R && st == epSuccess; ++s) {
    const MsgHeader& h = in[s].h;
    if (in[s].masked) continue;
    // This rank's own rows may stay in x (kMsgRowsInPlace: a call with both halves, no fp8): metadata only.
    const bool in_place = (h.flags & kMsgRowsInPlace) != 0;
    if (h.v[0] < 0 || h.v[0] > M || h.v[1] < 0 || h.v[1] > M || in[s].extra.size() != sizeof(int) * L ||
        (in_place && (s != rank_ || srow || !(a->phases & EP_LL_SEND))) ||
        h.data_bytes != static_cast<uint64_t>(h.v[0]) * (meta + (in_place ? 0 : out_row + srow)))
      st = fail(epInternalError, s, epPhaseHeader, "LL dispatch message sizes do not match its header");
    // Per-expert counts place rows (expert-major): none may exceed the rows the message carries.
    const int* cnt = reinterpret_cast<const int*>(in[s].extra.data());
    for (int e = 0; e < L && st == epSuccess && in[s].extra.size() == sizeof(int) * L; ++e)
      if (cnt[e] < 0 || cnt[e] > h.v[0])
        st = fail(epInternalError, s, epPhaseHeader, "LL dispatch per-expert count out of range");
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    return st;
  }
  const bool expert_major = a->layout == EP_LL_EXPERT_MAJOR;
  // Expert-major placement: rows of expert e from rank s start at the sum of lower ranks' counts.
  std::vector<int> begin(static_cast<size_t>(L) * R, 0), cursor(static_cast<size_t>(L) * R, 0);
  if (expert_major) {
    for (int e = 0; e < L; ++e) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        int c = in[s].masked ? 0 : reinterpret_cast<const int*>(in[s].extra.data())[e];
        begin[static_cast<size_t>(e) * R + s] = acc;
        a->recv_layout_range[static_cast<size_t>(e) * R + s] = packLayoutRange(c, acc);
        acc += c;
      }
      a->recv_count[e] = acc;
    }
  } else {
    for (size_t i = 0; i < static_cast<size_t>(R) * M * K; ++i) a->recv_topk_idx[i] = -1;
    for (int s = 0; s < R; ++s) a->recv_count[s] = in[s].masked ? 0 : static_cast<int>(in[s].h.v[1]);
  }
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x);
  std::vector<int32_t> md;
  for (int s = 0; s < R; ++s) {
    if (in[s].masked) continue;
    const int n = static_cast<int>(in[s].h.v[0]);
    md.resize(static_cast<size_t>(n) * (1 + K));
    EPCHECK(recvInto(s, md.data(), n * meta, epPhaseData));
    const bool in_place = (in[s].h.flags & kMsgRowsInPlace) != 0;
    const uint8_t* x = static_cast<const uint8_t*>(a->x);
    for (int i = 0; i < n; ++i) {  // bounds-check the peer's metadata before using it as indices
      const int32_t* mi = md.data() + static_cast<size_t>(i) * (1 + K);
      bool bad = mi[0] < 0 || mi[0] >= (in_place ? a->num_tokens : M);
      for (int k = 0; k < K; ++k) bad = bad || mi[1 + k] < -1 || mi[1 + k] >= L;
      if (bad) return fail(epInternalError, s, epPhaseData, "LL dispatch metadata out of range");
    }
    // Rows then scales, each placed at every destination the token has here.
    for (int pass = 0; pass < (srow ? 2 : 1); ++pass) {
      const size_t rb = pass == 0 ? out_row : srow;
      uint8_t* dst_base = pass == 0 ? rx : reinterpret_cast<uint8_t*>(a->recv_x_scales);
      if (expert_major)
        for (int e = 0; e < L; ++e) cursor[static_cast<size_t>(e) * R + s] = begin[static_cast<size_t>(e) * R + s];
      for (int i = 0; i < n; ++i) {
        const int32_t* mi = md.data() + static_cast<size_t>(i) * (1 + K);
        if (!in_place) EPCHECK(waitIn(s, rb, epPhaseData));
        auto place = [&](size_t dst_row) {
          if (in_place) memcpy(dst_base + dst_row * rb, x + static_cast<size_t>(mi[0]) * rb, rb);
          else in_[0][s].copyOut(dst_base + dst_row * rb, 0, rb);
        };
        if (expert_major) {
          for (int k = 0; k < K; ++k) {
            int e = mi[1 + k];
            bool dup = false;
            for (int j = 0; j < k; ++j) dup = dup || mi[1 + j] == e;
            if (e < 0 || dup) continue;
            const size_t es_idx = static_cast<size_t>(e) * R + s;
            const int row = cursor[es_idx]++;
            if (row >= begin[es_idx] + layoutRangeCount(a->recv_layout_range[es_idx]))  // more than it announced
              return fail(epInternalError, s, epPhaseData, "LL dispatch rows exceed the per-expert count announced");
            place(static_cast<size_t>(e) * R * M + row);
            if (pass == 0) a->recv_src_info[static_cast<size_t>(e) * R * M + row] = mi[0];
          }
        } else {
          place(static_cast<size_t>(s) * M + mi[0]);
          if (pass == 0)
            for (int k = 0; k < K; ++k)
              a->recv_topk_idx[(static_cast<size_t>(s) * M + mi[0]) * K + k] = mi[1 + k];
        }
        if (!in_place) in_[0][s].release(rb);
      }
    }
  }
  // In a call with both halves this rank's rows went out of x (llDispatch): they must be out before it returns.
  // (A receive half on its own must not wait here: a later send half's staged messages may be queued too.)
  if (!(a->phases & EP_LL_SEND)) return epSuccess;
  return flushSends(epPhaseData);
}

epResult_t HostEngine::llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t) {
  const bool ok = local == epSuccess;
  const int R = nranks_;
  const uint64_t sig =
      ok ? shapeSig({a->max_tokens_per_rank, a->hidden, a->topk, a->num_experts, a->dtype, a->layout}) : 0;
  auto send = [&]() -> epResult_t {
    const int H = a->hidden, K = a->topk, L = a->num_experts / R, M = a->max_tokens_per_rank;
    EPCHECK(flushSends(epPhaseData));
    const size_t row = H * dtypeSize(a->dtype);
    const uint8_t* y = static_cast<const uint8_t*>(a->y);
    // Rows back to source s in (local expert ascending, token ascending) order; a send half on its own stages
    // them, so that it returns at once and y may be reused.
    std::vector<std::vector<size_t>> rows_to(R);  // y row indices
    for (int e = 0; e < L; ++e) {
      for (int s = 0; s < R; ++s) {
        if (a->layout == EP_LL_EXPERT_MAJOR) {
          int64_t lr = a->recv_layout_range[static_cast<size_t>(e) * R + s];
          int c = layoutRangeCount(lr), b = layoutRangeBegin(lr);
          for (int i = 0; i < c; ++i) rows_to[s].push_back(static_cast<size_t>(e) * R * M + b + i);
        } else {
          for (int t = 0; t < a->recv_count[s]; ++t) {
            const int64_t* li = a->recv_topk_idx + (static_cast<size_t>(s) * M + t) * K;
            for (int k = 0; k < K; ++k)
              if (li[k] == e) {
                rows_to[s].push_back(static_cast<size_t>(e) * R * M + static_cast<size_t>(s) * M + t);
                break;
              }
          }
        }
      }
    }
    // Nothing goes back to masked ranks (dispatch outputs from before a mask change may still name their rows).
    for (int s = 0; s < R; ++s)
      if (!active(s)) rows_to[s].clear();
    // With the receive half in the same call, y stays valid until the call returns. With cross-memory attach
    // the rows stay in y and each peer reads its own (the message lists their y rows); this call returns once
    // every peer is done with them.
    // Without it, this rank's own rows still stay in y (it reads them itself), and the others' go out of y
    // directly (the receive half flushes the sends before returning), runs of consecutive rows as one piece.
    if (a->phases & EP_LL_RECV) {
      std::vector<int32_t>& idx = ll_combine_rows_;
      idx.clear();
      for (int s = 0; s < R; ++s)
        if (cma_ || s == rank_)
          for (size_t yr : rows_to[s]) idx.push_back(static_cast<int32_t>(yr));
      size_t off = 0;
      for (int s = 0; s < R; ++s) {
        if (!active(s)) continue;
        if (cma_ || s == rank_) {
          MsgHeader hdr = makeHeader(cur_op_, local, sig);
          hdr.flags = kMsgRowsByReference;
          hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
          hdr.v[2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(y));
          post(s, hdr, nullptr, 0, {{reinterpret_cast<const uint8_t*>(idx.data() + off), rows_to[s].size() * 4}});
          off += rows_to[s].size();
          continue;
        }
        std::vector<Seg> segs;
        for (size_t yr : rows_to[s]) {
          const uint8_t* p = y + yr * row;
          if (!segs.empty() && segs.back().p + segs.back().n == p) segs.back().n += row;
          else segs.push_back({p, row});
        }
        MsgHeader hdr = makeHeader(cur_op_, local, sig);
        hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
        post(s, hdr, nullptr, 0, std::move(segs));
      }
      return epSuccess;
    }
    size_t total = 0;
    for (int s = 0; s < R; ++s) total += rows_to[s].size() * row;
    ll_combine_stage_.resize(total);
    size_t off = 0;
    for (int s = 0; s < R; ++s) {
      if (!active(s)) continue;
      size_t b = off;
      for (size_t yr : rows_to[s]) {
        memcpy(ll_combine_stage_.data() + off, y + yr * row, row);
        off += row;
      }
      MsgHeader hdr = makeHeader(cur_op_, local, sig);
      hdr.v[0] = static_cast<int64_t>(rows_to[s].size());
      post(s, hdr, nullptr, 0, {{ll_combine_stage_.data() + b, off - b}});
    }
    return epSuccess;
  };
  return llOp(epOpLlCombine, llCallPhases(a), local, sig, send,
              [&](const Pending& p) { return llCombineRecv(a, p); });
}

// The two halves of an LL operation. `phases` are the call's, or 0 for a rejected call whose phases cannot be
// read: it then stands for what the engine's state allows: the receive half when this operation's send half is
// outstanding, else a send half when the other operation's receive is outstanding, else both halves.
// Call order (decided from local state, the same on every rank, so nothing is exchanged): a send half needs no
// send half of this operation outstanding, a receive half needs this operation's to be the oldest outstanding
// one, and a call with both halves needs none outstanding. A call out of order posts nothing.
// A rejected send half posts a header carrying its code (the peers' receive returns epRemoteError) and returns
// at once; a rejected receive half posts nothing and stays outstanding, so that a valid retry completes it; a
// rejected call with both halves does both, its receive half only draining the peers' messages.
epResult_t HostEngine::llOp(int op, unsigned phases, epResult_t local, uint64_t sig,
                            const std::function<epResult_t()>& send,
                            const std::function<epResult_t(const Pending&)>& recv) {
  const bool ok = local == epSuccess;
  if (phases == 0) phases = llPending(op) ? EP_LL_RECV : pending_.empty() ? EP_LL_SEND_RECV : EP_LL_SEND;
  const char* order = nullptr;
  if ((phases & EP_LL_SEND) && llPending(op))
    order = "send half called while the receive half (EP_LL_RECV) of its previous send half is outstanding";
  else if (phases == EP_LL_SEND_RECV && !pending_.empty())
    order = "call with both halves made while an LL receive half (EP_LL_RECV) is outstanding; complete it first";
  else if (phases == EP_LL_RECV && !llPending(op))
    order = "receive half (EP_LL_RECV) called with no matching send half outstanding";
  else if (phases == EP_LL_RECV && pending_.front().op != op)
    order = "receive half (EP_LL_RECV) called before the older outstanding receive half; complete that first";
  if (order != nullptr) return ok ? EP_ERROR(epInvalidUsage, "%s %s", hostOpName(op), order) : local;
  if (!ok && phases == EP_LL_RECV) return local;
  if (phases & EP_LL_SEND) {
    cur_op_ = op;
    cur_epoch_ = ++send_epoch_;
    if (ok) {
      EPCHECK(send());
    } else {
      for (int p = 0; p < nranks_; ++p)
        if (active(p)) post(p, makeHeader(op, local, sig), nullptr, 0, {});
    }
    pushSends();
    pending_.push_back({op, cur_epoch_, sig, local});
  }
  if (!(phases & EP_LL_RECV)) return local;
  Pending p = pending_.front();
  pending_.pop_front();
  cur_op_ = p.op;
  cur_epoch_ = p.epoch;
  if (ok && p.status == epSuccess) return recv(p);
  // The receive of a rejected send half, or a rejected call with both halves: consume the peers' messages.
  epResult_t st = local;
  if (ok)
    st = EP_ERROR(p.status,
                  "the send half of this %s (epoch %llu) was rejected (%s); its receive half completes without output",
                  hostOpName(op), static_cast<unsigned long long>(p.epoch), epGetErrorString(p.status));
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  st = statusFromPeers(in, st, p.sig);
  EPCHECK(drainPayloads(in));
  return st;
}

epResult_t HostEngine::llCombineRecv(const epLlCombineArgs_t* a, const Pending& pend) {
  cur_op_ = pend.op;
  cur_epoch_ = pend.epoch;
  const int R = nranks_, H = a->hidden, K = a->topk, E = a->num_experts, L = E / R, T = a->num_tokens;
  const size_t row = H * dtypeSize(a->dtype);
  ExpertMap m{E, R, L};
  // Where each (token, k) row lands in the staging: per source rank r, rows come in (local expert, token)
  // order, which this rank derives from its own routing.
  std::vector<int> expect(R, 0);
  std::vector<std::vector<std::pair<int, int>>> by_expert(E);  // expert -> (token, -) in token order
  for (int t = 0; t < T; ++t) {
    const int64_t* r = a->topk_idx + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k)
      if (r[k] >= 0 && !isRepeatedExpert(r, k) && active(m.rankOf(r[k]))) by_expert[r[k]].push_back({t, k});
  }
  std::vector<int> slot(static_cast<size_t>(T) * K, -1);
  std::vector<int> prefix(R + 1, 0);
  int next = 0;
  for (int e = 0; e < E; ++e) {
    for (auto& tk : by_expert[e]) slot[static_cast<size_t>(tk.first) * K + tk.second] = next++;
    expect[m.rankOf(e)] += static_cast<int>(by_expert[e].size());
  }
  for (int r = 0; r < R; ++r) prefix[r + 1] = prefix[r] + expect[r];
  // Repeated experts share the slot of their first occurrence.
  for (int t = 0; t < T; ++t) {
    const int64_t* r = a->topk_idx + static_cast<size_t>(t) * K;
    for (int k = 0; k < K; ++k)
      if (r[k] >= 0 && isRepeatedExpert(r, k))
        for (int j = 0; j < k; ++j)
          if (r[j] == r[k]) {
            slot[static_cast<size_t>(t) * K + k] = slot[static_cast<size_t>(t) * K + j];
            break;
          }
  }
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, epSuccess, pend.sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (!in[s].masked && (in[s].h.v[0] != expect[s] ||
                          in[s].h.data_bytes != static_cast<uint64_t>(expect[s]) *
                                                    ((in[s].h.flags & kMsgRowsByReference) ? sizeof(int32_t) : row)))
      st = EP_ERROR(epInvalidUsage,
                    "rank %d returns %lld rows in LL combine but this rank's routing names %d (token, expert) pairs "
                    "on it: topk_idx or the dispatch outputs passed to combine differ from those of the dispatch",
                    s, static_cast<long long>(in[s].h.v[0]), expect[s]);
  // A call with both halves that reached here sent successfully, and with cross-memory attach left its rows in y.
  const bool left_in_y = (a->phases & EP_LL_SEND) && cma_;
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    if (left_in_y) EPCHECK(waitReadDone(pend.epoch));
    return st;
  }
  scratch_.resize(static_cast<size_t>(next) * row);
  for (int s = 0; s < R; ++s) {
    if (in[s].masked) continue;
    uint8_t* dst = scratch_.data() + prefix[s] * row;
    if (!(in[s].h.flags & kMsgRowsByReference)) {
      EPCHECK(recvInto(s, dst, expect[s] * row, epPhaseData));
      continue;
    }
    // Rows left in rank s's y: the message lists their y rows.
    std::vector<int32_t> yrows(expect[s]);
    EPCHECK(recvInto(s, yrows.data(), yrows.size() * sizeof(int32_t), epPhaseData));
    if (s == rank_)  // read with a plain copy: the indices must name rows of this rank's y
      for (int32_t yr : yrows)
        if (yr < 0 || static_cast<size_t>(yr) >= static_cast<size_t>(L) * R * a->max_tokens_per_rank)
          return fail(epInternalError, s, epPhaseData, "LL combine row index out of range");
    EPCHECK(pullRows(s, yrows, static_cast<uint64_t>(in[s].h.v[2]), row, dst));
    in_[0][s].setReadDone(pend.epoch);
  }
  // The rows from rank s occupy [prefix[s], prefix[s+1]); slot numbering above runs over experts in
  // ascending order, which is also ascending rank order, so slot == staging row.
  acc_.resize(H);
  uint8_t* out = static_cast<uint8_t*>(a->out);
  for (int t = 0; t < T; ++t) {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      int sl = slot[static_cast<size_t>(t) * K + k];
      if (sl < 0) continue;
      const float w = a->topk_weights[static_cast<size_t>(t) * K + k];
      accumulateRowWeighted(acc_.data(), scratch_.data() + static_cast<size_t>(sl) * row, H, a->dtype, w);
    }
    storeRow(out + t * row, acc_.data(), H, a->dtype);
  }
  // In a call with both halves this rank's rows were sent straight from y, or are read from it by the peers:
  // either way they must be out before it returns. (A receive half on its own must not wait here: a later
  // send half's staged messages may be queued too.)
  if (!(a->phases & EP_LL_SEND)) return epSuccess;
  EPCHECK(flushSends(epPhaseData));
  return left_in_y ? waitReadDone(pend.epoch) : epSuccess;
}

epResult_t HostEngine::llCombineBuffer(void**, size_t*) {
  EP_FAIL(epNotSupported, "zero-copy LL combine buffers are a GPU engine feature (the host engine's combine "
                          "already reads y in place)");
}

epResult_t HostEngine::llDispatchBuffer(void**, size_t*, float**, size_t*) {
  EP_FAIL(epNotSupported, "zero-copy LL dispatch outputs are a GPU engine feature (the host engine writes the rows "
                          "into recv_x once already)");
}

}  // namespace epcomm
