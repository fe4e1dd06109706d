// What a worker builds at start from the cluster config: the engine (model, backend, KV
// cache), the transfer agent with the KV cache registered, and the Hello it introduces itself
// with. Also the one mapping from the engine's KV layout to kvtransfer's model-free block
// pools (kvtransfer/block_segments.h).
//
// Called from the starting thread, before any loop runs. Errors name the model path, the
// backend, the key or the KV size.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "common/config/cluster_config.h"
#include "common/metrics/metrics.h"
#include "common/proto/pdserve.pb.h"
#include "engine/engine.h"
#include "engine/model_weights.h"
#include "kvtransfer/agent.h"
#include "kvtransfer/block_segments.h"
#include "worker/flags.h"

namespace pd::worker {

struct EngineBundle {
  std::shared_ptr<const engine::ModelWeights> model;
  std::unique_ptr<engine::Engine> engine;
  // The KV cache as the transfer agent registers it: one region per tensor-parallel rank, in
  // rank order, each laid out as engine->kv().layout() (a rank's share of the kv heads).
  std::vector<MemDesc> kvRegions;
  std::string modelName;  // served model id
  // "<model name>/<KV layout>[.tpN]/w<weights fingerprint>" (Checkpoint::weightsFingerprint):
  // peers must agree on all of it (the router splits it from the right to say what differs).
  std::string fingerprint;
  int64_t maxModelLen = 0;
  // Seconds from opening the model to the backend ready (cpu: f32 host weights read; cuda:
  // weights streamed to the device, KV cache allocated): pdserve_model_load_seconds.
  double loadSeconds = 0;
};

// Loads the model and builds the engine as the config says. releaseKvOnFinish as for
// EngineOptions. `preloaded`, when set, is the model an earlier engine of this process
// computed from (EngineBundle::model, made by buildEngine with the same config.model.path and
// engine.backend): a role switch (flex_worker/) builds its new engine on it instead of
// reading the files again. cpu: the f32 host weights are shared, not re-read; cuda: it is
// only the description, and the backend streams the tensors to the device again (the old
// engine, its device weights and KV cache are gone by then). The KV cache is always new.
Result<EngineBundle> buildEngine(const config::ClusterConfig& config, bool releaseKvOnFinish,
                                 std::shared_ptr<const engine::ModelWeights> preloaded = nullptr);

// The KV tiers engine.kv_tiers asks for (engine/kv_tiers.h, docs/kv_cache.md), attached to
// the bundle's engine; nothing when both are off. The disk tier's files live under
// <disk_path>/<worker id>/: a worker restarted under the same id finds its blocks again, and
// two workers on one host never share a directory. Errors name the key and the directory.
Status attachKvTiers(const config::ClusterConfig& config, const std::string& workerId, EngineBundle& bundle);

// The transfer agent a worker runs: the config's transports in preference order, listening
// on --transfer-port, with every KV region (one per rank) registered in all of them.
Result<std::unique_ptr<kvt::TransferAgent>> startTransferAgent(const config::ClusterConfig& config,
                                                               const WorkerFlags& flags,
                                                               const std::vector<MemDesc>& kvRegions,
                                                               metrics::Registry& registry);

// What a worker says in its first frame to the router and to peers.
proto::Hello workerHello(proto::Role role, const WorkerFlags& flags, const EngineBundle& bundle);

// A KV region (one rank's) laid out as `layout`, as kvtransfer sees it: numBlocks may be a
// peer's pool size (its layer stride), everything else is ours.
kvt::BlockPool kvBlockPool(const engine::KvLayout& layout, const MemDesc& region);

}  // namespace pd::worker
