// Streaming-store copy (stream_copy.h).
#include "common/stream_copy.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace epcomm {

namespace {
// Below this a copy stays in cache anyway and the fence it needs costs more than the lines it saves.
constexpr size_t kStreamMin = 1024;
}  // namespace

void* streamCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n < kStreamMin) return memcpy(dst, src, n);
  uint8_t* d = static_cast<uint8_t*>(dst);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  // Plain stores up to the destination's next 16-byte boundary, streaming stores of whole 16-byte words (SSE2, in
  // every x86-64 CPU) four at a time, one line per turn where the destination is line-aligned, then the tail.
  const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  for (; n >= 16; n -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  memcpy(d, s, n);
  return dst;
#else
  return memcpy(dst, src, n);
#endif
}

void streamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_release);
#endif
}

}  // namespace epcomm
