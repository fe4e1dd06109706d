#include "common/base/mem_desc.h"

#include <sstream>

namespace pd {

size_t totalBytes(const DescList& list) {
  size_t n = 0;
  for (const auto& d : list) n += d.len;
  return n;
}

std::string toString(const MemDesc& d) {
  std::ostringstream s;
  s << memKindName(d.kind) << (d.kind == MemKind::kCuda ? ":" + std::to_string(d.device) : "") << "[0x" << std::hex
    << d.addr << std::dec << ", +" << d.len << ")";
  return s.str();
}

}  // namespace pd
