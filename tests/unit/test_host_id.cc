// Host numbering shared by both engines (common/host_id.h mapHosts): hosts in the order of their lowest rank, local
// indices ascending within a host, whatever order or sizes the identities come in.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/host_id.h"

namespace epcomm {
namespace {

HostMap mapOf(const std::vector<std::string>& ids) {
  std::vector<const char*> p;
  for (const std::string& s : ids) p.push_back(s.c_str());
  return mapHosts(p);
}

TEST(HostId, HostsNumberedByTheirLowestRankLocalIndicesAscending) {
  // Interleaved, uneven hosts: b holds ranks 0, 3, 4; a holds 1; c holds 2, 5.
  const HostMap m = mapOf({"id:b", "id:a", "id:c", "id:b", "id:b", "id:c"});
  EXPECT_EQ(m.host_of, (std::vector<int>{0, 1, 2, 0, 0, 2}));
  EXPECT_EQ(m.local_idx, (std::vector<int>{0, 0, 0, 1, 2, 1}));
  ASSERT_EQ(m.ranks.size(), 3u);
  EXPECT_EQ(m.ranks[0], (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(m.ranks[1], (std::vector<int>{1}));
  EXPECT_EQ(m.ranks[2], (std::vector<int>{2, 5}));
}

TEST(HostId, OneHostAndOneRankPerHost) {
  const HostMap one = mapOf({"h", "h", "h", "h"});
  EXPECT_EQ(one.host_of, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(one.local_idx, (std::vector<int>{0, 1, 2, 3}));
  const HostMap each = mapOf({"w", "x", "y", "z"});
  EXPECT_EQ(each.host_of, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(each.local_idx, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_TRUE(mapOf({}).ranks.empty());
}

// epcomm-run --hosts H puts rank r on host r * H / R: contiguous blocks, numbered in order.
TEST(HostId, EpcommRunBlocks) {
  for (int R : {2, 4, 6, 8, 16})
    for (int H : {1, 2, 3, 4}) {
      if (H > R) continue;
      std::vector<std::string> ids;
      for (int r = 0; r < R; ++r) ids.push_back("id:" + std::to_string(r * H / R));
      const HostMap m = mapOf(ids);
      ASSERT_EQ(static_cast<int>(m.ranks.size()), H);
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(m.host_of[r], r * H / R);
        EXPECT_EQ(m.ranks[m.host_of[r]][m.local_idx[r]], r);
      }
    }
}

}  // namespace
}  // namespace epcomm
