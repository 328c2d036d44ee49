#include "work.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace epcomm_torch {

EpWork::EpWork(int rank, c10d::OpType op, std::vector<at::Tensor> outputs, std::optional<c10::Stream> stream)
    : c10d::Work(rank, op), outputs_(std::move(outputs)) {
  std::vector<c10::Device> devices;
  if (stream) {
    devices.push_back(stream->device());
    event_ = std::make_shared<c10::Event>(stream->device_type());
    event_->record(*stream);
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
  if (stream) {
    // The future records its own events on the current stream: make that the operation's stream.
    c10::StreamGuard guard(*stream);
    future_->markCompleted(c10::IValue(outputs_));
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

bool EpWork::isCompleted() { return !event_ || event_->query(); }

bool EpWork::isSuccess() const { return true; }  // failures throw from the collective call itself

bool EpWork::wait(std::chrono::milliseconds /*timeout*/) {
  if (event_) {
    c10::impl::VirtualGuardImpl impl(event_->device_type());
    event_->block(impl.getStream(event_->device()));
  }
  return true;
}

void EpWork::synchronize() { wait(); }

std::vector<at::Tensor> EpWork::result() { return outputs_; }

c10::intrusive_ptr<c10::ivalue::Future> EpWork::getFuture() { return future_; }

}  // namespace epcomm_torch
