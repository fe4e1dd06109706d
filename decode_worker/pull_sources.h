// PullSources: the source side of peer pulls (docs/kv_cache.md, "Peer pulls"). A peer decode
// worker (the target) dials this worker's pull port, proves the cluster secret and the same
// model in its hello, sends its KvConnect offer (where its blocks live; answered as a prefill
// worker answers it, worker/kv_connect_acceptor.h), then one PullRequest per pull: the prompt's
// leading tokens and, for each of their blocks, a target block and the target's write grant.
//
//   accept() --(leading blocks of the prefix found in the KV region, or in a lower tier and
//        promoted into it, pinned)--> PUSHING: one
//        transfer per tensor-parallel rank, every layer of every block, posted at once
//   PUSHING --(every write confirmed at the target)--> DONE: PullDone{tokens}; blocks unpinned
//   accept() --(not one of the blocks held in any tier, bad target, no KvConnect)--> Error
//        (NOT_FOUND for blocks no longer held): the target computes them itself
//   PUSHING --(transfer error | deadline)--> FAILED: transfers cancelled, Error, unpinned
//   PUSHING --(Cancel | connection closed | shutdown)--> ENDED: transfers cancelled, unpinned;
//        a Cancel is acknowledged (Cancel{ack}) once every transfer reached a terminal poll
//        state, so no byte of the pull can land at the target any more (KV fencing, as a
//        remote prefill: docs/architecture.md "Remote prefill, prefill side")
//
// Why the source pushes rather than the target reading: every lane already writes into a
// peer's granted blocks (the target's write grant, its receiver fence on tcp, its quarantine
// for one-sided lanes), and that is all a pull needs; a read would need a read grant and
// read paths in every transport.
//
// Blocks: the pulled blocks stay pinned (a KV sequence of their own, holding their
// references, so eviction cannot take them while a transfer reads them) until the pull is
// terminal; TransferAgent::cancel returns once the transport no longer reads them, so they
// are unpinned right after it.
//
// Lower tiers (engine/kv_tiers.h): when the region's prefix of the pulled tokens stops at a
// block the host or disk tier holds, accept() first promotes the blocks that continue it
// (KvTierStore::promote, as a local request's prompt gets them), then serves them from the
// region like any other. Bounds: at most the free blocks less one per KV sequence here (each
// running request may need a fresh block next step; promotion only ever takes free blocks,
// evicting cached free ones, never a block a sequence holds), and at most the pulled prefix.
// A disk tier's read is synchronous on the loop: promotion runs in chunks of
// kPromoteChunkBlocks blocks and stops after the first chunk that ends past
// min(kMaxPromoteMs, a quarter of the pull's deadline) from accept, so one pull holds the
// loop for that long plus one chunk's reads at most; what was not promoted by then is not
// served (the pull serves its leading blocks, the target computes the rest).
//
// Deadline: PullRequest.deadline_ms (or kv_transfer.pull_timeout_ms) from accept (promotion
// included), one loop timer; the target's own deadline is the same length, so neither side
// waits past it.
//
// Threads: the loop thread only.
#pragma once

#include <span>
#include <unordered_map>
#include <vector>

#include "common/net/framed.h"
#include "worker/kv_connect_acceptor.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::decode {

class PullSources {
 public:
  explicit PullSources(worker::WorkerLoop& loop)
      : loop_(loop), targets_(loop, "decode worker", "pull KvConnect", "pull") {}

  void connect(const net::ConnectionPtr& target, const proto::KvConnect& offer);
  // A prefill worker pulls over the link this worker dialled for remote prefills (docs/kv_cache.md,
  // "Peer pulls", prefill side): the kvtransfer peer and the prefill worker's pool are already
  // known from that link's KvConnect, so `target` takes PullRequests without a KvConnect of
  // its own. Again for the same connection: updates it.
  void attach(const net::ConnectionPtr& target, kvt::AgentPeer peer, const worker::KvTargetLayout& layout);
  void accept(const net::ConnectionPtr& target, const proto::PullRequest& request);
  void cancel(const net::ConnectionPtr& target, uint64_t id);
  void dropConnection(const net::ConnectionPtr& target, const Status& why);
  void shutdown(const Status& why);

  void settle();  // polls transfers; moves pulls to their terminal states (loop poll)
  bool hasTransfers() const { return !pulls_.empty() || !ending_.empty(); }
  int pinnedBlocks() const;

 private:
  struct Pull {
    uint64_t requestId = 0;  // the target's
    net::ConnectionPtr target;
    kvt::AgentPeer peer = 0;
    engine::SeqId holder = 0;  // the KV sequence pinning the pulled blocks
    int blocks = 0;
    int tokens = 0;
    int promoted = 0;  // of the blocks, those promoted from a lower tier for this pull
    uint64_t bytes = 0;
    std::vector<kvt::AgentTransfer> inflight;
    Status failed;
    worker::WorkerLoop::TimerId deadlineTimer = 0;
    SteadyTime started;
  };
  struct Ending {
    uint64_t requestId = 0;
    net::ConnectionPtr ackTo;
    std::vector<kvt::AgentTransfer> inflight;
  };

  static constexpr int kPromoteChunkBlocks = 4;
  static constexpr int64_t kMaxPromoteMs = 50;

  void reject(const net::ConnectionPtr& target, uint64_t id, const Status& why);
  // Promotes lower-tier blocks continuing the region's prefix of `tokens` (bounded as the
  // header says); returns the blocks promoted.
  int promoteForPull(std::span<const int32_t> tokens, SteadyTime accepted, int64_t deadlineMs);
  // The pull `id` of `target` (its holder), 0 when none.
  engine::SeqId find(const net::FramedConnection* target, uint64_t id) const;
  void finish(engine::SeqId holder);
  // FAILED (reply) or ENDED; ackTo: the connection to acknowledge a Cancel on.
  void end(engine::SeqId holder, const Status& why, bool reply, net::ConnectionPtr ackTo = nullptr);
  void sendCancelAck(const net::ConnectionPtr& target, uint64_t id);

  worker::WorkerLoop& loop_;
  worker::KvConnectAcceptor targets_;  // per target connection
  // Keyed by the holder sequence: two targets may use the same request id.
  std::unordered_map<engine::SeqId, Pull> pulls_;
  std::unordered_map<engine::SeqId, Ending> ending_;
  engine::SeqId nextHolder_ = (engine::SeqId(1) << 62) | 1;  // apart from requests and quarantine holds
};

}  // namespace pd::decode
