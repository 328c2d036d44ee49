// Host engine: alltoallv with host counts and with counts in engine memory.
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
#include "engine/validate.h"

namespace epcomm {
// ------------------------------------------------------------------------------------------------------
// alltoallv and barrier
// ------------------------------------------------------------------------------------------------------

// Two rounds, so that counts are compared before any data moves: first every rank sends every peer its whole
// count table (send_counts and recv_counts), so that every rank checks every pair and all decide alike (the
// two ranks of a disagreeing pair return epInvalidUsage, the others epRemoteError); then the data.
epResult_t HostEngine::alltoallv(const void* sendbuf, const size_t* send_counts, const size_t* send_displs,
                                 void* recvbuf, const size_t* recv_counts, const size_t* recv_displs, size_t es,
                                 epResult_t local, epStream_t) {
  cur_op_ = epOpAlltoallv;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_;
  const bool ok = local == epSuccess;
  const uint64_t sig = shapeSig({static_cast<int64_t>(es)});
  std::vector<int64_t> table;  // [send_counts (R), recv_counts (R)]
  if (ok)
    for (const size_t* c : {send_counts, recv_counts})
      for (int p = 0; p < R; ++p) table.push_back(static_cast<int64_t>(c[p]));
  for (int p = 0; p < R; ++p)
    if (active(p)) post(p, makeHeader(cur_op_, local, sig), table.data(), sizeof(int64_t) * table.size(), {});
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (!in[s].masked && in[s].extra.size() != sizeof(int64_t) * 2 * R)
      st = fail(epInternalError, s, epPhaseHeader, "alltoallv count table does not match its header");
  if (st == epSuccess) {
    auto sends = [&](int a, int b) { return reinterpret_cast<const int64_t*>(in[a].extra.data())[b]; };
    auto expects = [&](int b, int a) { return reinterpret_cast<const int64_t*>(in[b].extra.data())[R + a]; };
    int bad_a = -1, bad_b = -1;  // the first disagreeing pair, preferring one this rank is in
    bool mine = false;
    for (int a = 0; a < R; ++a)
      for (int b = 0; b < R; ++b) {
        if (!active(a) || !active(b)) continue;  // pairs with a masked rank move nothing
        const bool m = a == rank_ || b == rank_;
        if (sends(a, b) != expects(b, a) && (bad_a < 0 || (m && !mine))) bad_a = a, bad_b = b, mine = m;
      }
    if (bad_a >= 0)
      st = EP_ERROR(mine ? epInvalidUsage : epRemoteError,
                    "alltoallv: rank %d sends %lld elements to rank %d (send_counts[%d]) but rank %d expects %lld "
                    "(recv_counts[%d]); no data moved",
                    bad_a, static_cast<long long>(sends(bad_a, bad_b)), bad_b, bad_b, bad_b,
                    static_cast<long long>(expects(bad_b, bad_a)), bad_a);
  }
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseHeader));
    return st;
  }
  for (int p = 0; p < R; ++p) {
    if (!active(p)) {
      drop_a2a_[p] += static_cast<int64_t>(send_counts[p]);
      continue;
    }
    post(p, makeHeader(cur_op_, local, sig), nullptr, 0,
         {{static_cast<const uint8_t*>(sendbuf) + send_displs[p] * es, send_counts[p] * es}});
  }
  pushSends();
  for (int s = 0; s < R; ++s) {
    if (!active(s)) continue;  // its receive range stays untouched
    EPCHECK(recvChannelHeader(s, 0, recv_counts[s] * es));
    EPCHECK(recvInto(s, static_cast<uint8_t*>(recvbuf) + recv_displs[s] * es, recv_counts[s] * es, epPhaseData));
  }
  return flushSends(epPhaseData);
}

epResult_t HostEngine::alltoallvDevice(const void* sendbuf, const int64_t* send_counts, void* recvbuf,
                                       size_t recv_capacity, int64_t* recv_counts, int64_t* num_dropped, size_t es,
                                       epResult_t local, epStream_t) {
  cur_op_ = epOpAlltoallvDevice;
  cur_epoch_ = ++send_epoch_;
  const int R = nranks_;
  const bool ok = local == epSuccess;
  const uint64_t sig = shapeSig({static_cast<int64_t>(es)});
  size_t off = 0;
  for (int p = 0; p < R; ++p) {
    if (!active(p)) {  // its rows are skipped in the packed send buffer
      if (ok) off += send_counts[p];
      continue;
    }
    MsgHeader hdr = makeHeader(cur_op_, local, sig);
    if (!ok) {
      post(p, hdr, nullptr, 0, {});
      continue;
    }
    hdr.v[0] = send_counts[p];
    post(p, hdr, nullptr, 0, {{static_cast<const uint8_t*>(sendbuf) + off * es, send_counts[p] * es}});
    off += send_counts[p];
  }
  pushSends();
  std::vector<Incoming> in;
  EPCHECK(recvHeaders(in));
  epResult_t st = statusFromPeers(in, local, sig);
  for (int s = 0; s < R && st == epSuccess; ++s)
    if (!in[s].masked && (in[s].h.v[0] < 0 || in[s].h.data_bytes != static_cast<uint64_t>(in[s].h.v[0]) * es))
      st = fail(epInternalError, s, epPhaseHeader, "alltoallv message sizes do not match its header");
  if (st != epSuccess) {
    EPCHECK(drainPayloads(in));
    EPCHECK(flushSends(epPhaseData));
    return st;
  }
  for (int p = 0; p < R; ++p)
    if (!active(p)) drop_a2a_[p] += send_counts[p];
  size_t pos = 0;
  int64_t dropped = 0;
  for (int s = 0; s < R; ++s) {
    if (in[s].masked) {
      recv_counts[s] = 0;
      continue;
    }
    size_t n = static_cast<size_t>(in[s].h.v[0]);
    size_t fit = pos < recv_capacity ? std::min(n, recv_capacity - pos) : 0;
    EPCHECK(recvInto(s, static_cast<uint8_t*>(recvbuf) + pos * es, fit * es, epPhaseData));
    EPCHECK(skipIn(s, (n - fit) * es, epPhaseData));
    pos += fit;
    dropped += static_cast<int64_t>(n - fit);
    recv_counts[s] = static_cast<int64_t>(n);
  }
  EPCHECK(flushSends(epPhaseData));
  if (num_dropped) *num_dropped = dropped;
  if (dropped > 0)
    return EP_ERROR(epCapacityExceeded,
                    "alltoallv (device counts) received %lld elements more than recv_capacity = %zu; they were "
                    "dropped and counted in num_dropped",
                    static_cast<long long>(dropped), recv_capacity);
  return epSuccess;
}

}  // namespace epcomm
