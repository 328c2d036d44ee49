// Element conversions of src/common/dtype.h checked against independent references:
//  - fp16: the compiler's _Float16 (exhaustive over all 65536 patterns, random floats, ties);
//  - bf16: exhaustive roundtrip, and a nearest-even search in double precision;
//  - fp8 e4m3fn: a value table built from the format's definition and a brute-force nearest-even search.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype.h"

namespace {

using epcomm::bf16ToFloat;
using epcomm::floatToBf16;
using epcomm::floatToFp16;
using epcomm::floatToFp8;
using epcomm::fp16ToFloat;
using epcomm::fp8ToFloat;

uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float fromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t halfBits(_Float16 h) {
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
_Float16 halfFromBits(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return h;
}
bool isNanHalf(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool isNanBf16(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }
bool isNanFp8(uint8_t v) { return (v & 0x7fu) == 0x7fu; }

// A seeded generator; the seed is printed so that a failure can be reproduced (EPCOMM_TEST_SEED overrides).
uint64_t testSeed() {
  static uint64_t seed = [] {
    const char* env = std::getenv("EPCOMM_TEST_SEED");
    uint64_t s = env ? std::strtoull(env, nullptr, 0) : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                                             std::random_device{}();
    std::printf("test_dtype seed: EPCOMM_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Floats that exercise every region: uniform bit patterns (NaN, inf, subnormals, huge), values of moderate
// exponent, and exact specials.
std::vector<float> interestingFloats(std::mt19937_64& rng, size_t n_random, int exp_lo, int exp_hi) {
  std::vector<float> v;
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            fromBits(0x7f800001u),  // signalling NaN
                            fromBits(0xffbfffffu),
                            std::numeric_limits<float>::denorm_min(),
                            -std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            1.0f,
                            -1.0f,
                            448.0f,
                            464.0f,
                            480.0f,
                            65504.0f,
                            65519.99f,
                            65520.0f,
                            -65520.0f,
                            65536.0f};
  for (float f : specials) v.push_back(f);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_int_distribution<int> expd(exp_lo, exp_hi);
  for (size_t i = 0; i < n_random; ++i) {
    v.push_back(fromBits(bits(rng)));  // anything
    // sign, exponent in range, random mantissa
    uint32_t sign = bits(rng) & 0x80000000u;
    int e = expd(rng);
    uint32_t u = sign | (static_cast<uint32_t>(e + 127) << 23) | (bits(rng) & 0x7fffffu);
    v.push_back(fromBits(u));
    // float subnormals
    v.push_back(fromBits(sign | (bits(rng) & 0x7fffffu)));
  }
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// fp16
// ---------------------------------------------------------------------------------------------------------
TEST(Dtype, Fp16ToFloatExhaustive) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    float got = fp16ToFloat(static_cast<uint16_t>(h));
    float want = static_cast<float>(halfFromBits(static_cast<uint16_t>(h)));
    if (isNanHalf(static_cast<uint16_t>(h))) {
      if (!std::isnan(got) && bad++ < 10) ADD_FAILURE() << "fp16ToFloat(0x" << std::hex << h << ") not NaN";
      if (std::isnan(got) && std::signbit(got) != std::signbit(want) && bad++ < 10)
        ADD_FAILURE() << "fp16ToFloat(0x" << std::hex << h << ") NaN sign";
      continue;
    }
    if (bitsOf(got) != bitsOf(want) && bad++ < 10)
      ADD_FAILURE() << "fp16ToFloat(0x" << std::hex << h << ") = 0x" << bitsOf(got) << " want 0x" << bitsOf(want);
  }
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, Fp16RoundtripExhaustive) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t hh = static_cast<uint16_t>(h);
    uint16_t back = floatToFp16(fp16ToFloat(hh));
    if (isNanHalf(hh)) {
      if (!isNanHalf(back) && bad++ < 10) ADD_FAILURE() << "NaN 0x" << std::hex << h << " -> 0x" << back;
      continue;
    }
    if (back != hh && bad++ < 10) ADD_FAILURE() << "roundtrip 0x" << std::hex << h << " -> 0x" << back;
  }
  EXPECT_EQ(bad, 0);
}

void checkFloatToFp16(float f, int& bad) {
  uint16_t got = floatToFp16(f);
  uint16_t want = halfBits(static_cast<_Float16>(f));
  if (std::isnan(f)) {
    if (!isNanHalf(got) && bad++ < 10)
      ADD_FAILURE() << "floatToFp16(NaN 0x" << std::hex << bitsOf(f) << ") = 0x" << got << " not NaN";
    return;
  }
  if (got != want && bad++ < 10)
    ADD_FAILURE() << "floatToFp16(" << f << " = 0x" << std::hex << bitsOf(f) << ") = 0x" << got << " want 0x"
                  << want;
}

TEST(Dtype, Fp16FromFloatRandom) {
  std::mt19937_64 rng(testSeed() ^ 0x16);
  int bad = 0;
  for (float f : interestingFloats(rng, 400000, -30, 17)) checkFloatToFp16(f, bad);
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, Fp16FromFloatTies) {
  // Midpoints between adjacent fp16 values (normal and subnormal) and their float neighbours.
  int bad = 0;
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    for (uint32_t s : {0u, 0x8000u}) {
      double a = fp16ToFloat(static_cast<uint16_t>(h | s));
      double b = (h + 1 == 0x7c00u) ? (s ? -65536.0 : 65536.0) : fp16ToFloat(static_cast<uint16_t>((h + 1) | s));
      float mid = static_cast<float>((a + b) / 2);  // exact: 12 significant bits fit a float
      ASSERT_EQ(static_cast<double>(mid), (a + b) / 2);
      checkFloatToFp16(mid, bad);
      checkFloatToFp16(std::nextafter(mid, 0.0f), bad);
      checkFloatToFp16(std::nextafter(mid, std::numeric_limits<float>::infinity()), bad);
      checkFloatToFp16(std::nextafter(mid, -std::numeric_limits<float>::infinity()), bad);
    }
  }
  EXPECT_EQ(bad, 0);
}

// ---------------------------------------------------------------------------------------------------------
// bf16
// ---------------------------------------------------------------------------------------------------------
// Independent reference: the two bf16 neighbours of f (truncation and the next code), distance measured in
// double, ties to the even code. Overflow: the code after 0x7f7f is infinity, treated as 2^128 for distance.
uint16_t refFloatToBf16(float f) {
  uint32_t u = bitsOf(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  uint16_t lo = static_cast<uint16_t>(a >> 16);
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | lo);  // inf (NaN is handled by the caller)
  uint16_t hi = static_cast<uint16_t>(lo + 1);
  auto val = [](uint16_t c) { return c == 0x7f80u ? std::ldexp(1.0, 128) : static_cast<double>(bf16ToFloat(c)); };
  double x = std::fabs(static_cast<double>(f));
  double dl = x - val(lo), dh = val(hi) - x;
  uint16_t r;
  if (dl < dh) r = lo;
  else if (dh < dl) r = hi;
  else r = (lo & 1u) ? hi : lo;
  return static_cast<uint16_t>(sign | r);
}

TEST(Dtype, Bf16RoundtripExhaustive) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t hh = static_cast<uint16_t>(h);
    float f = bf16ToFloat(hh);
    if (bitsOf(f) != (h << 16) && bad++ < 10) ADD_FAILURE() << "bf16ToFloat(0x" << std::hex << h << ")";
    uint16_t back = floatToBf16(f);
    if (isNanBf16(hh)) {
      if (!isNanBf16(back) && bad++ < 10) ADD_FAILURE() << "NaN 0x" << std::hex << h << " -> 0x" << back;
      continue;
    }
    if (back != hh && bad++ < 10) ADD_FAILURE() << "roundtrip 0x" << std::hex << h << " -> 0x" << back;
  }
  EXPECT_EQ(bad, 0);
}

void checkFloatToBf16(float f, int& bad) {
  uint16_t got = floatToBf16(f);
  if (std::isnan(f)) {
    if (!isNanBf16(got) && bad++ < 10)
      ADD_FAILURE() << "floatToBf16(NaN 0x" << std::hex << bitsOf(f) << ") = 0x" << got << " not NaN";
    return;
  }
  uint16_t want = refFloatToBf16(f);
  if (got != want && bad++ < 10)
    ADD_FAILURE() << "floatToBf16(" << f << " = 0x" << std::hex << bitsOf(f) << ") = 0x" << got << " want 0x"
                  << want;
}

TEST(Dtype, Bf16FromFloatRandomAndTies) {
  std::mt19937_64 rng(testSeed() ^ 0xbf16);
  int bad = 0;
  for (float f : interestingFloats(rng, 400000, -130, 127)) checkFloatToBf16(f, bad);
  // ties and neighbours: low 16 bits exactly 0x8000, and +-1 of it, for random upper halves
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t hi = bits(rng) & 0xffff0000u;
    for (uint32_t low : {0x8000u, 0x7fffu, 0x8001u, 0x0000u, 0xffffu}) checkFloatToBf16(fromBits(hi | low), bad);
  }
  // the largest finite values and their rounding to infinity
  for (uint32_t u = 0x7f7f0000u; u <= 0x7f7fffffu; ++u) {
    checkFloatToBf16(fromBits(u), bad);
    checkFloatToBf16(fromBits(u | 0x80000000u), bad);
  }
  EXPECT_EQ(bad, 0);
}

// ---------------------------------------------------------------------------------------------------------
// fp8 e4m3fn
// ---------------------------------------------------------------------------------------------------------
// Value of each code from the format's definition: sign, 4-bit exponent with bias 7, 3-bit mantissa,
// exponent 0 = subnormal (m/8 * 2^-6), S.1111.111 = NaN, no infinities.
double fp8Definition(uint8_t v) {
  int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(Dtype, Fp8ToFloatAllCodes) {
  int bad = 0;
  for (int v = 0; v < 256; ++v) {
    float got = fp8ToFloat(static_cast<uint8_t>(v));
    double want = fp8Definition(static_cast<uint8_t>(v));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code 0x" << std::hex << v;
      EXPECT_EQ(v == 0x7f || v == 0xff, true);
      continue;
    }
    if ((static_cast<double>(got) != want || std::signbit(got) != std::signbit(want)) && bad++ < 10)
      ADD_FAILURE() << "fp8ToFloat(0x" << std::hex << v << ") = " << got << " want " << want;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(fp8ToFloat(0x7e), 448.0f);
  EXPECT_EQ(fp8ToFloat(0xfe), -448.0f);
  EXPECT_EQ(fp8ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(Dtype, Fp8RoundtripAllCodes) {
  for (int v = 0; v < 256; ++v) {
    uint8_t c = static_cast<uint8_t>(v);
    uint8_t back = floatToFp8(fp8ToFloat(c));
    if (isNanFp8(c)) {
      EXPECT_TRUE(isNanFp8(back)) << "code 0x" << std::hex << v;
    } else {
      EXPECT_EQ(back, c) << "code 0x" << std::hex << v;
    }
  }
}

// Brute force: the nearest of the 127 finite magnitudes (codes 0x00..0x7e), ties to the even code; the
// sign copied (so -tiny -> 0x80); magnitudes >= 448 and infinities saturate to 448.
uint8_t refFloatToFp8(float f) {
  uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  double x = std::fabs(static_cast<double>(f));
  if (x >= 448.0) return static_cast<uint8_t>(sign | 0x7e);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    double d = std::fabs(fp8Definition(static_cast<uint8_t>(c)) - x);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

void checkFloatToFp8(float f, int& bad) {
  uint8_t got = floatToFp8(f);
  if (std::isnan(f)) {
    if (!isNanFp8(got) && bad++ < 10)
      ADD_FAILURE() << "floatToFp8(NaN 0x" << std::hex << bitsOf(f) << ") = 0x" << int(got) << " not NaN";
    return;
  }
  uint8_t want = refFloatToFp8(f);
  if (got != want && bad++ < 10)
    ADD_FAILURE() << "floatToFp8(" << f << " = 0x" << std::hex << bitsOf(f) << ") = 0x" << int(got) << " want 0x"
                  << int(want);
}

TEST(Dtype, Fp8FromFloatRandom) {
  std::mt19937_64 rng(testSeed() ^ 0xf8);
  int bad = 0;
  for (float f : interestingFloats(rng, 60000, -14, 10)) checkFloatToFp8(f, bad);
  EXPECT_EQ(bad, 0);
}

TEST(Dtype, Fp8FromFloatTies) {
  int bad = 0;
  // midpoints between adjacent finite values, neighbours of the midpoints, the values themselves
  for (int c = 0; c < 0x7e; ++c) {
    for (double s : {1.0, -1.0}) {
      double a = fp8Definition(static_cast<uint8_t>(c)), b = fp8Definition(static_cast<uint8_t>(c + 1));
      float mid = static_cast<float>(s * (a + b) / 2);
      ASSERT_EQ(static_cast<double>(mid), s * (a + b) / 2);
      for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), std::nextafter(mid, -1e9f),
                      static_cast<float>(s * a), static_cast<float>(s * b)})
        checkFloatToFp8(f, bad);
    }
  }
  // around the saturation point and the rounding of values between 448 and 480
  for (float f : {447.99f, 448.0f, 448.01f, 460.0f, 463.99f, 464.0f, 464.01f, 479.9f, 480.0f, 1e6f, 3e38f}) {
    checkFloatToFp8(f, bad);
    checkFloatToFp8(-f, bad);
  }
  // every float in [2^-12, 2^-5] with a coarse step through the mantissa (subnormal region and first binade)
  for (uint32_t u = 0x39800000u; u <= 0x3d000000u; u += 0x101u) {
    checkFloatToFp8(fromBits(u), bad);
    checkFloatToFp8(fromBits(u | 0x80000000u), bad);
  }
  EXPECT_EQ(bad, 0);
}

// loadAsFloat / storeFromFloat dispatch to the conversions above.
TEST(Dtype, LoadStoreDispatch) {
  uint8_t buf[16] = {};
  for (float f : {1.5f, -3.25f, 0.1f, 300.0f}) {
    epcomm::storeFromFloat(buf, 1, epFloat32, f);
    EXPECT_EQ(epcomm::loadAsFloat(buf, 1, epFloat32), f);
    epcomm::storeFromFloat(buf, 1, epBfloat16, f);
    EXPECT_EQ(epcomm::loadAsFloat(buf, 1, epBfloat16), bf16ToFloat(floatToBf16(f)));
    epcomm::storeFromFloat(buf, 1, epFloat16, f);
    EXPECT_EQ(epcomm::loadAsFloat(buf, 1, epFloat16), fp16ToFloat(floatToFp16(f)));
    epcomm::storeFromFloat(buf, 1, epFloat8E4M3, f);
    EXPECT_EQ(epcomm::loadAsFloat(buf, 1, epFloat8E4M3), fp8ToFloat(floatToFp8(f)));
  }
  EXPECT_EQ(epcomm::dtypeSize(epFloat8E4M3), 1u);
  EXPECT_EQ(epcomm::dtypeSize(epBfloat16), 2u);
  EXPECT_EQ(epcomm::dtypeSize(epInt64), 8u);
  // block scales: amax / 448 with the floor
  EXPECT_EQ(epcomm::fp8BlockScale(448.0f), 1.0f);
  EXPECT_EQ(epcomm::fp8BlockScaleInv(448.0f), 1.0f);
  EXPECT_EQ(epcomm::fp8BlockScale(0.0f), 1e-4f / 448.0f);
  EXPECT_TRUE(std::isfinite(epcomm::fp8BlockScaleInv(0.0f)));
}

}  // namespace
