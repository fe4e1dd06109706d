// KvQuarantine: KV blocks of remote prefills that ended while a one-sided writer (cma, ucx,
// verbs) may still write them (docs/reliability.md, "KV fencing"). A hold keeps the blocks out
// of the free pool (Engine::quarantineRemote moves them to a holder sequence) until one of:
//   - the prefill worker acknowledges the request's Cancel (Cancel{ack}: every transfer it
//     posted for the request is terminal); the Cancel is sent again on every new link to it;
//   - the prefill worker is known gone: no link to it and TransferAgent::unfencedLanesDead
//     (for cma, its process exited).
// A hold is never dropped on a timer: past kv_transfer.timeout_ms it is logged once and kept.
// While holds wait and no link is open, the worker is dialled again (PrefillLinks::redial).
// pdserve_kv_blocks_quarantined counts the held blocks.
//
// Threads: the loop thread only.
#pragma once

#include <string>
#include <unordered_map>

#include "decode_worker/prefill_links.h"
#include "worker/worker_loop.h"

namespace pd::decode {

class KvQuarantine {
 public:
  KvQuarantine(worker::WorkerLoop& loop, PrefillLinks& links) : loop_(loop), links_(links) {}

  // Moves request `id`'s reserved blocks (`blocks` of them) into a hold until the prefill
  // worker at `address` (kvtransfer peer `kvPeer`) acknowledges or is gone. `why` is logged.
  void hold(uint64_t id, const std::string& address, kvt::AgentPeer kvPeer, int blocks, const std::string& why);
  // Cancel{ack} for request `id` from `address`: its holds are released.
  void onCancelAck(const std::string& address, uint64_t id);
  // A new link to `address` is ready: ask again for the holds waiting on it (an answer may
  // have been lost with the old link; a worker that holds nothing answers at once).
  void onLinkReady(const std::string& address);
  // Releases holds whose writer is gone, redials writers that may live, logs holds past
  // their lease (loop poll).
  void poll();
  // Shutdown: the process ends and its memory with it.
  void releaseAll(const std::string& why);
  int blocks() const { return blocks_; }

 private:
  struct Hold {
    uint64_t requestId = 0;
    std::string address;
    kvt::AgentPeer kvPeer = 0;
    int blocks = 0;
    SteadyTime since;
    bool leaseLogged = false;
  };
  void release(engine::SeqId holder, const std::string& why);
  void sendCancel(const Hold& h);

  worker::WorkerLoop& loop_;
  PrefillLinks& links_;
  std::unordered_map<engine::SeqId, Hold> holds_;            // holder sequence -> hold
  engine::SeqId nextHolder_ = (engine::SeqId(1) << 63) | 1;  // far from the router's ids
  int blocks_ = 0;
};

}  // namespace pd::decode
