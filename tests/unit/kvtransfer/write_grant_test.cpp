// Write grants (transport.h "Scoped write grants"): over a real tcp
// transport, a write lands only under a live grant and inside its ranges; a write replayed
// after the revoke (the capability captured before, sent after: a slow-but-alive or forged
// writer) is refused before a byte lands, fails the sender's transfer naming why, and is
// counted in pdserve_kv_writes_rejected_total{reason}.
#include <atomic>
#include <mutex>

#include "tests/unit/kvtransfer/kvt_test_util.h"

namespace pd::kvt {
namespace {

using namespace testing;
using namespace std::chrono_literals;
constexpr size_t kBytes = 1 << 16;

// A receiver made through TransferAgent::create (so the agent installs its reject counter),
// with tcp only and region keys that do not authorise writes.
struct Receiver {
  explicit Receiver(size_t bytes = kBytes) : buf(bytes, 0xEE) {
    AgentOptions o;
    o.name = "decode";
    o.preference = {"tcp"};
    o.fallbackToTcp = false;
    o.transport.requireWriteGrant = true;
    auto a = TransferAgent::create(o, registry);
    REQUIRE(a.ok());
    agent = std::move(a).value();
    REQUIRE(agent->registerMemory(MemDesc{base(), bytes}).ok());
  }
  uintptr_t base() const { return reinterpret_cast<uintptr_t>(buf.data()); }
  double rejected(const std::string& reason) const {
    return metricValue(registry, "pdserve_kv_writes_rejected_total", {{"reason", reason}});
  }
  prometheus::Registry registry;
  std::vector<uint8_t> buf;
  std::unique_ptr<TransferAgent> agent;
};

Status write(Node& from, Receiver& to, AgentPeer peer, size_t len, size_t dstOff, const std::string& grant) {
  auto id = from.agent->post({MemDesc{from.base(), len}}, {MemDesc{to.base() + dstOff, len}}, peer, grant);
  if (!id.ok()) return id.status();
  return waitAgent(*from.agent, *to.agent, *id);
}

TEST_CASE("tcp write grants: only a live grant's ranges take writes, a replay after revoke is refused and counted",
          "[kvt][grant]") {
  Receiver decode;
  std::vector<NamedTransport> tp;
  tp.push_back({"tcp", make("tcp", "prefill")});
  Node prefill("prefill", std::move(tp), kBytes, /*fallback=*/false);
  for (size_t i = 0; i < kBytes; ++i) prefill.buf[i] = uint8_t(i * 7 + 1);

  // prefill -> decode carries the writes; decode loads prefill back to grant it.
  auto md = decode.agent->localMetadata();
  REQUIRE(md.ok());
  auto toDecode = prefill.agent->loadPeer(*md);
  REQUIRE(toDecode.ok());
  auto pmd = prefill.agent->localMetadata();
  REQUIRE(pmd.ok());
  auto writer = decode.agent->loadPeer(*pmd);
  REQUIRE(writer.ok());
  CHECK(decode.agent->receiverFenced(*writer));

  // The request's blocks: [4 KiB, 12 KiB).
  auto grant = decode.agent->grantWrite(*writer, {MemDesc{decode.base() + 4096, 8192}});
  REQUIRE(grant.ok());
  REQUIRE_FALSE(grant->empty());

  SECTION("a granted write lands") {
    Status st = write(prefill, decode, *toDecode, 8192, 4096, *grant);
    INFO(st.toString());
    REQUIRE(st.isOk());
    CHECK(std::memcmp(decode.buf.data() + 4096, prefill.buf.data(), 8192) == 0);
  }
  SECTION("a write outside the grant, or with a region key alone, is refused before it lands") {
    Status outside = write(prefill, decode, *toDecode, 4096, 12288, *grant);
    CHECK(outside.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(outside.message(), Catch::Contains("outside the memory its write grant covers"));
    CHECK(decode.rejected("outside_grant") == 1);
    Status noGrant = write(prefill, decode, *toDecode, 4096, 4096, "");
    CHECK(noGrant.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(noGrant.message(), Catch::Contains("no write grant"));
    CHECK(decode.rejected("grant_required") == 1);
    for (size_t i = 0; i < kBytes; ++i) REQUIRE(decode.buf[i] == 0xEE);
  }
  SECTION("the grant replayed after its revoke (a stale writer) is refused, counted, and the block is unchanged") {
    REQUIRE(write(prefill, decode, *toDecode, 8192, 4096, *grant).isOk());
    const std::vector<uint8_t> landed(decode.buf.begin() + 4096, decode.buf.begin() + 12288);
    REQUIRE(decode.agent->revokeWrite(*grant).isOk());
    for (size_t i = 0; i < kBytes; ++i) prefill.buf[i] = uint8_t(i * 13 + 5);  // new bytes, same capability
    Status stale = write(prefill, decode, *toDecode, 8192, 4096, *grant);
    INFO(stale.toString());
    CHECK(stale.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(stale.message(), Catch::Contains("revoked write grant"));
    CHECK(decode.rejected("unknown_grant") == 1);
    CHECK(std::equal(landed.begin(), landed.end(), decode.buf.begin() + 4096));
    // A revoked grant stays revoked; a fresh grant for the same blocks works (the next epoch).
    CHECK(decode.agent->revokeWrite(*grant).code() == StatusCode::kNotFound);
    auto next = decode.agent->grantWrite(*writer, {MemDesc{decode.base() + 4096, 8192}});
    REQUIRE(next.ok());
    CHECK(*next != *grant);
    CHECK(write(prefill, decode, *toDecode, 8192, 4096, *next).isOk());
  }
  SECTION("a grant over memory not registered here is refused") {
    std::vector<uint8_t> other(4096);
    auto bad = decode.agent->grantWrite(*writer, {MemDesc{reinterpret_cast<uintptr_t>(other.data()), 4096}});
    CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  }
}

// The revoke is a fence even while a write under the grant is landing: once revokeWrite()
// returned, not one more byte of it changes the target (the landing frame's connection is
// closed, later frames are refused), and the writer's transfer fails.
TEST_CASE("tcp write grants: a revoke in the middle of a landing write stops it at once", "[kvt][grant]") {
  constexpr size_t kBig = 128 << 20;
  Receiver decode(kBig);
  std::vector<NamedTransport> tp;
  tp.push_back({"tcp", make("tcp", "prefill")});
  Node prefill("prefill", std::move(tp), kBig, /*fallback=*/false);
  std::memset(prefill.buf.data(), 0x42, kBig);
  auto toDecode = prefill.agent->loadPeer(decode.agent->localMetadata().value());
  REQUIRE(toDecode.ok());
  auto writer = decode.agent->loadPeer(prefill.agent->localMetadata().value());
  REQUIRE(writer.ok());
  auto grant = decode.agent->grantWrite(*writer, {MemDesc{decode.base(), kBig}});
  REQUIRE(grant.ok());
  auto id = prefill.agent->post({MemDesc{prefill.base(), kBig}}, {MemDesc{decode.base(), kBig}}, *toDecode, *grant);
  REQUIRE(id.ok());
  // Wait until the first bytes landed, then revoke while the rest is on its way.
  const volatile uint8_t* first = decode.buf.data();
  const auto end = std::chrono::steady_clock::now() + 10s;
  while (*first != 0x42 && std::chrono::steady_clock::now() < end) std::this_thread::yield();
  REQUIRE(*first == 0x42);
  REQUIRE(decode.agent->revokeWrite(*grant).isOk());
  auto landed = [&] {
    size_t n = 0;
    for (size_t i = 0; i < kBig; i += 4096) n += decode.buf[i] == 0x42;
    return n;
  };
  const size_t atRevoke = landed();
  Status st = waitAgent(*prefill.agent, *decode.agent, *id);
  INFO(st.toString() << "; pages landed at the revoke: " << atRevoke << " of " << kBig / 4096);
  CHECK_FALSE(st.isOk());
  std::this_thread::sleep_for(200ms);
  CHECK(landed() == atRevoke);
  CHECK(atRevoke < kBig / 4096);  // the revoke really came mid-write
}

// One-sided lanes fence nothing: the agent says so, and the owner must quarantine.
TEST_CASE("agent: a lane that is not receiver-fenced makes the peer unfenced, unfencedLanesDead follows the lanes",
          "[kvt][grant]") {
  std::vector<NamedTransport> ta, tb;
  FaultOptions oneSided;
  oneSided.receiverFenced = false;
  ta.push_back({"tcp", std::make_unique<FaultTransport>(make("tcp", "a"), oneSided)});
  tb.push_back({"tcp", make("tcp", "b")});
  Node a("a", std::move(ta), kBytes, false), b("b", std::move(tb), kBytes, false);
  AgentPeer ab = connect(a, b);
  CHECK_FALSE(a.agent->receiverFenced(ab));
  CHECK_FALSE(a.agent->unfencedLanesDead(ab));
  CHECK_FALSE(a.agent->receiverFenced(12345));     // unknown: nothing is known fenced
  CHECK_FALSE(a.agent->unfencedLanesDead(12345));  // unknown: nothing is known dead
  auto g = a.agent->grantWrite(ab, {MemDesc{a.base(), 4096}});
  REQUIRE(g.ok());  // tcp under the fault wrapper still grants; the owner just may not rely on it
  CHECK(a.agent->revokeWrite(*g).isOk());
}

}  // namespace
}  // namespace pd::kvt
