// Row arithmetic of the host engine's combines, shared by HT and LL: rows accumulated in fp32 and stored in
// the row type, with the same rounding as the kernels (common/dtype.h).
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype.h"
#include "epcomm/epcomm.h"

namespace epcomm {
namespace host {

// acc[j] += w * float(src[j]) (or += float(src[j]) without a weight), one loop per type so that the
// compiler vectorizes it; fp-contract is off, so the product and the sum round separately, as in the kernels.
template <typename Load>
inline void accumulate(float* acc, int H, const Load& load, float w, bool weighted) {
  if (weighted)
    for (int j = 0; j < H; ++j) {
      float prod = w * load(j);
      acc[j] = acc[j] + prod;
    }
  else
    for (int j = 0; j < H; ++j) acc[j] = acc[j] + load(j);
}

inline void accumulateRowImpl(float* acc, const uint8_t* src, int H, int dt, float w, bool weighted) {
  const uint16_t* h16 = reinterpret_cast<const uint16_t*>(src);
  const float* f32 = reinterpret_cast<const float*>(src);
  switch (dt) {
    case epBfloat16: accumulate(acc, H, [&](int j) { return bf16ToFloat(h16[j]); }, w, weighted); break;
    case epFloat16: accumulate(acc, H, [&](int j) { return fp16ToFloat(h16[j]); }, w, weighted); break;
    default: accumulate(acc, H, [&](int j) { return f32[j]; }, w, weighted); break;
  }
}
inline void accumulateRow(float* acc, const uint8_t* src, int H, int dt) { accumulateRowImpl(acc, src, H, dt, 1.0f, false); }
inline void accumulateRowWeighted(float* acc, const uint8_t* src, int H, int dt, float w) {
  accumulateRowImpl(acc, src, H, dt, w, true);
}

inline void storeRow(uint8_t* dst, const float* acc, int H, int dt) {
  uint16_t* h16 = reinterpret_cast<uint16_t*>(dst);
  switch (dt) {
    case epBfloat16: for (int j = 0; j < H; ++j) h16[j] = floatToBf16(acc[j]); break;
    case epFloat16: for (int j = 0; j < H; ++j) h16[j] = floatToFp16(acc[j]); break;
    default: memcpy(dst, acc, sizeof(float) * H); break;
  }
}

}  // namespace host
}  // namespace epcomm
