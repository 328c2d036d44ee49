// Row arithmetic of the host engine's combines (rows.h).
#include "engine/host/rows.h"

#include <cstring>

#include "common/dtype.h"
#include "epcomm/epcomm.h"

// Each row function is compiled twice, for AVX2 and for the baseline, and the loader picks one by the CPU
// (target_clones): the loops below then run on 8 floats at a time instead of 4. The operations and their order
// are the same in both (no FMA: fp-contract is off), so the results are bit-identical either way.
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define EPCOMM_ROW_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef EPCOMM_ROW_CLONES
#define EPCOMM_ROW_CLONES
#endif

namespace epcomm {
namespace host {

// acc[j] += w * float(src[j]) (or += float(src[j]) without a weight), one loop per type; fp-contract is off, so
// the product and the sum round separately, as in the kernels. The loops run in blocks of kBlock columns with a
// fixed trip count (then the tail column by column) through restrict pointers: at -O2 the compiler vectorizes
// only loops that need neither a runtime alias check (a float row against a byte pointer, which may alias
// anything) nor a scalar epilogue, so the plain loops over H ran one column at a time, and they were the largest
// part of the host combines' CPU time. Every element gets the same operations in the same order as before, so the
// results are bit-identical.
constexpr int kBlock = 16;

template <typename Load>
inline void accumulate(float* __restrict acc, int H, const Load& load, float w, bool weighted) {
  int j = 0;
  if (weighted) {
    for (; j + kBlock <= H; j += kBlock)
      for (int k = 0; k < kBlock; ++k) {
        const float prod = w * load(j + k);
        acc[j + k] = acc[j + k] + prod;
      }
    for (; j < H; ++j) {
      const float prod = w * load(j);
      acc[j] = acc[j] + prod;
    }
  } else {
    for (; j + kBlock <= H; j += kBlock)
      for (int k = 0; k < kBlock; ++k) acc[j + k] = acc[j + k] + load(j + k);
    for (; j < H; ++j) acc[j] = acc[j] + load(j);
  }
}

EPCOMM_ROW_CLONES void accumulateRowImpl(float* __restrict acc, const uint8_t* __restrict src, int H, int dt, float w,
                                          bool weighted) {
  switch (dt) {
    case epBfloat16: {
      const uint16_t* __restrict h16 = reinterpret_cast<const uint16_t*>(src);
      accumulate(acc, H, [h16](int j) { return bf16ToFloat(h16[j]); }, w, weighted);
      break;
    }
    case epFloat16: {
      const uint16_t* __restrict h16 = reinterpret_cast<const uint16_t*>(src);
      accumulate(acc, H, [h16](int j) { return fp16ToFloat(h16[j]); }, w, weighted);
      break;
    }
    default: {
      const float* __restrict f32 = reinterpret_cast<const float*>(src);
      accumulate(acc, H, [f32](int j) { return f32[j]; }, w, weighted);
      break;
    }
  }
}

EPCOMM_ROW_CLONES void addRow(float* __restrict acc, const float* __restrict part, int H) {
  int j = 0;
  for (; j + kBlock <= H; j += kBlock)
    for (int k = 0; k < kBlock; ++k) acc[j + k] = acc[j + k] + part[j + k];
  for (; j < H; ++j) acc[j] = acc[j] + part[j];
}

EPCOMM_ROW_CLONES void storeRow(uint8_t* __restrict dst, const float* __restrict acc, int H, int dt) {
  switch (dt) {
    case epBfloat16: {
      uint16_t* __restrict h16 = reinterpret_cast<uint16_t*>(dst);
      int j = 0;
      for (; j + kBlock <= H; j += kBlock)
        for (int k = 0; k < kBlock; ++k) h16[j + k] = floatToBf16(acc[j + k]);
      for (; j < H; ++j) h16[j] = floatToBf16(acc[j]);
      break;
    }
    case epFloat16: {
      uint16_t* __restrict h16 = reinterpret_cast<uint16_t*>(dst);
      for (int j = 0; j < H; ++j) h16[j] = floatToFp16(acc[j]);
      break;
    }
    default: memcpy(dst, acc, sizeof(float) * H); break;
  }
}

}  // namespace host
}  // namespace epcomm
