// Element types and their conversions, shared by host and device code. Rounding is round-to-nearest-even
// everywhere, so the host engine and the kernels produce the same bits.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/hd.h"
#include "epcomm/epcomm.h"

namespace epcomm {

EP_HD size_t dtypeSize(int dt) {
  switch (dt) {
    case epFloat32: return 4;
    case epFloat16: return 2;
    case epBfloat16: return 2;
    case epFloat8E4M3: return 1;
    case epInt32: return 4;
    case epInt64: return 8;
    case epUint8: return 1;
    default: return 0;
  }
}

EP_HD const char* dtypeName(int dt) {
  switch (dt) {
    case epFloat32: return "fp32";
    case epFloat16: return "fp16";
    case epBfloat16: return "bf16";
    case epFloat8E4M3: return "fp8_e4m3";
    case epInt32: return "int32";
    case epInt64: return "int64";
    case epUint8: return "uint8";
    default: return "unknown";
  }
}

EP_HD uint32_t floatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
EP_HD float bitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// bfloat16 <-> float
EP_HD float bf16ToFloat(uint16_t h) { return bitsFloat(static_cast<uint32_t>(h) << 16); }
EP_HD uint16_t floatToBf16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float
EP_HD float fp16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bitsFloat(sign);
    // subnormal: value = man * 2^-24
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return (sign != 0) ? -v : v;
  }
  if (exp == 31) return bitsFloat(sign | 0x7f800000u | (man << 13));
  return bitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}
EP_HD uint16_t floatToFp16(float f) {
  uint32_t u = floatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (a < 0x38800000u) {                                                // below the smallest normal: subnormal
    if (a < 0x33000000u) return sign;                                   // < 2^-25 rounds to 0
    uint32_t exp = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // value = man * 2^(exp-150); half subnormal unit = 2^-24
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

// fp8 e4m3fn (no infinities; 0x7f/0xff are NaN; max finite 448). Conversion saturates to +-448.
constexpr float kFp8Max = 448.0f;
EP_HD float fp8ToFloat(uint8_t v) {
  uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xfu;
  uint32_t man = v & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bitsFloat(0x7fc00000u | sign);
  if (exp == 0) {
    float m = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
    return sign ? -m : m;
  }
  return bitsFloat(sign | ((exp + 120u) << 23) | (man << 20));
}
EP_HD uint8_t floatToFp8(float f) {
  uint32_t u = floatBits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448: saturate
  if (a < 0x3c800000u) {                                              // < 2^-6: subnormal range, unit 2^-9
    if (a <= 0x3a800000u) return sign;                                // <= 2^-10 (half a unit) rounds to 0
    uint32_t exp = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 141u - exp;  // value = man * 2^(exp-150); unit 2^-9 => q = man >> (141 - exp)
    if (shift >= 32u) return sign;
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);  // q == 8 carries into the smallest normal correctly
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t v = (r - 0x3c000000u) >> 20;  // rebias exponent 127 -> 7
  if (v > 0x7eu) v = 0x7eu;
  return static_cast<uint8_t>(sign | v);
}

// Loads and stores of one element of a floating type as float.
EP_HD float loadAsFloat(const void* base, size_t i, int dt) {
  switch (dt) {
    case epFloat32: return static_cast<const float*>(base)[i];
    case epFloat16: return fp16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case epBfloat16: return bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case epFloat8E4M3: return fp8ToFloat(static_cast<const uint8_t*>(base)[i]);
    default: return 0.0f;
  }
}
EP_HD void storeFromFloat(void* base, size_t i, int dt, float v) {
  switch (dt) {
    case epFloat32: static_cast<float*>(base)[i] = v; break;
    case epFloat16: static_cast<uint16_t*>(base)[i] = floatToFp16(v); break;
    case epBfloat16: static_cast<uint16_t*>(base)[i] = floatToBf16(v); break;
    case epFloat8E4M3: static_cast<uint8_t*>(base)[i] = floatToFp8(v); break;
    default: break;
  }
}

// LL fp8 quantization of one 128-column block: scale = amax / 448 with amax floored at 1e-4 (an all-zero
// block gets a tiny, finite scale), values multiplied by 448 / amax and converted with saturation.
constexpr float kFp8AmaxFloor = 1e-4f;
EP_HD float fp8BlockScale(float amax) { return (amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax) / kFp8Max; }
EP_HD float fp8BlockScaleInv(float amax) { return kFp8Max / (amax < kFp8AmaxFloor ? kFp8AmaxFloor : amax); }

}  // namespace epcomm
