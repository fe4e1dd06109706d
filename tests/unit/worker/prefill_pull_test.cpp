// The prefill worker's pull phase (prefill_worker/prefill_pulls.h; docs/kv_cache.md, "The
// prefill side") against a fake decode worker with a real TransferAgent (tcp) and a buffer as
// its KV pool: a PrefillRequest naming pull_tokens makes the prefill worker send a PullRequest
// for exactly those tokens back over the same connection, with a grant and the pull deadline.
// Whatever the decode worker answers -- PullDone, an Error, nothing -- the job is served
// (PrefillDone), the pull is counted by outcome, and no block stays held.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"
#include "prefill_worker/prefill_service.h"
#include "tests/unit/engine/model_test_util.h"

using namespace pd;
using namespace std::chrono_literals;

namespace {

constexpr int kPullTokens = 32;  // 2 blocks of the 40-token prompt
constexpr int kPullDeadlineMs = 400;

// Envelopes seen by a fake peer, from the io threads.
struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<proto::Envelope> got;
  net::ConnectionPtr conn;

  template <typename Pred>
  bool waitFor(Pred pred, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return pred(); });
  }
  net::ConnectionCallbacks callbacks(std::function<void(const net::ConnectionPtr&, const proto::Envelope&)> reply) {
    net::ConnectionCallbacks cb;
    cb.onOpen = [this](const net::ConnectionPtr& c) {
      std::lock_guard<std::mutex> lock(mu);
      conn = c;
      cv.notify_all();
    };
    cb.onMessage = [this, reply](const net::ConnectionPtr& c, proto::Envelope&& env) {
      {
        std::lock_guard<std::mutex> lock(mu);
        got.push_back(env);
        cv.notify_all();
      }
      if (reply) reply(c, env);
    };
    return cb;
  }
  size_t count(proto::Envelope::BodyCase body) {
    size_t n = 0;
    for (const auto& e : got) n += e.body_case() == body;
    return n;
  }
  std::optional<proto::Envelope> last(proto::Envelope::BodyCase body) {
    for (auto it = got.rbegin(); it != got.rend(); ++it)
      if (it->body_case() == body) return *it;
    return std::nullopt;
  }
};

// A worker's /metrics, by a plain HTTP/1.0 GET.
std::string metricsText(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n";
    (void)::send(fd, req.data(), req.size(), 0);
    char buf[8192];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, size_t(n));
  }
  ::close(fd);
  return out;
}

// The first series of `name` whose line contains `label` (or any, when empty); -1 if none.
double metric(int port, const std::string& name, const std::string& label = "") {
  std::istringstream in(metricsText(port));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || (line[name.size()] != ' ' && line[name.size()] != '{')) continue;
    if (!label.empty() && line.find(label) == std::string::npos) continue;
    return std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return -1;
}

template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return pred();
}

struct Harness {
  // `answer` is how the fake decode worker answers a PullRequest (nothing when empty).
  explicit Harness(std::function<void(const net::ConnectionPtr&, const proto::PullRequest&)> answer) {
    net::ConnectionOptions ro;
    ro.hello.set_role(proto::ROLE_ROUTER);
    ro.hello.set_worker_id("router-fake");
    auto r = net::FramedServer::listen(io, "127.0.0.1", 0, ro, router.callbacks({}));
    REQUIRE(r.ok());
    routerServer = std::move(r).value();
    const std::string model = engine::test::makeTestModel("worker_tiny", engine::MakeModelOptions{});
    auto config =
        config::parseClusterConfig("model: {path: " + model +
                                       "}\nengine: {backend: cpu, num_blocks: 64}\n"
                                       "kv_transfer: {transports: [tcp], timeout_ms: 20000, pull_timeout_ms: " +
                                       std::to_string(kPullDeadlineMs) + "}\nlogging: {level: warn}\n",
                                   "test.yaml");
    REQUIRE(config.ok());
    worker::WorkerFlags flags;
    flags.workerId = "prefill-t";
    flags.routers = {worker::RouterTarget{"127.0.0.1", routerServer->port()}};
    auto p = prefill::PrefillService::create(std::move(config).value(), flags);
    REQUIRE(p.ok());
    prefill = std::move(p).value();
    REQUIRE(prefill->start().isOk());
    REQUIRE(router.waitFor([&] { return router.conn != nullptr; }, 10s));
    uint64_t bytesPerToken = 0;
    REQUIRE(router.waitFor(
        [&] {
          for (const auto& e : router.got)
            if (e.body_case() == proto::Envelope::kLoadReport) bytesPerToken = e.load_report().kv_bytes_per_token();
          return bytesPerToken > 0;
        },
        5s));
    // The fake decode worker: 4 blocks of KV in one host buffer, a real agent.
    kvBuf.assign(4 * 16 * bytesPerToken, 0);
    kvt::AgentOptions o;
    o.name = "decode-fake";
    o.preference = {"tcp"};
    auto a = kvt::TransferAgent::create(o, registry);
    REQUIRE(a.ok());
    agent = std::move(a).value();
    region = MemDesc{reinterpret_cast<uintptr_t>(kvBuf.data()), kvBuf.size()};
    REQUIRE(agent->registerMemory(region).ok());
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
    proto::Envelope offer;
    offer.set_request_id(0);
    offer.mutable_kv_connect()->set_metadata(agent->localMetadata().value());
    offer.mutable_kv_connect()->set_num_blocks(4);
    offer.mutable_kv_connect()->add_regions()->set_base(region.addr);
    REQUIRE(link->send(std::move(offer)).isOk());
    REQUIRE(decode.waitFor([&] { return decode.count(proto::Envelope::kKvConnect) == 1; }, 5s));
    std::lock_guard<std::mutex> lock(decode.mu);
    reply = decode.last(proto::Envelope::kKvConnect)->kv_connect();
    auto loaded = agent->loadPeer(reply.metadata());
    REQUIRE(loaded.ok());
    peer = *loaded;
  }
  ~Harness() {
    if (link) link->close(Status::ok());
    if (prefill) prefill->stop();
    routerServer->stop();
  }

  // A PrefillRequest for a 40-token prompt into the fake's blocks 0..2, naming a pull of its
  // first kPullTokens tokens.
  void request(uint64_t id) {
    auto grant = agent->grantWrite(peer, {region});
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
  prometheus::Registry registry;
  std::vector<uint8_t> kvBuf;
  std::unique_ptr<kvt::TransferAgent> agent;
  MemDesc region{};
  net::ConnectionPtr link;
  proto::KvConnect reply;
  kvt::AgentPeer peer = 0;
};

void answerError(const net::ConnectionPtr& c, const proto::PullRequest& pr) {
  proto::Envelope env;
  env.set_request_id(pr.request_id());
  env.mutable_error()->set_code(proto::ERROR_NOT_FOUND);
  env.mutable_error()->set_message("fake decode worker: holds none of the pulled tokens any more");
  (void)c->send(std::move(env));
}

// PullDone without writing: the blocks hold whatever was there, which is all a test of the
// naming needs (the ids are not compared here).
void answerDone(const net::ConnectionPtr& c, const proto::PullRequest& pr) {
  proto::Envelope env;
  env.set_request_id(pr.request_id());
  env.mutable_pull_done()->set_request_id(pr.request_id());
  env.mutable_pull_done()->set_tokens(uint32_t(pr.prompt_token_ids_size()));
  env.mutable_pull_done()->set_bytes_transferred(4321);
  env.mutable_pull_done()->set_transport("tcp");
  (void)c->send(std::move(env));
}

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
