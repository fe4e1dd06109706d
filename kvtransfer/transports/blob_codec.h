// How the fabric transports (ucx, verbs) read their connection and key blobs, which are
// kvt.proto messages whose field 1 is a `fixed32 magic` naming the kind of blob and whose
// field 2 is the format version. Protobuf writes fields in number order, so every such blob
// starts with the same five bytes: that tells "another kind of blob" (kInvalidArgument, bad
// magic) from "our blob, damaged or cut short" (kDataLoss) before protobuf parses anything.
// Header-only; no state, any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/base/status.h"

namespace pd::kvt {

// Parses `blob` as M and checks magic and version. `what` starts every message ("ucx: remote
// key blob"), `kind` says what a blob with the wrong magic is not ("a UCX key").
template <typename M>
Result<M> parseMagicBlob(const std::string& blob, uint32_t magic, uint32_t version, std::string_view what,
                         std::string_view kind) {
  const std::string size = std::to_string(blob.size()) + " bytes";
  // Tag of field 1 as fixed32 (1 << 3 | 5), then the magic little-endian.
  const char head[5] = {0x0d, char(magic & 0xff), char((magic >> 8) & 0xff), char((magic >> 16) & 0xff),
                        char(magic >> 24)};
  if (blob.size() < sizeof head || blob.compare(0, sizeof head, head, sizeof head) != 0)
    return invalidArgument(std::string(what) + " is not " + std::string(kind) + " (bad magic; " + size + ")");
  M m;
  if (!m.ParseFromString(blob))
    return dataLoss(std::string(what) + " is truncated or corrupt (not a well-formed protobuf message; " + size + ")");
  if (!m.has_version()) return dataLoss(std::string(what) + " ends after its magic (truncated; " + size + ")");
  if (m.version() != version)
    return invalidArgument(std::string(what) + " has version " + std::to_string(m.version()) +
                           ", this build reads version " + std::to_string(version));
  return m;
}

}  // namespace pd::kvt
