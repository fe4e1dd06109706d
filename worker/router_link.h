// The worker's link to the router: dials it (retrying with backoff) from its own thread, says
// Hello with our role, and dials again after a drop. A router that refuses the registration
// sends an Error frame saying why (a duplicate id, another model, weights or KV layout): the
// link logs it, keeps it for /health (refusal()) and retries with a backoff doubling to 30 s. Incoming envelopes and
// state changes are posted to the loop's inbox; send() may be called from any thread (it fails while down), so the load
// reporter sends from the I/O pool while the loop computes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "common/base/status.h"
#include "common/net/framed.h"
#include "common/net/io_pool.h"
#include "common/proto/pdserve.pb.h"
#include "worker/loop_inbox.h"

namespace pd::worker {

class RouterLink {
 public:
  struct Handlers {
    std::function<void(proto::Envelope&&)> onMessage;         // loop thread
    std::function<void(bool up, const Status& why)> onState;  // loop thread
  };
  // options: the hello and the cluster credential (ConnectionOptions.clusterSecret) it dials with.
  RouterLink(net::IoPool& io, LoopInbox& inbox, std::string host, int port, net::ConnectionOptions options,
             Handlers handlers);
  ~RouterLink();
  void start();
  void stop();
  Status send(proto::Envelope env);
  bool isUp() const { return up_.load(); }
  // Why the router refused this worker's registration (its Error frame), until a later
  // registration lasts kRegisteredAfter; "" when it never refused. Any thread.
  std::string refusal();
  static constexpr std::chrono::seconds kRegisteredAfter{5};
  // Retries after a refusal double from 200 ms to this (a refused worker does not spin).
  static constexpr std::chrono::milliseconds kMaxBackoff{30000};
  // The router's hello said it takes KV events (proto Hello.kv_events); false while down.
  bool peerTakesKvEvents();

 private:
  void connectLoop();

  net::IoPool& io_;
  LoopInbox& inbox_;
  std::string host_;
  int port_;
  const net::ConnectionOptions options_;
  Handlers handlers_;
  std::mutex mu_;
  std::condition_variable cv_;
  net::ConnectionPtr conn_;
  Status lastClose_;       // why the last connection closed (guarded by mu_)
  std::string refusal_;    // the router's last refusal (guarded by mu_)
  int closesPending_ = 0;  // connections connect() returned whose onClose has not run (mu_)
  std::atomic<bool> up_{false};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace pd::worker
