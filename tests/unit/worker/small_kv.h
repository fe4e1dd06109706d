// A KV cache manager for worker unit tests: bookkeeping only (no memory), one layer.
#pragma once

#include <memory>

#include <catch2/catch.hpp>

#include "engine/kv_cache_manager.h"

namespace pd::test {

inline std::unique_ptr<engine::KvCacheManager> smallAccountingKv(int numBlocks, int blockSize) {
  engine::KvLayout l;
  l.numLayers = 1;
  l.numBlocks = numBlocks;
  l.blockSize = blockSize;
  l.numKvHeads = 1;
  l.headDim = 4;
  l.dtype = engine::KvDtype::kF32;
  auto kv = engine::KvCacheManager::create(l, engine::KvCacheManager::Backing::kAccountingOnly);
  REQUIRE(kv.ok());
  return std::move(kv).value();
}

}  // namespace pd::test
