// The verbs transport on whatever this machine has: without an RDMA device (CI, these VMs)
// the factory must say so cleanly; with one, a QP connected to itself moves bytes.
#include "kvtransfer/transports/verbs_transport.h"

#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include <catch2/catch.hpp>

#include "common/base/clock.h"

using namespace pd;
using namespace pd::kvt;
using namespace std::chrono_literals;

namespace {
int deviceCount() {
  int n = 0;
  ibv_device** l = ibv_get_device_list(&n);
  if (l) ibv_free_device_list(l);
  return l ? n : 0;
}
}  // namespace

TEST_CASE("verbs: the factory reports a missing device cleanly or works with one") {
  VerbsOptions tiny;
  tiny.maxSendWr = 1;
  CHECK(makeVerbsTransport(tiny).status().code() == StatusCode::kInvalidArgument);
  auto t = makeVerbsTransport();
  if (deviceCount() == 0) {
    REQUIRE(!t.ok());
    CHECK(t.status().code() == StatusCode::kUnavailable);
    CHECK(t.status().message() == "verbs: no RDMA device found (ibv_get_device_list returned 0 devices)");
    return;
  }
  // A device exists: loop one transport's QP back to itself and move 1 MiB.
  REQUIRE(t.ok());
  auto& x = *t;
  std::vector<uint8_t> a(1 << 20), b(1 << 20, 0);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 13);
  auto ha = x->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(a.data()), a.size()});
  auto hb = x->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(b.data()), b.size()});
  REQUIRE(ha.ok());
  REQUIRE(hb.ok());
  auto conn = x->localConnInfo();
  REQUIRE(conn.ok());
  auto peer = x->loadPeer(PeerInfo{"self", *conn, {*x->packRemoteKey(*hb)}});
  REQUIRE(peer.ok());
  auto id = x->post({MemDesc{reinterpret_cast<uintptr_t>(a.data()), a.size()}},
                    {MemDesc{reinterpret_cast<uintptr_t>(b.data()), b.size()}}, *peer, {});
  REQUIRE(id.ok());
  Deadline d = Deadline::in(10s);
  Status s;
  do {
    x->progress();
    s = x->poll(*id);
  } while (s.inProgress() && !d.expired());
  REQUIRE(s.isOk());
  CHECK(a == b);

  // GPU memory goes through dma-buf; where that is not available registration says why
  // (host memory labelled kCuda is never accepted as device memory).
  auto g = x->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(a.data()), a.size(), 0, MemKind::kCuda});
  REQUIRE(!g.ok());
  CHECK_THAT(g.status().message(), Catch::Contains("GPU memory"));
}

TEST_CASE("verbs: the two-step exchange connects one QP pair per peer, replies in any order") {
  if (deviceCount() == 0) {
    CHECK(!makeVerbsTransport().ok());  // nothing to connect here; the pairing rules are in verbs_codec_test
    return;
  }
  // One offering transport (the decode side) and two answering ones (prefill workers).
  VerbsOptions od, oa, ob;
  od.localName = "decode";
  oa.localName = "prefill-a";
  ob.localName = "prefill-b";
  auto d = makeVerbsTransport(od);
  auto a = makeVerbsTransport(oa);
  auto b = makeVerbsTransport(ob);
  REQUIRE(d.ok());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  std::vector<uint8_t> target(1 << 16, 0), fromA(1 << 15, 0xa), fromB(1 << 15, 0xb);
  auto ht = (*d)->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(target.data()), target.size()});
  auto ha = (*a)->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(fromA.data()), fromA.size()});
  auto hb = (*b)->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(fromB.data()), fromB.size()});
  REQUIRE(ht.ok());
  REQUIRE(ha.ok());
  REQUIRE(hb.ok());
  auto key = (*d)->packRemoteKey(*ht);
  REQUIRE(key.ok());
  auto offerA = (*d)->localConnInfo();
  auto offerB = (*d)->localConnInfo();
  REQUIRE(offerA.ok());
  REQUIRE(offerB.ok());
  auto pa = (*a)->loadPeer(PeerInfo{"decode", *offerA, {*key}});
  auto pb = (*b)->loadPeer(PeerInfo{"decode", *offerB, {*key}});
  REQUIRE(pa.ok());
  REQUIRE(pb.ok());
  auto replyA = (*a)->peerConnInfo(*pa);
  auto replyB = (*b)->peerConnInfo(*pb);
  REQUIRE(replyA.ok());
  REQUIRE(replyB.ok());
  // B answers first: pairing is by QP number, not by age.
  REQUIRE((*d)->loadPeer(PeerInfo{"prefill-b", *replyB, {}}).ok());
  REQUIRE((*d)->loadPeer(PeerInfo{"prefill-a", *replyA, {}}).ok());
  auto half = [&](size_t at) { return MemDesc{reinterpret_cast<uintptr_t>(target.data()) + at, 1 << 15}; };
  auto ia = (*a)->post({MemDesc{reinterpret_cast<uintptr_t>(fromA.data()), fromA.size()}}, {half(0)}, *pa, {});
  auto ib = (*b)->post({MemDesc{reinterpret_cast<uintptr_t>(fromB.data()), fromB.size()}}, {half(1 << 15)}, *pb, {});
  REQUIRE(ia.ok());
  REQUIRE(ib.ok());
  Deadline dl = Deadline::in(10s);
  Status sa(StatusCode::kInProgress, ""), sb(StatusCode::kInProgress, "");
  while ((sa.inProgress() || sb.inProgress()) && !dl.expired()) {
    (*a)->progress();
    (*b)->progress();
    (*d)->progress();
    if (sa.inProgress()) sa = (*a)->poll(*ia);
    if (sb.inProgress()) sb = (*b)->poll(*ib);
  }
  REQUIRE(sa.isOk());
  REQUIRE(sb.isOk());
  CHECK(std::count(target.begin(), target.begin() + (1 << 15), 0xa) == 1 << 15);
  CHECK(std::count(target.begin() + (1 << 15), target.end(), 0xb) == 1 << 15);
  // A reply loaded twice names a QP that is no longer pending: refused, not mis-paired.
  CHECK((*d)->loadPeer(PeerInfo{"prefill-a", *replyA, {}}).status().code() == StatusCode::kFailedPrecondition);
}
