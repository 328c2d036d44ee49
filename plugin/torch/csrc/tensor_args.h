// How tensors cross into the C API: dtype codes, data pointers (a valid stand-in for empty tensors, whose
// data pointer torch leaves NULL), and the stream of a device.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <epcomm/epcomm.h>

#include <optional>

namespace epcomm_torch {

// The epcomm dtype of t, or nullopt when the C API has none (the caller then moves bytes as epUint8).
std::optional<epDataType_t> toEpDtype(at::ScalarType t);

// data_ptr() of t, or a valid dummy address for a 0-byte tensor (the C API may reject NULL there).
void* dataPtr(const at::Tensor& t);

// The current stream of device (CUDA), as the cudaStream_t the C API takes; nullptr for CPU.
c10::Stream currentStream(const at::Device& device);
epStream_t nativeStream(const c10::Stream& stream);

}  // namespace epcomm_torch
