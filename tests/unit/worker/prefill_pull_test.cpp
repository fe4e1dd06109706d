// The prefill worker's pull phase (prefill_worker/prefill_pulls.h; docs/kv_cache.md, "The
// prefill side") against a fake decode worker with a real TransferAgent (tcp) and a buffer as
// its KV pool: a PrefillRequest naming pull_tokens makes the prefill worker send a PullRequest
// for exactly those tokens back over the same connection, with a grant and the pull deadline.
// Whatever the decode worker answers -- PullDone, an Error, nothing -- the job is served
// (PrefillDone), the pull is counted by outcome, and no block stays held.
#include <chrono>
#include <mutex>
#include <optional>

#include <catch2/catch.hpp>

#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"
#include "prefill_worker/prefill_service.h"
#include "tests/unit/engine/model_test_util.h"
#include "tests/unit/worker/fake_peer.h"

using namespace pd;
using namespace pd::test;
using namespace std::chrono_literals;

namespace {

constexpr int kPullTokens = 32;  // 2 blocks of the 40-token prompt
constexpr int kPullDeadlineMs = 400;

struct Harness {
  // `answer` is how the fake decode worker answers a PullRequest (nothing when empty).
  explicit Harness(std::function<void(const net::ConnectionPtr&, const proto::PullRequest&)> answer) {
    routerServer = listenAsRouter(io, router);
    const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
    prefill = startWorker<prefill::PrefillService>(
        config::parseClusterConfig("model: {path: " + model +
                                       "}\nengine: {backend: cpu, num_blocks: 64}\n"
                                       "kv_transfer: {transports: [tcp], timeout_ms: 20000, pull_timeout_ms: " +
                                       std::to_string(kPullDeadlineMs) + "}\nlogging: {level: warn}\n",
                                   "test.yaml"),
        "prefill-t", routerServer->port(), router);
    // The fake decode worker: 4 blocks of KV in one host buffer, a real agent.
    pool.emplace("decode-fake", std::vector<std::string>{"tcp"}, 4 * 16 * kvBytesPerToken(router));
    net::ConnectionOptions co;
    co.hello.set_role(proto::ROLE_DECODE);
    co.hello.set_worker_id("decode-fake");
    co.hello.set_model_fingerprint(router.conn->peerHello().model_fingerprint());
    auto conn =
        net::FramedClient::connect(io, "127.0.0.1", prefill->controlPort(), co,
                                   decode.callbacks([answer](const net::ConnectionPtr& c, const proto::Envelope& env) {
                                     if (env.body_case() == proto::Envelope::kPullRequest && answer)
                                       answer(c, env.pull_request());
                                   }),
                                   5s);
    REQUIRE(conn.ok());
    link = std::move(conn).value();
    const KvConnected connected = offerKvPool(*pool, 4, link, decode);
    reply = connected.reply;
    peer = connected.peer;
  }
  ~Harness() {
    if (link) link->close(Status::ok());
    if (prefill) prefill->stop();
    routerServer->stop();
  }

  // A PrefillRequest for a 40-token prompt into the fake's blocks 0..2, naming a pull of its
  // first kPullTokens tokens.
  void request(uint64_t id) {
    auto grant = pool->agent->grantWrite(peer, {pool->region()});
    REQUIRE(grant.ok());
    proto::Envelope env;
    env.set_request_id(id);
    auto* pr = env.mutable_prefill_request();
    pr->set_request_id(id);
    for (int32_t t : engine::test::testPrompt(40, id)) pr->add_prompt_token_ids(uint32_t(t));
    auto* layer = pr->mutable_kv_target()->add_layers();
    for (uint32_t b : {0u, 1u, 2u}) layer->add_block_ids(b);
    pr->mutable_kv_target()->set_write_grant(*grant);
    pr->set_pull_source_id("decode-fake");
    pr->set_pull_source_address("127.0.0.1:1");
    pr->set_pull_tokens(kPullTokens);
    REQUIRE(link->send(std::move(env)).isOk());
  }
  std::optional<proto::PrefillDone> done(std::chrono::milliseconds timeout) {
    std::optional<proto::PrefillDone> out;
    decode.waitFor(
        [&] {
          if (auto e = decode.last(proto::Envelope::kPrefillDone)) out = e->prefill_done();
          return out.has_value();
        },
        timeout);
    return out;
  }
  double pulls(const std::string& outcome) {
    return metric(prefill->metricsPort(), "pdserve_kv_pulls_total", "outcome=\"" + outcome + "\"");
  }
  bool allFree() {
    const int port = prefill->metricsPort();
    return metric(port, "pdserve_kv_cache_free_blocks") == metric(port, "pdserve_kv_cache_num_blocks") &&
           metric(port, "pdserve_kv_blocks_quarantined") <= 0;
  }

  net::IoPool io{2, "test-io"};
  Mailbox router, decode;
  std::unique_ptr<net::FramedServer> routerServer;
  std::unique_ptr<prefill::PrefillService> prefill;
  std::optional<FakeKvPool> pool;  // made once the worker reported its KV bytes per token
  net::ConnectionPtr link;
  proto::KvConnect reply;
  kvt::AgentPeer peer = 0;
};

void answerError(const net::ConnectionPtr& c, const proto::PullRequest& pr) {
  (void)c->send(pullRefused(pr, "fake decode worker: holds none of the pulled tokens any more"));
}

// PullDone without writing: the blocks hold whatever was there, which is all a test of the
// naming needs (the ids are not compared here).
void answerDone(const net::ConnectionPtr& c, const proto::PullRequest& pr) { (void)c->send(pullDone(pr, 4321)); }

}  // namespace

TEST_CASE("prefill pull: the KvConnect reply carries the pool; the PullRequest asks for the pulled blocks") {
  Harness h(answerDone);
  CHECK(h.reply.num_blocks() == 64);
  CHECK(h.reply.regions_size() == 1);
  h.request(7);
  const auto done = h.done(10s);
  REQUIRE(done);
  {
    std::lock_guard<std::mutex> lock(h.decode.mu);
    const auto pull = h.decode.last(proto::Envelope::kPullRequest);
    REQUIRE(pull);
    const auto prompt = engine::test::testPrompt(40, 7);
    REQUIRE(pull->pull_request().prompt_token_ids_size() == kPullTokens);
    for (int i = 0; i < kPullTokens; ++i) CHECK(pull->pull_request().prompt_token_ids(i) == uint32_t(prompt[i]));
    REQUIRE(pull->pull_request().kv_target().layers_size() == 1);
    CHECK(pull->pull_request().kv_target().layers(0).block_ids_size() == kPullTokens / 16);
    CHECK(!pull->pull_request().kv_target().write_grant().empty());
    CHECK(pull->pull_request().deadline_ms() == uint64_t(kPullDeadlineMs));
  }
  // The pulled tokens are a cached prefix of the job: its prefix hit, and its pull's timings.
  CHECK(done->cached_prompt_tokens() == uint32_t(kPullTokens));
  CHECK(done->timings().pull_tokens() == uint32_t(kPullTokens));
  CHECK(done->timings().pull_ms() > 0);
  CHECK(done->timings().pull_transport() == "tcp");
  CHECK(h.pulls("done") == 1);
  CHECK(metric(h.prefill->metricsPort(), "pdserve_kv_pull_bytes_total") == 4321);
  CHECK(eventually([&] { return h.allFree(); }, 5s));
}

TEST_CASE("prefill pull: a refusal computes the prompt here at once") {
  Harness h(answerError);
  const auto t0 = std::chrono::steady_clock::now();
  h.request(8);
  const auto done = h.done(10s);
  REQUIRE(done);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(kPullDeadlineMs + 2000));
  CHECK(done->cached_prompt_tokens() == 0);
  CHECK(done->timings().pull_tokens() == 0);
  CHECK(h.pulls("refused") == 1);
  CHECK(h.pulls("done") <= 0);
  CHECK(eventually([&] { return h.allFree(); }, 5s));
}

TEST_CASE("prefill pull: a silent decode worker costs the pull deadline, a Cancel, then the prompt computed here") {
  Harness h({});
  const auto t0 = std::chrono::steady_clock::now();
  h.request(9);
  const auto done = h.done(10s);
  const auto waited = std::chrono::steady_clock::now() - t0;
  REQUIRE(done);
  CHECK(waited >= std::chrono::milliseconds(kPullDeadlineMs - 20));
  CHECK(waited < 5s);  // the pull deadline, not kv_transfer.timeout_ms (20 s)
  CHECK(done->timings().pull_ms() >= kPullDeadlineMs - 20);
  CHECK(done->cached_prompt_tokens() == 0);
  CHECK(h.pulls("fell_back") == 1);
  {
    std::lock_guard<std::mutex> lock(h.decode.mu);
    const auto cancel = h.decode.last(proto::Envelope::kCancel);
    REQUIRE(cancel);
    CHECK(cancel->cancel().request_id() == 9);
    CHECK(!cancel->cancel().ack());
  }
  // tcp is receiver-fenced: the revoked grant frees the blocks at once, nothing is held.
  CHECK(eventually([&] { return h.allFree(); }, 5s));
}
