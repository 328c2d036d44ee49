// Host engine: HT notify, dispatch and combine.
// Transport, waits and agreement checks are in host_engine.cc; the message protocol is in host_engine.h.
#include <sys/uio.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "engine/host/host_engine.h"
#include "engine/host/rows.h"
#include "engine/routing.h"
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
  const uint64_t sig = ok ? shapeSig({E, H, K, a->dtype}) : 0;
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
  // scale rows, topk_idx rows as local ids, topk_weights rows). With cross-memory attach the x and scale rows
  // stay here and the message carries their token indices instead: the receiver pulls them.
  std::vector<std::vector<int64_t>> idx_out(ok ? R * C : 0);
  std::vector<std::vector<float>> w_out(ok ? R * C : 0);
  std::vector<std::vector<int32_t>> tok_out(ok && cma_ ? R * C : 0);
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
    for (int c = 0; c < C; ++c) {
      const int tb = chanBegin(T, c), te = chanBegin(T, c + 1);
      std::vector<Seg> segs;
      const uint8_t* x = static_cast<const uint8_t*>(a->x);
      auto in = [&](int t) { return (*in_rank)[static_cast<size_t>(t) * R + p] != 0; };
      if (cma_) {
        auto& to = tok_out[static_cast<size_t>(p) * C + c];
        for (int t = tb; t < te; ++t)
          if (in(t)) to.push_back(t);
        segs.push_back({reinterpret_cast<const uint8_t*>(to.data()), to.size() * sizeof(int32_t)});
      } else {
        for (int t = tb; t < te; ++t)
          if (in(t)) segs.push_back({x + t * xrow, xrow});
      }
      if (fp8 && !cma_) {
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
    EPCHECK(drainPayloads(in));
    EPCHECK(drainChannels(in));
    if (cma_) EPCHECK(exchangeDone());
    if (ok && !cached) h->valid = false;
    return st;
  }

  // Data: each channel places its rows of every source contiguously at their final rows.
  uint8_t* rx = static_cast<uint8_t*>(a->recv_x);
  EPCHECK(runChannels([&](int c) -> epResult_t {
    for (int s = 0; s < R; ++s) {
      if (in[s].masked) continue;
      int b = lay->recv_prefix[s];
      for (int cc = 0; cc < c; ++cc) b += lay->recv_chan_count[static_cast<size_t>(s) * C + cc];
      const int n = lay->recv_chan_count[static_cast<size_t>(s) * C + c];
      const bool has_idx = in[s].h.v[1] & 1, has_w = in[s].h.v[1] & 2;
      if (cma_) {
        EPCHECK(recvChannelHeader(s, c, n * (sizeof(int32_t) + (has_idx ? K * 8 : 0) + (has_w ? K * 4 : 0))));
        std::vector<int32_t> tokens(n);
        EPCHECK(recvInto(s, tokens.data(), n * sizeof(int32_t), epPhaseData, c));
        EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(in[s].h.v[2]), xrow, rx + b * xrow));
        if (fp8)
          EPCHECK(pullRows(s, tokens, static_cast<uint64_t>(in[s].h.v[3]), srow,
                           reinterpret_cast<uint8_t*>(a->recv_x_scales) + b * srow));
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
  const uint64_t sig = ok ? shapeSig({H, a->dtype}) : 0;
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
    if (cma_) continue;
    for (int c = 0; c < C; ++c) {
      const int n = h->recv_chan_count[static_cast<size_t>(p) * C + c];
      post(p, makeHeader(cur_op_, local, sig), nullptr, 0, {{x, n * row}}, c);
      x += n * row;
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
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    if (cma_) EPCHECK(exchangeDone());
    else EPCHECK(drainChannels(in));
    return st;
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
  std::vector<uint8_t> stage(static_cast<size_t>(R) * block * row);
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
        uint8_t* dst = stage.data() + static_cast<size_t>(r) * block * row;
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

}  // namespace epcomm
