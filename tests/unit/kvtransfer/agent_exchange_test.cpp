// The agent's two-step exchange (agent.h): offer, reply, load the reply. Over PairedTransport,
// which like verbs RC moves bytes only when both sides loaded each other, it shows that the
// one-way exchange cannot work and that the two-step one does, for many answering peers, in
// any order, and again after a reconnect.
#include "kvtransfer/kvt.pb.h"
#include "tests/unit/kvtransfer/kvt_test_util.h"
#include "tests/unit/kvtransfer/paired_transport.h"

namespace pd::kvt {
namespace {

using namespace testing;
constexpr size_t kBytes = 1 << 16;

// The transport pointer lives in a base constructed before Node, which creates the agent.
struct PairedHandle {
  PairedTransport* transport = nullptr;
};

struct PairedNode : PairedHandle, Node {
  PairedNode(const std::string& name, const std::shared_ptr<PairedFabric>& fabric)
      : Node(name, one(name, fabric, &transport), kBytes, /*fallback=*/false) {}
  static std::vector<NamedTransport> one(const std::string& name, const std::shared_ptr<PairedFabric>& fabric,
                                         PairedTransport** out) {
    auto t = std::make_unique<PairedTransport>(fabric, name);
    *out = t.get();
    std::vector<NamedTransport> v;
    v.push_back({"paired", std::move(t)});
    return v;
  }
};

// `from` writes `len` bytes of pattern `seed` at `offset` into `to`'s buffer.
Status push(PairedNode& from, PairedNode& to, AgentPeer peer, size_t offset, size_t len, uint8_t seed) {
  for (size_t i = 0; i < len; ++i) from.buf[i] = uint8_t(i * 7 + seed);
  auto id = from.agent->post({MemDesc{from.base(), len}}, {MemDesc{to.base() + offset, len}}, peer);
  if (!id.ok()) return id.status();
  return waitAgent(*from.agent, *to.agent, *id);
}

bool holds(const PairedNode& n, size_t offset, size_t len, uint8_t seed) {
  for (size_t i = 0; i < len; ++i)
    if (n.buf[offset + i] != uint8_t(i * 7 + seed)) return false;
  return true;
}

TEST_CASE("agent exchange: a one-way exchange cannot carry bytes over RC-like pairs", "[kvt][agent]") {
  auto fabric = std::make_shared<PairedFabric>();
  PairedNode decode("decode-0", fabric), prefill("prefill-0", fabric);
  auto offer = decode.agent->localMetadata();
  REQUIRE(offer.ok());
  auto peer = prefill.agent->loadPeer(*offer);
  REQUIRE(peer.ok());
  // The decode side never loaded the prefill: its endpoint is still waiting for a partner.
  Status s = push(prefill, decode, *peer, 0, 1024, 1);
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK_THAT(s.message(), Catch::Contains("not connected both ways"));
  CHECK(decode.transport->pendingEndpoints() == 1);
  CHECK(!holds(decode, 0, 1024, 1));
}

TEST_CASE("agent exchange: offer, reply, load the reply; replies pair by endpoint in any order", "[kvt][agent]") {
  auto fabric = std::make_shared<PairedFabric>();
  PairedNode decode("decode-0", fabric), p1("prefill-1", fabric), p2("prefill-2", fabric);
  // One fresh offer per answering peer.
  auto offer1 = decode.agent->localMetadata();
  auto offer2 = decode.agent->localMetadata();
  REQUIRE(offer1.ok());
  REQUIRE(offer2.ok());
  CHECK(*offer1 != *offer2);
  CHECK(decode.transport->pendingEndpoints() == 2);
  auto peer1 = p1.agent->loadPeer(*offer1);
  auto peer2 = p2.agent->loadPeer(*offer2);
  REQUIRE(peer1.ok());
  REQUIRE(peer2.ok());
  auto reply1 = p1.agent->peerMetadata(*peer1);
  auto reply2 = p2.agent->peerMetadata(*peer2);
  REQUIRE(reply1.ok());
  REQUIRE(reply2.ok());
  CHECK(p1.agent->peerMetadata(*peer1 + 100).status().code() == StatusCode::kNotFound);
  // The reply is an AgentMetadata with the answering agent's name, regions and keys.
  proto::AgentMetadata md;
  REQUIRE(md.ParseFromString(*reply1));
  CHECK(md.name() == "prefill-1");
  REQUIRE(md.regions_size() == 1);
  CHECK(md.regions(0).addr() == p1.base());
  REQUIRE(md.transports_size() == 1);
  CHECK(md.transports(0).transport() == "paired");
  CHECK(md.transports(0).conn_info().rfind("reply:", 0) == 0);
  CHECK(md.transports(0).remote_keys_size() == 1);

  // Before the decode side loads the reply, nothing moves.
  CHECK(push(p1, decode, *peer1, 0, 512, 3).code() == StatusCode::kUnavailable);

  // Replies come back out of order: each connects the endpoint offered to that peer.
  auto back2 = decode.agent->loadPeer(*reply2);
  auto back1 = decode.agent->loadPeer(*reply1);
  REQUIRE(back2.ok());
  REQUIRE(back1.ok());
  CHECK(*back1 != *back2);
  CHECK(decode.agent->peerName(*back1).value() == "prefill-1");
  CHECK(decode.transport->pendingEndpoints() == 0);
  // Every PrefillRequest carries the offer again: the same blob is the same peer.
  CHECK(p1.agent->loadPeer(*offer1).value() == *peer1);

  REQUIRE(push(p1, decode, *peer1, 0, 4096, 11).isOk());
  REQUIRE(push(p2, decode, *peer2, 8192, 4096, 22).isOk());
  CHECK(holds(decode, 0, 4096, 11));
  CHECK(holds(decode, 8192, 4096, 22));
  // The pair works both ways.
  REQUIRE(push(decode, p2, *back2, 100, 256, 33).isOk());
  CHECK(holds(p2, 100, 256, 33));

  // A reply can connect only once: loading the same reply blob again is the same peer, and a
  // reply naming an endpoint that is no longer pending is refused.
  CHECK(decode.agent->loadPeer(*reply1).value() == *back1);

  SECTION("a reconnect (new offer, new reply) replaces the pair on both sides") {
    auto offer1b = decode.agent->localMetadata();
    REQUIRE(offer1b.ok());
    auto peer1b = p1.agent->loadPeer(*offer1b);  // changed blob: reconnects
    REQUIRE(peer1b.ok());
    CHECK(*peer1b != *peer1);
    auto reply1b = p1.agent->peerMetadata(*peer1b);
    REQUIRE(reply1b.ok());
    auto back1b = decode.agent->loadPeer(*reply1b);
    REQUIRE(back1b.ok());
    REQUIRE(push(p1, decode, *peer1b, 16384, 2048, 44).isOk());
    CHECK(holds(decode, 16384, 2048, 44));
    // The old pair is gone on the prefill side.
    CHECK(!p1.agent->peerName(*peer1).ok());
  }
}

}  // namespace
}  // namespace pd::kvt
