// SegmentMatcher (kvtransfer/segment_matcher.h): the segment checks every transport's post()
// shares, and the words it refuses in.
#include "kvtransfer/segment_matcher.h"

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::kvt;
using Catch::Contains;

namespace {
MemDesc host(uintptr_t addr, size_t len) { return MemDesc{addr, len, 0, MemKind::kHost}; }
MemDesc cuda(uintptr_t addr, size_t len, int device) { return MemDesc{addr, len, device, MemKind::kCuda}; }
}  // namespace

TEST_CASE("segment matcher: every pair finds its registration and its key", "[kvt][segments]") {
  SegmentMatcher m("tcp transport");
  m.addRegion(7, host(0x1000, 0x1000));
  m.addRegion(9, host(0x8000, 0x100));
  const std::vector<KeyRange> keys{{0x100000, 0x1000}, {0x200000, 0x1000}};
  auto r = m.match({host(0x1000, 16), host(0x8010, 32), host(0x1ff0, 16)},
                   {MemDesc{0x200000, 16}, MemDesc{0x100010, 32}, MemDesc{0x100ff0, 16}}, keys, "decode-0");
  REQUIRE(r.ok());
  REQUIRE(r->size() == 3);
  CHECK((*r)[0].index == 0);
  CHECK((*r)[0].region == 7);
  CHECK((*r)[0].key == 1);
  CHECK((*r)[1].region == 9);
  CHECK((*r)[1].key == 0);
  CHECK((*r)[2].region == 7);  // the region's last byte
  CHECK((*r)[2].key == 0);     // the key's last byte
}

TEST_CASE("segment matcher: empty pairs are skipped, empty lists are fine", "[kvt][segments]") {
  SegmentMatcher m("ucx");
  m.addRegion(1, host(0x1000, 0x100));
  auto none = m.match({}, {}, {}, "p");
  REQUIRE(none.ok());
  CHECK(none->empty());
  // An empty pair is not checked against anything (it moves nothing).
  auto r = m.match({host(0x9999, 0), host(0x1000, 8)}, {MemDesc{0x5, 0}, MemDesc{0x10, 8}}, {{0x10, 8}}, "p");
  REQUIRE(r.ok());
  REQUIRE(r->size() == 1);
  CHECK((*r)[0].index == 1);
}

TEST_CASE("segment matcher: each refusal names the segment and what is wrong", "[kvt][segments]") {
  SegmentMatcher m("verbs");
  m.addRegion(1, host(0x1000, 0x100));
  m.addRegion(2, cuda(0x4000, 0x100, 1));
  const std::vector<KeyRange> keys{{0x10000, 0x100}};

  auto count = m.match({host(0x1000, 8)}, {}, keys, "prefill-3");
  CHECK(count.status().code() == StatusCode::kInvalidArgument);
  CHECK(count.status().message() == "verbs: 1 local segments but 0 remote segments");

  auto len = m.match({host(0x1000, 8), host(0x1008, 8)}, {MemDesc{0x10000, 8}, MemDesc{0x10008, 4}}, keys, "prefill-3");
  CHECK(len.status().code() == StatusCode::kInvalidArgument);
  CHECK(len.status().message() == "verbs: segment 1: local length 8 != remote length 4");

  auto outside = m.match({host(0x10f8, 16)}, {MemDesc{0x10000, 16}}, keys, "prefill-3");
  CHECK(outside.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(outside.status().message(),
             Contains("verbs: segment 0: local") && Contains("is not inside memory registered with this transport"));

  // The right addresses but other memory (host memory named as the device region) is named so.
  auto kind = m.match({host(0x4000, 16)}, {MemDesc{0x10000, 16}}, keys, "prefill-3");
  CHECK(kind.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(kind.status().message(), Contains("holds its addresses but is other memory"));
  auto device = m.match({cuda(0x4000, 16, 0)}, {MemDesc{0x10000, 16}}, keys, "prefill-3");
  CHECK_THAT(device.status().message(), Contains("is not inside memory registered"));
  CHECK(m.match({cuda(0x4000, 16, 1)}, {MemDesc{0x10000, 16}}, keys, "prefill-3").ok());

  auto remote =
      m.match({host(0x1000, 8), host(0x1010, 8)}, {MemDesc{0x10000, 8}, MemDesc{0x100fc, 8}}, keys, "prefill-3");
  CHECK(remote.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(remote.status().message(), Contains("verbs: segment 1: remote") &&
                                            Contains("is not inside any region peer 'prefill-3' exposed") &&
                                            Contains("1 key(s) loaded"));
}

TEST_CASE("segment matcher: ranges that wrap the address space never match", "[kvt][segments]") {
  SegmentMatcher m("tcp transport");
  m.addRegion(1, host(0x1000, 0x100));
  const std::vector<KeyRange> keys{{0x10000, 0x100}};
  const uintptr_t top = ~uintptr_t(0) - 7;
  CHECK(!m.match({host(top, 16)}, {MemDesc{0x10000, 16}}, keys, "p").ok());
  CHECK(!m.match({host(0x1000, 16)}, {MemDesc{top, 16}}, keys, "p").ok());
  CHECK(!KeyRange{0x10000, 0x100}.covers(0x10010, ~uint64_t(0)));
  CHECK(KeyRange{0x10000, 0x100}.covers(0x10000, 0x100));
  CHECK(!KeyRange{0x10000, 0x100}.covers(0x10000, 0x101));
}

TEST_CASE("segment matcher: a removed registration no longer matches", "[kvt][segments]") {
  SegmentMatcher m("loopback transport");
  m.addRegion(1, host(0x1000, 0x100));
  m.addRegion(2, host(0x2000, 0x100));
  m.removeRegion(1);
  m.removeRegion(42);  // unknown: a no-op
  CHECK(m.regionCount() == 1);
  const std::vector<KeyRange> keys{{0x10000, 0x100}};
  CHECK(m.match({host(0x1000, 8)}, {MemDesc{0x10000, 8}}, keys, "p").status().code() == StatusCode::kInvalidArgument);
  auto r = m.match({host(0x2000, 8)}, {MemDesc{0x10000, 8}}, keys, "p");
  REQUIRE(r.ok());
  CHECK((*r)[0].region == 2);
}
