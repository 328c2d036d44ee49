// The GPU engine's proxy (proxy.h): outbound rings into the net bridge, inbound records into this rank's buffers.
#include "engine/gpu/proxy.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "common/checks.h"
#include "common/log.h"
#include "common/param.h"
#include "common/stream_copy.h"
#include "common/thread_name.h"
#include "common/time.h"

namespace epcomm {

// Bytes of each outbound ring (one per rank of another host, pinned host memory) and of each inbox the bridge
// fills (one per such rank). Both hold several of the largest records (an HT queue slot, an LL slot's row). 0 (the
// default): gpuProxyDefaultRingBytes of the communicator's size.
EP_PARAM(GpuProxyRingBytes, "GPU_PROXY_RING_BYTES", 0);

size_t gpuProxyDefaultRingBytes(int nranks) {
  size_t ring = size_t{8} << 20;
  while (ring > (size_t{1} << 20) && ring * static_cast<size_t>(std::max(nranks, 1)) > (size_t{512} << 20)) ring /= 2;
  return ring;
}
// 1: the proxy prints where every stream stands once a second, and where its thread's time went (diagnostics).
EP_PARAM(GpuProxyTrace, "GPU_PROXY_TRACE", 0);
// Largest message the proxy's net bridge sends a run of records in (at most an eighth of the ring). Above the socket
// backend's inline size (64 KiB) its helper threads move it over several data sockets at once, which the proxy's
// bulk streams want; below, the proxy's bridge thread does, on one socket, with a syscall or more per message.
EP_PARAM(GpuProxyMsgBytes, "GPU_PROXY_MSG_BYTES", 1 << 20);
// 1: DATA payloads go into the far copies with streaming stores (common/stream_copy.h: no read of the destination,
// the caches left alone); 0: memcpy.
EP_PARAM(GpuProxyStreamStores, "GPU_PROXY_STREAM_STORES", 1);
// Who makes the net bridge's calls (sends, receives, credits): 0, the proxy's own thread, between its turns over the
// rings and inboxes (one polling thread per rank); 1, a progress thread of the bridge's; -1 (the default), the
// proxy's thread where this rank reaches at most kDriveMaxPeers ranks of other hosts, else the bridge's.
EP_PARAM(GpuProxyNetThread, "GPU_PROXY_NET_THREAD", -1);
// N > 0: in every run of N bytes or more that holds DATA payloads of kMinPlacedBytes or more, the bridge sends the run
// as one message that the receiver's net transport scatters as it lands, those payloads straight into the far copy
// (NetBridge placement; the socket backend), instead of into the inbox for a copy by the receiver's proxy; 0: every
// record through the inbox. Only what this rank sends: it takes placed payloads either way. On by default from 4 KiB
// runs since the first GPU runs (H100, 2 virtual hosts, -n 4, bench/results/h100-s33.log): proxy_bench at 4 ranks
// 15.2 -> 19.7 GB/s (2 ranks: no change), the engine's HT dispatch 14.1 -> 16.9 and LL dispatch / combine 7.7 / 10.0
// -> 9.0 / 11.6 GB/s, one round each; the cross-host GPU suites passed with it (HT 8, LL 14 tests at R = 4).
EP_PARAM(GpuProxyPlace, "GPU_PROXY_PLACE", 4096);

namespace {

// Measured with proxy_bench on a 16-core H200 host (bench/results/cpu-proxy-s19.log), the proxy's thread making the
// bridge's calls against a bridge thread: 1 rank of another host, +21% GB/s and -28% CPU time per byte; 3, +6% and
// -10%; 7, -18% and +12% (why is not measured yet; that run had no per-turn budget in loop(), see there).
constexpr int kDriveMaxPeers = 3;
constexpr int kInPerTurn = 1024;   // records stored from one inbox per turn of the loop
constexpr int kOutPerTurn = 1024;  // records moved from one ring per turn of the loop
// Smallest DATA payload placed: shorter ones stay in the inbox, where two pieces of the scattered receive would cost
// about what copying them does.
constexpr uint32_t kMinPlacedBytes = 2048;
constexpr int kPlaceKeyShift = 56;  // a placement key: buffer << kPlaceKeyShift | offset
// The key a record's payload is placed by (nextPayload names it, storeIn matches the bridge's receipt against it).
uint64_t placeKey(const GpuRemoteRecord& h) { return static_cast<uint64_t>(h.buf) << kPlaceKeyShift | h.off; }
std::mutex g_why_mutex;            // guards GpuProxy::why_ (diagnostics only)

// A record's ring bytes from its header (0 for a type no kernel writes).
uint64_t recordSize(const GpuRemoteRecord& h) {
  switch (h.type) {
    case kRemoteSkip: return h.len;
    case kRemoteData:
    case kRemotePlaced: return remoteRecordBytes(h.len);
    case kRemoteFlag: return remoteRecordBytes(8);
    default: return 0;
  }
}

}  // namespace

GpuProxy::GpuProxy(int rank, int nranks, std::vector<uint8_t> remote, std::unique_ptr<ProxyDevice> device)
    : rank_(rank), nranks_(nranks), remote_(std::move(remote)), dev_(std::move(device)) {
  out_.resize(nranks_);
  occ_.resize(nranks_);
  in_bad_ = std::make_unique<std::atomic<bool>[]>(nranks_);
  for (int r = 0; r < nranks_; ++r) in_bad_[r].store(false, std::memory_order_relaxed);
  why_.resize(nranks_);
}

GpuProxy::~GpuProxy() {
  stop(false, nullptr, 0);
  if (!dev_) return;
  for (Out& o : out_)
    if (o.ring) dev_->freeMapped(o.ring);
  if (consumed_) dev_->freeMapped(consumed_);
  if (reserved_dev_) dev_->freeDevice(reserved_dev_);
  if (table_dev_) dev_->freeDevice(table_dev_);
  for (uint8_t* f : far_host_)
    if (f) dev_->freeMapped(f);
}

epResult_t GpuProxy::start(Bootstrap* bs, const size_t bytes[kRemoteNumBuffers], int timeout_ms) {
  EP_REQUIRE(dev_ != nullptr, epNotSupported, "GPU proxy: this build has no CUDA device support");
  for (int b = 0; b < static_cast<int>(kRemoteNumBuffers); ++b) buf_bytes_[b] = bytes[b];
  const int64_t ring_set = epParamGpuProxyRingBytes();
  ring_bytes_ = (ring_set > 0 ? static_cast<size_t>(std::max<int64_t>(ring_set, 1 << 20))
                              : gpuProxyDefaultRingBytes(nranks_)) &
                ~size_t{kRemoteRecordAlign - 1};
  inbox_bytes_ = ring_bytes_;
  stream_stores_ = epParamGpuProxyStreamStores() != 0;
  place_min_run_ = static_cast<size_t>(std::max<int64_t>(epParamGpuProxyPlace(), 0));
  GpuRemote table{};
  void* dev = nullptr;
  EPCHECK(dev_->allocMapped(sizeof(uint64_t) * nranks_, reinterpret_cast<void**>(&consumed_), &dev));
  uint64_t* consumed_dev = static_cast<uint64_t*>(dev);
  // [0, R): the kernels' reservations; [R, 2R): the largest consumed count they read (GpuRemoteRing::seen).
  EPCHECK(dev_->allocDevice(sizeof(unsigned long long) * 2 * nranks_, reinterpret_cast<void**>(&reserved_dev_)));
  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    // Zeroed: no stamp matches a position before the kernels write it.
    EPCHECK(dev_->allocMapped(ring_bytes_, reinterpret_cast<void**>(&out_[r].ring), &dev));
    table.ring[r] = GpuRemoteRing{static_cast<uint8_t*>(dev), reserved_dev_ + r, consumed_dev + r, ring_bytes_,
                                  reserved_dev_ + nranks_ + r};
  }
  // The far copies: as large as the buffers (any offset may be written), zeroed like them.
  for (int b = 0; b < static_cast<int>(kRemoteNumBuffers); ++b) {
    if (buf_bytes_[b] == 0) continue;
    const epResult_t res = dev_->allocMapped(buf_bytes_[b], reinterpret_cast<void**>(&far_host_[b]), &dev);
    if (res != epSuccess)
      EP_FAIL(res, "GPU proxy: rank %d cannot allocate the %zu-byte far copy of its %s buffer in pinned host memory "
              "(what ranks of other hosts write lands there; smaller buffers: config.ll_max_tokens_per_rank, "
              "ll_num_experts and ll_max_hidden for LL, ht_max_tokens_per_rank and EPCOMM_GPU_QUEUE_ROWS for HT)",
              rank_, buf_bytes_[b], b == kRemoteLlBuffer ? "LL" : "HT");
    far_dev_[b] = static_cast<uint8_t*>(dev);
  }
  EPCHECK(dev_->allocDevice(sizeof(GpuRemote), reinterpret_cast<void**>(&table_dev_)));
  EPCHECK(dev_->upload(table_dev_, &table, sizeof(table)));

  // The bridge's inboxes: memory of this process only, not /dev/shm. A ring per rank of the communicator is 8 MiB x R,
  // past a container's default 64 MiB /dev/shm from R = 8: there the socket backend's receives into the last rings
  // failed with "Bad address" (proxy_bench --ranks 8 under a 64 MiB /dev/shm, s36).
  EPCHECK(inbox_.createPrivate(rank_, nranks_, 1, inbox_bytes_));
  bridge_ = std::make_unique<NetBridge>(rank_, nranks_, 1, ring_bytes_,  // the outbox is the ring
                                        static_cast<size_t>(std::max<int64_t>(epParamGpuProxyMsgBytes(), 4096)),
                                        remote_, &inbox_);
  for (int r = 0; r < nranks_; ++r)
    if (remote_[r]) bridge_->useOutboxMemory(0, r, out_[r].ring);  // sent from where the kernels wrote it
  bridge_->usePlacement(this);  // payloads into the far copies
  if (epParamGpuProxyTrace() != 0) bridge_->enableCallTiming();
  const int64_t net_thread = epParamGpuProxyNetThread();
  const int npeers = static_cast<int>(std::count(remote_.begin(), remote_.end(), 1));
  drives_bridge_ = net_thread == 0 || (net_thread < 0 && npeers <= kDriveMaxPeers);
  // Driven: no progress thread of the bridge's own, this proxy's thread makes its net calls (loop(), stop()).
  EPCHECK(bridge_->connect(bs, timeout_ms,
                           drives_bridge_ ? NetBridge::Progress::kCaller : NetBridge::Progress::kOwnThread));
  thread_ = std::thread([this] { loop(); });
  EP_INFO(kSubsysInit, "GPU proxy: rank %d reaches %d ranks of other hosts over net/%s, %zu-byte rings, net calls by "
          "%s", rank_, npeers, bridge_->backendName(), ring_bytes_,
          drives_bridge_ ? "the proxy's thread" : "the bridge's thread");
  return epSuccess;
}

void GpuProxy::noteFailure(int r, const char* what) {
  std::lock_guard<std::mutex> l(g_why_mutex);
  if (why_[r].empty()) why_[r] = what;
}

void GpuProxy::refuse(int q, const char* what) {
  noteFailure(q, what);
  in_bad_[q].store(true, std::memory_order_relaxed);
  EP_WARN("GPU proxy: rank %d drops everything further from rank %d: %s", rank_, q, what);
}

std::string GpuProxy::describe(int r) {
  if (r < 0 || r >= nranks_ || !remote_[r] || !bridge_) return "not a rank of another host";
  const RingCtl* in = inbox_.ringCtl(r, 0);
  char b[200];
  snprintf(b, sizeof(b), "proxy: ring toward it taken %llu freed %llu, inbox from it stored %llu of %llu; bridge: ",
           static_cast<unsigned long long>(__atomic_load_n(&out_[r].pos, __ATOMIC_ACQUIRE)),
           static_cast<unsigned long long>(__atomic_load_n(&consumed_[r], __ATOMIC_ACQUIRE)),
           static_cast<unsigned long long>(in->head.load()), static_cast<unsigned long long>(in->tail.load()));
  return b + bridge_->describe(r);
}

bool GpuProxy::failed(int r, std::string* why) const {
  std::string w;
  if (bridge_ && bridge_->dead(r, &w)) {
    if (why) *why = w;
    return true;
  }
  std::lock_guard<std::mutex> l(g_why_mutex);
  if (why_[r].empty()) return false;
  if (why) *why = why_[r];
  return true;
}

// Takes the whole records of ring r, in order, into the bridge's outbox toward r (the ring itself: its tail moves
// over them as far as r's credit allows), and gives the kernels back what the bridge has sent. Toward a dead rank
// records are dropped instead, once the bridge has stopped sending (the kernels may then write over bytes it would
// have sent).
bool GpuProxy::pumpOut(int r) {
  Out& o = out_[r];
  bool moved = false;
  if (o.broken) return false;
  if (!o.dropping && bridge_->dead(r)) {
    bridge_->stopSending(r);
    o.dropping = true;
  }
  uint64_t pos = o.pos, records = 0;
  for (int n = 0; n < kOutPerTurn; ++n) {
    const size_t at = pos % ring_bytes_;
    GpuRemoteRecord* h = reinterpret_cast<GpuRemoteRecord*>(o.ring + at);
    if (__atomic_load_n(&h->stamp, __ATOMIC_ACQUIRE) != pos + 1) break;
    const uint64_t size = recordSize(*h);
    if (size < sizeof(GpuRemoteRecord) || size % kRemoteRecordAlign != 0 || size > ring_bytes_ - at) {
      // This rank's own kernels wrote it: a bug. Nothing after it can be trusted; the peer times out.
      EP_WARN("GPU proxy: rank %d's ring toward rank %d holds a malformed record (type %u, %u bytes) at %llu",
              rank_, r, h->type, h->len, static_cast<unsigned long long>(pos));
      o.broken = true;
      noteFailure(r, "this rank's ring toward it held a malformed record");
      break;
    }
    if (h->type != kRemoteSkip && !o.dropping) records += size;
    pos += size;
    ++recs_out_;
  }
  if (records) forwarded_.fetch_add(records, std::memory_order_relaxed);
  if (pos != o.pos) {
    __atomic_store_n(&o.pos, pos, __ATOMIC_RELEASE);
    moved = true;
  }
  // The outbox tail: what was taken, within the peer's credit (the kernels may be up to a ring ahead of it, since
  // their room is what the bridge has sent). SKIPs go too: the inbox mirrors the ring.
  RingCtl* ctl = bridge_->outCtl(0, r);
  if (!o.dropping) {
    const uint64_t tail = std::min<uint64_t>(pos, ctl->head.load(std::memory_order_acquire) + ring_bytes_);
    if (tail != ctl->tail.load(std::memory_order_relaxed)) {
      ctl->tail.store(tail, std::memory_order_release);
      moved = true;
    }
  }
  const uint64_t free_to = o.dropping ? (bridge_->sendingStopped(r) ? pos : consumed_[r]) : bridge_->outRead(0, r);
  if (free_to != consumed_[r]) {
    __atomic_store_n(&consumed_[r], free_to, __ATOMIC_RELEASE);
    moved = true;
  }
  return moved;
}

// The bridge framing the ring toward `peer` asks for the next payload to place within [from, to): the records from
// o.scan on (whole records the proxy took, checked by pumpOut, not yet framed: the kernels leave them alone until
// `consumed` passes them), the first DATA with kMinPlacedBytes or more whose record lies within [from, to). Its
// header becomes PLACED before it goes out, so that the receiver's proxy does not copy the inbox bytes the payload
// never wrote.
bool GpuProxy::nextPayload(int peer, uint64_t from, uint64_t to, uint64_t* at, uint32_t* len, uint64_t* key) {
  if (place_min_run_ == 0) return false;
  Out& o = out_[peer];
  while (o.scan < to) {
    GpuRemoteRecord* h = reinterpret_cast<GpuRemoteRecord*>(o.ring + o.scan % ring_bytes_);
    const uint64_t size = recordSize(*h), rec = o.scan;
    if (size == 0) return false;  // (pumpOut took no such record)
    o.scan += size;
    // A record that ends past `to` goes framed (the run ends inside it).
    // (Only a record the key can name: pumpOut checked its size, not its buffer and offset, which the receiver
    // checks. One it cannot name goes through the inbox, where the receiver refuses it in order.)
    if (o.scan <= to && rec >= from && h->type == kRemoteData && h->len >= kMinPlacedBytes &&
        h->buf < kRemoteNumBuffers && (h->off >> kPlaceKeyShift) == 0) {
      h->type = kRemotePlaced;
      *at = rec + sizeof(GpuRemoteRecord);
      *len = h->len;
      *key = placeKey(*h);
      return true;
    }
  }
  return false;
}

// Everything toward `peer` before `to` is framed: o.scan moves past the records that begin before it, while their
// headers are still unsent (so not written over: `consumed` stays at or below what the bridge sent).
void GpuProxy::framed(int peer, uint64_t to) {
  Out& o = out_[peer];
  while (o.scan < to) {
    const uint64_t size = recordSize(*reinterpret_cast<const GpuRemoteRecord*>(o.ring + o.scan % ring_bytes_));
    if (size == 0) return;  // (pumpOut took no such record)
    o.scan += size;
  }
}

// Where a placed payload from `peer` lands: the far copy of its buffer, at its offset (checked, R5).
// Nothing more once the stream from `peer` is refused (see proxy.h: what is placed ahead of the checks).
uint8_t* GpuProxy::place(int peer, uint64_t key, uint32_t len) {
  const uint64_t b = key >> kPlaceKeyShift, off = key & ((uint64_t{1} << kPlaceKeyShift) - 1);
  if (in_bad_[peer].load(std::memory_order_relaxed) || b >= kRemoteNumBuffers || far_host_[b] == nullptr ||
      off > buf_bytes_[b] || len > buf_bytes_[b] - off)
    return nullptr;
  placed_.fetch_add(len, std::memory_order_relaxed);
  return far_host_[b] + off;
}

// Whole records of inbox q, checked, stored into the far copies in order (DATA: the bytes; FLAG: a release store,
// after everything before it), then released from the inbox. Stops once it has parsed *budget bytes (at least one
// record), and takes what it parsed off *budget.
bool GpuProxy::storeIn(int q, size_t* budget) {
  RingEnd inbox = inEnd(q);
  const size_t avail = inbox.available();
  if (in_bad_[q].load(std::memory_order_relaxed)) {  // keep the bridge flowing, store nothing
    if (avail > 0) inbox.release(avail);
    return false;
  }
  const size_t max_payload = inbox_bytes_ / 4;
  bool streamed = false;  // a streaming copy not yet fenced
  size_t parsed = 0;
  for (int n = 0; n < kInPerTurn && parsed < *budget && avail - parsed >= sizeof(GpuRemoteRecord); ++n) {
    GpuRemoteRecord h;
    inbox.copyOut(&h, parsed, sizeof(h));
    // Everything a peer sent is checked before use (R5).
    const char* bad = nullptr;
    if (h.type == kRemoteSkip) {  // the rest of a lap of the sender's ring (the inbox mirrors it)
      if (h.len < sizeof(h) || h.len % kRemoteRecordAlign != 0 || h.len > remoteRecordBytes(max_payload)) {
        refuse(q, "a SKIP record of a size no ring holds");
        break;
      }
      if (avail - parsed < h.len) break;
      parsed += h.len;
      continue;
    }
    const uint64_t len = h.type == kRemoteFlag ? 8 : h.len;
    if (h.type != kRemoteData && h.type != kRemotePlaced && h.type != kRemoteFlag) bad = "a record of an unknown type";
    else if (h.buf >= kRemoteNumBuffers || far_host_[h.buf] == nullptr) bad = "a record for a buffer this rank lacks";
    else if ((h.type == kRemoteFlag && (h.len != 8 || h.off % 8 != 0)) || len > max_payload ||
             h.off > buf_bytes_[h.buf] || len > buf_bytes_[h.buf] - h.off)
      bad = "a record past the end of its buffer, misaligned, or larger than the rings allow";
    if (bad != nullptr) {
      refuse(q, bad);
      break;
    }
    const uint64_t size = remoteRecordBytes(len);
    if (avail - parsed < size) break;  // the rest is still on its way
    if (h.type == kRemotePlaced) {  // the bridge's receipt where its payload would stand: it was placed, as said
      NetBridge::Placement::Receipt rc{};
      if (len >= sizeof(rc)) inbox.copyOut(&rc, parsed + sizeof(h), sizeof(rc));
      if (rc.magic != NetBridge::Placement::Receipt::kMagic || rc.len != len ||
          rc.key != placeKey(h)) {
        refuse(q, "a PLACED record whose payload was not placed as it says");
        break;
      }
    }
    uint8_t* at = far_host_[h.buf] + h.off;
    if (h.type == kRemoteFlag) {
      uint64_t v;
      inbox.copyOut(&v, parsed + sizeof(h), 8);
      if (streamed) streamFence();  // the bytes before the flag first
      streamed = false;
      __atomic_store_n(reinterpret_cast<uint64_t*>(at), v, __ATOMIC_RELEASE);
    } else if (len > 0 && h.type == kRemoteData) {  // (PLACED: the net transport stored it there already)
      inbox.copyOut(at, parsed + sizeof(h), len, stream_stores_ ? streamCopy : memcpy);
      streamed |= stream_stores_;
    }
    parsed += size;
    ++recs_in_;
  }
  if (streamed) streamFence();  // nothing stored stays unordered past this turn
  *budget -= std::min(parsed, *budget);
  if (parsed > 0) inbox.release(parsed);
  return parsed > 0;
}

// Once a turn while tracing: how full each outbox and inbox is (trace() prints the means).
void GpuProxy::sampleOccupancy() {
  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    const size_t free = bridge_->outEnd(0, r).freeBytes();
    Occupancy& o = occ_[r];
    ++o.turns;
    o.near_full += free < ring_bytes_ / 8;
    o.out_used += static_cast<double>(ring_bytes_ - free);
    o.in_avail += static_cast<double>(inEnd(r).available());
  }
}

// One line per remote rank: the ring (taken, the stamp and type at that position), the outbox toward it and the
// inbox from it, what the proxy moved so far, and the occupancy since the last line.
void GpuProxy::trace() {
  for (int r = 0; r < nranks_; ++r) {
    if (!remote_[r]) continue;
    const Out& o = out_[r];
    const GpuRemoteRecord* h = reinterpret_cast<const GpuRemoteRecord*>(o.ring + o.pos % ring_bytes_);
    RingEnd ob = bridge_->outEnd(0, r);
    RingEnd ib = inEnd(r);
    // Over the turns since the last line: near full most of the time, the credit loop (ring size over its round
    // trip) bounds the stream toward r; a large inbox backlog, this thread's stores do.
    Occupancy& oc = occ_[r];
    const double turns = static_cast<double>(std::max<uint64_t>(oc.turns, 1));
    fprintf(stderr, "epcomm proxy rank %d -> %d: ring at %llu (stamp there %llu, type %u%s), outbox %zu bytes free; "
            "inbox from %d: %zu available%s; records out %llu in %llu; over %llu turns: outbox in use %.2f MiB mean "
            "(of %.2f), within an eighth of full %.0f%% of them, inbox backlog %.1f KiB mean\n", rank_, r,
            static_cast<unsigned long long>(o.pos),
            static_cast<unsigned long long>(__atomic_load_n(&h->stamp, __ATOMIC_ACQUIRE)),
            h->type, o.broken ? ", broken" : "", ob.freeBytes(), r, ib.available(),
            in_bad_[r].load(std::memory_order_relaxed) ? ", refused" : "",
            static_cast<unsigned long long>(recs_out_), static_cast<unsigned long long>(recs_in_),
            static_cast<unsigned long long>(oc.turns), oc.out_used / turns / 1048576.0, ring_bytes_ / 1048576.0,
            100.0 * oc.near_full / turns, oc.in_avail / turns / 1024.0);
    oc = Occupancy{};
  }
  // The share of the last period this thread spent in turns that moved something, by part: near 100% in all, the
  // thread is what limits the streams.
  const int64_t now = nowNs(), span = std::max<int64_t>(now - busy_since_, 1);
  fprintf(stderr, "epcomm proxy rank %d: busy %.0f%% of %.2f s: rings %.0f%%, net calls %.0f%%, inboxes %.0f%%\n",
          rank_, 100.0 * (busy_ns_[0] + busy_ns_[1] + busy_ns_[2]) / span, span / 1e9, 100.0 * busy_ns_[0] / span,
          100.0 * busy_ns_[1] / span, 100.0 * busy_ns_[2] / span);
  busy_ns_[0] = busy_ns_[1] = busy_ns_[2] = 0;
  busy_since_ = now;
  // How this rank's records went out since the start: message counts and mean sizes by kind, and how many were no
  // larger than a frame (those the socket backend moves on the control stream, on this thread).
  const NetBridge::SendStats st = bridge_->sendStats();
  static const char* const kKind[NetBridge::kSendKinds] = {"frames", "next", "placed"};
  std::string line;
  char part[160];
  for (int k = 0; k < NetBridge::kSendKinds; ++k) {
    snprintf(part, sizeof(part), "%s %s %llu (mean %.1f KiB; %llu of at most 64 KiB, %.0f%% of the bytes)",
             k ? "," : "", kKind[k], static_cast<unsigned long long>(st.msgs[k]),
             st.msgs[k] ? st.bytes[k] / 1024.0 / st.msgs[k] : 0.0, static_cast<unsigned long long>(st.small[k]),
             st.bytes[k] ? 100.0 * st.small_bytes[k] / st.bytes[k] : 0.0);
    line += part;
  }
  fprintf(stderr, "epcomm proxy rank %d sent:%s\n", rank_, line.c_str());
  // The backend's calls since the last line: how many, and the mean time of each.
  const NetBridge::CallStats cs = bridge_->callStats();
  static const char* const kCall[NetBridge::kNetCalls] = {"isend", "test send", "irecv", "test recv", "poll"};
  line.clear();
  for (int k = 0; k < NetBridge::kNetCalls; ++k) {
    const uint64_t calls = cs.calls[k] - calls_seen_.calls[k];
    const int64_t ns = cs.ns[k] - calls_seen_.ns[k];
    snprintf(part, sizeof(part), "%s %s %llu x %.2f us", k ? "," : "", kCall[k], static_cast<unsigned long long>(calls),
             calls ? ns / 1e3 / calls : 0.0);
    line += part;
  }
  calls_seen_ = cs;
  fprintf(stderr, "epcomm proxy rank %d net calls:%s\n", rank_, line.c_str());
  // Payload messages in flight since the last line: mean time from posting to completion, and how many were in
  // flight at once on average (their summed time over the period).
  const NetBridge::FlightStats fs = bridge_->flightStats();
  line.clear();
  for (int d = 0; d < 2; ++d) {
    const uint64_t n = fs.done[d] - flights_seen_.done[d];
    const int64_t ns = fs.ns[d] - flights_seen_.ns[d];
    snprintf(part, sizeof(part), "%s %s %llu x %.1f us (%.1f at once)", d ? "," : "", d ? "receives" : "sends",
             static_cast<unsigned long long>(n), n ? ns / 1e3 / n : 0.0, static_cast<double>(ns) / span);
    line += part;
  }
  flights_seen_ = fs;
  fprintf(stderr, "epcomm proxy rank %d payloads in flight:%s\n", rank_, line.c_str());
}

bool GpuProxy::storeInboxes(size_t budget) {
  bool moved = false;
  for (int i = 0; i < nranks_ && budget > 0; ++i) {
    const int q = (in_first_ + i) % nranks_;
    if (remote_[q]) moved |= storeIn(q, &budget);
  }
  in_first_ = (in_first_ + 1) % nranks_;
  return moved;
}

void GpuProxy::loop() {
  nameThisThread("epcomm-proxy");
  const bool tracing = epParamGpuProxyTrace() != 0;
  int64_t next_trace = nowNs();
  busy_since_ = next_trace;
  Backoff backoff;
  for (;;) {
    if (tracing && nowNs() >= next_trace) {
      trace();
      next_trace = nowNs() + 1000000000LL;
    }
    const bool stopping = stop_.load(std::memory_order_acquire);
    bool moved = false;
    const int64_t t0 = tracing ? nowNs() : 0;
    for (int r = 0; r < nranks_; ++r)
      if (remote_[r]) moved |= pumpOut(r);
    if (stopping) break;  // flush: only the rings; see stop()
    // Where this thread drives the bridge, its net calls: what pumpOut just took goes out, what came in lands in the
    // inboxes, and what storeIn released on the last turn is credited. Then at most a credit step (an eighth of an
    // inbox) of records in all, from the inboxes in turn, before the next turn makes the net calls again (receives
    // to post, credits, the rings' sends), which would otherwise wait for every inbox to be stored whole.
    const int64_t t1 = tracing ? nowNs() : 0;
    if (drives_bridge_) moved |= bridge_->assist();
    const int64_t t2 = tracing ? nowNs() : 0;
    moved |= storeInboxes(drives_bridge_ ? inbox_bytes_ / 8 : SIZE_MAX);
    if (tracing) sampleOccupancy();
    if (tracing && moved) {  // where a busy turn's time goes (a turn that moved nothing is idle time)
      const int64_t t3 = nowNs();
      busy_ns_[0] += t1 - t0, busy_ns_[1] += t2 - t1, busy_ns_[2] += t3 - t2;
    }
    if (moved) backoff.reset();
    else backoff.pause();
  }
}

epResult_t GpuProxy::bytesForwarded(uint64_t* bytes, int wait_ms) {
  // What the kernels reserved so far (complete records once their kernels ended), then the proxy's progress.
  std::vector<unsigned long long> reserved(nranks_, 0);
  EPCHECK(dev_->download(reserved.data(), reserved_dev_, sizeof(unsigned long long) * nranks_));
  const Deadline deadline = Deadline::afterMs(wait_ms);
  Backoff backoff;
  for (int r = 0; r < nranks_; ++r)
    while (remote_[r] && !bridge_->dead(r) && !out_[r].broken &&
           __atomic_load_n(&out_[r].pos, __ATOMIC_ACQUIRE) < reserved[r] && !deadline.expired())
      backoff.pause();
  *bytes = forwarded_.load(std::memory_order_relaxed);
  return epSuccess;
}

epResult_t GpuProxy::rawStream(const std::vector<uint8_t>& to, size_t bytes_per_peer, size_t msg_bytes, int window,
                               int timeout_ms, const std::function<epResult_t()>& sync, uint64_t* bytes_sent,
                               double* seconds) {
  NetBridge::RawResult res;
  EPCHECK(bridge_->rawStream(to, bytes_per_peer, msg_bytes, window, timeout_ms, sync, &res));
  *bytes_sent = res.bytes_sent;
  *seconds = res.seconds;
  return epSuccess;
}

void GpuProxy::stop(bool flush, const uint8_t* live, int timeout_ms) {
  if (!thread_.joinable()) {
    if (bridge_) bridge_->shutdown(false, nullptr, 0);
    return;
  }
  stop_.store(true, std::memory_order_release);
  thread_.join();
  if (flush) {
    // This rank's kernels have ended: what they reserved is all they will write. Forward the rest, then let the
    // bridge send it and say goodbye.
    const Deadline deadline = Deadline::afterMs(timeout_ms);
    std::vector<unsigned long long> reserved(nranks_, 0);
    dev_->download(reserved.data(), reserved_dev_, sizeof(unsigned long long) * nranks_);
    // A peer that said goodbye destroyed its communicator: it reads nothing more, and it credits nothing more
    // either (its bridge has closed), so records beyond its last credit would wait here until the deadline.
    auto done = [&](int r) {
      return !remote_[r] || (live && !live[r]) || bridge_->dead(r) || bridge_->saidGoodbye(r);
    };
    auto owed = [&](int r) {
      if (done(r) || out_[r].broken) return false;
      const uint64_t tail = bridge_->outCtl(0, r)->tail.load(std::memory_order_relaxed);  // the credit's
      return out_[r].pos < reserved[r] || tail < out_[r].pos;
    };
    Backoff backoff;
    for (;;) {
      bool left = false, moved = false;
      for (int r = 0; r < nranks_; ++r) {
        if (done(r)) continue;
        moved |= pumpOut(r);
        left |= owed(r);
      }
      if (drives_bridge_) moved |= bridge_->assist();  // sends, and the credits that let the tails on
      // What peers still send is stored as before, which credits it: a peer flushing at the same time may have
      // records beyond this rank's last credit, and would otherwise wait for it as this rank waits for its.
      moved |= storeInboxes(SIZE_MAX);
      if (!left) break;
      if (deadline.expired()) {
        for (int r = 0; r < nranks_; ++r)
          if (owed(r))
            EP_WARN("GPU proxy: rank %d destroys its communicator with records toward rank %d not sent after %d ms "
                    "(taken %llu of %llu ring bytes, %llu within its credit): %s",
                    rank_, r, timeout_ms, static_cast<unsigned long long>(out_[r].pos),
                    static_cast<unsigned long long>(reserved[r]),
                    static_cast<unsigned long long>(bridge_->outCtl(0, r)->tail.load(std::memory_order_relaxed)),
                    bridge_->describe(r).c_str());
        break;
      }
      if (moved) backoff.reset();
      else backoff.pause();
    }
    std::vector<uint8_t> to(live ? std::vector<uint8_t>(live, live + nranks_) : remote_);
    bridge_->shutdown(true, to.data(), static_cast<int>(deadline.remainingMs()));
  } else {
    bridge_->shutdown(false, nullptr, 0);
  }
}

namespace {

// Host memory for both sides: what the CPU tests run the proxy on.
class HostProxyDevice final : public ProxyDevice {
 public:
  epResult_t allocMapped(size_t bytes, void** host, void** dev) override {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes ? bytes : 1) != 0) EP_FAIL(epSystemError, "allocating %zu bytes", bytes);
    memset(p, 0, bytes);
    *host = *dev = p;
    return epSuccess;
  }
  void freeMapped(void* host) override { free(host); }
  epResult_t allocDevice(size_t bytes, void** dev) override {
    void* h = nullptr;
    return allocMapped(bytes, dev, &h);
  }
  void freeDevice(void* dev) override { free(dev); }
  epResult_t upload(void* dev, const void* src, size_t bytes) override {
    memcpy(dev, src, bytes);
    return epSuccess;
  }
  epResult_t download(void* dst, const void* dev, size_t bytes) override {
    memcpy(dst, dev, bytes);
    return epSuccess;
  }
};

}  // namespace

std::unique_ptr<ProxyDevice> hostProxyDevice() { return std::make_unique<HostProxyDevice>(); }

#if !EPCOMM_HAVE_GPU_ENGINE
std::unique_ptr<ProxyDevice> cudaProxyDevice(int) { return nullptr; }
#endif

}  // namespace epcomm
