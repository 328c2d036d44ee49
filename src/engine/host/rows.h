// Row arithmetic of the host engine's combines, shared by HT and LL: rows accumulated in fp32 and stored in
// the row type, with the same rounding as the kernels (common/dtype.h).
#pragma once
#include <cstdint>

namespace epcomm {
namespace host {

// acc[j] += w * float(src[j]) (or += float(src[j]) without a weight); fp-contract is off, so the product and the
// sum round separately, as in the kernels. rows.cc says how the loops are written and compiled.
void accumulateRowImpl(float* acc, const uint8_t* src, int H, int dt, float w, bool weighted);
inline void accumulateRow(float* acc, const uint8_t* src, int H, int dt) { accumulateRowImpl(acc, src, H, dt, 1.0f, false); }
inline void accumulateRowWeighted(float* acc, const uint8_t* src, int H, int dt, float w) {
  accumulateRowImpl(acc, src, H, dt, w, true);
}
// acc[j] += part[j] (the hierarchical combine's host partials).
void addRow(float* acc, const float* part, int H);
// dst[j] = acc[j] rounded to the row type.
void storeRow(uint8_t* dst, const float* acc, int H, int dt);

}  // namespace host
}  // namespace epcomm
