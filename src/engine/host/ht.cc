// Host engine: HT notify, dispatch and combine.
// Transport, waits and agreement checks are in host_engine.cc; the message protocol is in host_engine.h.
#include <sys/uio.h>

#include <algorithm>
#include <atomic>
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

using host::accumulateRow;
using host::storeRow;

// ------------------------------------------------------------------------------------------------------
// HT notify / dispatch / combine
// ------------------------------------------------------------------------------------------------------

// Per-channel counts of the tokens this rank sends to p: channel c carries tokens [chanBegin(c), chanBegin(c+1)).
static void chanCountsTo(const uint8_t* in_rank, int T, int R, int C, int p, int* out) {
  for (int c = 0; c < C; ++c) {
    const int b = static_cast<int>(static_cast<int64_t>(T) * c / C), e = static_cast<int>(static_cast<int64_t>(T) * (c + 1) / C);
    int n = 0;
    for (int t = b; t < e; ++t) n += in_rank[static_cast<size_t>(t) * R + p];
    out[c] = n;
  }
}

// The HT count message to p: [per local expert of p (L)] [per channel (C)], and the rows in v[0].
static std::vector<int> countMessage(const std::vector<uint8_t>& in_rank, const std::vector<int>& per_expert_to,
                                     int T, int R, int L, int C, int p) {
  std::vector<int> m(L + C, 0);
  if (!per_expert_to.empty()) std::copy_n(per_expert_to.begin() + static_cast<size_t>(p) * L, L, m.begin());
  chanCountsTo(in_rank.data(), T, R, C, p, m.data() + L);
  return m;
}

// Fills the handle's receive side from the peers' count messages; false if a message is malformed.
static bool readCounts(const std::vector<int64_t>& rows, const std::vector<const int*>& msgs, int R, int L, int C,
                       bool with_experts, epHtHandle* h) {
  h->recv_count.assign(R, 0);
  h->recv_prefix.assign(R + 1, 0);
  h->recv_chan_count.assign(static_cast<size_t>(R) * C, 0);
  if (with_experts) h->recv_per_expert.assign(L, 0);
  for (int s = 0; s < R; ++s) {
    if (rows[s] < 0 || rows[s] > INT32_MAX / R) return false;
    int64_t sum = 0;
    for (int c = 0; c < C; ++c) {
      const int v = msgs[s][L + c];
      if (v < 0) return false;
      h->recv_chan_count[static_cast<size_t>(s) * C + c] = v;
      sum += v;
    }
    if (sum != rows[s]) return false;
    h->recv_count[s] = static_cast<int>(rows[s]);
    h->recv_prefix[s + 1] = h->recv_prefix[s] + h->recv_count[s];
    if (with_experts)
      for (int e = 0; e < L; ++e) h->recv_per_expert[e] += msgs[s][e];
  }
  h->num_recv = h->recv_prefix[R];
  return true;
}

epResult_t HostEngine::htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                                int* per_expert_host, epStream_t) {
  cur_op_ = epOpHtNotify;
  cur_epoch_ = ++send_epoch_;
  if (h && local == epSuccess) h->valid = false;
  const int R = nranks_, C = nchan_;
  const int E = local == epSuccess ? a->num_experts : 0;
  const int L = local == epSuccess ? E / R : 0;
  const uint64_t sig = shapeSig({E});
  std::vector<uint8_t> in_rank;
  std::vector<int> send_count, per_expert_to, masked_to;
  if (local == epSuccess)
    computeLayout(a->topk_idx, a->num_tokens, a->topk, E, in_rank, send_count, per_expert_to, &masked_to);
  for (int p = 0; p < R; ++p) {
    if (!active(p)) continue;
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (local == epSuccess) {
      hdr.v[0] = send_count[p];
      std::vector<int> m = countMessage(in_rank, per_expert_to, a->num_tokens, R, L, C, p);
      post(p, hdr, m.data(), sizeof(int) * m.size(), {});
    } else {
      post(p, hdr, nullptr, 0, {});
    }
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  EPCHECK(drainPayloads(in));
  EPCHECK(flushSends(epPhaseHeader));
  if (st != epSuccess) return st;
  std::vector<int64_t> rows(R, 0);
  const std::vector<int> none(L + C, 0);  // what a masked rank contributes
  std::vector<const int*> msgs(R, none.data());
  for (int s = 0; s < R; ++s) {
    if (in[s].masked) continue;
    if (in[s].extra.size() != sizeof(int) * (L + C))
      return fail(epInternalError, s, epPhaseHeader, "notify message has a bad count array");
    rows[s] = in[s].h.v[0];
    msgs[s] = reinterpret_cast<const int*>(in[s].extra.data());
  }
  epHtHandle fresh;  // the handle changes only once the counts are whole
  if (!readCounts(rows, msgs, R, L, C, true, &fresh))
    return fail(epInternalError, -1, epPhaseHeader, "notify counts are inconsistent");
  h->recv_count = std::move(fresh.recv_count);
  h->recv_prefix = std::move(fresh.recv_prefix);
  h->recv_chan_count = std::move(fresh.recv_chan_count);
  h->recv_per_expert = std::move(fresh.recv_per_expert);
  h->num_recv = fresh.num_recv;
  h->num_tokens = a->num_tokens;
  h->num_experts = E;
  h->in_rank = std::move(in_rank);
  h->send_count = std::move(send_count);
  h->masked_count = std::move(masked_to);
  h->mask_gen = mask_gen_;
  h->recv_rows = h->num_recv;
  h->valid = true;
  if (num_recv_host) *num_recv_host = h->num_recv;
  if (per_expert_host)
    for (int e = 0; e < L; ++e) per_expert_host[e] = h->recv_per_expert[e];
  return epSuccess;
}

epResult_t HostEngine::htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, epStream_t) {
  cur_op_ = epOpHtDispatch;
  cur_epoch_ = ++send_epoch_;
  if (local == epSuccess && (a->num_worst_tokens == 0 || (a->flags & EP_HT_USE_HANDLE_LAYOUT)))
    local = checkHandleMask(h, "HT dispatch");
  const int R = nranks_, C = nchan_;
  const bool ok = local == epSuccess;
  const bool cached = ok && (a->num_worst_tokens == 0 || (a->flags & EP_HT_USE_HANDLE_LAYOUT));
  const int T = ok ? a->num_tokens : 0, H = ok ? a->hidden : 0, K = ok ? a->topk : 0;
  const int E = ok ? a->num_experts : 0, L = ok ? E / R : 0;
  const bool fp8 = ok && a->dtype == epFloat8E4M3;
  const size_t xrow = ok ? H * dtypeSize(a->dtype) : 0;
  const size_t srow = fp8 ? sizeof(float) * (H / EP_FP8_BLOCK) : 0;
  // A rank without tokens may pass NULL arrays (the zero-size NULL rule): it still sends its (empty) routing.
  const bool send_idx = ok && (a->topk_idx != nullptr || T == 0);
  const bool send_w = send_idx && (a->topk_weights != nullptr || T == 0);
  const uint64_t sig = ok ? shapeSig({E, H, K, a->dtype, hier_ ? 1 : 0}) : 0;
  ExpertMap m{E, R, L > 0 ? L : 1};

  // Layout: from the handle (cached / exact mode) or from topk_idx.
  std::vector<uint8_t> in_rank_new;
  std::vector<int> send_count_new, per_expert_to, masked_new;
  const std::vector<uint8_t>* in_rank = &in_rank_new;
  const int* send_count = nullptr;
  const std::vector<int>* masked_to = &masked_new;
  if (ok) {
    if (cached) {
      in_rank = &h->in_rank;
      send_count = h->send_count.data();
      masked_to = &h->masked_count;
      if (send_idx) {  // per-expert counts travel again so that the receiver can check its cached copy
        std::vector<uint8_t> tmp;
        std::vector<int> tmp_count;
        computeLayout(a->topk_idx, T, K, E, tmp, tmp_count, per_expert_to);
      }
    } else {
      computeLayout(a->topk_idx, T, K, E, in_rank_new, send_count_new, per_expert_to, &masked_new);
      send_count = send_count_new.data();
    }
  }

  // Channel 0: the counts. Channel c: the rows of tokens [chanBegin(c), chanBegin(c+1)), field-major (x rows,
  // scale rows, topk_idx rows as local ids, topk_weights rows). With cross-memory attach, and always toward this
  // rank itself (rowsByRef), the x and scale rows stay here and the message carries their token indices instead:
  // the receiver pulls them (its own with a plain copy, one instead of two through its queue).
  std::vector<std::vector<int64_t>> idx_out(ok ? R * C : 0);
  std::vector<std::vector<float>> w_out(ok ? R * C : 0);
  std::vector<std::vector<int32_t>> tok_out(ok ? R * C : 0);
  for (int p = 0; p < R; ++p) {
    if (!active(p)) continue;
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    hdr.v[0] = send_count[p];
    hdr.v[1] = (send_idx ? 1 : 0) | (send_w ? 2 : 0);
    hdr.v[2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a->x));
    hdr.v[3] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a->x_scales));
    std::vector<int> cm = countMessage(*in_rank, per_expert_to, T, R, L, C, p);
    post(p, hdr, cm.data(), sizeof(int) * cm.size(), {});
    if (hier_ && remote_[p]) continue;  // its rows go through its host's forwarder (below)
    for (int c = 0; c < C; ++c) {
      const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
      std::vector<Seg> segs;
      const uint8_t* x = static_cast<const uint8_t*>(a->x);
      auto in = [&](int t) { return (*in_rank)[static_cast<size_t>(t) * R + p] != 0; };
      const bool by_ref = rowsByRef(p);
      if (by_ref) {
        auto& to = tok_out[static_cast<size_t>(p) * C + c];
        for (int t = tb; t < te; ++t)
          if (in(t)) to.push_back(t);
        segs.push_back({reinterpret_cast<const uint8_t*>(to.data()), to.size() * sizeof(int32_t)});
      } else {
        for (int t = tb; t < te; ++t)
          if (in(t)) segs.push_back({x + t * xrow, xrow});
      }
      if (fp8 && !by_ref) {
        const uint8_t* sc = reinterpret_cast<const uint8_t*>(a->x_scales);
        for (int t = tb; t < te; ++t)
          if (in(t)) segs.push_back({sc + t * srow, srow});
      }
      if (send_idx) {
        auto& io = idx_out[static_cast<size_t>(p) * C + c];
        auto& wo = w_out[static_cast<size_t>(p) * C + c];
        for (int t = tb; t < te; ++t) {
          if (!in(t)) continue;
          for (int k = 0; k < K; ++k) {
            int64_t e = a->topk_idx[static_cast<size_t>(t) * K + k];
            bool here = e >= 0 && m.rankOf(e) == p;
            io.push_back(here ? m.localOf(e) : -1);
            if (send_w) wo.push_back(here ? a->topk_weights[static_cast<size_t>(t) * K + k] : 0.0f);
          }
        }
        segs.push_back({reinterpret_cast<const uint8_t*>(io.data()), io.size() * sizeof(int64_t)});
        if (send_w) segs.push_back({reinterpret_cast<const uint8_t*>(wo.data()), wo.size() * sizeof(float)});
      }
      post(p, makeHeader(cur_op_, local, sig), nullptr, 0, std::move(segs), c);
    }
  }
  // Hierarchical: to every other host with an active rank, channel c carries ONE message to the forwarder
  // there: the tokens of channel c that any rank of that host needs, each once, with a word naming those ranks
  // (bit i = the host's i-th rank). Field-major: [mask n][x rows n][scale rows n][topk_idx n*K global ids]
  // [topk_weights n*K]. v[0] = n, v[1] = x row bytes | scale row bytes << 32, v[2] = K | E << 32, v[3] = the
  // idx/weights flags: self-describing, so that a forwarder can pass it on whatever its own arguments were.
  std::vector<std::vector<uint64_t>> union_mask(ok && hier_ ? static_cast<size_t>(nhosts_) * C : 0);
  if (ok && hier_) {
    for (int hh = 0; hh < nhosts_; ++hh) {
      const int f = hh == my_host_ ? -1 : forwarder(rank_, hh);
      if (f < 0) continue;
      const std::vector<int>& ranks = host_ranks_[hh];
      for (int c = 0; c < C; ++c) {
        const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
        auto& mk = union_mask[static_cast<size_t>(hh) * C + c];
        std::vector<int> toks;
        for (int t = tb; t < te; ++t) {
          uint64_t w = 0;
          for (size_t i = 0; i < ranks.size(); ++i)
            if ((*in_rank)[static_cast<size_t>(t) * R + ranks[i]]) w |= uint64_t{1} << i;
          if (w) mk.push_back(w), toks.push_back(t);
        }
        std::vector<Seg> segs;
        segs.push_back({reinterpret_cast<const uint8_t*>(mk.data()), mk.size() * sizeof(uint64_t)});
        const uint8_t* x = static_cast<const uint8_t*>(a->x);
        for (int t : toks) segs.push_back({x + t * xrow, xrow});
        if (fp8)
          for (int t : toks) segs.push_back({reinterpret_cast<const uint8_t*>(a->x_scales) + t * srow, srow});
        if (send_idx)
          for (int t : toks)
            segs.push_back({reinterpret_cast<const uint8_t*>(a->topk_idx + static_cast<size_t>(t) * K), K * sizeof(int64_t)});
        if (send_w)
          for (int t : toks)
            segs.push_back({reinterpret_cast<const uint8_t*>(a->topk_weights + static_cast<size_t>(t) * K), K * sizeof(float)});
        MsgHeader hdr = makeHeader(cur_op_, local, sig);
        hdr.v[0] = static_cast<int64_t>(toks.size());
        hdr.v[1] = static_cast<int64_t>(xrow | (static_cast<uint64_t>(srow) << 32));
        hdr.v[2] = static_cast<int64_t>(static_cast<uint64_t>(K) | (static_cast<uint64_t>(E) << 32));
        hdr.v[3] = (send_idx ? 1 : 0) | (send_w ? 2 : 0);
        post(f, hdr, nullptr, 0, std::move(segs), c);
      }
    }
  }
  if (hier_) {
    fwd_scratch_.assign(static_cast<size_t>(R) * C, {});
    fwd_self_.resize(static_cast<size_t>(R) * C);
  }
  pushSends();

  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  // Receive-side checks of what peers announced.
  epHtHandle fresh;
  epHtHandle* lay = cached ? h : &fresh;
  std::vector<int> per_expert(L, 0);
  bool have_counts = true;
  if (st == epSuccess) {
    std::vector<int64_t> rows(R, 0);
    const std::vector<int> none(L + C, 0);  // what a masked rank contributes
    std::vector<const int*> msgs(R, none.data());
    for (int s = 0; s < R && st == epSuccess; ++s) {
      if (in[s].masked) continue;
      if (in[s].extra.size() != sizeof(int) * (L + C) || in[s].h.data_bytes != 0)
        st = fail(epInternalError, s, epPhaseHeader, "dispatch count message does not match its header");
      rows[s] = in[s].h.v[0];
      msgs[s] = reinterpret_cast<const int*>(in[s].extra.data());
      have_counts = have_counts && (in[s].h.v[1] & 1);
    }
    if (st == epSuccess) {
      epHtHandle check;
      if (!readCounts(rows, msgs, R, L, C, have_counts, &check))
        st = fail(epInternalError, -1, epPhaseHeader, "dispatch counts are inconsistent");
      else if (cached && (check.recv_count != h->recv_count || check.recv_chan_count != h->recv_chan_count))
        st = EP_ERROR(epInvalidUsage,
                      "the handle's cached layout does not match what the ranks sent: the routing changed since "
                      "the handle was filled (notify again, or dispatch without EP_HT_USE_HANDLE_LAYOUT)");
      else if (!cached)
        fresh = std::move(check);
      per_expert = have_counts ? (cached ? check.recv_per_expert : fresh.recv_per_expert) : h->recv_per_expert;
    }
    if (st == epSuccess && a->num_worst_tokens > 0 && lay->num_recv > a->num_worst_tokens)
      st = EP_ERROR(epCapacityExceeded,
                    "HT dispatch received %d rows but num_worst_tokens is %d; nothing was written past the "
                    "capacity",
                    lay->num_recv, a->num_worst_tokens);
  }
  if (st != epSuccess) {
    if (ok && !cached) h->valid = false;
    if (unaligned_) return st;  // another operation on some rank: nothing to drain (statusFromPeers)
    EPCHECK(drainPayloads(in));
    if (hier_) EPCHECK(runChannels([&](int c) { return htDispatchRecvHier(a, nullptr, in, c); }));
    else EPCHECK(drainChannels(in));
    if (cma_) EPCHECK(exchangeDone());
    return st;
  }

  // Data: each channel places its rows of every source contiguously at their final rows.
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x);
  if (hier_) EPCHECK(runChannels([&](int c) { return htDispatchRecvHier(a, lay, in, c); }));
  else EPCHECK(runChannels([&](int c) -> epResult_t {
    for (int s = 0; s < R; ++s) {
      if (in[s].masked) continue;
      const int b = lay->chanRowBegin(s, c, C);
      const int n = lay->recv_chan_count[static_cast<size_t>(s) * C + c];
      const bool has_idx = in[s].h.v[1] & 1, has_w = in[s].h.v[1] & 2;
      if (rowsByRef(s)) {
        EPCHECK(pullDispatchRows(a, in[s].h, s, c, b, n, has_idx, has_w));
      } else {
        EPCHECK(recvChannelHeader(s, c, n * (xrow + srow + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
        EPCHECK(recvInto(s, rx + b * xrow, n * xrow, epPhaseData, c));
        if (fp8)
          EPCHECK(recvInto(s, reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow, n * srow, epPhaseData, c));
      }
      if (has_idx) {
        if (a->recv_topk_idx)
          EPCHECK(recvInto(s, a->recv_topk_idx + static_cast<size_t>(b) * K, sizeof(int64_t) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(s, sizeof(int64_t) * n * K, epPhaseData, c));
      }
      if (has_w) {
        if (a->recv_topk_weights)
          EPCHECK(recvInto(s, a->recv_topk_weights + static_cast<size_t>(b) * K, sizeof(float) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(s, sizeof(float) * n * K, epPhaseData, c));
      }
    }
    return flushSends(epPhaseData, c);
  }));
  // The senders' x must stay put until every receiver has pulled its rows.
  if (cma_) EPCHECK(exchangeDone());

  const int num_recv = lay->num_recv;
  if (a->num_worst_tokens > 0) {
    for (int r = num_recv; r < a->num_worst_tokens; ++r)
      for (int k = 0; k < K; ++k) {
        if (a->recv_topk_idx) a->recv_topk_idx[static_cast<size_t>(r) * K + k] = -1;
        if (a->recv_topk_weights) a->recv_topk_weights[static_cast<size_t>(r) * K + k] = 0.0f;
      }
  }
  if (a->num_recv_tokens) a->num_recv_tokens[0] = num_recv;
  for (int p = 0; p < R; ++p)
    if (!active(p) && !masked_to->empty()) drop_rows_[p] += (*masked_to)[p];
  if (a->recv_tokens_per_expert)
    for (int e = 0; e < L; ++e) a->recv_tokens_per_expert[e] = per_expert[e];
  if (!cached) {
    h->num_tokens = T;
    h->num_experts = E;
    h->in_rank = std::move(in_rank_new);
    h->send_count = std::move(send_count_new);
    h->masked_count = std::move(masked_new);
    h->mask_gen = mask_gen_;
    h->recv_count = std::move(fresh.recv_count);
    h->recv_prefix = std::move(fresh.recv_prefix);
    h->recv_chan_count = std::move(fresh.recv_chan_count);
    h->recv_per_expert = per_expert;
    h->num_recv = num_recv;
    h->recv_rows = num_recv;
    h->valid = true;
  }
  h->hier = hier_;
  if (hier_) h->fwd_mask = std::move(fwd_scratch_);
  return epSuccess;
}

epResult_t HostEngine::htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local, epStream_t) {
  cur_op_ = epOpHtCombine;
  cur_epoch_ = ++send_epoch_;
  if (local == epSuccess) local = checkHandleMask(h, "HT combine");
  const int R = nranks_, C = nchan_;
  const bool ok = local == epSuccess;
  const int H = ok ? a->hidden : 0;
  const size_t es = ok ? dtypeSize(a->dtype) : 0, row = H * es;
  const uint64_t sig = ok ? shapeSig({H, a->dtype, hier_ ? 1 : 0}) : 0;
  // Channel 0: the row count and where p's rows start in x; channel c: the rows of source p's tokens in p's
  // channel c, which are contiguous in this rank's receive order. With cross-memory attach there are no channel
  // messages: p pulls its rows straight out of x.
  for (int p = 0; p < R; ++p) {
    if (!active(p)) continue;
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    const uint8_t* x = static_cast<const uint8_t*>(a->x) + h->recv_prefix[p] * row;
    hdr.v[0] = h->recv_count[p];
    hdr.v[1] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x));
    post(p, hdr, nullptr, 0, {});
    if (cma_ || hier_) continue;
    for (int c = 0; c < C; ++c) {
      const int n = h->recv_chan_count[static_cast<size_t>(p) * C + c];
      post(p, makeHeader(cur_op_, local, sig), nullptr, 0, {{x, n * row}}, c);
      x += n * row;
    }
  }
  // Hierarchical: per channel, first each owner of another host gets its rows through its forwarder on this host
  // (owners ascending), then this host's owners get theirs directly (htCombineHier says why this order).
  if (ok && hier_) {
    auto slab = [&](int p, int c, const uint8_t** x, size_t* n) {
      *x = static_cast<const uint8_t*>(a->x) + static_cast<size_t>(h->chanRowBegin(p, c, C)) * row;
      *n = h->recv_chan_count[static_cast<size_t>(p) * C + c] * row;
    };
    for (int c = 0; c < C; ++c)
      for (int pass = 1; pass >= 0; --pass)
        for (int p = 0; p < R; ++p) {
          if (!active(p) || remote_[p] != pass) continue;
          const uint8_t* x;
          size_t n;
          slab(p, c, &x, &n);
          const int to = pass ? forwarder(p, my_host_) : p;
          if (to == rank_) {  // its own rows: htCombineHier reads them in place, not through its own queue
            MsgHeader hdr = makeHeader(cur_op_, local, sig);
            hdr.flags = kMsgRowsInPlace;
            post(to, hdr, nullptr, 0, {}, c);
            continue;
          }
          post(to, makeHeader(cur_op_, local, sig), nullptr, 0, {{x, n}}, c);
        }
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s) {
    if (in[s].masked) continue;
    if (in[s].h.v[0] != h->send_count[s] || in[s].h.data_bytes != 0)
      st = EP_ERROR(epInvalidUsage,
                    "rank %d returns %lld rows in HT combine but this rank's handle sent it %d tokens: the handles "
                    "of the ranks come from different dispatches",
                    s, static_cast<long long>(in[s].h.v[0]), h->send_count[s]);
  }
  if (st == epSuccess && ok && hier_ && !h->hier)
    st = EP_ERROR(epInvalidUsage, "the handle's dispatch did not run hierarchically but this combine does");
  std::atomic<bool> forward_failed{false};
  if (st != epSuccess) {
    if (unaligned_) return st;  // another operation on some rank: nothing to drain (statusFromPeers)
    EPCHECK(drainPayloads(in));
    if (cma_) EPCHECK(exchangeDone());
    else if (hier_)
      EPCHECK(runChannels([&](int c) { return htCombineHier(a, h, in, ok, false, c, &forward_failed); }));
    else EPCHECK(drainChannels(in));
    return st;
  }
  if (hier_) {
    EPCHECK(runChannels([&](int c) { return htCombineHier(a, h, in, ok, true, c, &forward_failed); }));
    if (forward_failed.load())
      return fail(epInvalidUsage, -1, epPhaseData,
                  "this rank could not reduce its host's rows for another host: its handle does not match what its "
                  "host's ranks returned");
    return epSuccess;
  }
  // Token by token, ranks ascending: fp32 accumulation in the order the design fixes, rounded once. Each
  // channel reduces its own tokens.
  const int T = a->num_tokens;
  uint8_t* out = static_cast<uint8_t*>(a->combined_x);
  if (cma_) {
    st = runChannels([&](int c) -> epResult_t { return htCombinePulled(a, h, in, c); });
    // The peers' x must stay put until every rank has pulled its rows.
    EPCHECK(exchangeDone());
    return st;
  }
  return runChannels([&](int c) -> epResult_t {
    const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
    std::vector<int> cnt(R, 0);
    for (int t = tb; t < te; ++t)
      for (int r = 0; r < R; ++r) cnt[r] += h->in_rank[static_cast<size_t>(t) * R + r];
    for (int r = 0; r < R; ++r)
      if (active(r)) EPCHECK(recvChannelHeader(r, c, cnt[r] * row));
    std::vector<float> acc(H);
    std::vector<uint8_t> tmp(row);
    for (int t = tb; t < te; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        if (!h->in_rank[static_cast<size_t>(t) * R + r]) continue;
        EPCHECK(waitIn(r, row, epPhaseData, c));
        const uint8_t* src = in_[c][r].peek(row);
        if (src == nullptr) {
          in_[c][r].copyOut(tmp.data(), 0, row);
          src = tmp.data();
        }
        accumulateRow(acc.data(), src, H, a->dtype);
        in_[c][r].release(row);
      }
      storeRow(out + t * row, acc.data(), H, a->dtype);
    }
    return flushSends(epPhaseData, c);
  });
}

epResult_t HostEngine::pullDispatchRows(const epHtDispatchArgs_t* a, const MsgHeader& h, int s, int c, int b, int n,
                                        bool has_idx, bool has_w) {
  const int K = a->topk;
  const size_t xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  const size_t srow = a->dtype == epFloat8E4M3 ? sizeof(float) * (a->hidden / EP_FP8_BLOCK) : 0;
  EPCHECK(recvChannelHeader(s, c, n * (sizeof(int32_t) + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
  std::vector<int32_t> tokens(n);
  EPCHECK(recvInto(s, tokens.data(), n * sizeof(int32_t), epPhaseData, c));
  if (s == rank_)  // read with a plain copy: the indices must name rows of this rank's x
    for (int32_t t : tokens)
      if (t < 0 || t >= a->num_tokens) return fail(epInternalError, s, epPhaseData, "HT dispatch row index out of range");
  EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(h.v[2]), xrow, static_cast<uint8_t*>(a->recv_x) + b * xrow));
  if (srow)
    EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(h.v[3]), srow,
                     reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow));
  return epSuccess;
}

// HT combine with cross-memory attach, channel c: the rows this rank's channel-c tokens got back from rank r
// are contiguous in r's x (r received them in token order), so they come over in blocks, one
// process_vm_readv per peer and block, into a staging buffer small enough to stay in cache for the reduction.
epResult_t HostEngine::htCombinePulled(const epHtCombineArgs_t* a, const epHtHandle* h, const std::vector<Incoming>& in,
                                       int c) {
  const int R = nranks_, C = nchan_, H = a->hidden;
  const size_t row = static_cast<size_t>(H) * dtypeSize(a->dtype);
  const int T = a->num_tokens, tb = chanBegin(T, c), te = chanBegin(T, c + 1);
  const uint8_t* in_rank = h->in_rank.data();
  // Where channel c's rows start in each peer's x: after the rows of this rank's earlier channels.
  std::vector<const uint8_t*> next(R);
  std::vector<int> per_chan(C);
  for (int r = 0; r < R; ++r) {
    chanCountsTo(in_rank, T, R, C, r, per_chan.data());
    size_t off = 0;
    for (int cc = 0; cc < c; ++cc) off += per_chan[cc];
    next[r] = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(in[r].h.v[1])) + off * row;
  }
  const int block = static_cast<int>(std::clamp<size_t>((256u << 10) / std::max<size_t>(row, 1), 1, 1024));
  ScratchArena& scratch = chan_scratch_[c];
  scratch.reset();
  uint8_t* const stage = scratch.get(static_cast<size_t>(R) * block * row);
  std::vector<const uint8_t*> cur(R);
  std::vector<float> acc(H);
  uint8_t* out = static_cast<uint8_t*>(a->combined_x);
  for (int t0 = tb; t0 < te; t0 += block) {
    const int t1 = std::min(te, t0 + block);
    for (int r = 0; r < R; ++r) {
      size_t n = 0;
      for (int t = t0; t < t1; ++t) n += in_rank[static_cast<size_t>(t) * R + r];
      if (r == rank_ || n == 0) {  // this rank's own rows are read in place
        cur[r] = next[r];
      } else {
        uint8_t* dst = stage + static_cast<size_t>(r) * block * row;
        iovec remote{const_cast<uint8_t*>(next[r]), n * row};
        EPCHECK(readPeer(r, &remote, 1, dst, n * row));
        cur[r] = dst;
      }
      next[r] += n * row;
    }
    for (int t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; r < R; ++r) {
        if (!in_rank[static_cast<size_t>(t) * R + r]) continue;
        accumulateRow(acc.data(), cur[r], H, a->dtype);
        cur[r] += row;
      }
      storeRow(out + static_cast<size_t>(t) * row, acc.data(), H, a->dtype);
    }
  }
  return epSuccess;
}


// ------------------------------------------------------------------------------------------------------
// Hierarchical HT across hosts
//
// Dispatch. A source sends the rows of its ranks on its own host directly (as flat), and to every other host
// one message per channel, to that host's forwarder for it (forwarder()): each token row that any rank there
// needs travels once, with a word naming those ranks. The forwarder passes each rank of its host (itself
// included) the very message the source would have sent it flat (rows, scales, topk_idx as that rank's local
// ids, weights), one per (source, rank, channel). The rings carry, per channel, in this order: a rank's own
// direct message, then the messages it forwards, sources ascending. So a receiver reads its own host's
// sources first (ascending), then the other hosts' sources (ascending), each through its forwarder; rows land
// at the same final places as flat, so every output is bit-identical to the flat path.
//
// Combine. A rank sends, per channel, first to the forwarder of each owner on another host (owners ascending)
// that owner's rows, then its own host's owners their rows directly. A forwarder first reduces, per owner it
// forwarded for (ascending), the rows of its host's ranks for each forwarded token in fp32, ranks ascending,
// and sends the owner the fp32 partial row (the row itself, in its dtype, where one rank holds the token: that
// partial is 0 + x = x exactly); then it does its own tokens: per token, hosts ascending, each
// host's partial (its own host's reduced here the same way) added to an fp32 accumulator that starts at 0,
// rounded once. The forward step needs only its own host's ranks, so no cycle of waits forms across hosts.
//
// Failures. Forwarding depends only on what every rank sees alike (the mask and the sources' header status), so
// it runs whether this rank's own part failed or not: a forwarder always forwards every accepted source, and
// always sends every owner it serves a partial (with an error status when it could not reduce), and receivers
// consume exactly those messages. A forwarder that dies is a dead peer for its host's receivers and a lost
// connection for the sources; after the survivors mask it, forwarder() picks another active rank.
// ------------------------------------------------------------------------------------------------------

int HostEngine::forwarder(int s, int hh) const {
  const std::vector<int>& ranks = host_ranks_[hh];
  int n = 0;
  for (int r : ranks) n += active(r) ? 1 : 0;
  if (n == 0) return -1;
  int k = local_idx_[s] % n;
  for (int r : ranks)
    if (active(r) && k-- == 0) return r;
  return -1;
}

epResult_t HostEngine::htForwardDispatch(const std::vector<Incoming>& in, int c,
                                         std::vector<std::vector<uint64_t>>& masks,
                                         ScratchArena& keep) {
  const int R = nranks_, C = nchan_;
  const std::vector<int>& mine = host_ranks_[my_host_];
  uint64_t valid = 0;
  for (size_t i = 0; i < mine.size(); ++i)
    if (active(mine[i])) valid |= uint64_t{1} << i;
  for (int s = 0; s < R; ++s) {
    fwd_self_[static_cast<size_t>(s) * C + c].set = false;
    if (!remote_[s] || in[s].masked || in[s].h.status != epSuccess || forwarder(s, my_host_) != rank_) continue;
    MsgHeader u;
    EPCHECK(recvInto(s, &u, sizeof(u), epPhaseData, c));
    const int64_t n = u.v[0];
    const uint64_t xrow = static_cast<uint64_t>(u.v[1]) & 0xffffffffu, srow = static_cast<uint64_t>(u.v[1]) >> 32;
    const uint64_t K = static_cast<uint64_t>(u.v[2]) & 0xffffffffu, E = static_cast<uint64_t>(u.v[2]) >> 32;
    const bool has_idx = u.v[3] & 1, has_w = u.v[3] & 2;
    // Bounds first (R5): every size below comes from the network.
    const bool sane = u.magic == kMsgMagic && u.epoch == cur_epoch_ && u.src == s && u.extra_bytes == 0 && n >= 0 &&
                      n <= INT32_MAX && xrow <= ring_bytes_ && srow <= ring_bytes_ && K <= 4096 &&
                      (!has_idx || (E > 0 && E % R == 0 && E <= (uint64_t{1} << 30))) && (!has_w || has_idx);
    const uint64_t per = 8 + xrow + srow + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0);
    if (!sane || u.data_bytes != static_cast<uint64_t>(n) * per || u.data_bytes > (uint64_t{1} << 36))
      return fail(epInternalError, s, epPhaseData, "HT dispatch message to forward is malformed");
    uint8_t* buf = keep.get(u.data_bytes);
    EPCHECK(recvInto(s, buf, u.data_bytes, epPhaseData, c));
    const uint64_t* mk = reinterpret_cast<const uint64_t*>(buf);
    const uint8_t* xs = buf + n * 8;
    const uint8_t* ss = xs + n * xrow;
    const uint8_t* idx = ss + n * srow;
    const uint8_t* wts = idx + (has_idx ? n * K * 8 : 0);
    for (int64_t i = 0; i < n; ++i)
      if (mk[i] == 0 || (mk[i] & ~valid))
        return fail(epInternalError, s, epPhaseData, "HT dispatch message to forward names no or inactive ranks");
    masks[static_cast<size_t>(s) * C + c].assign(mk, mk + n);
    const int64_t L = has_idx ? static_cast<int64_t>(E / R) : 1;
    for (size_t qi = 0; qi < mine.size(); ++qi) {
      const int q = mine[qi];
      if (!active(q)) continue;
      std::vector<int64_t> rows;
      for (int64_t i = 0; i < n; ++i)
        if ((mk[i] >> qi) & 1) rows.push_back(i);
      SelfForward* self = q == rank_ ? &fwd_self_[static_cast<size_t>(s) * C + c] : nullptr;
      std::vector<Seg> segs;
      for (int64_t i : rows) segs.push_back({xs + i * xrow, xrow});
      if (srow)
        for (int64_t i : rows) segs.push_back({ss + i * srow, srow});
      if (has_idx) {  // global expert ids -> q's local ids (-1 elsewhere), weights kept only for q's experts
        int64_t* io = reinterpret_cast<int64_t*>(keep.get(rows.size() * K * 8));
        float* wo = nullptr;
        if (has_w) {
          wo = reinterpret_cast<float*>(keep.get(rows.size() * K * 4));
        }
        for (size_t j = 0; j < rows.size(); ++j)
          for (uint64_t k = 0; k < K; ++k) {
            int64_t e;
            memcpy(&e, idx + (rows[j] * K + k) * 8, 8);
            const bool here = e >= 0 && e / L == q;
            io[j * K + k] = here ? e % L : -1;
            if (wo) {
              float w;
              memcpy(&w, wts + (rows[j] * K + k) * 4, 4);
              wo[j * K + k] = here ? w : 0.0f;
            }
          }
        segs.push_back({reinterpret_cast<const uint8_t*>(io), rows.size() * K * 8});
        if (wo) segs.push_back({reinterpret_cast<const uint8_t*>(wo), rows.size() * K * 4});
        if (self) self->idx = io, self->w = wo;
      }
      if (self) {  // its own rows: copied once, from here, by htDispatchRecvHier (not twice through its queue)
        self->has_idx = has_idx, self->has_w = has_w;
        self->xs = xs, self->ss = ss, self->xrow = xrow, self->srow = srow, self->K = K;
        self->rows = std::move(rows);
        self->set = true;
        continue;
      }
      post(q, makeHeader(cur_op_, epSuccess, 0), nullptr, 0, std::move(segs), c);
    }
  }
  return epSuccess;
}

epResult_t HostEngine::htDispatchRecvHier(const epHtDispatchArgs_t* a, const epHtHandle* lay,
                                          const std::vector<Incoming>& in, int c) {
  const int R = nranks_, C = nchan_;
  ScratchArena& keep = chan_scratch_[c];  // forwarded rows, until pushed (flushSends below)
  keep.reset();
  EPCHECK(htForwardDispatch(in, c, fwd_scratch_, keep));
  // This host's sources first, then the other hosts' through their forwarders: the rings' order.
  for (int pass = 0; pass < 2; ++pass)
    for (int s = 0; s < R; ++s) {
      if (in[s].masked || in[s].h.status != epSuccess || remote_[s] != pass) continue;
      const int r = pass ? forwarder(s, my_host_) : s;
      if (pass && r == rank_) {  // forwarded by this rank to itself: no message (htForwardDispatch kept it)
        if (lay != nullptr) EPCHECK(placeSelfForward(a, lay, s, c, in[s].h.v[1] & 1, in[s].h.v[1] & 2));
        continue;
      }
      if (lay == nullptr) {  // the operation failed: consume and discard
        MsgHeader h;
        EPCHECK(recvInto(r, &h, sizeof(h), epPhaseData, c));
        if (h.magic != kMsgMagic || h.epoch != cur_epoch_ || h.src != r)
          return fail(epInternalError, r, epPhaseData, "channel message out of sync");
        EPCHECK(skipIn(r, h.extra_bytes + h.data_bytes, epPhaseData, c));
        continue;
      }
      const int K = a->topk;
      const size_t xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
      const size_t srow = a->dtype == epFloat8E4M3 ? sizeof(float) * (a->hidden / EP_FP8_BLOCK) : 0;
      const int b = lay->chanRowBegin(s, c, C);
      const int n = lay->recv_chan_count[static_cast<size_t>(s) * C + c];
      const bool has_idx = in[s].h.v[1] & 1, has_w = in[s].h.v[1] & 2;
      if (!pass && rowsByRef(s)) {  // this rank's own rows: their token indices, then the rest as below
        EPCHECK(pullDispatchRows(a, in[s].h, s, c, b, n, has_idx, has_w));
      } else {
        EPCHECK(recvChannelHeader(r, c, n * (xrow + srow + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
        EPCHECK(recvInto(r, static_cast<uint8_t*>(a->recv_x) + b * xrow, n * xrow, epPhaseData, c));
        if (srow)
          EPCHECK(recvInto(r, reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow, n * srow, epPhaseData, c));
      }
      if (has_idx) {
        if (a->recv_topk_idx)
          EPCHECK(recvInto(r, a->recv_topk_idx + static_cast<size_t>(b) * K, sizeof(int64_t) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(r, sizeof(int64_t) * n * K, epPhaseData, c));
      }
      if (has_w) {
        if (a->recv_topk_weights)
          EPCHECK(recvInto(r, a->recv_topk_weights + static_cast<size_t>(b) * K, sizeof(float) * n * K, epPhaseData, c));
        else
          EPCHECK(skipIn(r, sizeof(float) * n * K, epPhaseData, c));
      }
    }
  return flushSends(epPhaseData, c);
}

epResult_t HostEngine::placeSelfForward(const epHtDispatchArgs_t* a, const epHtHandle* lay, int s, int c,
                                        bool has_idx, bool has_w) {
  const int C = nchan_, K = a->topk;
  const size_t xrow = static_cast<size_t>(a->hidden) * dtypeSize(a->dtype);
  const size_t srow = a->dtype == epFloat8E4M3 ? sizeof(float) * (a->hidden / EP_FP8_BLOCK) : 0;
  const SelfForward& f = fwd_self_[static_cast<size_t>(s) * C + c];
  const int b = lay->chanRowBegin(s, c, C);
  const size_t n = lay->recv_chan_count[static_cast<size_t>(s) * C + c];
  // The same checks as a message through the queue gets (recvChannelHeader: its size against the layout).
  if (!f.set || f.rows.size() != n || f.xrow != xrow || f.srow != srow || f.has_idx != has_idx ||
      f.has_w != has_w || (has_idx && f.K != static_cast<uint64_t>(K)))
    return fail(epInternalError, rank_, epPhaseData, "forwarded HT dispatch rows do not match the layout");
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x) + b * xrow;
  for (size_t j = 0; j < n; ++j) memcpy(rx + j * xrow, f.xs + f.rows[j] * xrow, xrow);
  if (srow) {
    uint8_t* rs = reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow;
    for (size_t j = 0; j < n; ++j) memcpy(rs + j * srow, f.ss + f.rows[j] * srow, srow);
  }
  if (n && has_idx && a->recv_topk_idx) memcpy(a->recv_topk_idx + static_cast<size_t>(b) * K, f.idx, n * K * 8);
  if (n && has_w && a->recv_topk_weights) memcpy(a->recv_topk_weights + static_cast<size_t>(b) * K, f.w, n * K * 4);
  return epSuccess;
}

epResult_t HostEngine::htCombineHier(const epHtCombineArgs_t* a, const epHtHandle* h, const std::vector<Incoming>& in,
                                     bool ok, bool st_ok, int c, std::atomic<bool>* forward_failed) {
  const int R = nranks_, C = nchan_;
  const int H = ok ? a->hidden : 0;
  const int dt = ok ? a->dtype : 0;
  const size_t row = ok ? static_cast<size_t>(H) * dtypeSize(a->dtype) : 0;
  const std::vector<int>& mine = host_ranks_[my_host_];
  ScratchArena& keep = chan_scratch_[c];  // partial rows, until pushed (flushSends below)
  keep.reset();
  std::vector<uint8_t> tmp(std::max<size_t>(row, static_cast<size_t>(H) * sizeof(float)));
  // The next `bytes` of q's channel-c message, read where they lie in the queue (a copy only where they wrap around
  // its end), then consumed.
  auto fromQueue = [&](int q, size_t bytes, auto&& use) -> epResult_t {
    EPCHECK(waitIn(q, bytes, epPhaseData, c));
    const uint8_t* src = in_[c][q].peek(bytes);
    if (src == nullptr) {
      in_[c][q].copyOut(tmp.data(), 0, bytes);
      src = tmp.data();
    }
    use(src);
    in_[c][q].release(bytes);
    return epSuccess;
  };
  // This rank's own rows (kMsgRowsInPlace): read in place in x, where `self` points, instead of from its queue.
  const uint8_t* self = nullptr;
  auto slab = [&](int p) {  // where this rank's channel-c rows for owner p start in x
    return static_cast<const uint8_t*>(a->x) + static_cast<size_t>(h->chanRowBegin(p, c, C)) * row;
  };
  auto accumulateFrom = [&](int q, float* acc) -> epResult_t {  // one row of q's channel-c message
    if (q == rank_) {
      accumulateRow(acc, self, H, dt);
      self += row;
      return epSuccess;
    }
    return fromQueue(q, row, [&](const uint8_t* src) { accumulateRow(acc, src, H, dt); });
  };

  // 1. Forward: this host's partial sums for the owners on other hosts this rank forwarded for.
  for (int s = 0; s < R; ++s) {
    if (!remote_[s] || !active(s) || forwarder(s, my_host_) != rank_) continue;
    const std::vector<uint64_t>* mk =
        ok && h->hier && h->fwd_mask.size() == static_cast<size_t>(R) * C ? &h->fwd_mask[static_cast<size_t>(s) * C + c]
                                                                          : nullptr;
    bool good = mk != nullptr;
    const size_t n = mk ? mk->size() : 0;
    std::vector<uint64_t> got(mine.size(), 0);  // the data bytes each rank of this host announced
    for (size_t qi = 0; qi < mine.size(); ++qi) {
      const int q = mine[qi];
      if (!active(q)) continue;
      if (in[q].h.status != epSuccess) {  // it rejected its arguments: it sent nothing
        good = false;
        continue;
      }
      MsgHeader m;
      EPCHECK(recvInto(q, &m, sizeof(m), epPhaseData, c));
      if (m.magic != kMsgMagic || m.epoch != cur_epoch_ || m.src != q || m.extra_bytes != 0 ||
          (q == rank_) != ((m.flags & kMsgRowsInPlace) != 0) || (q == rank_ && m.data_bytes != 0))
        return fail(epInternalError, q, epPhaseData, "HT combine message to reduce is out of sync");
      got[qi] = m.data_bytes;
      size_t want = 0;
      if (mk)
        for (uint64_t w : *mk) want += ((w >> qi) & 1) * row;
      // Its own rows are the ones its handle sent s (in place): as many as s's mask names on this rank.
      const size_t has = q == rank_ ? (ok ? h->recv_chan_count[static_cast<size_t>(s) * C + c] * row : 0) : m.data_bytes;
      if (has != want) good = false;
    }
    MsgHeader out = makeHeader(cur_op_, epSuccess, 0);
    if (good) {
      // A token that one rank of this host holds: its partial, 0 + x, is x exactly, so x goes as it is (row
      // dtype; the owner widens it, the same value). Otherwise the fp32 partial, never rounded to the row dtype.
      size_t bytes = 0;
      for (size_t i = 0; i < n; ++i) bytes += __builtin_popcountll((*mk)[i]) == 1 ? row : H * sizeof(float);
      uint8_t* const part_msg = keep.get(bytes);
      uint8_t* dst = part_msg;
      std::vector<float> acc(H);
      self = slab(s);
      for (size_t i = 0; i < n; ++i) {
        const uint64_t w = (*mk)[i];
        if (__builtin_popcountll(w) == 1) {
          const int q = mine[__builtin_ctzll(w)];
          if (q == rank_) {
            memcpy(dst, self, row);
            self += row;
          } else {
            EPCHECK(recvInto(q, dst, row, epPhaseData, c));
          }
          dst += row;
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);  // ranks ascending
        for (size_t qi = 0; qi < mine.size(); ++qi)
          if ((w >> qi) & 1) EPCHECK(accumulateFrom(mine[qi], acc.data()));
        memcpy(dst, acc.data(), H * sizeof(float));
        dst += H * sizeof(float);
      }
      out.v[0] = static_cast<int64_t>(n);
      post(s, out, nullptr, 0, {{part_msg, bytes}}, c);
    } else {
      for (size_t qi = 0; qi < mine.size(); ++qi)
        if (got[qi]) EPCHECK(skipIn(mine[qi], got[qi], epPhaseData, c));
      out.status = epInvalidUsage;
      out.v[0] = -1;
      post(s, out, nullptr, 0, {}, c);
      *forward_failed = true;
    }
  }

  // 2. This rank's own tokens: its host's ranks directly, every other host's partial from its forwarder.
  std::vector<int> fw(nhosts_, -1);
  for (int hh = 0; hh < nhosts_; ++hh)
    if (hh != my_host_) fw[hh] = forwarder(rank_, hh);
  if (!st_ok) {  // consume and discard
    std::vector<int> from;
    for (int q : mine)
      if (active(q) && in[q].h.status == epSuccess) from.push_back(q);
    for (int f : fw)
      if (f >= 0) from.push_back(f);
    for (int r : from) {
      MsgHeader m;
      EPCHECK(recvInto(r, &m, sizeof(m), epPhaseData, c));
      if (m.magic != kMsgMagic || m.epoch != cur_epoch_ || m.src != r)
        return fail(epInternalError, r, epPhaseData, "channel message out of sync");
      EPCHECK(skipIn(r, m.extra_bytes + m.data_bytes, epPhaseData, c));
    }
    return flushSends(epPhaseData, c);
  }
  const int T = a->num_tokens, tb = chanBegin(T, c), te = chanBegin(T, c + 1);
  const uint8_t* ir = h->in_rank.data();
  auto hostHas = [&](int t, int hh) {  // how many ranks of host hh hold token t
    int k = 0;
    for (int r : host_ranks_[hh]) k += ir[static_cast<size_t>(t) * R + r];
    return k;
  };
  for (int q : mine) {
    if (!active(q)) continue;
    int cnt = 0;
    for (int t = tb; t < te; ++t) cnt += ir[static_cast<size_t>(t) * R + q];
    if (q != rank_) {
      EPCHECK(recvChannelHeader(q, c, cnt * row));
      continue;
    }
    MsgHeader m;  // its own: in place, as many rows as its handle received from itself on channel c
    EPCHECK(recvInto(q, &m, sizeof(m), epPhaseData, c));
    if (m.magic != kMsgMagic || m.epoch != cur_epoch_ || m.src != q || m.extra_bytes != 0 || m.data_bytes != 0 ||
        !(m.flags & kMsgRowsInPlace) || h->recv_chan_count[static_cast<size_t>(q) * C + c] != cnt)
      return fail(epInternalError, q, epPhaseData, "channel message does not match its operation header");
  }
  epResult_t bad = epSuccess;
  std::vector<uint64_t> pbytes(nhosts_, 0);
  for (int hh = 0; hh < nhosts_; ++hh) {
    if (fw[hh] < 0) continue;
    size_t want = 0;  // one row in the row dtype where one rank holds the token, else an fp32 row
    for (int t = tb; t < te; ++t) {
      const int k = hostHas(t, hh);
      want += k == 0 ? 0 : k == 1 ? row : H * sizeof(float);
    }
    MsgHeader m;
    EPCHECK(recvInto(fw[hh], &m, sizeof(m), epPhaseData, c));
    if (m.magic != kMsgMagic || m.epoch != cur_epoch_ || m.src != fw[hh] || m.extra_bytes != 0)
      return fail(epInternalError, fw[hh], epPhaseData, "HT combine partial sum message is out of sync");
    pbytes[hh] = m.data_bytes;
    if (m.status != epSuccess || m.data_bytes != want)
      bad = fail(epRemoteError, fw[hh], epPhaseData,
                 "the forwarding rank of another host could not reduce its ranks' rows (its handle or arguments "
                 "do not match this combine)");
  }
  if (bad != epSuccess) {  // keep the rings aligned: discard what was announced
    for (int q : mine)
      if (active(q) && q != rank_)
        for (int t = tb; t < te; ++t)
          if (ir[static_cast<size_t>(t) * R + q]) EPCHECK(skipIn(q, row, epPhaseData, c));
    for (int hh = 0; hh < nhosts_; ++hh)
      if (fw[hh] >= 0) EPCHECK(skipIn(fw[hh], pbytes[hh], epPhaseData, c));
    EPCHECK(flushSends(epPhaseData, c));
    return bad;
  }
  std::vector<float> acc(H), part(H);
  const int part_step = static_cast<int>(std::max<size_t>(1, ring_bytes_ / 2 / sizeof(float)));
  uint8_t* out = static_cast<uint8_t*>(a->combined_x);
  self = slab(rank_);
  for (int t = tb; t < te; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int hh = 0; hh < nhosts_; ++hh) {
      if (!hostHas(t, hh)) continue;
      if (hh == my_host_) {
        std::fill(part.begin(), part.end(), 0.0f);
        for (int q : mine)
          if (ir[static_cast<size_t>(t) * R + q]) EPCHECK(accumulateFrom(q, part.data()));
      } else if (hostHas(t, hh) == 1) {  // the one row that host holds, widened: read in its queue
        std::fill(part.begin(), part.end(), 0.0f);
        EPCHECK(fromQueue(fw[hh], row, [&](const uint8_t* src) { accumulateRow(part.data(), src, H, dt); }));
      } else {  // that host's fp32 partial, added where it lies in the queue, in pieces of at most half a queue
        // (twice a row may be a whole queue, more than its sender ever gets credit for at once: net_bridge.cc)
        for (int j = 0; j < H; j += part_step) {
          const int n = std::min(part_step, H - j);
          EPCHECK(fromQueue(fw[hh], n * sizeof(float), [&](const uint8_t* src) {
            host::addRow(acc.data() + j, reinterpret_cast<const float*>(src), n);
          }));
        }
        continue;
      }
      host::addRow(acc.data(), part.data(), H);
    }
    host::storeRow(out + static_cast<size_t>(t) * row, acc.data(), H, dt);
  }
  return flushSends(epPhaseData, c);
}

epResult_t HostEngine::htCombineBuffer(void**, size_t*) {
  EP_FAIL(epNotSupported, "zero-copy HT combine buffers are a GPU engine feature (the host engine's combine "
                          "already reads x in place)");
}

}  // namespace epcomm
