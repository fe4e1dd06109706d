// Memory descriptors (docs/design.md §3): what kvtransfer moves and what backends allocate.
// A MemDesc names a byte range; it does not own it. DescList is an ordered list of them,
// the unit of registration and of one transfer's segments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/base/enum_names.h"

namespace pd {

enum class MemKind : uint8_t {
  kHost = 0,    // ordinary pageable host memory
  kPinned = 1,  // page-locked host memory (cudaHostAlloc / registered)
  kCuda = 2,    // device memory; `device` is the CUDA ordinal
};

inline constexpr EnumNames<MemKind, 3> kMemKindNames{
    {{MemKind::kHost, "host"}, {MemKind::kPinned, "pinned"}, {MemKind::kCuda, "cuda"}}};
inline const char* memKindName(MemKind kind) { return enumName(kMemKindNames, kind, "unknown"); }

struct MemDesc {
  uintptr_t addr = 0;
  size_t len = 0;
  int device = 0;  // CUDA ordinal for kCuda, 0 otherwise
  MemKind kind = MemKind::kHost;

  void* ptr() const { return reinterpret_cast<void*>(addr); }
  uintptr_t end() const { return addr + len; }
  // True when [other.addr, other.end()) lies inside this range on the same device.
  bool contains(const MemDesc& other) const {
    return kind == other.kind && device == other.device && other.addr >= addr && other.end() <= end() &&
           other.end() >= other.addr;
  }
};

using DescList = std::vector<MemDesc>;

size_t totalBytes(const DescList& list);
std::string toString(const MemDesc& d);

}  // namespace pd
