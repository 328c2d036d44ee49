// fp8 e4m3 conversion on the device: the hardware instruction with the host's bits (common/dtype.h floatToFp8).
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

namespace epcomm {
namespace dev {

// Two floats to e4m3 (a in the low byte) by the hardware conversion (round to nearest even, saturated to +-448):
// the same bits as floatToFp8 for every float, NaN's sign included, which the conversion drops and is put back
// here (tests/gpu/test_gpu_ll.cu Fp8Conversion checks all 2^32 inputs). About 20 instructions fewer per value than
// the portable version, which LL fp8 dispatches with eight destinations per row feel.
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  uint32_t r = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  if (a != a) r = (r & 0xff00u) | ((__float_as_uint(a) >> 24) & 0x80u) | 0x7fu;
  if (b != b) r = (r & 0x00ffu) | ((((__float_as_uint(b) >> 24) & 0x80u) | 0x7fu) << 8);
  return r;
}

}  // namespace dev
}  // namespace epcomm
