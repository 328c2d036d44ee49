// The torch.distributed backend "epcomm": a c10d::Backend whose all_to_all_single, all_to_all and barrier
// run on epcomm's engines (the host engine for CPU tensors, the GPU engine for CUDA tensors), and whose other
// collectives and point-to-point go to inner backends created on the same Store (gloo for CPU, NCCL for
// CUDA), so that existing process-group code keeps working. Communicators are created on first use per
// device type, from the Store (epCommInitRankWithAllgather): every rank issues the same operations, so every
// rank creates them at the same point.
#pragma once

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <epcomm/epcomm.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace epcomm_torch {

class EpcommBackend : public c10d::Backend {
 public:
  // cuda_inner may be null (no CUDA, or no NCCL); CUDA tensors then go to cpu_inner where it can take them.
  EpcommBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                c10::intrusive_ptr<c10d::Backend> cpu_inner, c10::intrusive_ptr<c10d::Backend> cuda_inner);
  ~EpcommBackend() override;

  const std::string getBackendName() const override { return "epcomm"; }

  // On epcomm's engines.
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // epcomm.all_to_all_v: counts (rows of dim 0) as int64 tensors on the data's device; output of fixed
  // capacity (its rows); recv_counts written. No host round trip (capturable on the GPU engine).
  c10::intrusive_ptr<c10d::Work> allToAllV(at::Tensor& output, const at::Tensor& input,
                                           const at::Tensor& send_counts, at::Tensor& recv_counts, bool async_op);

  // Delegated to the inner backends.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override;
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override;

  // Sequence numbers are the inner backends' business; torch calls these on every new group.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return 0; }

  void abort() override;
  void shutdown() override;

  // The communicator serving device_type ("cpu" or "cuda"), created now if needed (collective); as an integer
  // for Python code that calls the C API on the same communicator.
  uintptr_t commHandle(const at::Device& device);

  // Elastic ranks (epcomm.h, epCommSetActiveRanks): applies the mask to every communicator this backend has
  // created (CPU first, then CUDA devices in order: the same order on every rank). Collective among the ranks
  // the mask keeps; synchronous. A communicator not created before a rank died cannot be created afterwards
  // (its creation needs every rank). activeRanks: the mask in force (the AND over the communicators; all
  // ranks when none exists yet). maskedDrops: epCommGetMaskedDrops of device's communicator, zeros when it
  // was never created.
  void setActiveRanks(const std::vector<int32_t>& active);
  // epCommRecover on the first communicator (creation order) whose engine has it (the host engine), then that
  // mask on the others (epCommSetActiveRanks). Returns the mask; empty when no communicator exists yet.
  std::vector<int32_t> recover();
  std::vector<int32_t> activeRanks();
  std::pair<std::vector<int64_t>, std::vector<int64_t>> maskedDrops(const at::Device& device);

 private:
  epComm_t comm(const at::Device& device);
  std::vector<std::pair<std::string, epComm_t>> createdComms();  // (key, communicator) in creation order
  c10d::Backend& inner(const at::Device& device);
  c10::Stream opStream(const at::Device& device, bool async_op);
  [[noreturn]] void fail(const char* op, epResult_t rc, epComm_t comm);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> cpu_inner_;
  c10::intrusive_ptr<c10d::Backend> cuda_inner_;
  std::mutex mu_;                        // guards comms_ (creation), not the operations
  std::map<std::string, epComm_t> comms_;  // "cpu", "cuda:<index>"
  std::vector<std::string> created_;      // comms_' keys in creation order: the same sequence on every rank
  std::map<int, c10::Stream> comm_streams_;  // CUDA device -> stream for async_op
  int creations_ = 0;
  bool closed_ = false;
};

}  // namespace epcomm_torch
