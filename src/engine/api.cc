// The C API: argument checks, communicator bookkeeping, and dispatch to the engine. Every entry point that
// takes a communicator runs through onComm: it clears the thread's error, looks the communicator up, and on
// failure copies the message into the communicator (epGetLastError), whatever the failure was.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <new>
#include <unordered_map>

#include "bootstrap/bootstrap.h"
#include "common/checks.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/param.h"
#include "engine/comm.h"
#include "engine/host/host_engine.h"
#ifdef EPCOMM_HAVE_GPU_ENGINE
#include "engine/gpu/gpu_engine.h"
#endif
#include "engine/validate.h"

using namespace epcomm;

EP_PARAM(TimeoutMs, "TIMEOUT_MS", 30000);

void epComm::recordAsyncError(epResult_t code, int op, uint64_t epoch, int peer, int phase) {
  int expected = epSuccess;
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!async_error.compare_exchange_strong(expected, code)) return;  // keep the first
  async_info = EP_ERROR_INFO_INIT;
  async_info.op = op;
  async_info.epoch = epoch;
  async_info.rank = rank;
  async_info.peer = peer;
  async_info.phase = phase;
  async_info.result = code;
}

namespace {

thread_local char tEmpty[1] = {0};

// The communicators and handles alive in this process. A pointer from the caller is looked up here before it is
// read, so a destroyed or made-up one is refused (not read: freed memory, under AddressSanitizer an error).
// Entering a communicator counts the call under the same lock that destroy and abort take to unlist it, so that
// they can wait for the calls inside before they free it.
class Live {
 public:
  enum Kind { kComm, kHandle, kRegion };
  void add(const void* p, Kind k) {
    std::lock_guard<std::mutex> l(m_);
    objs_[p] = k;
  }
  // Unlists p if it is a live object of kind k; false if it is not (so that of two racing destroys one fails).
  bool remove(const void* p, Kind k) {
    std::lock_guard<std::mutex> l(m_);
    auto it = objs_.find(p);
    if (it == objs_.end() || it->second != k) return false;
    objs_.erase(it);
    return true;
  }
  bool has(const void* p, Kind k) {
    std::lock_guard<std::mutex> l(m_);
    auto it = objs_.find(p);
    return it != objs_.end() && it->second == k;
  }
  bool enter(epComm* c) {
    std::lock_guard<std::mutex> l(m_);
    auto it = objs_.find(c);
    if (it == objs_.end() || it->second != kComm) return false;
    c->active_calls.fetch_add(1);
    return true;
  }

 private:
  std::mutex m_;
  std::unordered_map<const void*, Kind> objs_;
};
Live& live() {
  static Live* l = new Live;  // never destroyed: calls may come from static destructors
  return *l;
}

// Records a failure's message as the communicator's; comm must be entered (or otherwise known live).
epResult_t finish(epComm* comm, epResult_t r) {
  if (r != epSuccess) {
    std::lock_guard<std::mutex> lock(comm->error_mutex);
    comm->last_error = threadLastError();
  }
  return r;
}

// Not aborted and not broken by an earlier asynchronous error.
epResult_t checkUsable(epComm* comm) {
  EP_REQUIRE(!comm->aborted.load(), epAborted, "the communicator was aborted");
  comm->engine->pollAsyncError();
  int ae = comm->async_error.load();
  if (ae != epSuccess)
    EP_FAIL(static_cast<epResult_t>(ae),
            "the communicator is unusable after an earlier %s (op %d, epoch %llu, peer %d): resynchronize it (every "
            "surviving rank calls epCommRecover, or epCommSetActiveRanks with the failed ranks masked or, after a "
            "timeout or mismatched operations, the current mask) or destroy it and create a new one",
            epGetErrorString(static_cast<epResult_t>(ae)), comm->async_info.op,
            static_cast<unsigned long long>(comm->async_info.epoch), comm->async_info.peer);
  return epSuccess;
}

enum class Need { kLive, kUsable };

// The one path of every entry point that takes a communicator (except destroy and abort, which free it):
// NULL is epNullPointer, a pointer that is not a live communicator epInvalidArgument, kUsable adds the aborted
// and broken checks; then fn runs while the call is counted in comm->active_calls, and a failure's message
// becomes the communicator's.
template <typename Fn>
epResult_t onComm(epComm* comm, Need need, Fn&& fn) {
  clearThreadError();
  EP_REQUIRE(comm != nullptr, epNullPointer, "comm is NULL");
  EP_REQUIRE(live().enter(comm), epInvalidArgument, "comm is not a live communicator (destroyed?)");
  epResult_t r = need == Need::kUsable ? checkUsable(comm) : epSuccess;
  try {  // no C++ exception crosses the C ABI
    if (r == epSuccess) r = fn();
  } catch (const std::bad_alloc&) {
    r = EP_ERROR(epSystemError, "out of host memory");
  } catch (const std::exception& e) {
    r = EP_ERROR(epInternalError, "unexpected exception: %s", e.what());
  }
  finish(comm, r);
  comm->active_calls.fetch_sub(1);
  return r;
}

// Takes comm out of the live set, then waits for the calls inside it to leave (with an abort they notice the
// flag within one backoff step) before it is freed.
epResult_t release(epComm* comm, bool abort) {
  clearThreadError();
  EP_REQUIRE(comm != nullptr, epNullPointer, "comm is NULL");
  EP_REQUIRE(live().remove(comm, Live::kComm), epInvalidArgument,
             "comm is not a live communicator (destroyed twice?)");
  if (abort) {
    comm->aborted.store(true);
    if (comm->bootstrap) comm->bootstrap->abort();
    if (comm->engine) comm->engine->abort();
  }
  while (comm->active_calls.load() != 0) usleep(100);
  comm->magic = 0;
  delete comm;
  return epSuccess;
}

ValidateCtx ctxOf(epComm* comm) { return ValidateCtx{comm, comm->engine->hostMemory(), comm->engine->maxRowBytes()}; }

// Operations other than LL halves may not start while an LL receive half is outstanding: their messages
// would queue behind it. Every rank makes this decision identically, so no exchange is needed; the call posts
// nothing.
epResult_t checkNoPending(epComm* comm, const char* what) {
  EP_REQUIRE(!comm->engine->anyPending(), epInvalidUsage,
             "%s called while an LL operation's receive half (EP_LL_RECV) is outstanding; complete it first", what);
  return epSuccess;
}

epResult_t resolveConfig(const epConfig_t* cfg, CommConfig* out) {
  epConfig_t def = EP_CONFIG_INIT;
  if (cfg == nullptr) cfg = &def;
  EP_REQUIRE(cfg->magic == EP_STRUCT_MAGIC && cfg->size >= sizeof(epConfig_t),
             epInvalidArgument, "config was not initialised from EP_CONFIG_INIT (size %u, magic 0x%x)", cfg->size,
             cfg->magic);
  int engine = cfg->engine;
  if (engine == EP_ENGINE_AUTO) {
    const char* env = paramString("EPCOMM_ENGINE");
    if (env == nullptr || strcmp(env, "auto") == 0) {
#ifdef EPCOMM_HAVE_GPU_ENGINE
      engine = gpuDeviceCount() > 0 ? EP_ENGINE_GPU : EP_ENGINE_HOST;
#else
      engine = EP_ENGINE_HOST;
#endif
    } else if (strcmp(env, "host") == 0) engine = EP_ENGINE_HOST;
    else if (strcmp(env, "gpu") == 0) engine = EP_ENGINE_GPU;
    else EP_FAIL(epInvalidArgument, "EPCOMM_ENGINE = '%s' is not one of host, gpu, auto", env);
  }
  EP_REQUIRE(engine == EP_ENGINE_HOST || engine == EP_ENGINE_GPU, epInvalidArgument,
             "config.engine = %d is not an epEngine_t", engine);
#ifndef EPCOMM_HAVE_GPU_ENGINE
  EP_REQUIRE(engine != EP_ENGINE_GPU, epNotSupported, "this build of epcomm has no GPU engine (built without CUDA)");
#endif
  out->engine = static_cast<epEngine_t>(engine);
  EP_REQUIRE(cfg->timeout_ms >= 0, epInvalidArgument, "config.timeout_ms = %d is negative", cfg->timeout_ms);
  out->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : static_cast<int>(epParamTimeoutMs());
  EP_REQUIRE(out->timeout_ms > 0, epInvalidArgument, "EPCOMM_TIMEOUT_MS = %d must be positive", out->timeout_ms);
  // EPCOMM_SETUP_TIMEOUT_MS, read at every creation (not cached like the other parameters: it bounds this call only).
  // 0: the larger of the communicator's timeout and 60 s (connecting the ranks of many hosts is not a wait that sees
  // progress at every step, and a short timeout is chosen to notice deaths, not to bound set-up).
  const int64_t setup = paramLoad("EPCOMM_SETUP_TIMEOUT_MS", 0);
  EP_REQUIRE(setup >= 0 && setup <= INT_MAX, epInvalidArgument, "EPCOMM_SETUP_TIMEOUT_MS = %lld is outside [0, %d]",
             static_cast<long long>(setup), INT_MAX);
  out->setup_timeout_ms = setup > 0 ? static_cast<int>(setup) : std::max(out->timeout_ms, 60000);
  EP_REQUIRE(cfg->num_channels >= 0, epInvalidArgument, "config.num_channels = %d is negative", cfg->num_channels);
  // 0 stays 0: the host engine then takes EPCOMM_HOST_CHANNELS or the cores per rank of its machine (epcomm.h).
  out->num_channels = cfg->num_channels;
  out->queue_bytes = cfg->queue_bytes;
  EP_REQUIRE(cfg->ll_max_tokens_per_rank >= 0, epInvalidArgument, "config.ll_max_tokens_per_rank = %d is negative",
             cfg->ll_max_tokens_per_rank);
  out->ll_max_tokens_per_rank = cfg->ll_max_tokens_per_rank;
  out->ll_max_hidden = cfg->ll_max_hidden > 0 ? cfg->ll_max_hidden : 7168;
  out->ll_num_experts = cfg->ll_num_experts > 0 ? cfg->ll_num_experts : 0;
  EP_REQUIRE(cfg->ll_zero_copy_dispatch == 0 || cfg->ll_zero_copy_dispatch == 1, epInvalidArgument,
             "config.ll_zero_copy_dispatch = %d must be 0 or 1", cfg->ll_zero_copy_dispatch);
  out->ll_zero_copy_dispatch = cfg->ll_zero_copy_dispatch != 0;
  EP_REQUIRE(cfg->ht_max_tokens_per_rank >= 0 && cfg->ht_max_hidden >= 0 && cfg->num_sms >= 0, epInvalidArgument,
             "config.ht_max_tokens_per_rank = %d, ht_max_hidden = %d and num_sms = %d must not be negative",
             cfg->ht_max_tokens_per_rank, cfg->ht_max_hidden, cfg->num_sms);
  out->ht_max_tokens_per_rank = cfg->ht_max_tokens_per_rank > 0 ? cfg->ht_max_tokens_per_rank : 4096;
  out->ht_max_hidden = cfg->ht_max_hidden > 0 ? cfg->ht_max_hidden : 7168;
  out->cuda_device = cfg->cuda_device;
  out->num_sms = cfg->num_sms;
  return epSuccess;
}

std::unique_ptr<Engine> makeEngine(epComm* comm) {
#ifdef EPCOMM_HAVE_GPU_ENGINE
  if (comm->config.engine == EP_ENGINE_GPU) return makeGpuEngine(comm);
#endif
  return std::make_unique<HostEngine>(comm);
}

epResult_t initComm(epComm_t* out, int nranks, int rank, const epConfig_t* config,
                    const std::function<epResult_t(int timeout_ms, std::unique_ptr<Bootstrap>*)>& boot) {
  EP_REQUIRE(out != nullptr, epNullPointer, "comm (the output pointer) is NULL");
  *out = nullptr;
  EP_REQUIRE(nranks >= 1 && nranks <= EP_MAX_RANKS, epRankMismatch, "nranks = %d is outside [1, %d]", nranks,
             EP_MAX_RANKS);
  EP_REQUIRE(rank >= 0 && rank < nranks, epRankMismatch, "rank = %d is outside [0, nranks = %d)", rank, nranks);
  CommConfig cfg;
  EPCHECK(resolveConfig(config, &cfg));
  auto comm = std::make_unique<epComm>();
  comm->rank = rank;
  comm->nranks = nranks;
  comm->config = cfg;
  comm->magic = kCommMagic;
  static std::atomic<uint64_t> next_serial{1};
  comm->serial = next_serial.fetch_add(1);
  comm->active.assign(nranks, 1);
  logSetRank(rank);
  EPCHECK(boot(cfg.setup_timeout_ms, &comm->bootstrap));
  comm->engine = makeEngine(comm.get());
  EPCHECK(comm->engine->init());
  comm->bootstrap->creationDone();
  EP_INFO(kSubsysInit, "communicator ready: rank %d of %d, timeout %d ms, set-up deadline %d ms", rank, nranks,
          cfg.timeout_ms, cfg.setup_timeout_ms);
  live().add(comm.get(), Live::kComm);
  *out = comm.release();
  return epSuccess;
}

// After a successful resynchronization (epCommSetActiveRanks, epCommRecover): the new mask, and the survivors are
// back in step, so the communicator is usable again.
void adoptMask(epComm* comm, const std::vector<uint8_t>& mask) {
  std::lock_guard<std::mutex> lock(comm->error_mutex);
  comm->active = mask;
  comm->async_error.store(epSuccess);
  comm->async_info = EP_ERROR_INFO_INIT;
}

}  // namespace

bool epcomm::isLiveHandle(const epHtHandle* h) { return live().has(h, Live::kHandle); }

extern "C" {

const char* epGetErrorString(epResult_t r) {
  switch (r) {
    case epSuccess: return "success";
    case epInvalidArgument: return "invalid argument";
    case epNullPointer: return "null pointer";
    case epUnsupportedDtype: return "unsupported data type";
    case epInvalidHidden: return "invalid hidden size";
    case epInvalidTopk: return "invalid top-k";
    case epInvalidNumExperts: return "invalid number of experts";
    case epExpertOutOfRange: return "expert id out of range";
    case epCapacityExceeded: return "capacity exceeded";
    case epBufferTooSmall: return "buffer too small";
    case epRankMismatch: return "rank count mismatch";
    case epInvalidUsage: return "invalid usage";
    case epNotSupported: return "not supported";
    case epSystemError: return "system error";
    case epCudaError: return "CUDA error";
    case epTimeout: return "timeout";
    case epRemoteError: return "remote error";
    case epAborted: return "aborted";
    case epInternalError: return "internal error";
    case epInvalidUniqueId: return "invalid unique id";
    case epAddressInUse: return "address in use";
    default: return "unknown result code";
  }
}

const char* epGetLastError(epComm_t comm) {
  if (comm == nullptr || !live().has(comm, Live::kComm)) {
    const char* m = threadLastError();
    return m ? m : tEmpty;
  }
  std::lock_guard<std::mutex> lock(comm->error_mutex);
  // The string lives as long as the communicator and is replaced only by a later failure on it.
  return comm->last_error.c_str();
}

epResult_t epGetVersion(int* version) {
  clearThreadError();
  EP_REQUIRE(version != nullptr, epNullPointer, "version is NULL");
  *version = EPCOMM_VERSION_CODE;
  return epSuccess;
}

size_t epDataTypeSize(epDataType_t dtype) { return dtypeSize(dtype); }

epResult_t epGetUniqueId(epUniqueId* id) {
  clearThreadError();
  EP_REQUIRE(id != nullptr, epNullPointer, "id is NULL");
  return bootstrapGetUniqueId(id);
}

epResult_t epUniqueIdToString(const epUniqueId* id, char* buf, size_t buf_bytes) {
  clearThreadError();
  EP_REQUIRE(id != nullptr, epNullPointer, "id is NULL");
  EP_REQUIRE(buf != nullptr, epNullPointer, "buf is NULL");
  return uniqueIdToString(id, buf, buf_bytes);
}

epResult_t epUniqueIdFromString(const char* str, epUniqueId* id) {
  clearThreadError();
  EP_REQUIRE(str != nullptr, epNullPointer, "str is NULL");
  EP_REQUIRE(id != nullptr, epNullPointer, "id is NULL");
  return uniqueIdFromString(str, id);
}

// *comm is NULL after any failure of the creation calls.
static epResult_t clearOut(epComm_t* comm) {
  clearThreadError();
  EP_REQUIRE(comm != nullptr, epNullPointer, "comm (the output pointer) is NULL");
  *comm = nullptr;
  return epSuccess;
}

epResult_t epCommInitRank(epComm_t* comm, int nranks, const epUniqueId* id, int rank, const epConfig_t* config) {
  EPCHECK(clearOut(comm));
  EP_REQUIRE(id != nullptr, epNullPointer, "id is NULL");
  EPCHECK(bootstrapCheckUniqueId(id));
  return initComm(comm, nranks, rank, config, [&](int timeout_ms, std::unique_ptr<Bootstrap>* bs) {
    return bootstrapInitSocket(id, rank, nranks, timeout_ms, bs);
  });
}

epResult_t epCommInitRankWithAllgather(epComm_t* comm, int nranks, int rank, epAllgatherFn_t fn, void* ctx,
                                       const epConfig_t* config) {
  EPCHECK(clearOut(comm));
  EP_REQUIRE(fn != nullptr, epNullPointer, "fn (the allgather callback) is NULL");
  return initComm(comm, nranks, rank, config, [&](int, std::unique_ptr<Bootstrap>* bs) {
    return bootstrapInitCallback(fn, ctx, rank, nranks, bs);
  });
}

epResult_t epCommInitFromEnv(epComm_t* comm, const epConfig_t* config) {
  EPCHECK(clearOut(comm));
  const char* r = paramString("EPCOMM_RANK");
  const char* n = paramString("EPCOMM_WORLD_SIZE");
  const char* s = paramString("EPCOMM_UNIQUE_ID");
  EP_REQUIRE(r && n && s, epInvalidArgument,
             "EPCOMM_RANK, EPCOMM_WORLD_SIZE and EPCOMM_UNIQUE_ID must be set (run under epcomm-run)");
  epUniqueId id;
  EPCHECK(uniqueIdFromString(s, &id));
  return epCommInitRank(comm, atoi(n), &id, atoi(r), config);
}

epResult_t epCommDestroy(epComm_t comm) { return release(comm, false); }

epResult_t epCommAbort(epComm_t comm) { return release(comm, true); }

epResult_t epCommGetAsyncError(epComm_t comm, epResult_t* async_error, epErrorInfo_t* info) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(async_error != nullptr, epNullPointer, "async_error is NULL");
    // Checked before anything is written: a failed call writes none of its outputs.
    EP_REQUIRE(info == nullptr || info->magic == EP_STRUCT_MAGIC, epInvalidArgument,
               "info was not initialised from EP_ERROR_INFO_INIT (magic 0x%x)", info ? info->magic : 0u);
    comm->engine->pollAsyncError();
    std::lock_guard<std::mutex> lock(comm->error_mutex);
    *async_error = static_cast<epResult_t>(comm->async_error.load());
    if (info != nullptr) {
      epErrorInfo_t i = comm->async_error.load() == epSuccess ? epErrorInfo_t(EP_ERROR_INFO_INIT) : comm->async_info;
      i.violation = comm->violation;
      i.num_violations = comm->num_violations;
      i.size = info->size;
      memcpy(info, &i, std::min<size_t>(info->size, sizeof(i)));
    }
    return epSuccess;
  });
}

epResult_t epCommRank(epComm_t comm, int* rank) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(rank != nullptr, epNullPointer, "rank is NULL");
    *rank = comm->rank;
    return epSuccess;
  });
}

epResult_t epCommSize(epComm_t comm, int* size) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(size != nullptr, epNullPointer, "size is NULL");
    *size = comm->nranks;
    return epSuccess;
  });
}

epResult_t epCommEngine(epComm_t comm, epEngine_t* engine) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(engine != nullptr, epNullPointer, "engine is NULL");
    *engine = comm->config.engine;
    return epSuccess;
  });
}

epResult_t epCommBarrier(epComm_t comm, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epCommBarrier"));
    return comm->engine->barrier(stream);
  });
}

epResult_t epCommSetActiveRanks(epComm_t comm, const int32_t* active, epStream_t stream) {
  // kLive: a broken communicator may call it (that is what it is for); an aborted one may not.
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(!comm->aborted.load(), epAborted, "the communicator was aborted");
    comm->engine->pollAsyncError();
    const bool broken = comm->async_error.load() != epSuccess;
    std::vector<uint8_t> mask;
    epResult_t local = validateActiveRanks(comm, active, &mask);
    // On a usable communicator an outstanding LL receive half is the caller's to complete (decided alike on every
    // rank); on a broken one the resynchronization discards it.
    if (local == epSuccess && !broken && comm->engine->llReceivePending())
      local = EP_ERROR(epInvalidUsage,
                       "epCommSetActiveRanks called while an LL operation's receive half (EP_LL_RECV) is "
                       "outstanding; complete it first");
    if (local != epSuccess) return comm->engine->setActiveRanksRejected(local, stream);
    EPCHECK(comm->engine->setActiveRanks(mask.data(), stream));
    adoptMask(comm, mask);
    return epSuccess;
  });
}

epResult_t epCommRecover(epComm_t comm, int32_t* active, epStream_t stream) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(!comm->aborted.load(), epAborted, "the communicator was aborted");
    EP_REQUIRE(comm->engine->canRecover(), epNotSupported,
               "epCommRecover is not supported by this engine yet (the host engine has it); call "
               "epCommSetActiveRanks with the failed ranks masked (epCommGetAsyncError's peer names one)");
    comm->engine->pollAsyncError();
    const bool broken = comm->async_error.load() != epSuccess;
    if (active)
      for (int q = 0; q < comm->nranks; ++q) active[q] = comm->active[q];
    // As in epCommSetActiveRanks: decided alike on every rank, and the others told at once.
    if (!broken && comm->engine->llReceivePending())
      return comm->engine->setActiveRanksRejected(
          EP_ERROR(epInvalidUsage, "epCommRecover called while an LL operation's receive half (EP_LL_RECV) is "
                   "outstanding; complete it first"),
          stream);
    std::vector<uint8_t> kept(comm->active.begin(), comm->active.end());
    const epResult_t r = comm->engine->recover(kept.data(), stream);
    if (active)
      for (int q = 0; q < comm->nranks; ++q) active[q] = kept[q];
    EPCHECK(r);
    adoptMask(comm, kept);
    return epSuccess;
  });
}

epResult_t epCommGetActiveRanks(epComm_t comm, int32_t* active) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(active != nullptr, epNullPointer, "active is NULL");
    std::lock_guard<std::mutex> lock(comm->error_mutex);
    for (int r = 0; r < comm->nranks; ++r) active[r] = comm->active[r];
    return epSuccess;
  });
}

epResult_t epCommGetMaskedDrops(epComm_t comm, int64_t* token_rows, int64_t* alltoallv_elements, epStream_t stream) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(!comm->aborted.load(), epAborted, "the communicator was aborted");
    if (token_rows == nullptr && alltoallv_elements == nullptr) return epSuccess;
    return comm->engine->maskedDrops(token_rows, alltoallv_elements, stream);
  });
}

epResult_t epCommGetNetBytes(epComm_t comm, uint64_t* bytes_sent) {
  return onComm(comm, Need::kLive, [&]() -> epResult_t {
    EP_REQUIRE(bytes_sent != nullptr, epNullPointer, "bytes_sent is NULL");
    return comm->engine->netBytesSent(bytes_sent);
  });
}

epResult_t epCommNetRawBandwidth(epComm_t comm, size_t bytes_per_peer, size_t msg_bytes, int window,
                                 uint64_t* bytes_sent, double* seconds) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EP_REQUIRE(bytes_sent != nullptr && seconds != nullptr, epNullPointer, "bytes_sent or seconds is NULL");
    EP_REQUIRE(bytes_per_peer > 0 && bytes_per_peer <= (size_t{1} << 40), epInvalidArgument,
               "bytes_per_peer = %zu is outside [1, 2^40]", bytes_per_peer);
    EP_REQUIRE(msg_bytes > 0 && msg_bytes <= (size_t{1} << 30), epInvalidArgument,
               "msg_bytes = %zu is outside [1, 1 GiB]", msg_bytes);
    EP_REQUIRE(window >= 1 && window <= 32, epInvalidArgument, "window = %d is outside [1, 32]", window);
    EPCHECK(checkNoPending(comm, "epCommNetRawBandwidth"));
    return comm->engine->netRawBandwidth(bytes_per_peer, msg_bytes, window, bytes_sent, seconds);
  });
}

epResult_t epGetDispatchLayout(epComm_t comm, const int64_t* topk_idx, int num_tokens, int topk, int num_experts,
                               int* num_tokens_per_rank, int* num_tokens_per_expert, uint8_t* is_token_in_rank,
                               epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(validateRouting(num_tokens, topk, num_experts, comm->nranks));
    EP_REQUIRE(topk_idx != nullptr || num_tokens == 0, epNullPointer, "topk_idx is NULL");
    if (num_tokens > 0 && comm->engine->hostMemory())
      EPCHECK(validateTopkIdx(topk_idx, num_tokens, topk, num_experts, "topk_idx"));
    return comm->engine->layout(topk_idx, num_tokens, topk, num_experts, num_tokens_per_rank, num_tokens_per_expert,
                                is_token_in_rank, stream);
  });
}

epResult_t epHtHandleCreate(epComm_t comm, int max_tokens, epHtHandle_t* handle) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EP_REQUIRE(handle != nullptr, epNullPointer, "handle (the output pointer) is NULL");
    EP_REQUIRE(max_tokens >= 0, epInvalidArgument, "max_tokens = %d is negative", max_tokens);
    epHtHandle* h = new (std::nothrow) epHtHandle();
    EP_REQUIRE(h != nullptr, epSystemError, "out of host memory for a handle");
    h->magic = kHandleMagic;
    h->comm = comm;
    h->max_tokens = max_tokens;
    h->in_rank.reserve(static_cast<size_t>(max_tokens) * comm->nranks);
    epResult_t r = comm->engine->handleInit(h);
    if (r != epSuccess) {
      delete h;
      return r;
    }
    live().add(h, Live::kHandle);
    *handle = h;
    return epSuccess;
  });
}

// Handles are not tied to a call on their communicator, so their failures are the thread's message only.
epResult_t epHtHandleDestroy(epHtHandle_t handle) {
  clearThreadError();
  EP_REQUIRE(handle != nullptr, epNullPointer, "handle is NULL");
  EP_REQUIRE(live().remove(handle, Live::kHandle), epInvalidArgument,
             "handle is not a live HT handle (destroyed twice?)");
  handle->magic = 0;
  epComm* comm = handle->comm;
  if (live().enter(comm)) {  // its communicator may be gone already
    comm->engine->handleFree(handle);
    comm->active_calls.fetch_sub(1);
  }
  delete handle;
  return epSuccess;
}

epResult_t epHtHandleGetCounts(epHtHandle_t handle, int* num_tokens, int* num_recv_tokens) {
  clearThreadError();
  EP_REQUIRE(handle != nullptr, epNullPointer, "handle is NULL");
  EP_REQUIRE(isLiveHandle(handle), epInvalidArgument, "handle is not a live HT handle");
  EP_REQUIRE(handle->valid, epInvalidUsage, "the handle holds no layout yet");
  if (num_tokens) *num_tokens = handle->num_tokens;
  if (num_recv_tokens) *num_recv_tokens = handle->num_recv;
  return epSuccess;
}

epResult_t epHtHandleGetRecvCounts(epHtHandle_t handle, int* recv_counts) {
  clearThreadError();
  EP_REQUIRE(handle != nullptr, epNullPointer, "handle is NULL");
  EP_REQUIRE(recv_counts != nullptr, epNullPointer, "recv_counts is NULL");
  EP_REQUIRE(isLiveHandle(handle), epInvalidArgument, "handle is not a live HT handle");
  EP_REQUIRE(handle->valid, epInvalidUsage, "the handle holds no layout yet");
  const std::vector<int>& prefix = handle->recv_prefix;  // [R + 1], filled by both engines' exact notify
  EP_REQUIRE(prefix.size() >= 2 && prefix.back() == handle->num_recv, epInvalidUsage,
             "the handle's layout has no host-visible per-rank counts");
  for (size_t r = 0; r + 1 < prefix.size(); ++r) recv_counts[r] = prefix[r + 1] - prefix[r];
  return epSuccess;
}

epResult_t epHtDispatchNotify(epComm_t comm, const epHtDispatchArgs_t* args, epHtHandle_t handle,
                              int* num_recv_tokens_host, int* recv_tokens_per_expert_host, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epHtDispatchNotify"));
    epResult_t local = validateHtDispatch(ctxOf(comm), args, handle, true);
    if (local == epSuccess && num_recv_tokens_host == nullptr)
      local = EP_ERROR(epNullPointer, "num_recv_tokens_host is NULL");
    return comm->engine->htNotify(args, handle, local, num_recv_tokens_host, recv_tokens_per_expert_host, stream);
  });
}

epResult_t epHtDispatch(epComm_t comm, const epHtDispatchArgs_t* args, epHtHandle_t handle, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epHtDispatch"));
    epResult_t local = validateHtDispatch(ctxOf(comm), args, handle, false);
    return comm->engine->htDispatch(args, handle, local, stream);
  });
}

epResult_t epHtCombine(epComm_t comm, const epHtCombineArgs_t* args, epHtHandle_t handle, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epHtCombine"));
    epResult_t local = validateHtCombine(ctxOf(comm), args, handle);
    return comm->engine->htCombine(args, handle, local, stream);
  });
}

epResult_t epLlDispatch(epComm_t comm, const epLlDispatchArgs_t* args, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    epResult_t local = validateLlDispatch(ctxOf(comm), args);
    return comm->engine->llDispatch(args, local, stream);
  });
}

epResult_t epLlCombine(epComm_t comm, const epLlCombineArgs_t* args, epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    epResult_t local = validateLlCombine(ctxOf(comm), args);
    return comm->engine->llCombine(args, local, stream);
  });
}

epResult_t epLlCombineBuffer(epComm_t comm, void** y, size_t* y_bytes) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EP_REQUIRE(y != nullptr && y_bytes != nullptr, epNullPointer, "%s is NULL", y == nullptr ? "y" : "y_bytes");
    return comm->engine->llCombineBuffer(y, y_bytes);
  });
}

epResult_t epLlDispatchBuffer(epComm_t comm, void** recv_x, size_t* recv_x_bytes, float** recv_x_scales,
                              size_t* recv_x_scales_bytes) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EP_REQUIRE(recv_x != nullptr && recv_x_bytes != nullptr && recv_x_scales != nullptr &&
                   recv_x_scales_bytes != nullptr,
               epNullPointer, "%s is NULL",
               recv_x == nullptr         ? "recv_x"
               : recv_x_bytes == nullptr ? "recv_x_bytes"
               : recv_x_scales == nullptr ? "recv_x_scales"
                                          : "recv_x_scales_bytes");
    return comm->engine->llDispatchBuffer(recv_x, recv_x_bytes, recv_x_scales, recv_x_scales_bytes);
  });
}

epResult_t epHtCombineBuffer(epComm_t comm, void** x, size_t* x_bytes) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EP_REQUIRE(x != nullptr && x_bytes != nullptr, epNullPointer, "%s is NULL", x == nullptr ? "x" : "x_bytes");
    return comm->engine->htCombineBuffer(x, x_bytes);
  });
}

epResult_t epCommRegister(epComm_t comm, void* ptr, size_t bytes, epMemRegion_t* region) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    // A refusal here is still one rank's part of a collective call: the engine tells the others.
    epResult_t local = epSuccess;
    if (region == nullptr) local = EP_ERROR(epNullPointer, "region (the output pointer) is NULL");
    else if (ptr == nullptr) local = EP_ERROR(epNullPointer, "ptr is NULL");
    else if (bytes == 0) local = EP_ERROR(epInvalidArgument, "bytes = 0: there is nothing to register");
    if (local == epSuccess) local = checkNoPending(comm, "epCommRegister");
    epMemRegion* r = new (std::nothrow) epMemRegion();
    if (local == epSuccess && r == nullptr) local = EP_ERROR(epSystemError, "out of host memory for a region");
    int slot = -1;
    const epResult_t res = comm->engine->registerMemory(ptr, bytes, local, &slot);
    if (res != epSuccess) {
      delete r;
      return res;
    }
    r->magic = kRegionMagic;
    r->comm = comm;
    r->comm_serial = comm->serial;
    r->slot = slot;
    live().add(r, Live::kRegion);
    *region = r;
    return epSuccess;
  });
}

epResult_t epCommDeregister(epMemRegion_t region) {
  clearThreadError();
  EP_REQUIRE(region != nullptr, epNullPointer, "region is NULL");
  EP_REQUIRE(live().has(region, Live::kRegion), epInvalidArgument,
             "region is not a live registration (deregistered twice?)");
  epComm* comm = region->comm;
  // A communicator that is gone took the region's mappings with it: the handle is only freed. One created later
  // at the same address is another one (its serial differs).
  const epResult_t r = !live().has(comm, Live::kComm) ? epSuccess : onComm(comm, Need::kLive, [&]() -> epResult_t {
    if (comm->serial != region->comm_serial) return epSuccess;
    EPCHECK(checkNoPending(comm, "epCommDeregister"));
    return comm->engine->deregisterMemory(region->slot);
  });
  if (r == epSuccess && live().remove(region, Live::kRegion)) {
    region->magic = 0;
    delete region;
  }
  return r;
}

epResult_t epHtDispatchSizes(epComm_t comm, const epHtDispatchArgs_t* args, int recv_rows, epBufferSizes_t* sizes) {
  return onComm(comm, Need::kUsable,
                [&]() -> epResult_t { return htDispatchSizes(ctxOf(comm), args, recv_rows, sizes); });
}

epResult_t epLlDispatchSizes(epComm_t comm, const epLlDispatchArgs_t* args, epBufferSizes_t* sizes) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t { return llDispatchSizes(ctxOf(comm), args, sizes); });
}

epResult_t epAlltoallv(epComm_t comm, const void* sendbuf, const size_t* send_counts, const size_t* send_displs,
                       void* recvbuf, const size_t* recv_counts, const size_t* recv_displs, epDataType_t dtype,
                       epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epAlltoallv"));
    epResult_t local = validateAlltoallv(ctxOf(comm), sendbuf, send_counts, send_displs, recvbuf, recv_counts,
                                         recv_displs, dtype);
    return comm->engine->alltoallv(sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs,
                                   dtypeSize(dtype), local, stream);
  });
}

epResult_t epAlltoallvDevice(epComm_t comm, const void* sendbuf, const int64_t* send_counts, void* recvbuf,
                             size_t recv_capacity, int64_t* recv_counts, int64_t* num_dropped, epDataType_t dtype,
                             epStream_t stream) {
  return onComm(comm, Need::kUsable, [&]() -> epResult_t {
    EPCHECK(checkNoPending(comm, "epAlltoallvDevice"));
    epResult_t local = validateAlltoallvDevice(ctxOf(comm), sendbuf, send_counts, recvbuf, recv_capacity,
                                               recv_counts, dtype);
    return comm->engine->alltoallvDevice(sendbuf, send_counts, recvbuf, recv_capacity, recv_counts, num_dropped,
                                         dtypeSize(dtype), local, stream);
  });
}

}  // extern "C"
