// PrefillPulls: a prefill worker's pulls (docs/kv_cache.md, "Peer pulls", prefill side). A
// PrefillRequest naming pull_tokens says the decode worker that sent it holds the prompt's
// first pull_tokens tokens (a multi-turn history it decoded) and that pulling them is
// predicted cheaper than computing them here. The pull rides the connection the request came
// on: both workers' transfer agents already know each other from its KvConnect, and the
// decode worker serves it from its KV region (PullSources), pushing into blocks reserved here.
//
//   start() --(blocks reserved for the whole prompt, Engine::submitRemote)--> PULLING:
//        PullRequest (the pulled blocks and this worker's write grant for them) to the decode
//        worker, one loop timer of kv_transfer.pull_timeout_ms
//   PULLING --(PullDone)--> DONE: the pulled blocks are named (a cached prefix), the request
//        queued (Engine::recomputeRemote): the scheduler attaches them, computing the rest
//   PULLING --(Error | deadline)--> FELL_BACK / REFUSED: Cancel to the decode worker (deadline);
//        the request queued with nothing pulled: the prompt is computed here
//   PULLING --(end(): the job ended: Cancel, its connection closed, shutdown)--> ENDED: Cancel
//        to the decode worker; the request stays the caller's to cancel
// A pull is an optimisation, never a reason to fail: whatever happens the job is served. The
// caller (PrefillJobs) hears every end but end() through onDone.
//
// Fencing: a pull that did not finish revokes its write grant. When every lane to the decode
// worker is receiver-fenced (tcp) that stops its writes at once and the blocks are reused;
// otherwise (one-sided cma, ucx, verbs writes) they are held out of the free pool
// (Engine::quarantineRemote) until the decode worker acknowledges the Cancel (Cancel{ack}: its
// transfers are terminal) or its lanes are known dead (TransferAgent::unfencedLanesDead), and
// the request continues in fresh blocks. pdserve_kv_blocks_quarantined counts the held ones.
//
// Threads: the loop thread only.
#pragma once

#include <functional>
#include <string>
#include <unordered_map>

#include "common/net/framed.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::prefill {

class PrefillPulls {
 public:
  // A pull ended and its request is queued in the engine (`queued` ok), or could not be (then
  // the caller fails the job with it). `tokens`: pulled (0: it fell back), in `ms` (blocks
  // reserved -> its end) over `transport`.
  using Done = std::function<void(uint64_t id, int tokens, double ms, const std::string& transport, Status queued)>;
  PrefillPulls(worker::WorkerLoop& loop, Done onDone) : loop_(loop), onDone_(std::move(onDone)) {}

  // Starts the pull of `pr` (pull_tokens > 0) over `decode`, whose transfer peer is `peer`:
  // true, `request` moved into the engine (waiting for the pull). False, `request` untouched:
  // no pull (no free blocks for the whole prompt now: the prompt queues like any other); the
  // pull outcome is counted. An error: the request is gone (the engine refused it).
  Result<bool> start(const net::ConnectionPtr& decode, kvt::AgentPeer peer, const proto::PrefillRequest& pr,
                     engine::Request& request);
  bool pulling(uint64_t id) const { return pulls_.count(id) != 0; }
  // The decode worker's answers on `decode`: PullDone, an Error for a pull, a Cancel{ack}.
  // Answers for pulls not running (any more) are ignored.
  void onPullDone(const net::ConnectionPtr& decode, const proto::PullDone& done);
  void onError(const net::ConnectionPtr& decode, uint64_t id, const Status& why);
  void onCancelAck(const net::ConnectionPtr& decode, uint64_t id);
  // The job `id` ended while pulling (no onDone): Cancel, fence or hold. The engine request
  // is left to the caller (cancel it after this).
  void end(uint64_t id, const std::string& why);
  // `decode` closed: its pulls end (as end()), and its holds wait only for its lanes to die.
  void dropConnection(const net::ConnectionPtr& decode);
  // Releases holds whose writer's lanes are dead (loop poll).
  void poll();
  void shutdown();
  int heldBlocks() const { return heldBlocks_; }

 private:
  struct Pull {
    net::ConnectionPtr decode;
    kvt::AgentPeer peer = 0;
    std::vector<int32_t> prompt;
    int tokens = 0;  // asked for
    std::string grant;
    int blocks = 0;  // reserved (the whole prompt)
    SteadyTime reservedAt;
    worker::WorkerLoop::TimerId deadlineTimer = 0;
  };
  struct Hold {
    uint64_t requestId = 0;
    net::ConnectionPtr decode;  // null once it closed
    kvt::AgentPeer peer = 0;
    int blocks = 0;
  };

  // Revokes the grant and, when writes may still land, moves the blocks into a hold; the
  // pull is forgotten.
  void fence(uint64_t id, Pull& p, const std::string& why);
  void fellBack(uint64_t id, const Status& why, const std::string& outcome, bool cancel);
  void sendCancel(const Pull& p, uint64_t id, const std::string& reason);
  void release(engine::SeqId holder, const std::string& why);
  void count(const std::string& outcome, uint64_t bytes, const std::string& transport, double seconds);

  worker::WorkerLoop& loop_;
  Done onDone_;
  std::unordered_map<uint64_t, Pull> pulls_;
  std::unordered_map<engine::SeqId, Hold> holds_;
  engine::SeqId nextHolder_ = (engine::SeqId(1) << 63) | (engine::SeqId(1) << 61) | 1;  // apart from request ids
  int heldBlocks_ = 0;
};

}  // namespace pd::prefill
