// Bootstrap: how the ranks of a communicator find each other and run setup collectives (allgather,
// barrier) before and beside the data transports. Two paths:
//  - socket: epGetUniqueId starts a rendezvous listener whose address and a random secret travel in the
//    unique id; ranks check in there, learn rank 0's address and keep one TCP connection to rank 0 (a star)
//    for setup collectives. Every connection presents the secret; strangers are dropped and logged.
//  - callback: the caller's all-gather (e.g. a torch Store) carries the bytes; rank 0's random secret is
//    spread through it.
// Every wait has a deadline; a rank that never arrives or dies makes the others fail with a clear error.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "epcomm/epcomm.h"

namespace epcomm {

constexpr size_t kSecretBytes = 16;

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  // Random per-communicator secret, the same on every rank (names shared memory, authenticates transports).
  const uint8_t* secret() const { return secret_; }

  // In place: buf holds nranks slots of bytes_per_rank; this rank's slot is filled by the caller; on return
  // every slot holds that rank's bytes. Fails with epTimeout/epRemoteError/epAborted naming the peer.
  virtual epResult_t allgather(void* buf, size_t bytes_per_rank, int timeout_ms) = 0;
  virtual epResult_t barrier(int timeout_ms);
  // Unblocks any wait in progress (it returns epAborted) and closes connections. Safe from another thread.
  virtual void abort() = 0;
  // The communicator is created. The caller's all-gather may be called only during creation (the header's
  // contract: its context may be gone afterwards), so the callback path refuses every later call.
  virtual void creationDone() {}

 protected:
  int rank_ = 0;
  int nranks_ = 0;
  uint8_t secret_[kSecretBytes] = {};
};

// epGetUniqueId: starts the rendezvous listener (a detached thread in this process) and fills *id.
epResult_t bootstrapGetUniqueId(epUniqueId* id);

// Checks an id's framing (magic, version, checksum) without connecting: epInvalidUniqueId with a message.
epResult_t bootstrapCheckUniqueId(const epUniqueId* id);

// The id as 2 * EP_UNIQUE_ID_BYTES lowercase hex digits plus a NUL (EP_UNIQUE_ID_STRING_BYTES); epBufferTooSmall
// when buf_bytes is less.
epResult_t uniqueIdToString(const epUniqueId* id, char* buf, size_t buf_bytes);
// Parses that text (either case); epInvalidUniqueId for a wrong length or a non-hex character, then checks
// the id with bootstrapCheckUniqueId.
epResult_t uniqueIdFromString(const char* s, epUniqueId* id);

epResult_t bootstrapInitSocket(const epUniqueId* id, int rank, int nranks, int timeout_ms,
                               std::unique_ptr<Bootstrap>* out);
epResult_t bootstrapInitCallback(epAllgatherFn_t fn, void* ctx, int rank, int nranks,
                                 std::unique_ptr<Bootstrap>* out);

}  // namespace epcomm
