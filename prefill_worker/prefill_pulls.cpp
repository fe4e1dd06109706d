#include "prefill_worker/prefill_pulls.h"

#include <algorithm>

#include "common/base/log.h"
#include "kvtransfer/block_segments.h"
#include "worker/pull_metrics.h"

namespace pd::prefill {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "prefill";
}  // namespace

Result<bool> PrefillPulls::start(const net::ConnectionPtr& decode, kvt::AgentPeer peer, const proto::PrefillRequest& pr,
                                 engine::Request& request) {
  engine::Engine& engine = loop_.engine();
  const engine::KvCacheManager& kv = engine.kv();
  const uint64_t id = pr.request_id();
  // Worth it only now: with no blocks free for the prompt it queues like any other.
  if (kv.blocksFor(request.numPromptTokens()) > kv.numFreeBlocks()) {
    count("fell_back", 0, "", 0);
    return false;
  }
  Pull p;
  p.decode = decode;
  p.peer = peer;
  p.prompt.assign(pr.prompt_token_ids().begin(), pr.prompt_token_ids().end());
  p.tokens = int(pr.pull_tokens());
  auto blocks = engine.submitRemote(std::move(request));
  if (!blocks.ok()) return blocks.status();
  p.blocks = int(blocks->size());
  p.reservedAt = steadyNow();
  // The grant: exactly the pulled blocks, every layer of every rank's region, to this decode
  // worker alone; revoked when the pull ends.
  const size_t granted = std::min(blocks->size(), size_t(p.tokens / kv.blockSize()));
  const std::span<const engine::BlockId> grantedBlocks(blocks->data(), granted);
  auto grant = [&]() -> Result<std::string> {
    DescList ranges;
    for (const MemDesc& region : loop_.bundle().kvRegions) {
      const kvt::BlockPool pool = worker::kvBlockPool(kv.layout(), region);
      PD_ASSIGN_OR_RETURN(auto segs,
                          kvt::blockSegments(pool, grantedBlocks, pool, grantedBlocks, 0, kv.layout().numLayers));
      ranges.insert(ranges.end(), segs.remote.begin(), segs.remote.end());
    }
    return loop_.agent().grantWrite(peer, ranges);
  }();
  pulls_.emplace(id, std::move(p));
  if (!grant.ok()) {
    fellBack(id, grant.status().withContext("KV write grant"), "fell_back", /*cancel=*/false);
    return true;
  }
  Pull& pull = pulls_.at(id);
  pull.grant = std::move(grant).value();
  worker::KvTargetBlocks target;
  target.blockIds.assign(grantedBlocks.begin(), grantedBlocks.end());
  target.writeGrant = pull.grant;
  const int64_t deadlineMs = loop_.config().kvTransfer.pullTimeoutMs;
  proto::Envelope env;
  env.set_request_id(id);
  auto* req = env.mutable_pull_request();
  req->set_request_id(id);
  req->mutable_prompt_token_ids()->Add(pr.prompt_token_ids().begin(), pr.prompt_token_ids().begin() + pull.tokens);
  *req->mutable_kv_target() = worker::toProto(target);
  req->set_deadline_ms(uint64_t(deadlineMs));
  pull.deadlineTimer = loop_.at(steadyNow() + milliseconds(deadlineMs), [this, id, deadlineMs] {
    auto it = pulls_.find(id);
    if (it == pulls_.end()) return;
    it->second.deadlineTimer = 0;
    fellBack(id, deadlineExceeded("pull not done within " + std::to_string(deadlineMs) + " ms"), "fell_back",
             /*cancel=*/true);
  });
  if (Status s = decode->send(std::move(env)); !s.isOk()) fellBack(id, s, "fell_back", /*cancel=*/false);
  return true;
}

// The pulled blocks hold the prompt's first tokens: named, they are a cached prefix that the
// scheduler attaches when the request, queued now, is admitted.
void PrefillPulls::onPullDone(const net::ConnectionPtr& decode, const proto::PullDone& done) {
  const uint64_t id = done.request_id();
  auto it = pulls_.find(id);
  if (it == pulls_.end() || it->second.decode != decode) return;
  Pull& p = it->second;
  loop_.cancelTimer(p.deadlineTimer);
  // Every write was confirmed here before PullDone: nothing can land later; replays of the
  // grant are refused from now on.
  if (Status s = loop_.agent().revokeWrite(p.grant); !s.isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": revoking its pull grant: " << s.toString();
  }
  engine::Engine& engine = loop_.engine();
  const int bs = engine.kv().blockSize();
  const int tokens = std::min<int>(int(done.tokens()), p.tokens) / bs * bs;
  Status named = tokens > 0 ? engine.kv().cacheComputedBlocks(id, p.prompt, tokens) : Status::ok();
  const double seconds = secondsBetween(p.reservedAt, steadyNow());
  pulls_.erase(it);
  if (!named.isOk()) {
    PD_LOG(kWarn, kTag) << "request " << id << ": naming pulled blocks: " << named.toString()
                        << "; computing the prompt here";
    count("fell_back", 0, "", 0);
    return onDone_(id, 0, 1e3 * seconds, "", engine.recomputeRemote(id));
  }
  count("done", done.bytes_transferred(), done.transport(), seconds);
  PD_LOG(kDebug, kTag) << "request " << id << ": pulled " << tokens << " tokens in " << 1e3 * seconds << " ms";
  onDone_(id, tokens, 1e3 * seconds, done.transport(), engine.recomputeRemote(id));
}

void PrefillPulls::onError(const net::ConnectionPtr& decode, uint64_t id, const Status& why) {
  auto it = pulls_.find(id);
  if (it == pulls_.end() || it->second.decode != decode) return;
  fellBack(id, why, "refused", /*cancel=*/false);
}

void PrefillPulls::fellBack(uint64_t id, const Status& why, const std::string& outcome, bool cancel) {
  Pull& p = pulls_.at(id);
  if (cancel) sendCancel(p, id, why.message());
  const double ms = 1e3 * secondsBetween(p.reservedAt, steadyNow());
  PD_LOG(kWarn, kTag) << "request " << id << ": pull " << outcome << " (" << why.message()
                      << "); computing the prompt here";
  count(outcome, 0, "", 0);
  fence(id, p, outcome + ": " + why.message());
  onDone_(id, 0, ms, "", loop_.engine().recomputeRemote(id));
}

void PrefillPulls::end(uint64_t id, const std::string& why) {
  auto it = pulls_.find(id);
  if (it == pulls_.end()) return;
  sendCancel(it->second, id, why);
  count("fell_back", 0, "", 0);
  fence(id, it->second, "ended: " + why);
}

void PrefillPulls::sendCancel(const Pull& p, uint64_t id, const std::string& reason) {
  proto::Envelope env;
  env.set_request_id(id);
  env.mutable_cancel()->set_request_id(id);
  env.mutable_cancel()->set_reason(reason);
  (void)p.decode->send(std::move(env));
}

void PrefillPulls::fence(uint64_t id, Pull& p, const std::string& why) {
  loop_.cancelTimer(p.deadlineTimer);
  bool fenced = true;  // no grant: no writer was told
  if (!p.grant.empty()) {
    Status revoked = loop_.agent().revokeWrite(p.grant);
    fenced = revoked.isOk() && loop_.agent().receiverFenced(p.peer);
    if (!revoked.isOk()) PD_LOG(kWarn, kTag) << "request " << id << ": revoking its pull grant: " << revoked.toString();
  }
  if (!fenced) {
    // One-sided writes may still land: the blocks leave the request, untouched, until the
    // decode worker says its transfers are terminal.
    const engine::SeqId holder = nextHolder_++;
    if (Status s = loop_.engine().quarantineRemote(id, holder); s.isOk()) {
      holds_[holder] = Hold{id, p.decode, p.peer, p.blocks};
      heldBlocks_ += p.blocks;
      loop_.metrics().kvBlocksQuarantined.set(heldBlocks_);
      PD_LOG(kWarn, kTag) << "request " << id << ": holding " << p.blocks << " KV blocks until decode worker "
                          << p.decode->peerHello().worker_id() << " confirms its pull writes stopped (" << why << ")";
    } else {
      PD_LOG(kWarn, kTag) << "request " << id << ": quarantining its pull blocks: " << s.toString();
    }
  }
  pulls_.erase(id);
}

void PrefillPulls::onCancelAck(const net::ConnectionPtr& decode, uint64_t id) {
  std::vector<engine::SeqId> done;
  for (const auto& [holder, h] : holds_)
    if (h.requestId == id && h.decode == decode) done.push_back(holder);
  for (engine::SeqId holder : done) release(holder, "pull cancel acknowledged");
}

void PrefillPulls::release(engine::SeqId holder, const std::string& why) {
  auto it = holds_.find(holder);
  if (it == holds_.end()) return;
  (void)loop_.engine().kv().free(holder);
  heldBlocks_ -= it->second.blocks;
  loop_.metrics().kvBlocksQuarantined.set(heldBlocks_);
  PD_LOG(kDebug, kTag) << "request " << it->second.requestId << ": " << it->second.blocks
                       << " held KV blocks released: " << why;
  holds_.erase(it);
}

void PrefillPulls::dropConnection(const net::ConnectionPtr& decode) {
  // The caller ended the connection's jobs (end()) first; here only what outlives them.
  for (auto& [holder, h] : holds_)
    if (h.decode == decode) h.decode.reset();
  poll();
}

void PrefillPulls::poll() {
  std::vector<engine::SeqId> dead;
  for (const auto& [holder, h] : holds_)
    if (!h.decode && loop_.agent().unfencedLanesDead(h.peer)) dead.push_back(holder);
  for (engine::SeqId holder : dead) release(holder, "the decode worker's lanes are dead");
}

void PrefillPulls::shutdown() {
  for (auto& [id, p] : pulls_) loop_.cancelTimer(p.deadlineTimer);
  pulls_.clear();
  std::vector<engine::SeqId> all;
  for (const auto& [holder, h] : holds_) all.push_back(holder);
  for (engine::SeqId holder : all) release(holder, "shutting down");
}

void PrefillPulls::count(const std::string& outcome, uint64_t bytes, const std::string& transport, double seconds) {
  worker::countPeerPull(loop_.registry(), outcome, bytes, transport, seconds);
}

}  // namespace pd::prefill
