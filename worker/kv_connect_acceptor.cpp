#include "worker/kv_connect_acceptor.h"

#include "common/base/log.h"

namespace pd::worker {

const KvConnectTarget* KvConnectAcceptor::accept(const net::ConnectionPtr& conn, const proto::KvConnect& offer) {
  auto& agent = loop_.agent();
  const auto& regions = loop_.bundle().kvRegions;
  KvConnectTarget target;
  Result<std::string> reply = [&]() -> Result<std::string> {
    PD_ASSIGN_OR_RETURN(target.layout, fromProto(offer));
    if (target.layout.regions.size() != regions.size()) {
      return invalidArgument("KvConnect: " + std::to_string(target.layout.regions.size()) +
                             " KV regions, this worker has " + std::to_string(regions.size()) +
                             " (one per tensor-parallel rank)");
    }
    PD_ASSIGN_OR_RETURN(target.peerName, kvt::TransferAgent::metadataName(offer.metadata()));
    for (const auto& [c, other] : targets_) {
      if (c != conn.get() && other.peerName == target.peerName) {
        return failedPrecondition("KvConnect: transfer peer '" + target.peerName +
                                  "' is already connected on another control connection; a peer is replaced only "
                                  "once that connection closes");
      }
    }
    PD_ASSIGN_OR_RETURN(target.peer, agent.loadPeer(offer.metadata()));
    return agent.peerMetadata(target.peer);
  }();
  proto::Envelope env;
  env.set_request_id(0);
  if (!reply.ok()) {
    Status why = reply.status().withContext(who_ + " " + loop_.flags().workerId + ": " + exchange_ + " from " +
                                            conn->peerHello().worker_id());
    PD_LOG(kWarn, logTag_) << why.toString();
    *env.mutable_error() = net::toProtoError(why);
    (void)conn->send(std::move(env));
    return nullptr;
  }
  env.mutable_kv_connect()->set_metadata(std::move(reply).value());
  if (replyWithPool_) {
    KvTargetLayout mine;
    mine.numBlocks = loop_.engine().kv().numTotalBlocks();
    mine.regions = regions;
    toProto(mine, env.mutable_kv_connect());
  }
  (void)conn->send(std::move(env));
  KvConnectTarget& kept = targets_[conn.get()];
  kept = std::move(target);
  return &kept;
}

const KvConnectTarget* KvConnectAcceptor::find(const net::FramedConnection* conn) const {
  auto it = targets_.find(conn);
  return it == targets_.end() ? nullptr : &it->second;
}

}  // namespace pd::worker
