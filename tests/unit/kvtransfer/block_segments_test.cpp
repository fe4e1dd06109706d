// blockSegments: runs of consecutive blocks coalesce per layer, the memory kind travels with
// each side, and mismatched pools or bad ranges are refused with the reason.
#include "kvtransfer/block_segments.h"

#include <catch2/catch.hpp>

namespace pd::kvt {
namespace {

BlockPool pool(uintptr_t base, MemKind kind = MemKind::kHost, int device = 0) {
  return BlockPool{base, 512, 32, 4, kind, device};
}

TEST_CASE("block segments: consecutive blocks coalesce into one segment per layer", "[kvt][segments]") {
  const std::vector<int> src{3, 4, 5, 9}, dst{10, 11, 12, 13};
  auto segs = blockSegments(pool(0x10000), src, pool(0x900000), dst, 1, 3);
  REQUIRE(segs.ok());
  const size_t bb = 512, lb = 512 * 32;
  REQUIRE(segs->local.size() == 4);
  // layer 1: blocks 3-5 -> 10-12 (one run), then 9 -> 13
  CHECK(segs->local[0].addr == 0x10000 + lb + 3 * bb);
  CHECK(segs->remote[0].addr == 0x900000 + lb + 10 * bb);
  CHECK(segs->local[0].len == 3 * bb);
  CHECK(segs->local[1].addr == 0x10000 + lb + 9 * bb);
  CHECK(segs->remote[1].addr == 0x900000 + lb + 13 * bb);
  CHECK(segs->local[1].len == bb);
  // layer 2
  CHECK(segs->local[2].addr == 0x10000 + 2 * lb + 3 * bb);
  CHECK(segs->remote[3].addr == 0x900000 + 2 * lb + 13 * bb);

  // A run breaks when either side is not consecutive.
  const std::vector<int> dst2{10, 11, 20, 21};
  auto segs2 = blockSegments(pool(0x10000), src, pool(0x900000), dst2, 0, 1);
  REQUIRE(segs2.ok());
  CHECK(segs2->local.size() == 3);
  CHECK(segs2->local[0].kind == MemKind::kHost);
}

TEST_CASE("block segments: a GPU pool's segments carry its memory kind and device", "[kvt][segments]") {
  const std::vector<int> src{3, 4}, dst{7, 9};
  auto g = blockSegments(pool(0x10000, MemKind::kCuda, 1), src, pool(0x900000, MemKind::kCuda, 2), dst, 0, 2);
  REQUIRE(g.ok());
  REQUIRE(g->local.size() == 4);
  for (size_t i = 0; i < g->local.size(); ++i) {
    CHECK(g->local[i].kind == MemKind::kCuda);
    CHECK(g->local[i].device == 1);
    CHECK(g->remote[i].kind == MemKind::kCuda);
    CHECK(g->remote[i].device == 2);
  }
}

TEST_CASE("block segments: mismatched pools and bad ranges are refused with a reason", "[kvt][segments]") {
  std::vector<int> src{0, 1}, dst{0, 1};
  BlockPool wide = pool(0x900000);
  wide.blockBytes = 1024;
  auto r = blockSegments(pool(0x10000), src, wide, dst, 0, 1);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("block pools disagree"));
  CHECK(blockSegments(pool(0x10000), src, pool(0x900000), dst, 0, 5).status().code() == StatusCode::kInvalidArgument);
  CHECK(blockSegments(pool(0x10000), src, pool(0x900000), dst, 2, 2).status().code() == StatusCode::kInvalidArgument);
  dst = {0, 32};
  CHECK_THAT(blockSegments(pool(0x10000), src, pool(0x900000), dst, 0, 1).status().message(),
             Catch::Contains("target block id 32"));
  dst = {0};
  CHECK(blockSegments(pool(0x10000), src, pool(0x900000), dst, 0, 1).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pd::kvt
