// KvTransceiver: segment building from a KvLayout, layer-wise sending, per-request events,
// and the deadline path when a notification is lost (FaultTransport).
#include "kvtransfer/transceiver.h"

#include "tests/unit/kvtransfer/kvt_test_util.h"

namespace pd::kvt {
namespace {

using namespace testing;
using namespace std::chrono_literals;

engine::KvLayout smallLayout() {
  engine::KvLayout l;
  l.numLayers = 4;
  l.numBlocks = 32;
  l.blockSize = 4;
  l.numKvHeads = 2;
  l.headDim = 8;
  l.dtype = engine::KvDtype::kF32;
  return l;  // blockBytes = 2*4*2*8*4 = 512
}

TEST_CASE("transceiver: consecutive blocks coalesce into one segment per layer", "[kvt][transceiver]") {
  KvSource src{0x10000, smallLayout(), {3, 4, 5, 9}};
  KvTarget dst{1, 0x900000, smallLayout(), {10, 11, 12, 13}};
  auto segs = KvTransceiver::buildSegments(src, dst, 1, 3);
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
  KvTarget dst2{1, 0x900000, smallLayout(), {10, 11, 20, 21}};
  auto segs2 = KvTransceiver::buildSegments(src, dst2, 0, 1);
  REQUIRE(segs2.ok());
  CHECK(segs2->local.size() == 3);
  CHECK(segs2->local[0].kind == MemKind::kHost);

  // A GPU KV cache: every segment carries the memory kind and device of its side.
  KvSource gsrc{0x10000, smallLayout(), {3, 4}, MemKind::kCuda, 1};
  KvTarget gdst{1, 0x900000, smallLayout(), {7, 9}, MemKind::kCuda, 2};
  auto g = KvTransceiver::buildSegments(gsrc, gdst, 0, 2);
  REQUIRE(g.ok());
  REQUIRE(g->local.size() == 4);
  for (size_t i = 0; i < g->local.size(); ++i) {
    CHECK(g->local[i].kind == MemKind::kCuda);
    CHECK(g->local[i].device == 1);
    CHECK(g->remote[i].kind == MemKind::kCuda);
    CHECK(g->remote[i].device == 2);
  }
}

TEST_CASE("transceiver: mismatched layouts and bad ranges are refused with a reason", "[kvt][transceiver]") {
  KvSource src{0x10000, smallLayout(), {0, 1}};
  KvTarget dst{1, 0x900000, smallLayout(), {0, 1}};
  dst.layout.headDim = 16;
  auto r = KvTransceiver::buildSegments(src, dst, 0, 1);
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("layouts disagree"));
  dst.layout = smallLayout();
  CHECK(KvTransceiver::buildSegments(src, dst, 0, 5).status().code() == StatusCode::kInvalidArgument);
  CHECK(KvTransceiver::buildSegments(src, dst, 2, 2).status().code() == StatusCode::kInvalidArgument);
  dst.blockIds = {0, 32};
  CHECK_THAT(KvTransceiver::buildSegments(src, dst, 0, 1).status().message(), Catch::Contains("target block id 32"));
  dst.blockIds = {0};
  CHECK(KvTransceiver::buildSegments(src, dst, 0, 1).status().code() == StatusCode::kInvalidArgument);
}

struct Pair {
  explicit Pair(FaultOptions prefillFaults = {}, bool faulty = false)
      : prefill("prefill-0", transports("prefill-0", prefillFaults, faulty), smallLayout().totalBytes()),
        decode("decode-0", transports("decode-0", {}, false), smallLayout().totalBytes()) {
    peer = connect(prefill, decode);
    for (size_t i = 0; i < prefill.buf.size(); ++i) prefill.buf[i] = uint8_t(i * 7 + 3);
  }
  static std::vector<NamedTransport> transports(const std::string& who, FaultOptions f, bool faulty) {
    std::vector<NamedTransport> v;
    auto t = make("tcp", who);
    if (faulty) t = std::make_unique<FaultTransport>(std::move(t), std::move(f));
    v.push_back({"tcp", std::move(t)});
    return v;
  }
  Node prefill, decode;
  AgentPeer peer = 0;
};

TEST_CASE("transceiver: layer-by-layer push lands in the target blocks and completes once", "[kvt][transceiver]") {
  Pair p;
  KvTransceiver tx(*p.prefill.agent);
  KvTransceiver rx(*p.decode.agent);
  const auto layout = smallLayout();
  KvSource src{p.prefill.base(), layout, {5, 6, 7, 2, 30}};
  KvTarget dst{p.peer, p.decode.base(), layout, {0, 1, 2, 3, 8}};
  REQUIRE(rx.expect(42, layout.numLayers, Deadline::in(10s)).isOk());
  std::vector<KvEvent> txEvents, rxEvents;
  auto pump = [&](std::chrono::milliseconds forAtLeast) {
    auto end = std::chrono::steady_clock::now() + forAtLeast;
    do {
      for (auto& e : tx.poll()) txEvents.push_back(e);
      for (auto& e : rx.poll()) rxEvents.push_back(e);
      std::this_thread::sleep_for(200us);
    } while (std::chrono::steady_clock::now() < end);
  };
  for (int layer = 0; layer < layout.numLayers; ++layer) {
    REQUIRE(tx.send(42, src, dst, layer, layer + 1).isOk());
    pump(5ms);
    if (layer < layout.numLayers - 1) {
      CHECK(rxEvents.empty());  // not complete before the last layer
      CHECK(txEvents.empty());
    }
  }
  auto end = std::chrono::steady_clock::now() + 10s;
  while ((txEvents.empty() || rxEvents.empty()) && std::chrono::steady_clock::now() < end) pump(1ms);
  REQUIRE(txEvents.size() == 1);
  REQUIRE(rxEvents.size() == 1);
  CHECK(txEvents[0].kind == KvEventKind::kSent);
  CHECK(rxEvents[0].kind == KvEventKind::kReceived);
  CHECK(rxEvents[0].request == 42);
  CHECK(tx.pendingSends() == 0);
  CHECK(rx.pendingExpects() == 0);
  // Every (layer, block) landed where the target asked, and nothing else was touched.
  std::vector<bool> written(size_t(layout.numLayers) * layout.numBlocks, false);
  for (int l = 0; l < layout.numLayers; ++l) {
    for (size_t i = 0; i < src.blockIds.size(); ++i) {
      const uint8_t* s = p.prefill.buf.data() + layout.blockOffset(l, src.blockIds[i]);
      const uint8_t* d = p.decode.buf.data() + layout.blockOffset(l, dst.blockIds[i]);
      CHECK(std::memcmp(s, d, layout.blockBytes()) == 0);
      written[size_t(l) * layout.numBlocks + size_t(dst.blockIds[i])] = true;
    }
  }
  for (int l = 0; l < layout.numLayers; ++l) {
    for (int b = 0; b < layout.numBlocks; ++b) {
      if (written[size_t(l) * layout.numBlocks + size_t(b)]) continue;
      const uint8_t* d = p.decode.buf.data() + layout.blockOffset(l, b);
      CHECK(std::all_of(d, d + layout.blockBytes(), [](uint8_t v) { return v == 0; }));
    }
  }
}

TEST_CASE("transceiver: a dropped notification turns into a deadline error naming the missing layers",
          "[kvt][transceiver]") {
  FaultOptions f;
  f.dropNotifications = 1;  // layer 0's notification is lost; its data still goes
  Pair p(f, true);
  KvTransceiver tx(*p.prefill.agent);
  ManualClock clock;
  KvTransceiver rx(*p.decode.agent, clock);
  const auto layout = smallLayout();
  KvSource src{p.prefill.base(), layout, {1}};
  KvTarget dst{p.peer, p.decode.base(), layout, {1}};
  REQUIRE(rx.expect(7, layout.numLayers, Deadline::in(2s, clock)).isOk());
  for (int layer = 0; layer < layout.numLayers; ++layer) REQUIRE(tx.send(7, src, dst, layer, layer + 1).isOk());
  std::vector<KvEvent> txEvents, rxEvents;
  auto end = std::chrono::steady_clock::now() + 10s;
  while (txEvents.empty() && std::chrono::steady_clock::now() < end) {
    for (auto& e : tx.poll()) txEvents.push_back(e);
    for (auto& e : rx.poll()) rxEvents.push_back(e);
  }
  REQUIRE(txEvents.size() == 1);
  CHECK(txEvents[0].kind == KvEventKind::kSent);  // the sender saw every write confirmed
  for (int i = 0; i < 50; ++i) {
    for (auto& e : rx.poll()) rxEvents.push_back(e);
    std::this_thread::sleep_for(1ms);
  }
  CHECK(rxEvents.empty());  // still waiting for layer 0
  clock.advance(3s);
  for (auto& e : rx.poll()) rxEvents.push_back(e);
  REQUIRE(rxEvents.size() == 1);
  CHECK(rxEvents[0].kind == KvEventKind::kReceiveFailed);
  CHECK(rxEvents[0].status.code() == StatusCode::kDeadlineExceeded);
  CHECK_THAT(rxEvents[0].status.message(), Catch::Contains("3 of 4 layers") && Catch::Contains("missing 0"));
  CHECK(rx.pendingExpects() == 0);
}

TEST_CASE("transceiver: a failed layer fails the request once and cancels the rest", "[kvt][transceiver]") {
  FaultOptions f;
  f.failAfterPosts = 2;
  f.latency = 20ms;  // the remaining layers are still in flight when layer 2 fails
  Pair p(f, true);
  KvTransceiver tx(*p.prefill.agent);
  const auto layout = smallLayout();
  KvSource src{p.prefill.base(), layout, {1, 2}};
  KvTarget dst{p.peer, p.decode.base(), layout, {3, 4}};
  for (int layer = 0; layer < layout.numLayers; ++layer) REQUIRE(tx.send(9, src, dst, layer, layer + 1).isOk());
  std::vector<KvEvent> events;
  auto end = std::chrono::steady_clock::now() + 10s;
  while (events.empty() && std::chrono::steady_clock::now() < end) {
    for (auto& e : tx.poll()) events.push_back(e);
  }
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == KvEventKind::kSendFailed);
  CHECK(events[0].request == 9);
  // Layers 2 and 3 both fail (injected); whichever is harvested first names the failure.
  CHECK_THAT(events[0].status.message(),
             (Catch::Contains("request 9 layers [2, 3)") || Catch::Contains("request 9 layers [3, 4)")) &&
                 Catch::Contains("injected"));
  CHECK(tx.pendingSends() == 0);
  for (int i = 0; i < 20; ++i) {
    auto more = tx.poll();
    CHECK(more.empty());
    std::this_thread::sleep_for(1ms);
  }
}

}  // namespace
}  // namespace pd::kvt
