// The decode worker's side of KvConnect (docs/serving.md, pdserve.proto): against a fake
// router and a fake prefill worker (real framed connections), a disaggregated request waits
// for the prefill worker's KvConnect answer, never sends its PrefillRequest without one, and
// fails through the remote-prefill failure path when the answer is a refusal or never comes.
#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>

#include <catch2/catch.hpp>

#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "decode_worker/decode_service.h"
#include "kvtransfer/agent.h"
#include "kvtransfer/kvt.pb.h"
#include "tests/scratch_dir.h"
#include "tests/test_skip.h"
#include "tests/unit/engine/model_test_util.h"
#include "tests/unit/worker/fake_peer.h"

using namespace pd;
using namespace pd::test;
using namespace std::chrono_literals;

namespace {

// A Generate of `prompt` for `maxTokens` tokens, as the router sends one; the caller adds
// whatever disaggregates it.
proto::Envelope generateOf(uint64_t id, const std::vector<int32_t>& prompt, uint32_t maxTokens) {
  proto::Envelope env;
  env.set_request_id(id);
  auto* g = env.mutable_generate();
  g->set_request_id(id);
  for (int32_t t : prompt) g->add_prompt_token_ids(uint32_t(t));
  g->mutable_sampling()->set_max_tokens(maxTokens);
  return env;
}

struct Harness {
  explicit Harness(int64_t timeoutMs, const std::string& transports = "[tcp]", const std::string& moreKv = "",
                   const std::string& engine = "num_blocks: 64") {
    routerServer = listenAsRouter(io, router);
    const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
    decode = startWorker<decode::DecodeService>(
        config::parseClusterConfig("model: {path: " + model + "}\nengine: {backend: cpu, " + engine +
                                       "}\n"
                                       "kv_transfer: {transports: " +
                                       transports + ", timeout_ms: " + std::to_string(timeoutMs) +
                                       ", on_remote_prefill_failure: fail" + moreKv + "}\nlogging: {level: warn}\n",
                                   "test.yaml"),
        "decode-t", routerServer->port(), router);
  }
  ~Harness() {
    if (decode) decode->stop();
    if (prefillServer) prefillServer->stop();
    routerServer->stop();
  }

  // A fake prefill worker serving the decode worker's model; `reply` answers its messages.
  void startPrefill(std::function<void(const net::ConnectionPtr&, const proto::Envelope&)> reply) {
    net::ConnectionOptions po;
    po.hello.set_role(proto::ROLE_PREFILL);
    po.hello.set_worker_id("prefill-fake");
    po.hello.set_model_fingerprint(router.conn->peerHello().model_fingerprint());
    auto p = net::FramedServer::listen(io, "127.0.0.1", 0, po, prefill.callbacks(std::move(reply)));
    REQUIRE(p.ok());
    prefillServer = std::move(p).value();
  }

  // A disaggregated Generate of a 40-token prompt, prefilled by the fake prefill worker.
  void generate(uint64_t id) {
    proto::Envelope env = generateOf(id, engine::test::testPrompt(40, id), 4);
    setPrefillWorker(env);
    REQUIRE(router.conn->send(std::move(env)).isOk());
  }
  void setPrefillWorker(proto::Envelope& env) const {
    env.mutable_generate()->set_prefill_worker_address("127.0.0.1:" + std::to_string(prefillServer->port()));
    env.mutable_generate()->set_prefill_worker_id("prefill-fake");
  }

  // The request's final TokenChunk, as the router received it.
  std::optional<proto::TokenChunk> finalChunk(uint64_t id, std::chrono::milliseconds timeout) {
    std::optional<proto::TokenChunk> out;
    router.waitFor(
        [&] {
          for (const auto& e : router.got)
            if (e.body_case() == proto::Envelope::kTokenChunk && e.token_chunk().request_id() == id &&
                e.token_chunk().finish_reason() != proto::FINISH_NONE)
              out = e.token_chunk();
          return out.has_value();
        },
        timeout);
    return out;
  }

  net::IoPool io{2, "test-io"};
  Mailbox router, prefill;
  std::unique_ptr<net::FramedServer> routerServer, prefillServer;
  std::unique_ptr<decode::DecodeService> decode;
};

}  // namespace

TEST_CASE("decode KvConnect: no answer means no PrefillRequest, and the request fails at the deadline") {
  Harness h(600);
  h.startPrefill({});  // accepts, never answers
  const auto start = std::chrono::steady_clock::now();
  h.generate(7);
  auto chunk = h.finalChunk(7, 10s);
  REQUIRE(chunk.has_value());
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(chunk->finish_reason() == proto::FINISH_ERROR);
  CHECK_THAT(chunk->error().message(), Catch::Contains("did not answer KvConnect within 600 ms"));
  CHECK(waited >= 550ms);
  // The decode worker closes the connection that never finished its exchange.
  REQUIRE(h.prefill.waitFor([&] { return h.prefill.closed == 1; }, 5s));
  std::lock_guard<std::mutex> lock(h.prefill.mu);
  // Exactly one offer, made for this prefill worker: the decode agent's metadata.
  REQUIRE(h.prefill.count(proto::Envelope::kKvConnect) == 1);
  CHECK(h.prefill.count(proto::Envelope::kPrefillRequest) == 0);
  kvt::proto::AgentMetadata md;
  REQUIRE(md.ParseFromString(h.prefill.got.front().kv_connect().metadata()));
  CHECK(md.name() == "decode-t");
  REQUIRE(md.transports_size() >= 1);
}

TEST_CASE("decode KvConnect: a refusal fails the queued request at once with the prefill's reason") {
  Harness h(20000);
  h.startPrefill([](const net::ConnectionPtr& c, const proto::Envelope& env) {
    if (env.body_case() != proto::Envelope::kKvConnect) return;
    proto::Envelope err;
    err.set_request_id(0);
    err.mutable_error()->set_code(proto::ERROR_UNAVAILABLE);
    err.mutable_error()->set_message("fake prefill: no common transport");
    (void)c->send(std::move(err));
  });
  const auto start = std::chrono::steady_clock::now();
  h.generate(8);
  auto chunk = h.finalChunk(8, 10s);
  REQUIRE(chunk.has_value());
  CHECK(std::chrono::steady_clock::now() - start < 5s);  // not the 20 s deadline
  CHECK(chunk->finish_reason() == proto::FINISH_ERROR);
  CHECK_THAT(chunk->error().message(), Catch::Contains("fake prefill: no common transport"));
  // A second request reconnects and offers again.
  h.generate(9);
  auto again = h.finalChunk(9, 10s);
  REQUIRE(again.has_value());
  CHECK_THAT(again->error().message(), Catch::Contains("fake prefill: no common transport"));
  std::lock_guard<std::mutex> lock(h.prefill.mu);
  CHECK(h.prefill.count(proto::Envelope::kKvConnect) == 2);
  CHECK(h.prefill.count(proto::Envelope::kPrefillRequest) == 0);
}

// ---- KV fencing (docs/reliability.md): the decode side's quarantine, against a fake prefill worker that
// has a real TransferAgent (it answers KvConnect with its real reply, so the decode worker
// loads a real lane to it) and never pushes: the decode worker's deadline fails the request.
namespace {

// The fake prefill worker's kvtransfer side: a real agent over a pool of `bytes`, each `fill`
// (driven under a mutex: io threads). With poolBlocks > 0 its KvConnect reply carries the
// pool, that many blocks at its base, as a prefill worker that can pull does.
struct FakePrefillKv {
  explicit FakePrefillKv(std::vector<std::string> transports, size_t bytes = 1 << 16, uint8_t fill = 0x5A,
                         uint32_t poolBlocks = 0)
      : pool("prefill-fake", std::move(transports), bytes, fill), poolBlocks(poolBlocks) {}
  // Answers KvConnect with the real reply; records the offer and the PrefillRequest's target.
  void handle(const net::ConnectionPtr& c, const proto::Envelope& env) {
    std::lock_guard<std::mutex> lock(mu);
    if (env.body_case() == proto::Envelope::kKvConnect) {
      offer = env.kv_connect();
      auto p = pool.agent->loadPeer(env.kv_connect().metadata());
      REQUIRE(p.ok());
      peer = *p;
      proto::Envelope reply;
      reply.set_request_id(0);
      reply.mutable_kv_connect()->set_metadata(pool.agent->peerMetadata(*p).value());
      if (poolBlocks > 0) {
        reply.mutable_kv_connect()->set_num_blocks(poolBlocks);
        reply.mutable_kv_connect()->add_regions()->set_base(pool.region().addr);
      }
      (void)c->send(std::move(reply));
    } else if (env.body_case() == proto::Envelope::kPrefillRequest) {
      target = env.prefill_request().kv_target();
    }
  }
  // A write of 64 bytes into the target's first region under the target's grant, waited for.
  Status staleWrite() {
    std::lock_guard<std::mutex> lock(mu);
    MemDesc local{reinterpret_cast<uintptr_t>(pool.buf.data()), 64};
    MemDesc remote{uintptr_t(offer.regions(0).base()), 64};
    auto id = pool.agent->post({local}, {remote}, peer, target.write_grant());
    if (!id.ok()) return id.status();
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < end) {
      pool.agent->progress();
      Status st = pool.agent->poll(*id);
      if (!st.inProgress()) return st;
      std::this_thread::sleep_for(1ms);
    }
    return deadlineExceeded("test: stale write still pending");
  }
  std::mutex mu;
  FakeKvPool pool;
  uint32_t poolBlocks = 0;
  kvt::AgentPeer peer = 0;
  proto::KvConnect offer;  // where the decode worker's blocks live (the connection's facts)
  proto::KvTarget target;  // the request's blocks and grant
};

void ackCancel(const net::ConnectionPtr& c, uint64_t id) {
  proto::Envelope ack;
  ack.set_request_id(id);
  ack.mutable_cancel()->set_request_id(id);
  ack.mutable_cancel()->set_ack(true);
  REQUIRE(c->send(std::move(ack)).isOk());
}

}  // namespace

TEST_CASE(
    "decode KV fencing: over a receiver-fenced lane (tcp) the blocks are free at once, the revoked grant is refused") {
  FakePrefillKv kv({"tcp"});  // declared first: the fake prefill server may call it until the worker stops
  Harness h(600, "[tcp]");
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) { kv.handle(c, env); });
  const int port = h.decode->metricsPort();
  const double total = metric(port, "pdserve_kv_cache_num_blocks");
  REQUIRE(total > 0);
  h.generate(21);
  // The request's epoch travels in its target (recorded by the fake after the mailbox saw it).
  CHECK(eventually(
      [&] {
        std::lock_guard<std::mutex> lock(kv.mu);
        return !kv.target.write_grant().empty();
      },
      10s));
  CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") < total; }, 2s));  // reserved
  auto chunk = h.finalChunk(21, 10s);
  REQUIRE(chunk.has_value());
  CHECK(chunk->finish_reason() == proto::FINISH_ERROR);
  // The decode worker gave up: the blocks are free at once, nothing is quarantined.
  CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == total; }, 2s));
  CHECK(metric(port, "pdserve_kv_blocks_quarantined") == 0);
  REQUIRE(h.prefill.waitFor([&] { return h.prefill.count(proto::Envelope::kCancel) == 1; }, 5s));
  // The slow-but-alive writer's late write under the revoked grant is refused and counted.
  Status late = kv.staleWrite();
  CHECK(late.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(late.message(), Catch::Contains("revoked write grant"));
  CHECK(metric(port, "pdserve_kv_writes_rejected_total", "unknown_grant") == 1);
}

TEST_CASE(
    "decode KV fencing: over a one-sided lane (cma) the blocks stay quarantined until the cancel is acknowledged "
    "or the writer is gone") {
  Harness h(600, "[cma, tcp]");
  auto kv = std::make_unique<FakePrefillKv>(std::vector<std::string>{"cma", "tcp"});
  std::mutex kvMu;  // kv is destroyed mid-test (the writer dies)
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) {
    std::lock_guard<std::mutex> lock(kvMu);
    if (kv) kv->handle(c, env);
  });
  const int port = h.decode->metricsPort();
  const double total = metric(port, "pdserve_kv_cache_num_blocks");
  REQUIRE(total > 0);
  h.generate(31);
  auto chunk = h.finalChunk(31, 10s);
  REQUIRE(chunk.has_value());
  CHECK(chunk->finish_reason() == proto::FINISH_ERROR);
  if (metric(port, "pdserve_kv_peers", "transport=\"cma\"") != 1) pd::test::skipTest("cma does not connect here");
  // Cancelled, not acknowledged: the 3 blocks of the 40-token prompt are held.
  const double held = metric(port, "pdserve_kv_blocks_quarantined");
  CHECK(held == 3);
  CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == total - held; }, 2s));
  std::this_thread::sleep_for(300ms);  // no timer frees them
  CHECK(metric(port, "pdserve_kv_blocks_quarantined") == held);
  REQUIRE(h.prefill.waitFor([&] { return h.prefill.count(proto::Envelope::kCancel) == 1; }, 5s));
  net::ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(h.prefill.mu);
    conn = h.prefill.conn;
  }
  SECTION("the acknowledgement releases them") {
    ackCancel(conn, 999);  // another request's ack releases nothing
    std::this_thread::sleep_for(200ms);
    CHECK(metric(port, "pdserve_kv_blocks_quarantined") == held);
    ackCancel(conn, 31);
    CHECK(eventually([&] { return metric(port, "pdserve_kv_blocks_quarantined") == 0; }, 5s));
    CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == total; }, 2s));
    CHECK(metric(port, "pdserve_kv_quarantine_seconds_count") == 1);
  }
  SECTION("the writer going away (its KV lanes dead, its control connection closed) releases them") {
    {
      std::lock_guard<std::mutex> lock(kvMu);
      kv.reset();  // its transports close their sockets: the decode's lanes to it die
    }
    std::this_thread::sleep_for(300ms);
    CHECK(metric(port, "pdserve_kv_blocks_quarantined") == held);  // its control connection is still up
    conn->close(unavailable("test: the prefill worker exits"));
    CHECK(eventually([&] { return metric(port, "pdserve_kv_blocks_quarantined") == 0; }, 10s));
    CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == total; }, 2s));
  }
}

// ---- Peer pulls (docs/kv_cache.md, "Peer pulls"): the target's lifecycle against a fake source
// with a real TransferAgent (tcp). Whatever the source does, the request is served: pulled
// blocks are attached as a cached prefix, and any failure recomputes the prompt, even with
// on_remote_prefill_failure: fail.
namespace {

constexpr int kPullTokens = 32;  // 2 blocks of the 40-token prompt

void generatePull(Harness& h, uint64_t id) {
  proto::Envelope env = generateOf(id, engine::test::testPrompt(40, id), 4);
  auto* g = env.mutable_generate();
  g->set_pull_source_id("decode-source");
  g->set_pull_source_address("127.0.0.1:" + std::to_string(h.prefillServer->port()));
  g->set_pull_tokens(kPullTokens);
  REQUIRE(h.router.conn->send(std::move(env)).isOk());
}

// A fake source: KvConnect answered for real; each PullRequest recorded and answered by `answer`.
struct FakeSource {
  FakePrefillKv kv{{"tcp"}};
  std::function<void(const net::ConnectionPtr&, const proto::PullRequest&)> answer;
  std::vector<proto::PullRequest> pulls;
  void handle(const net::ConnectionPtr& c, const proto::Envelope& env) {
    if (env.body_case() == proto::Envelope::kPullRequest) {
      {
        std::lock_guard<std::mutex> lock(kv.mu);
        pulls.push_back(env.pull_request());
      }
      if (answer) answer(c, env.pull_request());
      return;
    }
    kv.handle(c, env);
  }
};

const std::string kPullKv = ", peer_pulls: true, pull_timeout_ms: 400";

}  // namespace

TEST_CASE("peer pull: a source that no longer holds the blocks refuses; the prompt is computed here") {
  FakeSource src;  // declared first: the fake prefill server may call it until the worker stops
  Harness h(20000, "[tcp]", kPullKv);
  src.answer = [](const net::ConnectionPtr& c, const proto::PullRequest& pr) {
    (void)c->send(pullRefused(pr, "fake source: holds none of the pulled tokens any more"));
  };
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) { src.handle(c, env); });
  const int port = h.decode->metricsPort();
  const double total = metric(port, "pdserve_kv_cache_num_blocks");
  generatePull(h, 41);
  auto chunk = h.finalChunk(41, 10s);
  REQUIRE(chunk.has_value());
  CHECK(chunk->finish_reason() == proto::FINISH_LENGTH);  // served, not failed
  CHECK(chunk->usage().cached_tokens() == 0);
  CHECK(chunk->timings().pull_tokens() == 0);
  CHECK(metric(port, "pdserve_kv_pulls_total", "outcome=\"refused\"") == 1);
  // The PullRequest asked for exactly the pulled tokens, one target block each, with a grant.
  {
    std::lock_guard<std::mutex> lock(src.kv.mu);
    REQUIRE(src.pulls.size() == 1);
    CHECK(src.pulls[0].prompt_token_ids_size() == kPullTokens);
    REQUIRE(src.pulls[0].kv_target().layers_size() == 1);
    CHECK(src.pulls[0].kv_target().layers(0).block_ids_size() == kPullTokens / 16);
    CHECK(!src.pulls[0].kv_target().write_grant().empty());
    CHECK(src.pulls[0].deadline_ms() == 400);
  }
  // tcp is receiver-fenced: nothing quarantined, every block free once the request ended.
  CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == total; }, 5s));
  CHECK(metric(port, "pdserve_kv_blocks_quarantined") == 0);
}

TEST_CASE("peer pull: a silent source costs the pull deadline, then the prompt is computed here") {
  FakeSource src;  // answers KvConnect, never a PullRequest (declared first: it outlives the worker)
  Harness h(20000, "[tcp]", kPullKv);
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) { src.handle(c, env); });
  const int port = h.decode->metricsPort();
  const auto start = std::chrono::steady_clock::now();
  generatePull(h, 42);
  auto chunk = h.finalChunk(42, 10s);
  REQUIRE(chunk.has_value());
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(chunk->finish_reason() == proto::FINISH_LENGTH);
  CHECK(waited >= 380ms);
  CHECK(waited < 5s);  // the pull deadline, not kv_transfer.timeout_ms (20 s)
  CHECK(chunk->timings().pull_ms() >= 380);
  CHECK(metric(port, "pdserve_kv_pulls_total", "outcome=\"fell_back\"") == 1);
  // The source is told to stop.
  REQUIRE(h.prefill.waitFor([&] { return h.prefill.count(proto::Envelope::kCancel) == 1; }, 5s));
}

TEST_CASE("peer pull: PullDone attaches the pulled blocks as a cached prefix and computes the rest") {
  FakeSource src;  // declared first: the fake prefill server may call it until the worker stops
  Harness h(20000, "[tcp]", kPullKv);
  src.answer = [](const net::ConnectionPtr& c, const proto::PullRequest& pr) {
    // (The fake writes nothing: the blocks hold whatever they held; this checks the lifecycle.)
    (void)c->send(pullDone(pr, 12345));
  };
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) { src.handle(c, env); });
  const int port = h.decode->metricsPort();
  generatePull(h, 43);
  auto chunk = h.finalChunk(43, 10s);
  REQUIRE(chunk.has_value());
  CHECK(chunk->finish_reason() == proto::FINISH_LENGTH);
  CHECK(chunk->usage().cached_tokens() == kPullTokens);
  CHECK(chunk->timings().pull_tokens() == kPullTokens);
  CHECK(chunk->timings().pull_transport() == "tcp");
  CHECK(metric(port, "pdserve_kv_pulls_total", "outcome=\"done\"") == 1);
  CHECK(metric(port, "pdserve_kv_pull_bytes_total") == 12345);
  CHECK(metric(port, "pdserve_kv_blocks_quarantined") == 0);
}

TEST_CASE("peer pull: a Generate naming a pull is refused by name when pulls are off here") {
  FakeSource src;  // declared first: the fake prefill server may call it until the worker stops
  Harness h(20000, "[tcp]");
  h.startPrefill([&](const net::ConnectionPtr& c, const proto::Envelope& env) { src.handle(c, env); });
  generatePull(h, 44);
  auto chunk = h.finalChunk(44, 10s);
  REQUIRE(chunk.has_value());
  CHECK(chunk->finish_reason() == proto::FINISH_ERROR);
  CHECK_THAT(chunk->error().message(), Catch::Contains("kv_transfer.peer_pulls"));
}

// The source side (decode_worker/pull_sources.h): a fake target dials the decode worker's pull
// port, with a real agent over tcp and a buffer as its KV region. A prefix the decode worker
// computed is pushed into the target's blocks and PullDone says how many tokens; a prefix it
// does not hold is refused (not found); nothing stays pinned afterwards.
namespace {

// Computes `prompt` colocated on the harness's decode worker (its full blocks get names).
void computeHere(Harness& h, uint64_t id, const std::vector<int32_t>& prompt) {
  REQUIRE(h.router.conn->send(generateOf(id, prompt, 2)).isOk());
  const auto last = h.finalChunk(id, 10s);
  REQUIRE(last.has_value());
  INFO(last->DebugString());
  REQUIRE(last->finish_reason() == proto::FINISH_LENGTH);
}

// A PullRequest `id` for `tokens` into `blocks` (one layer's ids) under `grant`, deadline 2 s.
proto::Envelope pullRequestOf(uint64_t id, const std::vector<int32_t>& tokens, const std::vector<uint32_t>& blocks,
                              const std::string& grant) {
  proto::Envelope env;
  env.set_request_id(id);
  auto* pr = env.mutable_pull_request();
  pr->set_request_id(id);
  for (int32_t t : tokens) pr->add_prompt_token_ids(uint32_t(t));
  auto* layer = pr->mutable_kv_target()->add_layers();
  for (uint32_t b : blocks) layer->add_block_ids(b);
  pr->mutable_kv_target()->set_write_grant(grant);
  pr->set_deadline_ms(2000);
  return env;
}

// A fake pull target against the harness's decode worker (the source): `numBlocks` blocks of
// KV in one host buffer, a real agent over tcp, dialled to the source's pull port, KvConnect
// exchanged and a write grant made for the whole buffer.
struct FakePullTarget {
  FakePullTarget(Harness& h, int numBlocks) {
    const std::string address = h.router.conn->peerHello().address();
    REQUIRE(!address.empty());  // the pull port, in the hello
    bytesPerToken = kvBytesPerToken(h.router);
    pool.emplace("target-fake", std::vector<std::string>{"tcp"}, size_t(numBlocks) * 16 * bytesPerToken);
    net::ConnectionOptions co;
    co.hello.set_role(proto::ROLE_DECODE);
    co.hello.set_worker_id("target-fake");
    co.hello.set_model_fingerprint(h.router.conn->peerHello().model_fingerprint());
    const size_t colon = address.rfind(':');
    auto c = net::FramedClient::connect(h.io, address.substr(0, colon), std::atoi(address.c_str() + colon + 1), co,
                                        mail.callbacks(), 5s);
    REQUIRE(c.ok());
    conn = std::move(c).value();
    const KvConnected connected = offerKvPool(*pool, uint32_t(numBlocks), conn, mail);
    auto g = pool->agent->grantWrite(connected.peer, {pool->region()});
    REQUIRE(g.ok());
    grant = *g;
  }
  ~FakePullTarget() {
    if (conn) conn->close(Status::ok());
  }
  // Sends PullRequest `id` for `tokens` into `blocks` and returns the source's answer
  // (PullDone or Error).
  proto::Envelope pull(uint64_t id, const std::vector<int32_t>& tokens, const std::vector<uint32_t>& blocks) {
    const size_t before = mail.count(proto::Envelope::kPullDone) + mail.count(proto::Envelope::kError);
    REQUIRE(conn->send(pullRequestOf(id, tokens, blocks, grant)).isOk());
    REQUIRE(mail.waitFor(
        [&] { return mail.count(proto::Envelope::kPullDone) + mail.count(proto::Envelope::kError) > before; }, 10s));
    std::lock_guard<std::mutex> lock(mail.mu);
    return mail.got.back();
  }
  std::vector<uint8_t> block(int b) const {
    const size_t bytes = 16 * bytesPerToken;
    const std::vector<uint8_t>& buf = pool->buf;
    return std::vector<uint8_t>(buf.begin() + long(size_t(b) * bytes), buf.begin() + long(size_t(b + 1) * bytes));
  }

  uint64_t bytesPerToken = 0;
  std::optional<FakeKvPool> pool;  // made once the worker reported its KV bytes per token
  Mailbox mail;
  net::ConnectionPtr conn;
  std::string grant;
};

}  // namespace

TEST_CASE("pull source: pushes the blocks it holds, refuses what it does not hold, unpins after") {
  Harness h(20000, "[tcp]", kPullKv);
  // The decode worker computes a 40-token prompt colocated: its first 2 blocks get names.
  const auto prompt = engine::test::testPrompt(40, 51);
  computeHere(h, 51, prompt);
  FakePullTarget t(h, 4);
  const uint64_t bytesPerToken = t.bytesPerToken;
  {
    const proto::Envelope done = t.pull(1, std::vector<int32_t>(prompt.begin(), prompt.begin() + 32), {0, 1});
    INFO(done.DebugString());
    REQUIRE(done.body_case() == proto::Envelope::kPullDone);
    CHECK(done.pull_done().tokens() == 32);
    CHECK(done.pull_done().bytes_transferred() == 32 * bytesPerToken);
    CHECK(done.pull_done().transport() == "tcp");
  }
  // The computed KV landed in the target's blocks 0 and 1 (not all zero), block 2 untouched.
  const auto b0 = t.block(0);
  CHECK(std::any_of(b0.begin(), b0.end(), [](uint8_t b) { return b != 0; }));
  // A prefix it never computed: refused, by name.
  {
    const proto::Envelope refused = t.pull(2, engine::test::testPrompt(32, 77), {2, 3});
    REQUIRE(refused.body_case() == proto::Envelope::kError);
    CHECK(refused.error().code() == proto::ERROR_NOT_FOUND);
    CHECK_THAT(refused.error().message(), Catch::Contains("holds none of the 32 pulled tokens"));
  }
  // Nothing stays pinned: every block is free (cached) again.
  const int port = h.decode->metricsPort();
  CHECK(eventually(
      [&] { return metric(port, "pdserve_kv_cache_free_blocks") == metric(port, "pdserve_kv_cache_num_blocks"); }, 5s));
}

namespace {

// The source serves a prefix its region evicted to a lower tier (docs/kv_cache.md, "Peer
// pulls"): a 40-token prompt computed, pulled once from the region, then evicted by a prompt
// that needs the whole 8-block region; the same pull again (into the same target blocks,
// zeroed) promotes the blocks from `tier` and pushes the same bytes.
void pullFromTier(const std::string& tier, const std::string& tiers) {
  Harness h(20000, "[tcp]", kPullKv, "num_blocks: 8, kv_tiers: {" + tiers + "}");
  const int port = h.decode->metricsPort();
  const auto prompt = engine::test::testPrompt(40, 61);
  const std::vector<int32_t> pulled(prompt.begin(), prompt.begin() + 32);
  computeHere(h, 61, prompt);
  FakePullTarget t(h, 4);
  {
    const proto::Envelope done = t.pull(1, pulled, {0, 1});
    INFO(done.DebugString());
    REQUIRE(done.body_case() == proto::Envelope::kPullDone);
    REQUIRE(done.pull_done().tokens() == 32);
  }
  const std::vector<uint8_t> servedFromRegion = t.pool->buf;
  REQUIRE(std::any_of(servedFromRegion.begin(), servedFromRegion.end(), [](uint8_t b) { return b != 0; }));
  std::fill(t.pool->buf.begin(), t.pool->buf.end(), 0);
  // The disk tier's write-through lands off the loop: both blocks are on disk first.
  if (tier == "disk") {
    REQUIRE(eventually([&] { return metric(port, "pdserve_kv_tier_blocks", "tier=\"disk\"") >= 2; }, 5s));
  }
  // 112 tokens (the longest prompt 8 blocks take) and 2 generated: all 8 blocks, so both
  // named blocks leave the region.
  computeHere(h, 62, engine::test::testPrompt(112, 62));
  const std::string from = "from=\"" + tier + "\"";
  const double promotedBefore = std::max(0.0, metric(port, "pdserve_kv_tier_promotions_total", from));
  {
    const proto::Envelope done = t.pull(2, pulled, {0, 1});
    INFO(done.DebugString());
    REQUIRE(done.body_case() == proto::Envelope::kPullDone);
    CHECK(done.pull_done().tokens() == 32);
    CHECK(done.pull_done().bytes_transferred() == 32 * t.bytesPerToken);
  }
  // The same KV as the region served, byte for byte.
  CHECK((t.pool->buf == servedFromRegion));
  CHECK(eventually([&] { return metric(port, "pdserve_kv_tier_promotions_total", from) - promotedBefore == 2; }, 5s));
  // Nothing stays pinned.
  CHECK(eventually([&] { return metric(port, "pdserve_kv_cache_free_blocks") == 8; }, 5s));
}

}  // namespace

TEST_CASE("pull source: a prefix its region demoted to the host tier is promoted and pushed") {
  pullFromTier("host", "host_bytes: 8388608");
}

TEST_CASE("pull source: a prefix only its disk tier holds is promoted and pushed") {
  const std::string dir = (pd::test::scratchDir() / "pull_disk").string();
  pullFromTier("disk", "disk_bytes: 8388608, disk_path: " + dir);
}

// The prefill side of peer pulls (docs/kv_cache.md, "The prefill side"): a disaggregated
// Generate naming this decode worker as the pull source is forwarded in the PrefillRequest
// when the prefill worker's KvConnect reply carried its pool, and the PullRequest the prefill
// worker sends back over the same connection is served from this worker's region into the
// prefill worker's granted blocks; without the pool in the reply nothing is forwarded.
TEST_CASE("prefill pull: the decode worker forwards the pull and serves it over the prefill link") {
  const bool pool = GENERATE(true, false);
  INFO("the reply carries the pool: " << pool);
  Harness h(20000, "[tcp]", kPullKv);
  const auto prompt = engine::test::testPrompt(40, 61);
  computeHere(h, 61, prompt);  // its leading blocks are named in the region
  const uint64_t bytesPerToken = kvBytesPerToken(h.router);
  // The fake prefill worker: a real agent over a 4-block pool (all zero), in its KvConnect reply
  // when `pool`. Its handler owns it: the server may still call it while `h` stops the worker
  // (a Cancel), after this scope's locals are gone.
  auto fake = std::make_shared<FakePrefillKv>(std::vector<std::string>{"tcp"}, 4 * 16 * bytesPerToken, 0, pool ? 4 : 0);
  FakePrefillKv& kv = *fake;
  h.startPrefill([fake](const net::ConnectionPtr& c, const proto::Envelope& env) { fake->handle(c, env); });
  {
    proto::Envelope env = generateOf(62, prompt, 4);
    h.setPrefillWorker(env);
    auto* g = env.mutable_generate();
    g->set_pull_source_id("decode-t");
    g->set_pull_source_address("127.0.0.1:1");  // not dialled: the pull rides the prefill link
    g->set_pull_tokens(kPullTokens);
    REQUIRE(h.router.conn->send(std::move(env)).isOk());
  }
  REQUIRE(h.prefill.waitFor([&] { return h.prefill.count(proto::Envelope::kPrefillRequest) == 1; }, 10s));
  proto::PrefillRequest pr;
  net::ConnectionPtr link;
  {
    std::lock_guard<std::mutex> lock(h.prefill.mu);
    for (const auto& e : h.prefill.got)
      if (e.body_case() == proto::Envelope::kPrefillRequest) pr = e.prefill_request();
    link = h.prefill.conn;
  }
  if (!pool) {
    CHECK(pr.pull_tokens() == 0);
    CHECK(pr.pull_source_id().empty());
    return;
  }
  CHECK(pr.pull_tokens() == uint32_t(kPullTokens));
  CHECK(pr.pull_source_id() == "decode-t");
  // The prefill worker's pull, back over the same connection, into its blocks 1 and 2.
  std::string grant;
  {
    std::lock_guard<std::mutex> lock(kv.mu);
    auto g = kv.pool.agent->grantWrite(kv.peer, {kv.pool.region()});
    REQUIRE(g.ok());
    grant = std::move(g).value();
  }
  const std::vector<int32_t> pulled(pr.prompt_token_ids().begin(), pr.prompt_token_ids().begin() + kPullTokens);
  REQUIRE(link->send(pullRequestOf(62, pulled, {1, 2}, grant)).isOk());
  REQUIRE(h.prefill.waitFor(
      [&] { return h.prefill.count(proto::Envelope::kPullDone) + h.prefill.count(proto::Envelope::kError) >= 1; },
      10s));
  {
    std::lock_guard<std::mutex> lock(h.prefill.mu);
    for (const auto& e : h.prefill.got) {
      if (e.body_case() != proto::Envelope::kPullDone && e.body_case() != proto::Envelope::kError) continue;
      INFO(e.DebugString());
      REQUIRE(e.body_case() == proto::Envelope::kPullDone);
      CHECK(e.pull_done().tokens() == uint32_t(kPullTokens));
      CHECK(e.pull_done().bytes_transferred() == kPullTokens * bytesPerToken);
    }
  }
  // The pushed KV landed in the fake pool (it was all zero).
  CHECK(std::any_of(kv.pool.buf.begin(), kv.pool.buf.end(), [](uint8_t b) { return b != 0; }));
}
