#include "tensor_args.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace epcomm_torch {

std::optional<epDataType_t> toEpDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return epFloat32;
    case at::kHalf: return epFloat16;
    case at::kBFloat16: return epBfloat16;
    case at::kFloat8_e4m3fn: return epFloat8E4M3;
    case at::kInt: return epInt32;
    case at::kLong: return epInt64;
    case at::kByte: return epUint8;
    default: return std::nullopt;
  }
}

void* dataPtr(const at::Tensor& t) {
  static uint64_t dummy[2];
  void* p = t.data_ptr();
  return p != nullptr ? p : static_cast<void*>(dummy);
}

c10::Stream currentStream(const at::Device& device) {
  // Device-generic: no CUDA headers are needed to build against a CUDA torch.
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

epStream_t nativeStream(const c10::Stream& stream) {
  if (stream.device_type() != c10::DeviceType::CUDA) return nullptr;
  return static_cast<epStream_t>(stream.native_handle());
}

}  // namespace epcomm_torch
