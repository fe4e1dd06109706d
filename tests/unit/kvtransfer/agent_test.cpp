// TransferAgent: transport choice, metadata exchange, and the fallback and error paths driven
// by FaultTransport over real loopback and tcp transports in one process.
#include <numeric>

#include "kvtransfer/kvt.pb.h"
#include "tests/unit/kvtransfer/kvt_test_util.h"

namespace pd::kvt {
namespace {

using namespace testing;
using namespace std::chrono_literals;
constexpr size_t kBytes = 1 << 20;

std::vector<NamedTransport> lanes(const std::string& who, FaultOptions fabricFaults, bool faultyFabric) {
  std::vector<NamedTransport> v;
  auto fabric = make("loopback", who);
  if (faultyFabric) fabric = std::make_unique<FaultTransport>(std::move(fabric), std::move(fabricFaults));
  v.push_back({"loopback", std::move(fabric)});  // stands in for the fabric (ucx / verbs)
  v.push_back({"tcp", make("tcp", who)});
  return v;
}

void fillPattern(std::vector<uint8_t>& buf, uint8_t seed) {
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = uint8_t(i * 131 + seed);
}

// Sends [0, len) of a's buffer to offset `dstOff` of b's; returns the outcome.
Status sendOnce(Node& a, Node& b, AgentPeer peer, size_t len, size_t dstOff, AgentTransfer* idOut = nullptr) {
  MemDesc l{a.base(), len};
  MemDesc r{b.base() + dstOff, len};
  auto id = a.agent->post({l}, {r}, peer);
  if (!id.ok()) return id.status();
  if (idOut) *idOut = *id;
  return waitAgent(*a.agent, *b.agent, *id);
}

// The worker's loop calls loadPeer, so it must not wait for a connection. A peer
// whose tcp port is closed loads at once; its transfer fails with the reason; the next load
// of the same blob sees the dead lane and connects again (a new peer id), instead of handing
// back a peer that fails every transfer.
TEST_CASE("agent: loading an unreachable tcp peer never blocks; the dead lane reconnects at the next load",
          "[kvt][agent]") {
  std::vector<NamedTransport> ta;
  ta.push_back({"tcp", make("tcp", "a")});
  Node a("a", std::move(ta), 1 << 16);
  std::string gone;
  {
    std::vector<NamedTransport> tb;
    tb.push_back({"tcp", make("tcp", "b")});
    Node b("b", std::move(tb), 1 << 16);
    gone = b.agent->localMetadata().value();
  }  // b's port is closed now
  const auto t0 = std::chrono::steady_clock::now();
  auto peer = a.agent->loadPeer(gone);
  REQUIRE(peer.ok());
  CHECK(std::chrono::steady_clock::now() - t0 < 200ms);
  proto::AgentMetadata md;
  REQUIRE(md.ParseFromString(gone));
  const MemDesc remote{md.regions(0).addr(), 4096};
  auto id = a.agent->post({MemDesc{a.base(), 4096}}, {remote}, *peer);
  REQUIRE(id.ok());
  Status st = deadlineExceeded("pending");
  for (int i = 0; i < 5000 && (st = a.agent->poll(*id)).inProgress(); ++i) {
    a.agent->progress();
    std::this_thread::sleep_for(1ms);
  }
  INFO(st.toString());
  CHECK(st.code() == StatusCode::kUnavailable);
  CHECK_THAT(st.message(), Catch::Contains("cannot connect"));
  auto again = a.agent->loadPeer(gone);
  REQUIRE(again.ok());
  CHECK(*again != *peer);
}

TEST_CASE("agent: picks the first transport both sides have and keeps tcp as fallback lane", "[kvt][agent]") {
  Node a("prefill-0", lanes("prefill-0", {}, false), kBytes);
  Node b("decode-0", lanes("decode-0", {}, false), kBytes);
  AgentPeer p = connect(a, b);
  CHECK(a.agent->peerTransport(p).value() == "loopback");
  CHECK(a.agent->peerName(p).value() == "decode-0");
  // Loading the same metadata again is idempotent.
  CHECK(connect(a, b) == p);

  fillPattern(a.buf, 7);
  REQUIRE(sendOnce(a, b, p, 64 * 1024, 4096).isOk());
  CHECK(std::memcmp(b.buf.data() + 4096, a.buf.data(), 64 * 1024) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_bytes_total", {{"transport", "loopback"}}) == 64 * 1024);
  CHECK(metricValue(a.registry, "pdserve_kv_transfers_total", {{"transport", "loopback"}, {"outcome", "ok"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_latency_seconds", {{"transport", "loopback"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_fallbacks_total", {{"from", "loopback"}, {"to", "tcp"}}) == 0);
}

TEST_CASE("agent: a failed fabric transfer on a live peer is retried once over tcp and counted", "[kvt][agent]") {
  FaultOptions f;
  f.failAfterPosts = 0;  // every fabric transfer fails
  Node a("prefill-0", lanes("prefill-0", f, true), kBytes);
  Node b("decode-0", lanes("decode-0", {}, false), kBytes);
  AgentPeer p = connect(a, b);
  REQUIRE(a.agent->peerTransport(p).value() == "loopback");
  fillPattern(a.buf, 9);
  Status st = sendOnce(a, b, p, 200 * 1000, 100);
  INFO(st.toString());
  REQUIRE(st.isOk());
  CHECK(std::memcmp(b.buf.data() + 100, a.buf.data(), 200 * 1000) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_fallbacks_total", {{"from", "loopback"}, {"to", "tcp"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_failures_total",
                    {{"transport", "loopback"}, {"code", "INTERNAL"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_bytes_total", {{"transport", "tcp"}}) == 200 * 1000);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_bytes_total", {{"transport", "loopback"}}) == 0);
  CHECK(a.agent->inFlight() == 0);
}

TEST_CASE("agent: with fallback disabled the fabric failure reaches the caller", "[kvt][agent]") {
  FaultOptions f;
  f.failAfterPosts = 1;  // the first succeeds, the rest fail
  Node a("prefill-0", lanes("prefill-0", f, true), kBytes, /*fallback=*/false);
  Node b("decode-0", lanes("decode-0", {}, false), kBytes);
  AgentPeer p = connect(a, b);
  REQUIRE(sendOnce(a, b, p, 1000, 0).isOk());
  Status st = sendOnce(a, b, p, 1000, 0);
  CHECK(st.code() == StatusCode::kInternal);
  CHECK_THAT(st.message(), Catch::Contains("injected"));
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_fallbacks_total", {{"from", "loopback"}, {"to", "tcp"}}) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfers_total", {{"transport", "loopback"}, {"outcome", "failed"}}) == 1);
}

TEST_CASE("agent: a fabric connection killed mid-transfer falls back to tcp", "[kvt][agent]") {
  FaultOptions f;
  f.killAfterPosts = 0;  // simulated kill right after the first post
  Node a("prefill-0", lanes("prefill-0", f, true), kBytes);
  Node b("decode-0", lanes("decode-0", {}, false), kBytes);
  AgentPeer p = connect(a, b);
  fillPattern(a.buf, 11);
  Status st = sendOnce(a, b, p, kBytes / 2, kBytes / 2);
  INFO(st.toString());
  REQUIRE(st.isOk());
  CHECK(std::memcmp(b.buf.data() + kBytes / 2, a.buf.data(), kBytes / 2) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_fallbacks_total", {{"from", "loopback"}, {"to", "tcp"}}) == 1);
  // Later posts find the fabric dead at post() and go straight over tcp, counted again.
  REQUIRE(sendOnce(a, b, p, 1000, 0).isOk());
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_fallbacks_total", {{"from", "loopback"}, {"to", "tcp"}}) == 2);
}

TEST_CASE("agent: tcp connection killed mid-transfer fails every pending transfer, nothing pending", "[kvt][agent]") {
  auto tcpT = make("tcp", "prefill-0");
  auto* raw = dynamic_cast<TcpTransport*>(tcpT.get());
  REQUIRE(raw);
  FaultOptions f;
  f.killAfterPosts = 3;
  f.killer = [raw](PeerId peer) { raw->dropConnections(peer); };
  std::vector<NamedTransport> ta;
  ta.push_back({"tcp", std::make_unique<FaultTransport>(std::move(tcpT), f)});
  std::vector<NamedTransport> tb;
  tb.push_back({"tcp", make("tcp", "decode-0")});
  Node a("prefill-0", std::move(ta), 64 << 20);
  Node b("decode-0", std::move(tb), 64 << 20);
  AgentPeer p = connect(a, b);
  std::vector<AgentTransfer> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = a.agent->post({MemDesc{a.base(), 64 << 20}}, {MemDesc{b.base(), 64 << 20}}, p);
    if (!id.ok()) {
      CHECK(id.status().code() == StatusCode::kUnavailable);
      continue;
    }
    ids.push_back(*id);
  }
  int failed = 0;
  for (auto id : ids) {
    Status st = waitAgent(*a.agent, *b.agent, id, 5s);
    CHECK(!st.inProgress());
    CHECK(st.code() != StatusCode::kDeadlineExceeded);
    if (!st.isOk()) {
      CHECK(st.code() == StatusCode::kUnavailable);
      ++failed;
    }
  }
  CHECK(failed >= 1);
  CHECK(a.agent->inFlight() == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_failures_total",
                    {{"transport", "tcp"}, {"code", "UNAVAILABLE"}}) == failed);
}

TEST_CASE("agent: creation skips transports that are missing and says why", "[kvt][agent]") {
  prometheus::Registry reg;
  AgentOptions o;
  o.name = "x";
  o.preference = {"nonesuch", "tcp"};
  auto a = TransferAgent::create(o, reg);
  REQUIRE(a.ok());
  CHECK((*a)->transportNames() == std::vector<std::string>{"tcp"});

  o.preference = {"nonesuch"};
  o.fallbackToTcp = false;
  auto b = TransferAgent::create(o, reg);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(b.status().message(), Catch::Contains("nonesuch") && Catch::Contains("not built"));
}

TEST_CASE("agent: bad metadata and unknown ids are clear errors", "[kvt][agent]") {
  Node a("a", lanes("a", {}, false), 4096);
  auto p = a.agent->loadPeer("definitely not protobuf \xff\xff\xff");
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == StatusCode::kInvalidArgument);
  CHECK(a.agent->poll(12345).code() == StatusCode::kNotFound);

  // A peer offering nothing we have.
  proto::AgentMetadata md;
  md.set_version(1);
  md.set_name("alien");
  auto* t = md.add_transports();
  t->set_transport("carrier-pigeon");
  auto q = a.agent->loadPeer(md.SerializeAsString());
  REQUIRE_FALSE(q.ok());
  CHECK(q.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(q.status().message(), Catch::Contains("alien") && Catch::Contains("does not offer"));
}

}  // namespace
}  // namespace pd::kvt

#if PD_HAVE_CMA
namespace pd::kvt {
namespace {
std::vector<NamedTransport> sameNodeLanes(const std::string& who) {
  std::vector<NamedTransport> v;
  v.push_back({"cma", testing::make("cma", who)});
  v.push_back({"tcp", testing::make("tcp", who)});
  return v;
}
}  // namespace

TEST_CASE("agent: a same-node peer gets the cma lane, tcp stays the fallback, the lane is in the metrics",
          "[kvt][agent][cma]") {
  using namespace testing;
  // Both agents live in this process: same node and pid namespace, so cma connects.
  Node a("prefill-0", sameNodeLanes("prefill-0"), kBytes);
  Node b("decode-0", sameNodeLanes("decode-0"), kBytes);
  AgentPeer p = connect(a, b);
  CHECK(a.agent->peerTransport(p).value() == "cma");
  CHECK(metricValue(a.registry, "pdserve_kv_peers", {{"transport", "cma"}}) == 1);
  fillPattern(a.buf, 9);
  REQUIRE(sendOnce(a, b, p, 256 * 1024, 8192).isOk());
  CHECK(std::memcmp(b.buf.data() + 8192, a.buf.data(), 256 * 1024) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfers_total", {{"transport", "cma"}, {"outcome", "ok"}}) == 1);
  REQUIRE(a.agent->unloadPeer(p).isOk());
  CHECK(metricValue(a.registry, "pdserve_kv_peers", {{"transport", "cma"}}) == 0);
}
}  // namespace pd::kvt
#endif
