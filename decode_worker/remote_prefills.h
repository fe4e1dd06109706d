// RemotePrefills: the decode side of the remote-prefill lifecycle (docs/architecture.md,
// "Remote prefill, decode side"). It owns every disaggregated request from the router's
// Generate until its KV is in place, and the connections to the prefill workers that serve
// them (each starts with the kvtransfer exchange, KvConnect).
//
//   start() --> WAITING_BLOCKS --(blocks reserved for the whole prompt)--> CONNECTING
//   CONNECTING --(prefill worker's KvConnect reply loaded)--> REQUESTED (PrefillRequest sent)
//   REQUESTED --(PrefillDone)--> KV_READY: the engine decodes from the first token (handed off)
//   any --(Error | prefill disconnects | refused KvConnect | deadline)--> FAILED:
//        Cancel to the prefill worker; recompute here (the engine frees the reserved blocks
//        and queues a local prefill) or, per kv_transfer.on_remote_prefill_failure, fail;
//        also fail (429) when recomputing would break the ITL SLO of the running streams
//   any --(cancel(): client or router)--> CANCELLED: Cancel to the prefill worker; the
//        engine frees the reserved blocks
//
// Deadlines (loop timers, kv_transfer.timeout_ms each): WAITING_BLOCKS from start();
// CONNECTING + REQUESTED together from the reservation. A prefill worker that is slow,
// stopped or unreachable delays only the requests sent to it: nothing here waits on it.
//
// Threads: the loop thread only.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/net/framed.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::decode {

class RemotePrefills {
 public:
  struct Callbacks {
    // KV_READY: the engine holds the request now; `events` are its first token (and finish).
    std::function<void(uint64_t id, const std::vector<engine::EngineEvent>& events)> onKvReady;
    // FAILED without recompute: the request is gone from the engine; tell the client.
    std::function<void(uint64_t id, const Status& why)> onFailed;
  };
  RemotePrefills(worker::WorkerLoop& loop, Callbacks callbacks);

  // A disaggregated request: `request` is the engine request, `gen` the router's Generate
  // (prefill_worker_address names the prefill worker).
  void start(proto::Generate gen, engine::Request request);
  // CANCELLED. Unknown ids are ignored (the request may be past KV_READY).
  void cancel(uint64_t id, const std::string& reason);
  // Reserves blocks for waiting requests, in arrival order (loop poll).
  void admitWaiting();
  int waitingForBlocks() const { return int(waiting_.size()); }
  bool anyInFlight() const { return !requests_.empty(); }
  bool contains(uint64_t id) const { return requests_.count(id) != 0; }
  // Ends every request (FAILED, no recompute) and closes the peer connections.
  void shutdown(const Status& why);

 private:
  enum class State { kWaitingBlocks, kConnecting, kRequested };
  struct Remote {
    State state = State::kWaitingBlocks;
    proto::Generate gen;
    std::string address;  // the prefill worker's control address
    std::vector<engine::BlockId> blocks;
    worker::WorkerLoop::TimerId deadlineTimer = 0;
  };
  struct Waiting {
    uint64_t id;
    engine::Request request;
  };
  // One control connection per prefill worker. After the hello comes KvConnect: requests
  // wait in CONNECTING until the reply is loaded.
  struct Peer {
    net::ConnectionPtr conn;
    bool connecting = false;
    bool kvReady = false;
    std::string offer;  // our KvConnect offer on this connection; every request carries it
    worker::WorkerLoop::TimerId kvTimer = 0;
    std::unordered_set<uint64_t> requests;
  };

  void reserved(uint64_t id, std::vector<engine::BlockId> blocks);
  void sendPrefillRequest(Peer& peer, uint64_t id);
  void connect(const std::string& address);
  void onConnected(const std::string& address, Result<net::ConnectionPtr> r);
  void onPeerMessage(const std::string& address, proto::Envelope&& env);
  void onKvConnectReply(const std::string& address, proto::Envelope&& env);
  void onPeerClosed(const std::string& address, const net::ConnectionPtr& c, const Status& why);
  void dropPeer(const std::string& address, const Status& why);
  void failPeerRequests(const std::string& address, const Status& why);
  void onPrefillDone(uint64_t id, const proto::PrefillDone& done);
  void failed(uint64_t id, const Status& why);  // FAILED: recompute or fail
  // Why recomputing a prompt of this length here would break the decode pool's ITL SLO for
  // the streams running on this worker (ok: it would not, or nothing runs). Under overload a
  // remote prefill times out, and piling its prefill onto the decode pool would stall every
  // stream there: the request fails with 429 instead (docs/serving.md, "Overload").
  Status recomputeStall(int promptTokens) const;
  void sendCancel(const Remote& r, const std::string& reason);
  void forget(uint64_t id);
  worker::WorkerLoop::TimerId deadline(uint64_t id, std::function<Status()> why);

  worker::WorkerLoop& loop_;
  Callbacks callbacks_;
  std::unordered_map<uint64_t, Remote> requests_;
  std::deque<Waiting> waiting_;
  std::unordered_map<std::string, Peer> peers_;
};

}  // namespace pd::decode
