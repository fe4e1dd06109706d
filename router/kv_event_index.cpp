#include "router/kv_event_index.h"

#include "router/prefix_index.h"

namespace pd::router {

uint8_t KvEventIndex::tierBit(int tier) {
  // A tier this router does not know counts as held somewhere below the region.
  return tier >= 0 && tier < 8 ? uint8_t(1u << tier) : uint8_t(1u << 7);
}

void KvEventIndex::addWorker(const std::string& worker) {
  // The worker sends a snapshot when it registers: no resync request before maxLag passed.
  WorkerState w;
  w.resyncAskedAt = steadyNow();
  workers_[worker] = std::move(w);
}

void KvEventIndex::applyEvents(WorkerState& w, const proto::KvEventBatch& batch) {
  for (const auto& e : batch.events()) {
    switch (e.kind()) {
      case proto::KvEvent::BLOCK_STORED:
        for (uint64_t h : e.block_hashes()) w.blocks[h] |= tierBit(e.tier());
        break;
      case proto::KvEvent::BLOCK_REMOVED:
        for (uint64_t h : e.block_hashes()) {
          auto b = w.blocks.find(h);
          if (b == w.blocks.end()) continue;
          b->second &= uint8_t(~tierBit(e.tier()));
          if (b->second == 0) w.blocks.erase(b);  // no tier holds it any more
        }
        break;
      case proto::KvEvent::ALL_BLOCKS_CLEARED:
        w.blocks.clear();
        break;
      default:
        break;  // a kind this router does not know: newer workers add only kinds it may skip
    }
  }
}

void KvEventIndex::caughtUp(WorkerState& w) {
  if (w.seq >= w.reportedSeq) w.behindSince.reset();
}

KvEventIndex::Applied KvEventIndex::apply(const std::string& worker, const proto::KvEventBatch& batch) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return Applied::kIgnored;
  WorkerState& w = it->second;
  const bool startsSnapshot =
      batch.snapshot() && batch.events_size() > 0 && batch.events(0).kind() == proto::KvEvent::ALL_BLOCKS_CLEARED;
  if (startsSnapshot) {
    if (w.synced && batch.seq() < w.seq) return Applied::kIgnored;  // an old answer; we are past it
    w.synced = true;
    w.seq = batch.seq();
    w.resyncAskedAt.reset();
  } else if (batch.snapshot()) {
    // A further frame of the snapshot just started (same seq); else a stray one.
    if (!w.synced || batch.seq() != w.seq) return Applied::kIgnored;
  } else {
    if (!w.synced || batch.seq() <= w.seq) return Applied::kIgnored;
    if (batch.seq() != w.seq + 1) {
      w.synced = false;
      w.blocks.clear();
      return Applied::kGap;
    }
    w.seq = batch.seq();
  }
  applyEvents(w, batch);
  caughtUp(w);
  return Applied::kApplied;
}

void KvEventIndex::noteReportedSeq(const std::string& worker, uint64_t seq, SteadyTime now) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  WorkerState& w = it->second;
  w.reportedSeq = std::max(w.reportedSeq, seq);
  if (w.seq >= w.reportedSeq)
    caughtUp(w);
  else if (!w.behindSince)
    w.behindSince = now;
}

bool KvEventIndex::current(const std::string& worker, SteadyTime now) const {
  auto it = workers_.find(worker);
  if (it == workers_.end() || !it->second.synced) return false;
  return !it->second.behindSince || now - *it->second.behindSince < maxLag_;
}

bool KvEventIndex::takeResyncDue(const std::string& worker, SteadyTime now) {
  auto it = workers_.find(worker);
  if (it == workers_.end() || current(worker, now)) return false;
  WorkerState& w = it->second;
  if (w.resyncAskedAt && now - *w.resyncAskedAt < maxLag_) return false;
  w.resyncAskedAt = now;
  return true;
}

int64_t KvEventIndex::cachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : leadingCachedTokens(it->second.blocks, hashes, blockSize_);
}

int64_t KvEventIndex::regionCachedTokens(const std::string& worker, std::span<const uint64_t> hashes) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  size_t n = 0;
  while (n < hashes.size()) {
    auto b = it->second.blocks.find(hashes[n]);
    if (b == it->second.blocks.end() || !(b->second & tierBit(proto::KvEvent::TIER_REGION))) break;
    ++n;
  }
  return int64_t(n) * blockSize_;
}

int64_t KvEventIndex::diskOnlyTokens(const std::string& worker, std::span<const uint64_t> hashes) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  const uint8_t fast = tierBit(proto::KvEvent::TIER_REGION) | tierBit(proto::KvEvent::TIER_HOST);
  int64_t n = 0;
  for (uint64_t h : hashes) {
    auto b = it->second.blocks.find(h);
    if (b == it->second.blocks.end()) break;  // the run ends
    if (!(b->second & fast)) ++n;
  }
  return n * blockSize_;
}

size_t KvEventIndex::tierBlocks(const std::string& worker, int tier) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  size_t n = 0;
  for (const auto& [h, mask] : it->second.blocks) n += (mask & tierBit(tier)) ? 1 : 0;
  return n;
}

size_t KvEventIndex::blocks(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.blocks.size();
}

uint64_t KvEventIndex::appliedSeq(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.seq;
}

}  // namespace pd::router
