// Bootstrap wire formats: the unique id layout and the framed messages of the rendezvous and the star.
// Everything is little-endian and encoded byte by byte, so the layout does not depend on the compiler.
//
// Unique id (EP_UNIQUE_ID_BYTES = 128):
//   [0,4) magic kIdMagic | [4,8) EPCOMM_VERSION_CODE | [8,24) secret | [24,48) root address (WireAddr)
//   [48,120) zero | [120,128) FNV-1a 64 of bytes [0,120)
// Frame: a 24-byte header {u32 magic kFrameMagic, u16 type, u16 flags=0, u32 seq, u32 reserved, u64 len}
// followed by len payload bytes. Every receiver checks the magic, the type, and len against the exact (or
// maximum) size it expects before reading the payload.
//   kHello      rank -> root      {secret[16], i32 rank, i32 nranks, u32 pid, WireAddr listen}   (52 bytes)
//   kProgress   root -> ranks     {i32 arrived, i32 nranks, text: the missing ranks}           (<= 8+kMaxText)
//   kRootOk     root -> ranks     {WireAddr of rank 0's listener}                             (24 bytes)
//   kRootError  root -> ranks     {i32 epResult_t, text}                                      (<= 4+kMaxText)
//   kStarHello  rank r -> rank 0  {secret[16], i32 rank, i32 nranks}                          (24 bytes)
//   kData       allgather payload: rank r -> rank 0 its slot; rank 0 -> rank r all slots (seq checked)
//   kError      rank 0 -> rank r  {i32 epResult_t, text}: rank 0 failed the collective
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "bootstrap/bootstrap.h"
#include "bootstrap/socket.h"

namespace epcomm::bsproto {

constexpr uint32_t kIdMagic = 0x44495045u;     // "EPID"
constexpr uint32_t kFrameMagic = 0x46425045u;  // "EPBF"
constexpr size_t kIdChecksumOffset = 120;

enum FrameType : uint16_t {
  kHello = 1,
  kProgress = 2,
  kRootOk = 3,
  kRootError = 4,
  kStarHello = 5,
  kData = 6,
  kError = 7,
};

constexpr size_t kHeaderBytes = 24;
constexpr size_t kWireAddrBytes = 24;
constexpr size_t kHelloBytes = kSecretBytes + 12 + kWireAddrBytes;
constexpr size_t kStarHelloBytes = kSecretBytes + 8;
constexpr size_t kMaxText = 1024;

inline void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
inline void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
inline uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline uint64_t fnv1a64(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint32_t seq = 0;
  uint64_t len = 0;
};

inline void encodeHeader(const FrameHeader& h, uint8_t* out) {
  put32(out, h.magic);
  put16(out + 4, h.type);
  put16(out + 6, h.flags);
  put32(out + 8, h.seq);
  put32(out + 12, 0);
  put64(out + 16, h.len);
}
inline FrameHeader decodeHeader(const uint8_t* in) {
  FrameHeader h;
  h.magic = get32(in);
  h.type = get16(in + 4);
  h.flags = get16(in + 6);
  h.seq = get32(in + 8);
  h.len = get64(in + 16);
  return h;
}

// WireAddr: {u8 family (4 or 6, 0 = none), u8 0, u16 port, u32 IPv6 scope id, u8 addr[16]}
void encodeAddr(const sock::Addr& a, uint8_t* out);
bool decodeAddr(const uint8_t* in, sock::Addr* out);  // false for an unknown family

struct Hello {
  uint8_t secret[kSecretBytes] = {};
  int32_t rank = 0;
  int32_t nranks = 0;
  uint32_t pid = 0;
  sock::Addr listen;  // family 0 (none) for ranks other than 0
};
void encodeHello(const Hello& h, uint8_t* out);  // kHelloBytes
bool decodeHello(const uint8_t* in, Hello* h);

// What an id carries, after bootstrapCheckUniqueId accepted it.
struct IdInfo {
  sock::Addr root;
  uint8_t secret[kSecretBytes] = {};
};
epResult_t decodeUniqueId(const epUniqueId* id, IdInfo* info);

// Constant-time comparison of two secrets.
inline bool secretEqual(const uint8_t* a, const uint8_t* b) {
  uint8_t d = 0;
  for (size_t i = 0; i < kSecretBytes; ++i) d |= static_cast<uint8_t>(a[i] ^ b[i]);
  return d == 0;
}

// Test hook: called on rank 0 with the address of its star listener right after it opens it (before the
// rendezvous), so that a test can aim a stranger at it. nullptr (the default) disables it.
using StarListenHook = void (*)(const sock::Addr& listen);
void setStarListenHookForTest(StarListenHook hook);

}  // namespace epcomm::bsproto
