#include "decode_worker/kv_quarantine.h"

#include <vector>

#include "common/base/log.h"

namespace pd::decode {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "decode";
}  // namespace

void KvQuarantine::hold(uint64_t id, const std::string& address, kvt::AgentPeer kvPeer, int blocks,
                        const std::string& why) {
  const engine::SeqId holder = nextHolder_++;
  if (Status s = loop_.engine().quarantineRemote(id, holder); !s.isOk()) {
    // Not expected (the request holds its reservation until here); the blocks stay with the
    // request and are freed with it: say so loudly, it is the unfenced case.
    PD_LOG(kError, kTag) << "request " << id << ": cannot quarantine its KV blocks (" << s.toString()
                         << "); freeing them although prefill worker " << address << " may still write them";
    return;
  }
  Hold h;
  h.requestId = id;
  h.address = address;
  h.kvPeer = kvPeer;
  h.blocks = blocks;
  h.since = steadyNow();
  blocks_ += blocks;
  loop_.metrics().kvBlocksQuarantined.set(blocks_);
  PD_LOG(kInfo, kTag) << "request " << id << " (" << why << "): " << blocks
                      << " KV block(s) quarantined until prefill worker " << address
                      << " acknowledges the cancel or is gone (its KV lane is one-sided)";
  holds_.emplace(holder, std::move(h));
}

void KvQuarantine::release(engine::SeqId holder, const std::string& why) {
  auto it = holds_.find(holder);
  if (it == holds_.end()) return;
  const double held = secondsBetween(it->second.since, steadyNow());
  PD_LOG(kInfo, kTag) << "request " << it->second.requestId << ": " << it->second.blocks
                      << " quarantined KV block(s) released after " << int64_t(held * 1e3) << " ms: " << why;
  (void)loop_.engine().kv().free(holder);
  blocks_ -= it->second.blocks;
  loop_.metrics().kvBlocksQuarantined.set(blocks_);
  loop_.metrics().kvQuarantineSeconds.observe(held);
  holds_.erase(it);
}

void KvQuarantine::onCancelAck(const std::string& address, uint64_t id) {
  std::vector<engine::SeqId> acked;
  for (const auto& [holder, h] : holds_) {
    if (h.requestId == id && h.address == address) acked.push_back(holder);
  }
  for (engine::SeqId holder : acked) {
    release(holder, "prefill worker " + address + " acknowledged the cancel");
  }
}

void KvQuarantine::sendCancel(const Hold& h) {
  proto::Envelope cancel;
  cancel.set_request_id(h.requestId);
  cancel.mutable_cancel()->set_request_id(h.requestId);
  cancel.mutable_cancel()->set_reason("KV fencing: acknowledge that nothing of this request is in flight");
  (void)links_.send(h.address, std::move(cancel));
}

void KvQuarantine::onLinkReady(const std::string& address) {
  for (const auto& [holder, h] : holds_) {
    if (h.address == address) sendCancel(h);
  }
}

void KvQuarantine::poll() {
  if (holds_.empty()) return;
  const auto now = steadyNow();
  const auto lease = milliseconds(loop_.config().kvTransfer.timeoutMs);
  std::vector<std::pair<engine::SeqId, std::string>> gone;
  for (auto& [holder, h] : holds_) {
    const bool linked = links_.connected(h.address);
    if (!linked && loop_.agent().unfencedLanesDead(h.kvPeer)) {
      gone.emplace_back(holder, "prefill worker " + h.address + " is gone (control connection closed, KV lane dead)");
      continue;
    }
    // Its link closed (a lease that ran out, a reset) but the writer may live: only a new
    // link can carry the Cancel and its acknowledgement, so dial it again rather than hold
    // the blocks until a request goes there.
    if (!linked) links_.redial(h.address);
    if (!h.leaseLogged && now - h.since > lease) {
      h.leaseLogged = true;
      PD_LOG(kWarn, kTag) << "request " << h.requestId << ": " << h.blocks << " KV block(s) still quarantined "
                          << lease.count() << " ms after its remote prefill ended: prefill worker " << h.address
                          << " has neither acknowledged the cancel nor gone away; holding them"
                             " (a one-sided writer may still write them)";
    }
  }
  for (auto& [holder, why] : gone) release(holder, why);
}

void KvQuarantine::releaseAll(const std::string& why) {
  std::vector<engine::SeqId> holders;
  for (const auto& [holder, h] : holds_) holders.push_back(holder);
  for (engine::SeqId holder : holders) release(holder, why);
}

}  // namespace pd::decode
