#include "kvtransfer/segment_matcher.h"

#include <algorithm>

namespace pd::kvt {

void SegmentMatcher::addRegion(MemHandle handle, const MemDesc& desc) { regions_.emplace_back(handle, desc); }

void SegmentMatcher::removeRegion(MemHandle handle) {
  regions_.erase(std::remove_if(regions_.begin(), regions_.end(), [&](const auto& r) { return r.first == handle; }),
                 regions_.end());
}

Result<std::vector<SegmentMatch>> SegmentMatcher::match(const DescList& local, const DescList& remote,
                                                        const std::vector<KeyRange>& keys,
                                                        std::string_view peerName) const {
  if (local.size() != remote.size()) {
    return invalidArgument(transport_ + ": " + std::to_string(local.size()) + " local segments but " +
                           std::to_string(remote.size()) + " remote segments");
  }
  std::vector<SegmentMatch> out;
  out.reserve(local.size());
  // KV transfers name many neighbouring blocks of one pool: try the last hit first.
  const std::pair<MemHandle, MemDesc>* lastRegion = nullptr;
  size_t lastKey = keys.size();
  for (size_t i = 0; i < local.size(); ++i) {
    const MemDesc& l = local[i];
    const MemDesc& r = remote[i];
    if (l.len != r.len) {
      return invalidArgument(transport_ + ": segment " + std::to_string(i) + ": local length " + std::to_string(l.len) +
                             " != remote length " + std::to_string(r.len));
    }
    if (l.len == 0) continue;
    if (!lastRegion || !lastRegion->second.contains(l)) {
      lastRegion = nullptr;
      const MemDesc* sameRange = nullptr;  // a registration with these addresses but another kind / device
      for (const auto& reg : regions_) {
        if (reg.second.contains(l)) {
          lastRegion = &reg;
          break;
        }
        if (!sameRange && KeyRange{reg.second.addr, reg.second.len}.covers(l.addr, l.len)) sameRange = &reg.second;
      }
      if (!lastRegion) {
        std::string why = sameRange ? " is not inside memory registered with this transport (registration " +
                                          toString(*sameRange) + " holds its addresses but is other memory)"
                                    : " is not inside memory registered with this transport";
        return invalidArgument(transport_ + ": segment " + std::to_string(i) + ": local " + toString(l) + why);
      }
    }
    if (lastKey >= keys.size() || !keys[lastKey].covers(r.addr, r.len)) {
      lastKey = keys.size();
      for (size_t k = 0; k < keys.size(); ++k) {
        if (keys[k].covers(r.addr, r.len)) {
          lastKey = k;
          break;
        }
      }
      if (lastKey == keys.size()) {
        return invalidArgument(transport_ + ": segment " + std::to_string(i) + ": remote " + toString(r) +
                               " is not inside any region peer '" + std::string(peerName) + "' exposed (" +
                               std::to_string(keys.size()) + " key(s) loaded for it)");
      }
    }
    out.push_back(SegmentMatch{i, lastRegion->first, lastKey});
  }
  return out;
}

}  // namespace pd::kvt
