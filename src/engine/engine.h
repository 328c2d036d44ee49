// What an engine provides to the API layer. The API layer validates arguments (validate.h) and passes the
// result as `local`: a rank whose arguments were rejected still takes part as far as its engine needs to keep
// peers from waiting, and returns `local`.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/checks.h"

#include "epcomm/epcomm.h"

struct epHtHandle;

namespace epcomm {

class Engine {
 public:
  virtual ~Engine() = default;
  virtual epResult_t init() = 0;
  // Whether argument arrays (topk_idx, layout arrays) may be read on the host.
  virtual bool hostMemory() const = 0;
  virtual size_t maxRowBytes() const = 0;
  // An LL receive half is outstanding: other operations must wait for it.
  virtual bool anyPending() const { return false; }
  // An LL send half whose receive half was not issued yet (epCommSetActiveRanks refuses to discard it on a usable
  // communicator). The GPU engine lets other operations run between the halves, so this can differ from
  // anyPending().
  virtual bool llReceivePending() const { return anyPending(); }

  virtual epResult_t handleInit(epHtHandle* h) = 0;
  virtual void handleFree(epHtHandle* h) = 0;

  virtual epResult_t layout(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* per_rank,
                            int* per_expert, uint8_t* in_rank, epStream_t stream) = 0;
  virtual epResult_t htNotify(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local, int* num_recv_host,
                              int* per_expert_host, epStream_t stream) = 0;
  virtual epResult_t htDispatch(const epHtDispatchArgs_t* a, epHtHandle* h, epResult_t local,
                                epStream_t stream) = 0;
  virtual epResult_t htCombine(const epHtCombineArgs_t* a, epHtHandle* h, epResult_t local,
                               epStream_t stream) = 0;
  virtual epResult_t llDispatch(const epLlDispatchArgs_t* a, epResult_t local, epStream_t stream) = 0;
  virtual epResult_t llCombine(const epLlCombineArgs_t* a, epResult_t local, epStream_t stream) = 0;
  virtual epResult_t alltoallv(const void* sendbuf, const size_t* send_counts, const size_t* send_displs,
                               void* recvbuf, const size_t* recv_counts, const size_t* recv_displs,
                               size_t elem_bytes, epResult_t local, epStream_t stream) = 0;
  virtual epResult_t alltoallvDevice(const void* sendbuf, const int64_t* send_counts, void* recvbuf,
                                     size_t recv_capacity, int64_t* recv_counts, int64_t* num_dropped,
                                     size_t elem_bytes, epResult_t local, epStream_t stream) = 0;
  // Zero-copy LL combine input: a region of the communicator's registered memory for the next combine's y.
  virtual epResult_t llCombineBuffer(void** y, size_t* bytes) = 0;
  // Zero-copy LL dispatch output: a region of registered memory the senders write the next dispatch's rows into.
  virtual epResult_t llDispatchBuffer(void** x, size_t* x_bytes, float** scales, size_t* scales_bytes) = 0;
  // Zero-copy HT combine input: the region of registered memory the token owners read the combine's x from.
  virtual epResult_t htCombineBuffer(void** x, size_t* bytes) = 0;
  virtual epResult_t barrier(epStream_t stream) = 0;
  // Memory registration (epCommRegister / epCommDeregister), collective; `local` is the API layer's verdict on
  // this rank's arguments. *slot names the region in deregisterMemory (the same on every rank). An engine that
  // reads its inputs in place keeps nothing (slot -1).
  virtual epResult_t registerMemory(void* ptr, size_t bytes, epResult_t local, int* slot) {
    (void)ptr;
    (void)bytes;
    *slot = -1;
    return local;
  }
  virtual epResult_t deregisterMemory(int slot) {
    (void)slot;
    return epSuccess;
  }
  // Elastic ranks: active has nranks entries (1 keep, 0 masked), already validated by the API layer (own rank
  // kept, no rank re-added). Collective among the kept ranks; synchronous; resynchronizes the protocol state
  // with the other survivors so that the next operation starts clean.
  virtual epResult_t setActiveRanks(const uint8_t* active, epStream_t stream) {
    (void)active;
    (void)stream;
    return EP_ERROR(epNotSupported, "elastic ranks (epCommSetActiveRanks) are not supported by this engine yet");
  }
  // A call of epCommSetActiveRanks that the API layer rejected with `local`: an engine that can tells the other
  // survivors at once (they return epRemoteError instead of waiting until their deadline). Returns `local`.
  virtual epResult_t setActiveRanksRejected(epResult_t local, epStream_t stream) {
    (void)stream;
    return local;
  }
  // epCommRecover: the survivors agree on whom to mask and resynchronize with that mask; kept (nranks) gets the
  // mask this rank ended with (on failure, as far as it got: its own entry 0 where the others hold it out). Only
  // where canRecover() (the API layer answers epNotSupported before anything collective otherwise).
  virtual bool canRecover() const { return false; }
  virtual epResult_t recover(uint8_t* kept, epStream_t stream) {
    (void)kept;
    (void)stream;
    return EP_ERROR(epInternalError, "recover() called on an engine without it");
  }
  // Cumulative drop counters (nranks each; either may be NULL).
  virtual epResult_t maskedDrops(int64_t* token_rows, int64_t* a2a_elements, epStream_t stream) {
    (void)token_rows;
    (void)a2a_elements;
    (void)stream;
    return EP_ERROR(epNotSupported, "masked-drop counters (epCommGetMaskedDrops) are not supported by this engine yet");
  }
  // Cumulative bytes this rank handed to the inter-host transport (epCommGetNetBytes).
  virtual epResult_t netBytesSent(uint64_t* bytes) {
    (void)bytes;
    return EP_ERROR(epNotSupported, "inter-host byte counts (epCommGetNetBytes) are not supported by this engine");
  }
  // Raw throughput of the inter-host transport (epCommNetRawBandwidth): this rank's bytes sent and seconds.
  virtual epResult_t netRawBandwidth(size_t bytes_per_peer, size_t msg_bytes, int window, uint64_t* bytes_sent,
                                     double* seconds) {
    (void)bytes_per_peer;
    (void)msg_bytes;
    (void)window;
    (void)bytes_sent;
    (void)seconds;
    return EP_ERROR(epNotSupported, "raw net throughput (epCommNetRawBandwidth) is not supported by this engine");
  }
  // Makes waits in flight give up (they return epAborted); called before the communicator is freed.
  virtual void abort() {}
  // Moves errors recorded by device code into the communicator (epComm::recordAsyncError / violations).
  virtual void pollAsyncError() {}
};

}  // namespace epcomm
