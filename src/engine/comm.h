// The communicator behind epComm_t: identity, configuration, error state, and the engine that runs its
// operations. The API layer (api.cc) validates arguments and forwards to the engine.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/bootstrap.h"
#include "epcomm/epcomm.h"

namespace epcomm {

class Engine;

// The configuration after defaults and environment are applied.
struct CommConfig {
  epEngine_t engine = EP_ENGINE_HOST;
  int timeout_ms = 30000;
  // Deadline of the waits inside epCommInitRank (exchanges, barriers, net connections across hosts): wiring up many
  // ranks may take longer than a wait without progress is allowed to (EPCOMM_SETUP_TIMEOUT_MS).
  int setup_timeout_ms = 60000;
  int num_channels = 0;  // host engine threads per rank; 0 = EPCOMM_HOST_CHANNELS or cores / ranks of the machine
  size_t queue_bytes = 0;
  int ll_max_tokens_per_rank = 0;
  int ll_max_hidden = 7168;
  int ll_num_experts = 0;
  bool ll_zero_copy_dispatch = false;
  int ht_max_tokens_per_rank = 4096;
  int ht_max_hidden = 7168;
  int cuda_device = -1;
  int num_sms = 0;
};

}  // namespace epcomm

struct epComm {
  uint32_t magic = 0;
  uint64_t serial = 0;  // unique per communicator in this process (an address may be reused after a destroy)
  int rank = 0;
  int nranks = 0;
  epcomm::CommConfig config;
  std::unique_ptr<epcomm::Bootstrap> bootstrap;
  std::unique_ptr<epcomm::Engine> engine;

  std::mutex error_mutex;
  std::string last_error;
  // First asynchronous error; once set the communicator is broken and every operation fails fast.
  std::atomic<int> async_error{epSuccess};
  epErrorInfo_t async_info{};
  std::atomic<bool> aborted{false};
  std::atomic<int> active_calls{0};
  epResult_t violation = epSuccess;  // first device-side argument violation (GPU engine)
  uint64_t num_violations = 0;
  // Elastic ranks: the active-ranks mask as epCommGetActiveRanks reports it (1 = active); the engine holds its own
  // copy. A rank once masked stays masked.
  std::vector<uint8_t> active;

  void recordAsyncError(epResult_t code, int op, uint64_t epoch, int peer, int phase);
};

struct epHtHandle {
  uint32_t magic = 0;
  epComm* comm = nullptr;
  int max_tokens = 0;
  // The layout of the last notify/dispatch: valid once one succeeded.
  bool valid = false;
  int num_tokens = 0;
  int num_recv = 0;
  int num_experts = 0;
  std::vector<uint8_t> in_rank;        // [max_tokens, R] token t goes to rank r
  std::vector<int> send_count;         // [R] tokens this rank sends to r
  std::vector<int> recv_count;         // [R] rows received from r
  std::vector<int> recv_prefix;        // [R + 1] first received row of r
  std::vector<int> recv_per_expert;    // [E/R] rows naming each local expert
  std::vector<int> recv_chan_count;    // [R][channels] rows received from r on each host-engine channel
  // Host engine: the first received row of r's channel c (of C): r's rows lie channel after channel.
  int chanRowBegin(int r, int c, int C) const {
    int b = recv_prefix[r];
    for (int cc = 0; cc < c; ++cc) b += recv_chan_count[static_cast<size_t>(r) * C + cc];
    return b;
  }
  int recv_rows = 0;                   // rows of the recv buffers of the last dispatch (exact: num_recv)
  void* gpu = nullptr;                 // the GPU engine's device-side copy of the layout
  uint64_t mask_gen = 0;               // host engine: the mask generation the layout was computed under
  std::vector<int> masked_count;       // host engine: [R] tokens of the layout not sent because r was masked
  // Host engine, hierarchical HT across hosts: whether the last dispatch ran hierarchically, and for each source
  // rank s of another host that this rank forwarded and channel c, fwd_mask[s * C + c] holds one word per row
  // forwarded (token order): bit i = the i-th rank of this host received that row. Combine reduces by it.
  bool hier = false;
  std::vector<std::vector<uint64_t>> fwd_mask;
};

// A registration (epCommRegister): which communicator, and the engine's slot for it (-1: the engine keeps nothing).
struct epMemRegion {
  uint32_t magic = 0;
  epComm* comm = nullptr;
  uint64_t comm_serial = 0;  // comm->serial: tells its communicator from a later one at the same address
  int slot = -1;
};

namespace epcomm {
constexpr uint32_t kCommMagic = 0x436f6d6du;    // "Comm"
constexpr uint32_t kHandleMagic = 0x48616e64u;  // "Hand"
constexpr uint32_t kRegionMagic = 0x52656769u;  // "Regi"

// Whether h is a handle that epHtHandleCreate made and epHtHandleDestroy has not freed. Pointers are looked up
// before they are read, so a destroyed or made-up handle is refused instead of dereferenced (api.cc).
bool isLiveHandle(const epHtHandle* h);
}  // namespace epcomm
