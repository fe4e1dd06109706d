// One name table per enum, next to the enum's definition: its name function reads the table,
// and parsing a name back (config files, flags) reads the same table, so the two never drift.
//
//   enum class MemKind { kHost, kPinned, kCuda };
//   inline constexpr EnumNames<MemKind, 3> kMemKindNames{
//       {{MemKind::kHost, "host"}, {MemKind::kPinned, "pinned"}, {MemKind::kCuda, "cuda"}}};
//   inline const char* memKindName(MemKind k) { return enumName(kMemKindNames, k); }
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace pd {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

template <typename E, size_t N>
using EnumNames = std::array<EnumName<E>, N>;

// The name of `value`, or `unknown` for a value the table lacks (a cast integer).
template <typename E, size_t N>
constexpr const char* enumName(const EnumNames<E, N>& names, E value, const char* unknown = "?") {
  for (const EnumName<E>& n : names) {
    if (n.value == value) return n.name;
  }
  return unknown;
}

// The value named `name` (exact match), or nullopt.
template <typename E, size_t N>
constexpr std::optional<E> enumFromName(const EnumNames<E, N>& names, std::string_view name) {
  for (const EnumName<E>& n : names) {
    if (name == n.name) return n.value;
  }
  return std::nullopt;
}

// "a, b, c": the names in table order, for error messages.
template <typename E, size_t N>
std::string enumNameList(const EnumNames<E, N>& names, std::string_view separator = ", ") {
  std::string out;
  for (const EnumName<E>& n : names) {
    if (!out.empty()) out += separator;
    out += n.name;
  }
  return out;
}

}  // namespace pd
