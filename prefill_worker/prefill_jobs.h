// PrefillJobs: the prefill side of the remote-prefill lifecycle (docs/architecture.md,
// "Remote prefill, prefill side"). It owns every PrefillRequest this worker accepted, from
// admission to the PrefillDone (or Error) it sends back, and nothing else touches them.
//
//   accept() --> COMPUTING --(every chunk computed, first token sampled)--> PUSHING
//   accept() of a request naming pull_tokens --> COMPUTING, pulling first (PrefillPulls: its
//        prefix pulled from the decode worker, or computed here when the pull fails); the
//        chunks then start after the pulled prefix
//   COMPUTING / PUSHING --(all layers posted and confirmed at the target)--> DONE: PrefillDone
//   COMPUTING / PUSHING --(transfer error | deadline | step failure)--> FAILED: Error to decode
//   COMPUTING / PUSHING --(Cancel | decode connection closed | shutdown)--> ENDED: no reply,
//        except the Cancel acknowledgement (Cancel{ack}): sent once every transfer posted for
//        the request reached a terminal poll state, so no byte of it can land at the decode
//        worker any more (KV fencing; at once when nothing was in flight or the job is unknown)
//
// Deadline: one per job, PrefillRequest.deadline_ms (or kv_transfer.timeout_ms), a loop
// lease on progress: it covers the queue, compute and push, and every layer of the job
// computed renews it, so a prompt that takes longer than deadline_ms to compute is computed
// once while a stuck step still fails it. The decode worker's deadline for the request is
// the same lease, renewed by the PrefillProgress it is sent (at most every quarter of
// deadline_ms) while layers are computed (docs/reliability.md, "Remote prefill deadlines"). Blocks: the job's own KV
// blocks stay held (engine release off) until the terminal state, after every transfer that reads them finished or was
// cancelled (TransferAgent::cancel returns once the transport no longer reads them), so no
// block is reused while a transfer still reads it. The target blocks belong to the decode
// worker; PrefillDone is the one signal that they are filled (sent only after the transport
// confirmed every write at the target).
//
// Threads: the loop thread only.
#pragma once

#include <optional>
#include <unordered_map>
#include <vector>

#include "common/net/framed.h"
#include "prefill_worker/prefill_pulls.h"
#include "worker/kv_connect_acceptor.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::prefill {

class PrefillJobs {
 public:
  explicit PrefillJobs(worker::WorkerLoop& loop);

  // Step 2 of the kvtransfer exchange (KvConnect in pdserve.proto), once per decode
  // connection: worker::KvConnectAcceptor (worker/kv_connect_acceptor.h) checks the decode
  // worker's KV layout and offer and answers; the connection's target is kept until it closes.
  void connect(const net::ConnectionPtr& decode, const proto::KvConnect& offer);
  // Validates the request's blocks against its connection's target and queues the prompt,
  // also while the worker drains (what still arrives was routed before the drain was known).
  // On failure the decode worker gets an Error naming the problem and nothing is kept.
  void accept(const net::ConnectionPtr& decode, const proto::PrefillRequest& request);
  // The decode worker ended the request (Cancel): end it, and acknowledge on `decode` once its
  // transfers are terminal. An unknown id is acknowledged at once (nothing of it is here).
  void cancel(const net::ConnectionPtr& decode, uint64_t id);
  void dropConnection(const net::ConnectionPtr& decode, const Status& why);
  // The decode worker's answers to this worker's pulls (PrefillPulls): PullDone, an Error
  // for a request, a Cancel{ack}.
  void onPullReply(const net::ConnectionPtr& decode, const proto::Envelope& env);
  void shutdown(const Status& why);

  // Loop hooks.
  void onLayerDone(int layer, const engine::StepView& step);
  void onStepEvents(const std::vector<engine::EngineEvent>& events);
  void settle();  // polls transfers; moves jobs to their terminal states
  bool hasTransfers() const;
  bool empty() const { return jobs_.empty() && ending_.empty(); }
  uint32_t transfersInFlight() const;
  // pdserve_remote_prefills{state} for COMPUTING, PUSHING and the ended jobs whose transfers
  // are still being cancelled (loop poll).
  void exportStates();

 private:
  enum class State { kComputing, kPushing };
  struct Job {
    State state = State::kComputing;
    net::ConnectionPtr decode;
    kvt::AgentPeer peer = 0;
    worker::KvTargetLayout target;  // the connection's (copied: the job may outlive it)
    worker::KvTargetBlocks blocks;  // the request's own
    std::vector<kvt::AgentTransfer> inflight;
    int pushedTokens = 0;  // prompt tokens whose KV was posted for every layer
    std::optional<engine::SampledToken> first;
    Status failed;  // the first failure; the job ends FAILED at the next settle()
    worker::WorkerLoop::TimerId deadlineTimer = 0;
    std::chrono::milliseconds leaseMs{0};  // PrefillRequest.deadline_ms
    SteadyTime progressAt;                 // the lease runs from here: receipt, then each layer computed
    SteadyTime progressSentAt;             // the last PrefillProgress to the decode worker
    SteadyTime received;
    std::optional<SteadyTime> computedAt;
    double queueS = 0, computeS = 0;  // the engine's queue and prefill time (PrefillDone timings)
    int cachedTokens = 0;             // the engine's prefix hit for the prompt (PrefillDone)
    double inboxS = 0;                // the PrefillRequest's wait for the loop before accept()
    uint64_t bytes = 0;
    bool pulling = false;  // its prefix is being pulled (PrefillPulls); not in the engine's queue yet
    int pulledTokens = 0;  // PrefillDone.timings: the pull, when one was asked
    double pullMs = 0;
    std::string pullTransport;
  };

  // An ended job's transfers, cancelled, polled to their terminal states by settle(); then
  // the Cancel acknowledgement goes to `ackTo` (null: no acknowledgement).
  struct Ending {
    net::ConnectionPtr ackTo;
    std::vector<kvt::AgentTransfer> inflight;
  };

  void reject(const net::ConnectionPtr& decode, uint64_t id, const Status& why);
  void sendCancelAck(const net::ConnectionPtr& decode, uint64_t id);
  void renewLease(uint64_t id, Job& job, int computedTokens);
  // Polls the job's transfers: the finished ones are dropped, the first failure kept in
  // job.failed (acted on by settle()).
  void pollInflight(Job& job);
  void finish(uint64_t id);  // DONE
  // FAILED (reply) or ENDED; ackTo: the connection to acknowledge a Cancel on.
  void end(uint64_t id, const Status& why, bool reply, net::ConnectionPtr ackTo = nullptr);
  // PrefillPulls' end of a pull: the job computes from here.
  void pulled(uint64_t id, int tokens, double ms, const std::string& transport, const Status& queued);

  worker::WorkerLoop& loop_;
  PrefillPulls pulls_;
  worker::KvConnectAcceptor targets_;  // per decode connection
  std::unordered_map<uint64_t, Job> jobs_;
  std::unordered_map<uint64_t, Ending> ending_;
};

}  // namespace pd::prefill
