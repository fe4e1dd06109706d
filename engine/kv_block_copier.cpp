#include "engine/kv_block_copier.h"

namespace pd::engine {

Status HostKvBlockCopier::copyOut(BlockId b, uint8_t* dst) {
  kv_.copyBlockOut(b, dst);
  return Status::ok();
}

Status HostKvBlockCopier::copyIn(const uint8_t* src, BlockId b) {
  kv_.copyBlockIn(src, b);
  return Status::ok();
}

Result<int> HostKvBlockCopier::startCopyOut(BlockId) {
  return unimplemented("kv block copier: a host region is copied synchronously (no staging slots)");
}

}  // namespace pd::engine
