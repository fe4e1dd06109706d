// The verbs transport on whatever this machine has: without an RDMA device (CI, these VMs)
// the factory must say so cleanly; with one, a QP connected to itself moves bytes.
#include <infiniband/verbs.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <vector>

#include "common/base/clock.h"
#include "kvtransfer/transports/verbs_transport.h"

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
  // A device exists: loop one transport's QP back to itself and move 1 MiB with a notification.
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
                    {MemDesc{reinterpret_cast<uintptr_t>(b.data()), b.size()}}, *peer, std::string("req-42"));
  REQUIRE(id.ok());
  Deadline d = Deadline::in(10s);
  Status s;
  std::vector<Notification> notes;
  do {
    x->progress();
    s = x->poll(*id);
    for (auto& n : x->takeNotifications()) notes.push_back(n);
  } while (s.inProgress() && !d.expired());
  REQUIRE(s.isOk());
  CHECK(a == b);
  while (notes.empty() && !d.expired()) {
    x->progress();
    for (auto& n : x->takeNotifications()) notes.push_back(n);
  }
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].payload == "req-42");

  // GPU memory goes through dma-buf; where that is not available registration says why
  // (host memory labelled kCuda is never accepted as device memory).
  auto g = x->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(a.data()), a.size(), 0, MemKind::kCuda});
  REQUIRE(!g.ok());
  CHECK_THAT(g.status().message(), Catch::Contains("GPU memory"));
}
