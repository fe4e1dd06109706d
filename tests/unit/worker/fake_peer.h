// Fakes for worker tests that stand in for a worker's peers over real framed connections
// (decode_kvconnect_test.cpp, prefill_pull_test.cpp): a mailbox of what a fake peer received,
// a fake router and the worker service started against it, the worker's /metrics read over
// HTTP, a fake peer's KV pool behind a real TransferAgent, and a pull source's answers.
// Test-only: the helpers REQUIRE on failure, so they run inside a Catch2 test case.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/config/cluster_config.h"
#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "kvtransfer/agent.h"
#include "worker/flags.h"

namespace pd::test {

// Envelopes, the connection and its closes as a fake peer sees them, from the io threads.
// Read `got`, `conn` and `closed` under `mu` (waitFor's predicate already holds it).
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
  // Callbacks that record into this mailbox; `reply`, when set, answers each message.
  net::ConnectionCallbacks callbacks(
      std::function<void(const net::ConnectionPtr&, const proto::Envelope&)> reply = {}) {
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
  std::optional<proto::Envelope> last(proto::Envelope::BodyCase body) {
    for (auto it = got.rbegin(); it != got.rend(); ++it)
      if (it->body_case() == body) return *it;
    return std::nullopt;
  }
};

// A fake router: a framed server on an ephemeral loopback port for a worker under test to
// register with; what the worker sends lands in `mail`.
inline std::unique_ptr<net::FramedServer> listenAsRouter(net::IoPool& io, Mailbox& mail) {
  net::ConnectionOptions ro;
  ro.hello.set_role(proto::ROLE_ROUTER);
  ro.hello.set_worker_id("router-fake");
  auto r = net::FramedServer::listen(io, "127.0.0.1", 0, ro, mail.callbacks());
  REQUIRE(r.ok());
  return std::move(r).value();
}

// The worker under test (a DecodeService or PrefillService) made from `config` as worker `id`,
// started against the fake router at `routerPort`, once it connected to it (`router.conn`).
template <typename Service>
std::unique_ptr<Service> startWorker(Result<config::ClusterConfig> config, const std::string& id, int routerPort,
                                     Mailbox& router) {
  REQUIRE(config.ok());
  worker::WorkerFlags flags;
  flags.workerId = id;
  flags.routers = {worker::RouterTarget{"127.0.0.1", routerPort}};
  auto made = Service::create(std::move(config).value(), flags);
  REQUIRE(made.ok());
  std::unique_ptr<Service> service = std::move(made).value();
  REQUIRE(service->start().isOk());
  REQUIRE(router.waitFor([&] { return router.conn != nullptr; }, std::chrono::seconds(10)));
  return service;
}

// A worker's /metrics, by a plain HTTP/1.0 GET.
inline std::string metricsText(int port) {
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
inline double metric(int port, const std::string& name, const std::string& label = "") {
  std::istringstream in(metricsText(port));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || (line[name.size()] != ' ' && line[name.size()] != '{')) continue;
    if (!label.empty() && line.find(label) == std::string::npos) continue;
    return std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  return -1;
}

// Polls `pred` every 20 ms until it holds or `timeout` passed; its last answer.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// The worker's KV bytes per token, from the first LoadReport in the fake router's `router`
// that carries it (waited for up to 5 s).
inline uint64_t kvBytesPerToken(Mailbox& router) {
  uint64_t bytesPerToken = 0;
  REQUIRE(router.waitFor(
      [&] {
        for (const auto& e : router.got)
          if (e.body_case() == proto::Envelope::kLoadReport) bytesPerToken = e.load_report().kv_bytes_per_token();
        return bytesPerToken > 0;
      },
      std::chrono::seconds(5)));
  return bytesPerToken;
}

// A fake peer's KV: `bytes` of host memory, each byte `fill`, registered whole with a real
// TransferAgent named `name` over `transports` (tried in that order).
struct FakeKvPool {
  FakeKvPool(const std::string& name, std::vector<std::string> transports, size_t bytes, uint8_t fill = 0)
      : buf(bytes, fill) {
    kvt::AgentOptions o;
    o.name = name;
    o.preference = std::move(transports);
    auto a = kvt::TransferAgent::create(o, registry);
    REQUIRE(a.ok());
    agent = std::move(a).value();
    REQUIRE(agent->registerMemory(region()).ok());
  }
  MemDesc region() const { return MemDesc{reinterpret_cast<uintptr_t>(buf.data()), buf.size()}; }

  prometheus::Registry registry;  // outlives the agent, which registers its metrics here
  std::vector<uint8_t> buf;
  std::unique_ptr<kvt::TransferAgent> agent;
};

// The connecting side of KvConnect, as a decode worker offers its pool: `pool` (its first
// `numBlocks` blocks of KV) offered over `conn`, the answer waited for in `mail` (the
// connection's mailbox) and loaded as pool's peer. Returns the answer and the peer.
struct KvConnected {
  proto::KvConnect reply;
  kvt::AgentPeer peer = 0;
};
inline KvConnected offerKvPool(FakeKvPool& pool, uint32_t numBlocks, const net::ConnectionPtr& conn, Mailbox& mail) {
  proto::Envelope offer;
  offer.set_request_id(0);
  offer.mutable_kv_connect()->set_metadata(pool.agent->localMetadata().value());
  offer.mutable_kv_connect()->set_num_blocks(numBlocks);
  offer.mutable_kv_connect()->add_regions()->set_base(pool.region().addr);
  REQUIRE(conn->send(std::move(offer)).isOk());
  REQUIRE(mail.waitFor([&] { return mail.count(proto::Envelope::kKvConnect) == 1; }, std::chrono::seconds(5)));
  KvConnected out;
  std::lock_guard<std::mutex> lock(mail.mu);
  out.reply = mail.last(proto::Envelope::kKvConnect)->kv_connect();
  auto loaded = pool.agent->loadPeer(out.reply.metadata());
  REQUIRE(loaded.ok());
  out.peer = *loaded;
  return out;
}

// A pull source's answers to `pr`: a refusal (not found) saying `message`, and a PullDone of
// every token asked for, `bytes` moved over tcp (the fakes write nothing).
inline proto::Envelope pullRefused(const proto::PullRequest& pr, const std::string& message) {
  proto::Envelope env;
  env.set_request_id(pr.request_id());
  env.mutable_error()->set_code(proto::ERROR_NOT_FOUND);
  env.mutable_error()->set_message(message);
  return env;
}
inline proto::Envelope pullDone(const proto::PullRequest& pr, uint64_t bytes) {
  proto::Envelope env;
  env.set_request_id(pr.request_id());
  env.mutable_pull_done()->set_request_id(pr.request_id());
  env.mutable_pull_done()->set_tokens(uint32_t(pr.prompt_token_ids_size()));
  env.mutable_pull_done()->set_bytes_transferred(bytes);
  env.mutable_pull_done()->set_transport("tcp");
  return env;
}

}  // namespace pd::test
