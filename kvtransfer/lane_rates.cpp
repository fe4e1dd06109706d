#include "kvtransfer/lane_rates.h"

#include <algorithm>

namespace pd::kvt {

void LaneRates::record(const std::string& transport, size_t bytes, double seconds) {
  if (bytes == 0 || !(seconds > 0)) return;
  auto& window = samples_[transport];
  window.emplace_back(bytes, seconds);
  if (window.size() > kWindow) window.pop_front();
}

std::vector<LaneRates::Figure> LaneRates::figures() const {
  std::vector<Figure> out;
  for (const auto& [transport, window] : samples_) {
    if (window.empty()) continue;
    double best = 0;
    for (const auto& [b, s] : window) best = std::max(best, double(b) / s);
    double quickest = window.front().second;
    for (const auto& [b, s] : window) quickest = std::min(quickest, s);
    out.push_back({transport, best, 1e3 * quickest, window.size()});
  }
  return out;
}

}  // namespace pd::kvt
