// RemotePrefills: the decode side of the remote-prefill lifecycle (docs/architecture.md,
// "Remote prefill, decode side"). It owns every disaggregated request from the router's
// Generate until its KV is in place. Its two helpers own the rest: PrefillLinks the
// connections to the prefill workers (dial, KvConnect, lease), KvQuarantine the blocks a
// one-sided writer may still write after a request ended.
//
//   start() --> WAITING_BLOCKS --(blocks reserved for the whole prompt)--> CONNECTING
//   CONNECTING --(the link to its prefill worker is ready)--> REQUESTED (PrefillRequest sent)
//   REQUESTED --(PrefillDone)--> KV_READY: the engine decodes from the first token (handed off)
//   any --(Error | its link goes down | deadline)--> FAILED: Cancel to the prefill worker;
//        recompute here (the engine frees the reserved blocks and queues a local prefill) or,
//        per kv_transfer.on_remote_prefill_failure, fail; also fail (429) when recomputing
//        would break the ITL SLO of the running streams
//   any --(cancel(): client or router)--> CANCELLED: Cancel to the prefill worker; the
//        engine frees the reserved blocks
//   FAILED / CANCELLED after the PrefillRequest went out: the request's write grant is
//        revoked; when every lane to that prefill worker is receiver-fenced (tcp) the revoke
//        is the fence and the blocks are freed at once; otherwise (cma, ucx, verbs: one-sided
//        writes) they go to the KvQuarantine. A recompute uses fresh blocks.
//
// Deadlines (loop leases, kv_transfer.timeout_ms each): WAITING_BLOCKS from start();
// CONNECTING + REQUESTED together from the reservation, renewed by every PrefillProgress the
// prefill worker sends while it computes the request's layers: a deadline on progress, not
// on the whole prefill, so a long prompt on a slow worker is computed once, while a stopped
// or stuck one still fails it within timeout_ms of its last progress (docs/reliability.md,
// "Remote prefill deadlines"). A prefill worker that is slow, stopped or unreachable delays
// only the requests sent to it: nothing here waits on it.
//
// A disaggregated Generate that names a pull is the prefill worker's pull: the PrefillRequest
// carries it (pull_source_*, pull_tokens) when the prefill worker's KvConnect reply said it
// takes pulls (its pool), and the prefill worker's PullRequest comes back over this link, to
// be served from this worker's region (Callbacks::onLinkPull -> PullSources).
//
// Peer pulls (docs/kv_cache.md, "Peer pulls") are the same lifecycle with a peer decode worker
// as the writer: a Generate naming pull_source_address starts one. Its blocks are reserved
// like a remote prefill's, the link (PrefillLinks: the same dial, authentication, KvConnect
// and lease) goes to the source, and the PullRequest carries the grant for the pulled blocks
// alone. PullDone -> the pulled blocks are named (they hold the prompt's first tokens) and the
// request is queued here (Engine::recomputeRemote), where the scheduler attaches them as a
// cached prefix and computes only the rest. Any failure (an Error such as "not held any
// more", the link down, kv_transfer.pull_timeout_ms from the reservation) recomputes the
// whole prompt here, whatever on_remote_prefill_failure says: a pull is an optimisation, never
// a reason to fail. Fencing and quarantine are a remote prefill's. A pull whose prompt finds no
// free blocks at once is not attempted: the prompt queues in the engine like a colocated one.
//
// Threads: the loop thread only.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "decode_worker/kv_quarantine.h"
#include "decode_worker/prefill_links.h"
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
    // A peer pull ended: `tokens` of the prompt were pulled (0: it fell back to computing
    // them) in `ms` (blocks reserved -> PullDone) over `transport`.
    std::function<void(uint64_t id, int tokens, double ms, const std::string& transport)> onPulled;
    // A prefill worker pulls a prompt's prefix from this worker over the link to it (a
    // PullRequest, or a Cancel that is not an acknowledgement): `conn` is the link, `peer` its
    // kvtransfer peer, `layout` the prefill worker's pool from its KvConnect reply. Only
    // delivered when the reply carried that pool.
    std::function<void(const net::ConnectionPtr& conn, kvt::AgentPeer peer, const worker::KvTargetLayout& layout,
                       proto::Envelope&& env)>
        onLinkPull;
    // A link that delivered pulls closed: they end (PullSources::dropConnection).
    std::function<void(const net::ConnectionPtr& conn, const Status& why)> onLinkPullDown;
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
  // KvQuarantine::poll (loop poll).
  void pollQuarantine() { quarantine_.poll(); }
  int quarantinedBlocks() const { return quarantine_.blocks(); }
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
    SteadyTime leaseFrom;       // the deadline is timeout_ms after this (set, then renewed)
    std::string grant;          // TransferAgent::grantWrite for `blocks` ("" until REQUESTED)
    kvt::AgentPeer kvPeer = 0;  // the prefill worker's kvtransfer peer the grant is for
    bool writerDone = false;    // PrefillDone: every write confirmed, nothing can land later
    SteadyTime reservedAt;      // when its blocks were reserved (CONNECTING)
    SteadyTime requestedAt;     // when the PrefillRequest went (REQUESTED)
    int pullTokens = 0;         // > 0: a peer pull of the prompt's first pullTokens tokens
  };
  struct Waiting {
    uint64_t id;
    engine::Request request;
  };

  void reserved(uint64_t id, std::vector<engine::BlockId> blocks);
  void sendPrefillRequest(uint64_t id);
  // PrefillLinks' callbacks.
  void onLinkReady(const std::string& address);
  void onLinkMessage(const std::string& address, proto::Envelope&& env);
  void onLinkDown(const std::string& address, const Status& why);
  void onPrefillDone(uint64_t id, const proto::PrefillDone& done);
  void onPullDone(uint64_t id, const proto::PullDone& done);
  // A pull's end, counted: pdserve_kv_pulls_total{outcome,transport} and, when done, its
  // bytes and latency.
  void countPull(const Remote& r, const std::string& outcome, uint64_t bytes, const std::string& transport);
  int64_t timeoutMs(const Remote& r) const;
  // FAILED: recompute or fail. A pull always recomputes, counted under `pullOutcome`.
  void failed(uint64_t id, const Status& why, const std::string& pullOutcome = "fell_back");
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
  // CANCELLED or FAILED (`how`): Cancel to the prefill worker with `reason`, the writes
  // fenced or the blocks quarantined, the request forgotten here.
  void end(uint64_t id, const std::string& how, const std::string& reason);
  void forget(uint64_t id);
  worker::WorkerLoop::TimerId deadline(uint64_t id, std::function<Status()> why);

  worker::WorkerLoop& loop_;
  Callbacks callbacks_;
  PrefillLinks links_;
  KvQuarantine quarantine_;
  std::unordered_map<uint64_t, Remote> requests_;
  // Per prefill worker address, the link that delivered its pulls (onLinkPullDown on its end).
  std::unordered_map<std::string, net::ConnectionPtr> pullLinks_;
  std::deque<Waiting> waiting_;
};

}  // namespace pd::decode
