#include "decode_worker/pull_sources.h"

#include <algorithm>

#include "common/base/log.h"
#include "engine/kv_tiers.h"
#include "kvtransfer/block_segments.h"

namespace pd::decode {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "pull";
}  // namespace

void PullSources::reject(const net::ConnectionPtr& target, uint64_t id, const Status& why) {
  proto::Envelope env;
  env.set_request_id(id);
  *env.mutable_error() = net::toProtoError(why);
  (void)target->send(std::move(env));
}

// The same exchange and checks as a prefill worker's (worker/kv_connect_acceptor.h).
void PullSources::connect(const net::ConnectionPtr& conn, const proto::KvConnect& offer) {
  const worker::KvConnectTarget* target = targets_.accept(conn, offer);
  if (!target) return;
  PD_LOG(kInfo, kTag) << "peer " << conn->peerHello().worker_id() << " pulls KV over "
                      << loop_.agent().peerTransport(target->peer).value();
}

int PullSources::promoteForPull(std::span<const int32_t> tokens, SteadyTime accepted, int64_t deadlineMs) {
  engine::KvTierStore* tiers = loop_.engine().kvTiers();
  if (!tiers) return 0;
  engine::KvCacheManager& kv = loop_.engine().kv();
  // Every sequence here may take one fresh block in its next step: those stay free.
  int budget = std::min(kv.numFreeBlocks() - kv.numSequences(), int(tokens.size()) / kv.blockSize());
  const SteadyTime until = accepted + std::min(milliseconds(kMaxPromoteMs), milliseconds(deadlineMs / 4));
  int promoted = 0;
  while (budget > 0) {
    const int n = tiers->promote(tokens, int(tokens.size()), std::min(budget, kPromoteChunkBlocks));
    if (n == 0) break;
    promoted += n;
    budget -= n;
    if (steadyNow() >= until) break;
  }
  return promoted;
}

void PullSources::attach(const net::ConnectionPtr& conn, kvt::AgentPeer peer, const worker::KvTargetLayout& layout) {
  worker::KvConnectTarget t;
  t.peer = peer;
  auto name = loop_.agent().peerName(peer);
  t.peerName = name.ok() ? name.value() : std::string();
  t.layout = layout;
  targets_.attach(conn.get(), std::move(t));
}

engine::SeqId PullSources::find(const net::FramedConnection* target, uint64_t id) const {
  for (const auto& [holder, p] : pulls_)
    if (p.target.get() == target && p.requestId == id) return holder;
  return 0;
}

void PullSources::accept(const net::ConnectionPtr& conn, const proto::PullRequest& pr) {
  const uint64_t id = pr.request_id();
  const SteadyTime accepted = steadyNow();  // the deadline runs from here, promotion included
  const worker::KvConnectTarget* target = targets_.find(conn.get());
  if (!target) return reject(conn, id, failedPrecondition("PullRequest before KvConnect"));
  if (find(conn.get(), id)) {
    return reject(conn, id, failedPrecondition("pull " + std::to_string(id) + " is already running here"));
  }
  engine::KvCacheManager& kv = loop_.engine().kv();
  const engine::KvLayout& layout = kv.layout();
  std::vector<int32_t> tokens(pr.prompt_token_ids().begin(), pr.prompt_token_ids().end());
  if (tokens.empty() || tokens.size() % size_t(layout.blockSize) != 0) {
    return reject(
        conn, id,
        invalidArgument("PullRequest: " + std::to_string(tokens.size()) +
                        " tokens is not a positive multiple of the block size " + std::to_string(layout.blockSize)));
  }
  auto blocks = worker::fromProto(pr.kv_target(), target->layout.numBlocks);
  if (!blocks.ok()) return reject(conn, id, blocks.status());
  const size_t wanted = tokens.size() / size_t(layout.blockSize);
  if (blocks->blockIds.size() < wanted) {
    return reject(conn, id,
                  invalidArgument("PullRequest: " + std::to_string(blocks->blockIds.size()) + " target blocks for " +
                                  std::to_string(wanted) + " blocks of tokens"));
  }
  const int64_t deadlineMs = pr.deadline_ms() ? int64_t(pr.deadline_ms()) : loop_.config().kvTransfer.pullTimeoutMs;
  // Blocks a lower tier holds past the region's prefix come back into the region first; they
  // are then cached blocks like any other (attached and pinned below).
  const int promoted = promoteForPull(tokens, accepted, deadlineMs);
  // Pinned from here: a sequence of our own holds the blocks' references.
  const engine::SeqId holder = nextHolder_++;
  auto held = kv.attachCachedPrefix(holder, tokens, int(tokens.size()));
  if (!held.ok()) return reject(conn, id, held.status());
  if (*held == 0) {
    (void)kv.free(holder);
    return reject(conn, id,
                  notFound("decode worker " + loop_.flags().workerId + " holds none of the " +
                           std::to_string(tokens.size()) + " pulled tokens any more"));
  }
  Pull p;
  p.requestId = id;
  p.target = conn;
  p.peer = target->peer;
  p.holder = holder;
  p.tokens = *held;
  p.blocks = *held / layout.blockSize;
  p.started = steadyNow();
  p.promoted = promoted;
  const auto table = kv.blockTable(holder);
  const std::span<const int> ours(table.data(), size_t(p.blocks));
  const std::span<const int> theirs(blocks->blockIds.data(), size_t(p.blocks));
  engine::KvLayout targetLayout = layout;
  targetLayout.numBlocks = target->layout.numBlocks;
  const auto& regions = loop_.bundle().kvRegions;
  for (size_t r = 0; r < regions.size() && p.failed.isOk(); ++r) {
    auto segments =
        kvt::blockSegments(worker::kvBlockPool(layout, regions[r]), ours,
                           worker::kvBlockPool(targetLayout, target->layout.regions[r]), theirs, 0, layout.numLayers);
    if (!segments.ok()) {
      p.failed = segments.status();
      break;
    }
    auto t = loop_.agent().post(segments->local, segments->remote, p.peer, blocks->writeGrant);
    if (!t.ok()) {
      p.failed = t.status();
      break;
    }
    p.inflight.push_back(t.value());
    p.bytes += totalBytes(segments->local);
  }
  pulls_.emplace(holder, std::move(p));
  pulls_.at(holder).deadlineTimer = loop_.at(accepted + milliseconds(deadlineMs), [this, holder, deadlineMs] {
    auto it = pulls_.find(holder);
    if (it == pulls_.end()) return;
    it->second.deadlineTimer = 0;
    end(holder, deadlineExceeded("pull not confirmed within " + std::to_string(deadlineMs) + " ms"), true);
  });
  loop_.agent().progress();
  settle();
}

void PullSources::settle() {
  std::vector<engine::SeqId> done, failed;
  for (auto& [holder, p] : pulls_) {
    for (size_t i = 0; i < p.inflight.size();) {
      Status s = loop_.agent().poll(p.inflight[i]);
      if (s.inProgress()) {
        ++i;
        continue;
      }
      if (!s.isOk() && p.failed.isOk()) p.failed = s;
      p.inflight.erase(p.inflight.begin() + long(i));
    }
    if (!p.failed.isOk())
      failed.push_back(holder);
    else if (p.inflight.empty())
      done.push_back(holder);
  }
  for (engine::SeqId h : done) finish(h);
  for (engine::SeqId h : failed) end(h, pulls_.at(h).failed, /*reply=*/true);
  for (auto it = ending_.begin(); it != ending_.end();) {
    auto& inflight = it->second.inflight;
    for (size_t i = 0; i < inflight.size();) {
      if (loop_.agent().poll(inflight[i]).inProgress())
        ++i;
      else
        inflight.erase(inflight.begin() + long(i));
    }
    if (!inflight.empty()) {
      ++it;
      continue;
    }
    if (it->second.ackTo) sendCancelAck(it->second.ackTo, it->second.requestId);
    it = ending_.erase(it);
  }
}

void PullSources::finish(engine::SeqId holder) {
  Pull& p = pulls_.at(holder);
  proto::Envelope env;
  env.set_request_id(p.requestId);
  auto* d = env.mutable_pull_done();
  d->set_request_id(p.requestId);
  d->set_tokens(uint32_t(p.tokens));
  d->set_bytes_transferred(p.bytes);
  if (p.promoted) {
    PD_LOG(kDebug, kTag) << "pull " << p.requestId << ": " << p.tokens << " tokens, " << p.promoted
                         << " block(s) of them promoted from a lower tier";
  }
  if (auto name = loop_.agent().peerTransport(p.peer); name.ok()) d->set_transport(name.value());
  (void)p.target->send(std::move(env));
  loop_.cancelTimer(p.deadlineTimer);
  (void)loop_.engine().kv().free(holder);
  pulls_.erase(holder);
}

void PullSources::end(engine::SeqId holder, const Status& why, bool reply, net::ConnectionPtr ackTo) {
  auto it = pulls_.find(holder);
  if (it == pulls_.end()) return;
  Pull& p = it->second;
  // cancel() returns once the transport no longer reads our blocks: they are unpinned now,
  // and the Cancel is acknowledged once every transfer reports its terminal state.
  for (auto t : p.inflight) (void)loop_.agent().cancel(t);
  if (!p.inflight.empty() || ackTo) {
    Ending& e = ending_[holder];
    e.requestId = p.requestId;
    e.inflight = p.inflight;
    e.ackTo = std::move(ackTo);
  }
  if (reply) {
    PD_LOG(kWarn, kTag) << "pull " << p.requestId << " for " << p.target->peerHello().worker_id() << ": "
                        << why.toString();
    reject(p.target, p.requestId, why);
  }
  loop_.cancelTimer(p.deadlineTimer);
  (void)loop_.engine().kv().free(holder);
  pulls_.erase(it);
}

void PullSources::sendCancelAck(const net::ConnectionPtr& target, uint64_t id) {
  proto::Envelope env;
  env.set_request_id(id);
  env.mutable_cancel()->set_request_id(id);
  env.mutable_cancel()->set_ack(true);
  (void)target->send(std::move(env));
}

void PullSources::cancel(const net::ConnectionPtr& target, uint64_t id) {
  const engine::SeqId holder = find(target.get(), id);
  if (!holder) {
    // Nothing of it here (never accepted, or already ended and settled): acknowledged at once
    // unless an ending of it is still settling.
    for (auto& [h, e] : ending_) {
      if (e.requestId == id && (!e.ackTo || e.ackTo == target)) {
        e.ackTo = target;
        return;
      }
    }
    return sendCancelAck(target, id);
  }
  end(holder, Status::ok(), /*reply=*/false, target);
  settle();
}

void PullSources::dropConnection(const net::ConnectionPtr& target, const Status& why) {
  targets_.drop(target.get());
  std::vector<engine::SeqId> holders;
  for (auto& [h, p] : pulls_)
    if (p.target == target) holders.push_back(h);
  for (engine::SeqId h : holders) end(h, why, /*reply=*/false);
  for (auto& [h, e] : ending_)
    if (e.ackTo == target) e.ackTo = nullptr;
}

void PullSources::shutdown(const Status& why) {
  std::vector<engine::SeqId> holders;
  for (auto& [h, p] : pulls_) holders.push_back(h);
  for (engine::SeqId h : holders) end(h, why, /*reply=*/true);
  targets_.clear();
}

int PullSources::pinnedBlocks() const {
  int n = 0;
  for (const auto& [h, p] : pulls_) n += p.blocks;
  return n;
}

}  // namespace pd::decode
