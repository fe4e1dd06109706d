#include "common/net/handshake_slots.h"

#include <algorithm>

namespace pd::net {

uint64_t HandshakeSlots::evictFrom(Slots& slots, bool allowNewest) {
  auto silent = std::find_if(slots.begin(), slots.end(), [](const Slot& s) { return !s.heard; });
  if (silent != slots.end()) {
    uint64_t id = silent->id;
    slots.erase(silent);
    --held_;
    return id;
  }
  if (!allowNewest || slots.empty()) return 0;
  uint64_t id = slots.back().id;
  slots.pop_back();
  --held_;
  return id;
}

HandshakeSlots::Admission HandshakeSlots::admit(uint64_t id, const std::string& address) {
  std::lock_guard<std::mutex> lock(mutex_);
  Admission a;
  Slots& mine = byAddress_[address];
  if (mine.size() >= perAddress_) {
    a.evict = evictFrom(mine, /*allowNewest=*/false);
    if (a.evict == 0) {
      if (mine.empty()) byAddress_.erase(address);
      return a;
    }
  } else if (held_ >= total_) {
    auto top = std::max_element(byAddress_.begin(), byAddress_.end(),
                                [](const auto& x, const auto& y) { return x.second.size() < y.second.size(); });
    if (top == byAddress_.end() || top->second.size() <= mine.size()) {
      if (mine.empty()) byAddress_.erase(address);
      return a;
    }
    a.evict = evictFrom(top->second, /*allowNewest=*/true);
    if (top->second.empty()) byAddress_.erase(top);
  }
  Slots& slots = byAddress_[address];  // the erase above may have moved nothing of ours
  slots.push_back(Slot{id, false});
  ++held_;
  a.admitted = true;
  return a;
}

void HandshakeSlots::heard(uint64_t id, const std::string& address) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = byAddress_.find(address);
  if (it == byAddress_.end()) return;
  for (auto& s : it->second)
    if (s.id == id) s.heard = true;
}

void HandshakeSlots::release(uint64_t id, const std::string& address) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = byAddress_.find(address);
  if (it == byAddress_.end()) return;
  auto& slots = it->second;
  auto s = std::find_if(slots.begin(), slots.end(), [id](const Slot& x) { return x.id == id; });
  if (s == slots.end()) return;
  slots.erase(s);
  --held_;
  if (slots.empty()) byAddress_.erase(it);
}

size_t HandshakeSlots::held() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}

size_t HandshakeSlots::heldBy(const std::string& address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = byAddress_.find(address);
  return it == byAddress_.end() ? 0 : it->second.size();
}

}  // namespace pd::net
