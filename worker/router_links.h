// RouterLinks: a worker's links to every router (several routers, sharing nothing
// but what workers report). Each --router target is resolved to all its addresses (a
// Kubernetes headless Service resolves to every router pod) and gets one RouterLink per
// address; the names are resolved again every `reresolve`, so routers that come and go are
// joined and left. Every link registers on its own and carries the requests of its router:
// messages and state changes say which link they came from, and replies go back on it.
//
// Threads: start()/stop() from the owner; send(), broadcast(), anyUp() from any thread; the
// handlers run on the loop thread (posted to the inbox); resolution runs on its own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "worker/flags.h"
#include "worker/router_link.h"

namespace pd::worker {

using RouterId = uint32_t;  // a link, unique for the life of the process

class RouterLinks {
 public:
  struct Handlers {
    std::function<void(RouterId, proto::Envelope&&)> onMessage;         // loop thread
    std::function<void(RouterId, bool up, const Status& why)> onState;  // loop thread
  };
  // `targets` with their ports filled in.
  RouterLinks(net::IoPool& io, LoopInbox& inbox, std::vector<RouterTarget> targets, net::ConnectionOptions options,
              Handlers handlers, std::chrono::milliseconds reresolve = std::chrono::seconds(10));
  ~RouterLinks();

  void start();
  void stop();
  // kUnavailable when that link is gone or down.
  Status send(RouterId router, proto::Envelope env);
  // To every link that is up (load reports); kvEventsOnly: to those whose router takes KV
  // events (RouterLink::peerTakesKvEvents).
  void broadcast(const proto::Envelope& env, bool kvEventsOnly = false);
  // Whether link `router` is up and its router takes KV events.
  bool takesKvEvents(RouterId router) const;
  bool anyUp() const;
  // The first link's RouterLink::refusal(), prefixed with its router's address; "" when none.
  std::string refusal() const;

 private:
  struct Link {
    RouterId id = 0;
    std::shared_ptr<RouterLink> link;
  };
  // The addresses of every target ("ip:port"); a target that does not resolve keeps its links.
  std::map<std::string, bool> resolveAll(std::vector<std::string>* failed) const;
  void sync();
  void resolverLoop();

  net::IoPool& io_;
  LoopInbox& inbox_;
  const std::vector<RouterTarget> targets_;
  const net::ConnectionOptions options_;  // every link's hello and cluster credential
  const Handlers handlers_;
  const std::chrono::milliseconds reresolve_;
  mutable std::mutex mu_;              // guards links_ and nextId_
  std::map<std::string, Link> links_;  // by "ip:port"
  RouterId nextId_ = 1;
  std::mutex waitMu_;  // with cv_: the resolver's sleep, cut short by stop()
  std::condition_variable cv_;
  std::atomic<bool> stopping_{false};
  std::thread resolver_;
};

}  // namespace pd::worker
