// ShmRegion's private variant (createPrivate), which holds the GPU proxy's inboxes: the ring layout of a shared
// region in anonymous memory of this process, so that its size (8 MiB per rank of the communicator by default) is
// not bounded by /dev/shm, which containers cap at 64 MiB unless told otherwise.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "transport/shm/shm.h"

namespace {

// The /proc/self/maps line of the mapping that holds `p` (empty if none does).
std::string mappingOf(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream in(line);
    in >> std::hex >> lo >> dash >> hi;
    if (a >= lo && a < hi) return line;
  }
  return "";
}

TEST(ShmRegion, PrivateRegionHoldsEveryRingOutsideDevShm) {
  constexpr int kRanks = 16;
  constexpr size_t kRing = 8u << 20;  // 16 rings of the GPU proxy's default: 128 MiB, twice a container's /dev/shm
  epcomm::ShmRegion region;
  ASSERT_EQ(region.createPrivate(3, kRanks, 1, kRing), epSuccess);
  EXPECT_EQ(region.header()->rank, 3);
  EXPECT_EQ(region.header()->nranks, kRanks);
  const std::string map = mappingOf(region.base());
  ASSERT_FALSE(map.empty());
  EXPECT_EQ(map.find("/dev/shm"), std::string::npos) << map;
  // Every ring starts empty and takes bytes at its end, its neighbours' counters untouched.
  for (int src = 0; src < kRanks; ++src) {
    epcomm::RingEnd producer(region.ringCtl(src, 0), region.ringData(src, 0), kRing);
    ASSERT_EQ(producer.freeBytes(), kRing) << "ring " << src;
    region.ringData(src, 0)[kRing - 1] = static_cast<uint8_t>(src);
    region.ringCtl(src, 0)->tail.store(kRing, std::memory_order_release);
  }
  for (int src = 0; src < kRanks; ++src) {
    epcomm::RingEnd consumer(region.ringCtl(src, 0), region.ringData(src, 0), kRing);
    EXPECT_EQ(consumer.available(), kRing) << "ring " << src;
    EXPECT_EQ(region.ringData(src, 0)[kRing - 1], static_cast<uint8_t>(src)) << "ring " << src;
  }
}

}  // namespace
