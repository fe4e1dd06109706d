// The decode worker's side of KvConnect (docs/serving.md, pdserve.proto): against a fake
// router and a fake prefill worker (real framed connections), a disaggregated request waits
// for the prefill worker's KvConnect answer, never sends its PrefillRequest without one, and
// fails through the remote-prefill failure path when the answer is a refusal or never comes.
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "decode_worker/decode_service.h"
#include "kvtransfer/kvt.pb.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;
using namespace std::chrono_literals;

namespace {

// Envelopes and connections seen by a fake peer, from the io threads.
struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<proto::Envelope> got;
  net::ConnectionPtr conn;
  int closed = 0;

  template <typename Pred>
  bool waitFor(Pred pred, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return pred(); });
  }
  net::ConnectionCallbacks callbacks(std::function<void(const net::ConnectionPtr&, const proto::Envelope&)> reply = {}) {
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) {
      std::lock_guard<std::mutex> lock(mu);
      conn = c;
      cv.notify_all();
    };
    cb.onMessage = [this, reply](const net::ConnectionPtr& c, proto::Envelope&& env) {
      // Recorded before the reply goes out: whoever sees the reply's effect sees this too.
      {
        std::lock_guard<std::mutex> lock(mu);
        got.push_back(env);
        cv.notify_all();
      }
      if (reply) reply(c, env);
    };
    cb.onClose = [this](const net::ConnectionPtr&, const Status&) {
      std::lock_guard<std::mutex> lock(mu);
      ++closed;
      cv.notify_all();
    };
    return cb;
  }
  size_t count(proto::Envelope::BodyCase body) {
    size_t n = 0;
    for (const auto& e : got) n += e.body_case() == body;
    return n;
  }
};

struct Harness {
  explicit Harness(int64_t timeoutMs) {
    net::ConnectionOptions ro;
    ro.hello.set_role(proto::ROLE_ROUTER);
    ro.hello.set_worker_id("router-fake");
    auto r = net::FramedServer::listen(io, "127.0.0.1", 0, ro, router.callbacks());
    REQUIRE(r.ok());
    routerServer = std::move(r).value();
    const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
    auto config = config::parseClusterConfig(
        "model: {path: " + model + "}\nengine: {backend: cpu, num_blocks: 64}\n"
        "kv_transfer: {transports: [tcp], timeout_ms: " + std::to_string(timeoutMs) +
            ", on_remote_prefill_failure: fail}\nlogging: {level: warn}\n",
        "test.yaml");
    REQUIRE(config.ok());
    worker::WorkerFlags flags;
    flags.workerId = "decode-t";
    flags.routers = {worker::RouterTarget{"127.0.0.1", routerServer->port()}};
    auto d = decode::DecodeService::create(std::move(config).value(), flags);
    REQUIRE(d.ok());
    decode = std::move(d).value();
    REQUIRE(decode->start().isOk());
    REQUIRE(router.waitFor([&] { return router.conn != nullptr; }, 10s));
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

  void generate(uint64_t id) {
    proto::Envelope env;
    env.set_request_id(id);
    auto* g = env.mutable_generate();
    g->set_request_id(id);
    for (int32_t t : engine::test::testPrompt(40, id)) g->add_prompt_token_ids(uint32_t(t));
    g->mutable_sampling()->set_max_tokens(4);
    g->set_prefill_worker_address("127.0.0.1:" + std::to_string(prefillServer->port()));
    g->set_prefill_worker_id("prefill-fake");
    REQUIRE(router.conn->send(std::move(env)).isOk());
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
