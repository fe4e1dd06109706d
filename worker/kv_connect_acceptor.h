// KvConnectAcceptor: the serving side of the KvConnect exchange (KvConnect in pdserve.proto),
// shared by the two roles that push KV into a peer's granted blocks: a prefill worker taking a
// decode worker's connection (prefill_worker/prefill_jobs.h) and a decode worker taking a peer
// pull's (decode_worker/pull_sources.h).
//
// Once per control connection: checks where the peer's KV blocks live against this worker's
// layout (one region per tensor-parallel rank), loads its transfer offer and answers with this
// worker's metadata, so the peer can connect back; on any failure it answers an Error with
// request_id 0 (the peer fails what it queued on the connection at once), logs it, and keeps
// nothing. An accepted connection's target is kept until drop() (the connection closed).
// No other live connection may hold the transfer peer the offer names: the agent keys peers by
// name, so a second connection naming a connected peer (an unauthenticated one in open mode)
// would replace it and fail its transfers (docs/security.md, "KvConnect and peer names"). A
// repeat on the same connection is the same peer and reloads it.
//
// Threads: the worker loop thread only.
#pragma once

#include <string>
#include <unordered_map>

#include "common/net/framed.h"
#include "worker/proto_convert.h"
#include "worker/worker_loop.h"

namespace pd::worker {

// An accepted connection's KV target: its transfer peer and where its blocks live.
struct KvConnectTarget {
  kvt::AgentPeer peer = 0;
  std::string peerName;  // the transfer agent's name for it (its metadata's)
  KvTargetLayout layout;
};

class KvConnectAcceptor {
 public:
  // `who` names this side in errors ("prefill worker", "decode worker"); `exchange` the
  // exchange ("KvConnect", "pull KvConnect"); `logTag` the caller's log tag. `replyWithPool`:
  // the answer also carries this worker's own pool (num_blocks, regions), where the peer may
  // push in turn (a prefill worker's pulls from its decode worker, docs/kv_cache.md).
  KvConnectAcceptor(WorkerLoop& loop, std::string who, std::string exchange, const char* logTag,
                    bool replyWithPool = false)
      : loop_(loop),
        who_(std::move(who)),
        exchange_(std::move(exchange)),
        logTag_(logTag),
        replyWithPool_(replyWithPool) {}

  // Validates `offer`, answers on `conn` (KvConnect with our metadata, or the Error) and
  // returns the kept target; nullptr when refused (the Error is sent and logged).
  const KvConnectTarget* accept(const net::ConnectionPtr& conn, const proto::KvConnect& offer);
  // Keeps `target` for `conn` without an exchange: a link whose transfer peer is already
  // known (a prefill worker's connection back to its decode worker, serving its pulls).
  void attach(const net::FramedConnection* conn, KvConnectTarget target) { targets_[conn] = std::move(target); }
  // The connection's target; nullptr before an accepted KvConnect.
  const KvConnectTarget* find(const net::FramedConnection* conn) const;
  void drop(const net::FramedConnection* conn) { targets_.erase(conn); }
  void clear() { targets_.clear(); }

 private:
  WorkerLoop& loop_;
  std::string who_, exchange_;
  const char* logTag_;
  bool replyWithPool_;
  std::unordered_map<const net::FramedConnection*, KvConnectTarget> targets_;
};

}  // namespace pd::worker
