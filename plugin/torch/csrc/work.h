// Work of the epcomm backend. CPU (host engine): the operation has completed, or thrown, before the Work
// exists. CUDA (GPU engine): the operation is enqueued on a stream and an event marks its end; wait() makes
// the caller's current stream wait for that event (it does not block the CPU), as NCCL's Work does.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <optional>
#include <vector>

namespace epcomm_torch {

class EpWork : public c10d::Work {
 public:
  // stream: where a CUDA operation was enqueued (nullopt for CPU).
  EpWork(int rank, c10d::OpType op, std::vector<at::Tensor> outputs, std::optional<c10::Stream> stream);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<c10::Event> event_;  // CUDA only
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace epcomm_torch
