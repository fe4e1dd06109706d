#include "worker/router_link.h"

#include "common/base/log.h"

namespace pd::worker {

RouterLink::RouterLink(net::IoPool& io, LoopInbox& inbox, std::string host, int port, net::ConnectionOptions options,
                       Handlers handlers)
    : io_(io),
      inbox_(inbox),
      host_(std::move(host)),
      port_(port),
      options_(std::move(options)),
      handlers_(std::move(handlers)) {}

RouterLink::~RouterLink() { stop(); }

void RouterLink::start() {
  thread_ = std::thread([this] { connectLoop(); });
}

void RouterLink::stop() {
  stopping_ = true;
  cv_.notify_all();
  net::ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = conn_;
  }
  if (conn) conn->close(cancelled("worker shutting down"));
  if (thread_.joinable()) thread_.join();
  // A connection's onClose runs on an I/O thread and uses this object: wait (bounded) for the
  // last one, so the destructor cannot free it under the callback (ASan: heap-use-after-free
  // in test_worker_load_reporter, docs/security.md).
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(2), [this] { return closesPending_ <= 0; });
}

Status RouterLink::send(proto::Envelope env) {
  net::ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = conn_;
  }
  if (!conn) return unavailable("router " + host_ + ":" + std::to_string(port_) + ": not connected");
  return conn->send(std::move(env));
}

std::string RouterLink::refusal() {
  std::lock_guard<std::mutex> lock(mu_);
  return refusal_;
}

bool RouterLink::peerTakesKvEvents() {
  std::lock_guard<std::mutex> lock(mu_);
  return conn_ && conn_->isOpen() && conn_->peerHello().kv_events();
}

// Dials until connected, waits while the connection lives, and dials again after a drop. A
// connection the router closes at once (it refused the registration: a duplicate id, another
// model) is retried with a growing backoff, and the reason is logged; it never leaves the
// link waiting on a connection that is already gone.
void RouterLink::connectLoop() {
  auto backoff = std::chrono::milliseconds(200);
  while (!stopping_) {
    net::ConnectionOptions opts = options_;
    net::ConnectionCallbacks cb;
    // Ours from the handshake on, before connect() returns here: the router may send a request
    // at once, and the loop may answer it (send()) before this thread runs again.
    cb.onOpen = [this](const net::ConnectionPtr& c) {
      std::lock_guard<std::mutex> lock(mu_);
      conn_ = c;
    };
    cb.onMessage = [this](const net::ConnectionPtr& c, proto::Envelope&& env) {
      if (env.has_error()) {
        // The router refused the registration (router/worker_registry.h): keep why, and close
        // our side now rather than wait for its close.
        Status why = net::fromProtoError(env.error());
        PD_LOG(kError, "worker") << "router " << host_ << ":" << port_
                                 << " refused the registration: " << why.message();
        {
          std::lock_guard<std::mutex> lock(mu_);
          refusal_ = why.message();
        }
        c->close(why);
        return;
      }
      auto shared = std::make_shared<proto::Envelope>(std::move(env));
      inbox_.post([this, shared] { handlers_.onMessage(std::move(*shared)); });
    };
    cb.onClose = [this](const net::ConnectionPtr& c, const Status& why) {
      // All of it under the lock: once stop() sees closesPending_ drop, nothing here touches
      // this object any more.
      std::lock_guard<std::mutex> lock(mu_);
      if (conn_ == c) conn_.reset();
      lastClose_ = why;
      up_ = false;
      inbox_.post([this, why] { handlers_.onState(false, why); });
      --closesPending_;
      cv_.notify_all();
    };
    net::RetryPolicy retry;
    retry.totalTimeout = std::chrono::seconds(5);
    auto conn = net::FramedClient::connectWithRetry(io_, host_, port_, opts, cb, retry);
    if (!conn.ok()) {
      PD_LOG(kWarn, "worker") << "router " << host_ << ":" << port_ << ": " << conn.status().toString() << "; retrying";
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_.load(); });
      continue;
    }
    const auto openedAt = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++closesPending_;  // connect() returned it: its onClose runs exactly once (framed.h)
      // It may have closed already (a refusal right after the hello): then it is not ours.
      if (conn.value()->isOpen()) conn_ = conn.value();
    }
    if (conn_) {
      up_ = true;
      PD_LOG(kInfo, "worker") << "registered with router " << host_ << ":" << port_
                              << " (unless it refuses: then an Error follows)";
      inbox_.post([this] { handlers_.onState(true, Status::ok()); });
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_ && conn_ && conn_->isOpen()) {
      cv_.wait_for(lock, std::chrono::seconds(1));
      if (std::chrono::steady_clock::now() - openedAt >= kRegisteredAfter) refusal_.clear();
    }
    // Stopping before stop() saw this connection: close it here, so its onClose runs now.
    if (stopping_ && conn.value()->isOpen()) conn.value()->close(cancelled("worker shutting down"));
    conn_.reset();
    if (stopping_) break;
    // A connection that did not last was most likely refused: back off, and say why.
    if (std::chrono::steady_clock::now() - openedAt < kRegisteredAfter) {
      PD_LOG(kWarn, "worker") << "router " << host_ << ":" << port_ << " closed the registration ("
                              << (refusal_.empty() ? lastClose_.message() : refusal_) << "); registering again in "
                              << backoff.count() << " ms";
      cv_.wait_for(lock, backoff, [this] { return stopping_.load(); });
      backoff = std::min(backoff * 2, kMaxBackoff);
    } else {
      backoff = std::chrono::milliseconds(200);
    }
  }
}

}  // namespace pd::worker
