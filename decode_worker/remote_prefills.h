// RemotePrefills: the decode side of the remote-prefill lifecycle (docs/architecture.md,
// "Remote prefill, decode side"). It owns every disaggregated request from the router's
// Generate until its KV is in place, and the connections to the prefill workers that serve
// them (each starts with the kvtransfer exchange, KvConnect).
//
//   start() --> WAITING_BLOCKS --(blocks reserved for the whole prompt)--> CONNECTING
//   CONNECTING --(prefill worker's KvConnect reply loaded)--> REQUESTED (PrefillRequest sent)
//   REQUESTED --(PrefillDone)--> KV_READY: the engine decodes from the first token (handed off)
//   any --(Error | prefill disconnects or its lease runs out | refused KvConnect | deadline)--> FAILED:
//        Cancel to the prefill worker; recompute here (the engine frees the reserved blocks
//        and queues a local prefill) or, per kv_transfer.on_remote_prefill_failure, fail;
//        also fail (429) when recomputing would break the ITL SLO of the running streams
//   any --(cancel(): client or router)--> CANCELLED: Cancel to the prefill worker; the
//        engine frees the reserved blocks
//   FAILED / CANCELLED after the PrefillRequest went out --> QUARANTINED (KV fencing, issue
//        12; docs/reliability.md): the request's write grant is revoked; when every
//        lane to that prefill worker is receiver-fenced (tcp) the revoke is the fence and the
//        blocks are freed at once; otherwise (cma, ucx, verbs: one-sided writes) they move to
//        a quarantine holder (Engine::quarantineRemote) and are released only when the prefill
//        worker acknowledges the Cancel (Cancel{ack}) or is known gone (its control connection
//        closed AND TransferAgent::unfencedLanesDead: for cma its process exited). A recompute uses
//        fresh blocks. Past the lease (kv_transfer.timeout_ms) the hold is logged, never
//        dropped on a timer alone. On a new connection to that worker the Cancel is sent again;
//        with holds waiting and no connection (a lease ran out, a reset) it is dialled again.
//
// Deadlines (loop timers, kv_transfer.timeout_ms each): WAITING_BLOCKS from start();
// CONNECTING + REQUESTED together from the reservation. Leases: the connection to each
// prefill worker carries heartbeats both ways (net keepalive, kv_transfer.heartbeat_ms) and is
// closed when the prefill worker is silent for kv_transfer.lease_ms, so a stopped or cut-off
// prefill worker fails its requests here within the lease, not the whole timeout. A prefill worker that is slow,
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
    // `split` holds the remote part of its TTFT split (proto Timings: prefill_queue_ms,
    // prefill_ms and transfer_ms as the prefill worker measured them, kv_connect_ms on this
    // host); `at` is when the PrefillDone arrived here (its connection read it: the wait for
    // the loop is part of the hand-off).
    std::function<void(uint64_t id, const proto::Timings& split, SteadyTime at,
                       const std::vector<engine::EngineEvent>& events)>
        onKvReady;
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
  // Releases quarantined blocks whose writer is known gone; reconnects to a writer that may
  // live but whose connection closed, so that its acknowledgement can come; logs holds past
  // their lease (loop poll).
  void pollQuarantine();
  int quarantinedBlocks() const { return quarantinedBlocks_; }
  // pdserve_remote_prefills{state} for WAITING_BLOCKS, CONNECTING and REQUESTED (loop poll).
  void exportStates();

 private:
  enum class State { kWaitingBlocks, kConnecting, kRequested };
  struct Remote {
    State state = State::kWaitingBlocks;
    proto::Generate gen;
    std::string address;  // the prefill worker's control address
    std::vector<engine::BlockId> blocks;
    worker::WorkerLoop::TimerId deadlineTimer = 0;
    std::string grant;          // TransferAgent::grantWrite for `blocks` ("" until REQUESTED)
    kvt::AgentPeer kvPeer = 0;  // the prefill worker's kvtransfer peer the grant is for
    bool writerDone = false;    // PrefillDone: every write confirmed, nothing can land later
    SteadyTime reservedAt;      // when its blocks were reserved (CONNECTING)
    SteadyTime requestedAt;     // when the PrefillRequest went (REQUESTED)
  };
  // Blocks a remote prefill that ended may still be writing (QUARANTINED).
  struct Quarantined {
    uint64_t requestId = 0;
    std::string address;
    kvt::AgentPeer kvPeer = 0;
    int blocks = 0;
    SteadyTime since;
    bool leaseLogged = false;
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
    kvt::AgentPeer kvPeer = 0;  // loaded from its KvConnect reply (valid while kvReady)
    std::unordered_set<uint64_t> requests;
    SteadyTime lastHeard;       // its last message on this connection
    SteadyTime redialAt{};      // pollQuarantine: no new connection for quarantined holds before
    std::chrono::milliseconds redialDelay{0};  // the backoff of those dials (0: none yet)
  };
  static constexpr std::chrono::milliseconds kFirstRedial{500};
  static constexpr std::chrono::milliseconds kMaxRedial{8000};

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
  // Why recomputing this request here would break the decode pool's ITL SLO for the streams
  // running on this worker, when its prefill worker is alive but behind (it answered since it
  // got the request). Under overload a remote prefill times out, and piling its prefill onto
  // the decode pool would stall every stream there: the request fails with 429 instead
  // (docs/serving.md, "Overload"). ok: recompute as configured.
  Status recomputeStall(const Remote& r) const;
  void sendCancel(const Remote& r, const std::string& reason);
  // Revokes the request's write grant. True when no write of it can land any more (nothing
  // was requested, the writer confirmed all, or every lane is receiver-fenced).
  bool fenceWrites(uint64_t id, Remote& r);
  // Moves the request's reserved blocks into the quarantine (the engine keeps them held).
  void quarantine(uint64_t id, const Remote& r, const std::string& why);
  void release(engine::SeqId holder, const std::string& why);
  void onCancelAck(const std::string& address, uint64_t id);
  void forget(uint64_t id);
  worker::WorkerLoop::TimerId deadline(uint64_t id, std::function<Status()> why);

  worker::WorkerLoop& loop_;
  Callbacks callbacks_;
  std::unordered_map<uint64_t, Remote> requests_;
  std::deque<Waiting> waiting_;
  std::unordered_map<std::string, Peer> peers_;
  std::unordered_map<engine::SeqId, Quarantined> quarantine_;  // holder sequence -> hold
  engine::SeqId nextHolder_ = (engine::SeqId(1) << 63) | 1;   // far from the router's ids
  int quarantinedBlocks_ = 0;
};

}  // namespace pd::decode
