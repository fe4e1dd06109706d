// PrefillLinks: a decode worker's control connections to the prefill workers, one per
// address, and what makes each usable for remote prefills: the kvtransfer exchange
// (KvConnect in pdserve.proto) that also carries the facts of the connection, once -- where
// this worker's KV blocks live (its regions and pool size). The hello already compared the
// peers' model and KV layout fingerprint; a mismatch closes the connection before KvConnect.
//
//   dial() --> CONNECTING --(hello accepted)--> HANDSHAKING (KvConnect offer sent)
//   HANDSHAKING --(reply loaded)--> READY: onReady; PrefillRequests may go
//   any --(connect error | refused hello | KvConnect refused or unanswered within
//          kv_transfer.timeout_ms | close | lease)--> DOWN: onDown; the next dial() makes a new one
//
// Leases: every link carries heartbeats both ways (kv_transfer.heartbeat_ms) and is closed
// when the prefill worker is silent for kv_transfer.lease_ms, so a stopped or cut-off prefill
// worker is DOWN within the lease. Nothing here waits: connections are made with connectAsync
// and every reply is a message posted to the loop.
//
// Threads: the loop thread only (callbacks run there too).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/net/framed.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::decode {

class PrefillLinks {
 public:
  struct Callbacks {
    // The link to `address` is READY: requests may be sent on it.
    std::function<void(const std::string& address)> onReady;
    // A message about one request (request_id != 0) from `address`.
    std::function<void(const std::string& address, proto::Envelope&& env)> onMessage;
    // The link to `address` went DOWN (or could not be made), with the reason.
    std::function<void(const std::string& address, const Status& why)> onDown;
  };
  PrefillLinks(worker::WorkerLoop& loop, Callbacks callbacks);

  // Dials `address` unless a link to it is open or being made.
  void dial(const std::string& address);
  // dial(), at most once per backoff (500 ms doubling to 8 s; a link that becomes READY
  // resets it): for a caller that needs a link when no request does (the KV quarantine).
  void redial(const std::string& address);

  bool ready(const std::string& address) const;
  // Connected: READY or HANDSHAKING.
  bool connected(const std::string& address) const;
  // Connected, KvConnect not answered yet.
  bool handshaking(const std::string& address) const;
  // The prefill worker's kvtransfer peer; valid while ready().
  kvt::AgentPeer kvPeer(const std::string& address) const;
  // The link's connection (null when none): pulls the prefill worker asks over it are served
  // on it (PullSources::attach).
  net::ConnectionPtr connection(const std::string& address) const;
  // The prefill worker's own KV pool from its KvConnect reply; null while not ready or when
  // the reply did not carry it (then it takes no pulls over this link).
  const worker::KvTargetLayout* replyLayout(const std::string& address) const;
  // When the last message from `address` arrived on its current link (epoch when none);
  // PrefillProgress does not count (it says a request computes, not that the worker answers).
  SteadyTime lastHeard(const std::string& address) const;

  // Sends on a READY (or HANDSHAKING) link; kUnavailable when there is none.
  Status send(const std::string& address, proto::Envelope env);
  // Closes every link; no callback runs for them.
  void shutdown(const Status& why);

 private:
  struct Link {
    net::ConnectionPtr conn;
    bool connecting = false;
    bool kvReady = false;
    worker::WorkerLoop::TimerId kvTimer = 0;            // KvConnect must be answered by then
    kvt::AgentPeer kvPeer = 0;                          // loaded from its KvConnect reply
    std::optional<worker::KvTargetLayout> replyLayout;  // the reply's pool, when it sent one
    SteadyTime lastHeard;
    SteadyTime redialAt{};
    std::chrono::milliseconds redialDelay{0};  // 0: no backoff running
  };
  static constexpr std::chrono::milliseconds kFirstRedial{500};
  static constexpr std::chrono::milliseconds kMaxRedial{8000};

  void onConnected(const std::string& address, Result<net::ConnectionPtr> r);
  void onMessage(const std::string& address, const net::ConnectionPtr& c, proto::Envelope&& env);
  void onKvConnectReply(const std::string& address, proto::Envelope&& env);
  void onClosed(const std::string& address, const net::ConnectionPtr& c, const Status& why);
  // Closes the link (onClosed ignores that close) and reports it DOWN.
  void drop(const std::string& address, const Status& why);
  const Link* find(const std::string& address) const;

  worker::WorkerLoop& loop_;
  Callbacks callbacks_;
  std::unordered_map<std::string, Link> links_;
};

}  // namespace pd::decode
