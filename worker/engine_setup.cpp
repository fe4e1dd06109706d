#include "worker/engine_setup.h"

#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/base/log.h"
#include "common/constraint/constraint.h"
#include "common/metrics/pdserve_metrics.h"
#include "engine/cpu_backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_kv_copier.h"
#include "engine/kv_cache_manager.h"
#include "engine/kv_tiers.h"

namespace pd::worker {

namespace {

// The storage type of the CUDA backend's weights and KV cache: model.dtype, auto -> bf16.
engine::KvDtype cudaDtype(config::DType d) {
  switch (d) {
    case config::DType::kF32:
      return engine::KvDtype::kF32;
    case config::DType::kF16:
      return engine::KvDtype::kF16;
    case config::DType::kAuto:
    case config::DType::kBF16:
      return engine::KvDtype::kBF16;
  }
  return engine::KvDtype::kBF16;
}

// engine.kv_cache_dtype (validated by the config): auto is f32 on cpu and the model's dtype on
// cuda (as before the key existed).
engine::KvDtype kvCacheDtype(const config::ClusterConfig& config) {
  const std::string& d = config.engine.kvCacheDtype;
  if (d == "auto")
    return config.engine.backend == config::Backend::kCuda ? cudaDtype(config.model.dtype) : engine::KvDtype::kF32;
  return pd::enumFromName(engine::kKvDtypeNames, d).value_or(engine::KvDtype::kF32);
}

struct BackendAndKv {
  std::unique_ptr<engine::Backend> backend;
  std::unique_ptr<engine::KvCacheManager> kv;
  std::vector<MemDesc> regions;  // one per tensor-parallel rank
};

// engine.backend: cpu -> the KV cache in host memory the manager maps; cuda -> in device
// memory the backend allocates, which the manager only keeps the books of.
Result<BackendAndKv> makeBackend(const config::ClusterConfig& config, std::shared_ptr<const engine::ModelWeights> model,
                                 const engine::KvLayout& layout) {
  BackendAndKv out;
  if (config.engine.backend == config::Backend::kCpu) {
    PD_ASSIGN_OR_RETURN(out.kv, engine::KvCacheManager::create(layout));
    engine::CpuBackendOptions cpu;
    cpu.numThreads = config.engine.threads;
    cpu.weightFormat = config.engine.weightFormat;
    PD_ASSIGN_OR_RETURN(out.backend, engine::createCpuBackend(std::move(model), layout, out.kv->data(), cpu));
    out.regions = {out.kv->region()};
    return out;
  }
  engine::CudaBackendOptions cuda;
  cuda.weightDtype = cudaDtype(config.model.dtype);
  cuda.tensorParallelSize = config.engine.tensorParallelSize;
  // layout.numBlocks is 0 then: the backend sizes the cache from what the GPU has left after
  // the weights and the scratch of the largest step the scheduler will form.
  cuda.gpuMemoryUtilization = config.engine.gpuMemoryUtilization;
  cuda.reserveTokens = static_cast<int>(config.engine.maxBatchTokens);
  cuda.reserveSeqs = config.engine.maxRunningRequests;
  PD_ASSIGN_OR_RETURN(auto backend, engine::createCudaBackend(std::move(model), layout, cuda));
  // Every rank's region has the same layout and block ids: the books are kept once, over
  // rank 0's region, in the per-rank layout that transfer offsets are computed in.
  out.regions = backend->kvRegions();
  PD_ASSIGN_OR_RETURN(out.kv, engine::KvCacheManager::createOver(backend->rankKvLayout(), out.regions[0]));
  out.backend = std::move(backend);
  return out;
}

// The tier store over the bundle's KV cache: a host region is copied with memcpy; the cuda
// backend's device regions (one per rank) by the CUDA block copier, which copies each
// block's share of every rank down asynchronously (docs/kv_cache.md, "Tiers on cuda").
Result<std::unique_ptr<engine::KvTierStore>> makeTierStore(EngineBundle& bundle, const engine::KvTierOptions& opts) {
  engine::KvCacheManager& kv = bundle.engine->kv();
  if (kv.region().kind != MemKind::kCuda) return engine::KvTierStore::create(kv, opts, bundle.fingerprint);
  PD_ASSIGN_OR_RETURN(auto copier, engine::createCudaKvBlockCopier(kv.layout(), bundle.kvRegions));
  return engine::KvTierStore::create(kv, opts, bundle.fingerprint, std::move(copier));
}

}  // namespace

Result<EngineBundle> buildEngine(const config::ClusterConfig& config, bool releaseKvOnFinish,
                                 std::shared_ptr<const engine::ModelWeights> preloaded) {
  if (config.engine.backend == config::Backend::kCuda) {
    // Before the model is loaded: without a device there is nothing to load it onto.
    Status device = engine::cudaDeviceAvailable();
    if (!device.isOk()) return Status(device.code(), "engine.backend: cuda: " + device.message());
  }
  EngineBundle b;
  const auto loadStart = std::chrono::steady_clock::now();
  const bool reused = preloaded != nullptr;
  // cpu: the f32 host weights the backend computes from; cuda: the config only -- the backend
  // streams the tensors to the device in their dtype (weight_stream.h), no host copy.
  if (preloaded) {
    b.model = std::move(preloaded);
  } else if (config.engine.backend == config::Backend::kCuda) {
    PD_ASSIGN_OR_RETURN(b.model, engine::describeModel(config.model.path));
  } else {
    // engine.weight_format bf16 / q8_0: converted at load, the f32 copies of the linear
    // weights freed (half / about a quarter of their bytes resident).
    PD_ASSIGN_OR_RETURN(b.model, engine::loadModel(config.model.path, config.engine.weightFormat));
  }
  const auto& mc = b.model->config;
  b.modelName =
      config.model.name.empty() ? std::filesystem::path(config.model.path).filename().string() : config.model.name;
  b.maxModelLen = config.model.maxModelLen > 0 ? config.model.maxModelLen : mc.maxPositionEmbeddings;

  const engine::KvDtype kvDtype = kvCacheDtype(config);
  // engine.kv_cache_bytes is the whole cache: a block id holds blockBytes in every layer (and
  // with tensor parallelism every rank's share of the kv heads, so the sum over the ranks).
  engine::KvLayout probe = engine::kvLayoutFor(mc, 1, config.engine.blockSize, kvDtype);
  const int64_t bytesPerBlock = int64_t(probe.totalBytes());
  const bool byUtilization = config.engine.gpuMemoryUtilization > 0;  // cuda only (config checks)
  int64_t numBlocks =
      config.engine.numBlocks > 0 ? config.engine.numBlocks : config.engine.kvCacheBytes / bytesPerBlock;
  if (byUtilization) {
    numBlocks = 0;
  } else if (numBlocks < 1) {
    return invalidArgument("engine.kv_cache_bytes: " + std::to_string(config.engine.kvCacheBytes) +
                           " bytes hold no block of " + std::to_string(bytesPerBlock) + " bytes (" +
                           std::to_string(probe.blockBytes()) + " in each of " + std::to_string(probe.numLayers) +
                           " layers) for this model");
  }
  auto layout = engine::kvLayoutFor(mc, static_cast<int>(numBlocks), config.engine.blockSize, kvDtype);
  PD_ASSIGN_OR_RETURN(auto parts, makeBackend(config, b.model, layout));
  b.loadSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - loadStart).count();
  {
    const auto& kl = parts.backend->kvLayout();  // the blocks chosen (gpu_memory_utilization)
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.2f s", b.loadSeconds);
    PD_LOG(kInfo, "engine") << "model " << config.model.path
                            << (reused ? " (weights kept from the previous role) ready on " : " loaded on ")
                            << config::toString(config.engine.backend) << " in " << secs << "; KV cache "
                            << kl.numBlocks << " blocks of " << kl.blockSize
                            << " tokens = " << int64_t(kl.numBlocks) * kl.blockSize << " tokens of context ("
                            << (kl.totalBytes() >> 20) << " MiB in " << engine::kvDtypeName(kl.dtype)
                            << (byUtilization ? ", by engine.gpu_memory_utilization" : "") << ")";
  }
  engine::EngineOptions opts;
  opts.scheduler.maxBatchTokens = static_cast<int>(config.engine.maxBatchTokens);
  opts.scheduler.maxNumSeqs = config.engine.maxRunningRequests;
  opts.scheduler.enablePrefixCaching = config.engine.enablePrefixCaching;
  opts.releaseKvOnFinish = releaseKvOnFinish;
  // Only steps with decode rows are capped, so this matters where streams decode.
  if (config.engine.sloSizedPrefillChunks) {
    opts.prefillChunks.itlTargetMs = config.pools.decode.slo.itlMs;
    opts.prefillChunks.percentile = config.pools.decode.slo.percentile;
  }
  opts.prefillChunks.minTokens = config.engine.minPrefillChunkTokens;
  PD_RETURN_IF_ERROR(opts.scheduler.validate());
  // Peers must agree on what one region's blocks hold: the per-rank layout and the rank count.
  b.fingerprint = b.modelName + "/" + parts.kv->layout().fingerprint();
  if (parts.regions.size() > 1) b.fingerprint += ".tp" + std::to_string(parts.regions.size());
  // ... and on the weights: two checkpoints of one model have the same name and layout, and a
  // decode worker continuing another's KV would emit wrong tokens without an error.
  b.fingerprint += "/w" + b.model->weightsFingerprint;
  b.kvRegions = std::move(parts.regions);
  b.engine = std::make_unique<engine::Engine>(std::move(parts.backend), std::move(parts.kv), opts);
  // Constrained decoding masks tokens by their bytes: read them once from the model's
  // tokenizer. A model without one serves everything else (constrained requests get an error
  // naming why).
  const std::string tokenizerPath = config.model.path + "/tokenizer.json";
  if (std::filesystem::exists(tokenizerPath)) {
    auto vocab = constraint::TokenVocabulary::fromTokenizerJson(tokenizerPath, mc.vocabSize);
    if (vocab.ok()) {
      b.engine->setConstraintVocabulary(*vocab);
    } else {
      PD_LOG(kWarn, "engine") << "constrained decoding off: " << vocab.status().toString();
    }
  }
  return b;
}

Status attachKvTiers(const config::ClusterConfig& config, const std::string& workerId, EngineBundle& bundle) {
  const auto& t = config.engine.kvTiers;
  if (!t.on()) return Status::ok();
  engine::KvTierOptions opts;
  opts.hostBytes = t.hostBytes;
  opts.diskBytes = t.diskBytes;
  opts.diskWriteQueueBytes = t.diskWriteQueueBytes;
  if (t.diskBytes > 0) {
    std::string id = workerId.empty() ? std::string("worker") : workerId;
    for (char& c : id) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') c = '_';
    }
    opts.diskPath = (std::filesystem::path(t.diskPath) / id).string();
  }
  auto tiers = makeTierStore(bundle, opts);
  if (!tiers.ok()) return tiers.status().withContext("engine.kv_tiers");
  const engine::KvTierStats s = (*tiers)->stats();
  PD_LOG(kInfo, "engine") << "KV tiers: host " << s.hostCapacityBlocks << " blocks (" << (t.hostBytes >> 20) << " MiB)"
                          << (t.diskBytes > 0 ? ", disk " + std::to_string(t.diskBytes >> 20) + " MiB in " +
                                                    (*tiers)->disk()->dir().string() + " holding " +
                                                    std::to_string(s.diskBlocks) + " blocks from before"
                                              : std::string(", no disk tier"));
  bundle.engine->setKvTiers(std::move(*tiers));
  return Status::ok();
}

Result<std::unique_ptr<kvt::TransferAgent>> startTransferAgent(const config::ClusterConfig& config,
                                                               const WorkerFlags& flags,
                                                               const std::vector<MemDesc>& kvRegions,
                                                               metrics::Registry& registry) {
  kvt::AgentOptions opts;
  opts.name = flags.workerId;
  opts.preference.clear();
  for (auto t : config.kvTransfer.transports) opts.preference.emplace_back(config::toString(t));
  opts.transport.listenHost = config.kvTransfer.listenHost;
  // Peers dial the advertised address, never the bind (which may be 0.0.0.0).
  opts.transport.advertiseHost = flags.advertiseHost;
  opts.transport.listenPort = static_cast<uint16_t>(flags.transferPort);
  // KV fencing (docs/reliability.md): a write into this worker's KV must carry the
  // live grant of its request; a region key alone (a forged or stale write) is refused.
  opts.transport.requireWriteGrant = true;
  // The KV TCP port takes writes only from peers that prove the cluster secret; ucx, verbs and
  // cma connection info reaches peers only over the (authenticated) control plane.
  if (config.cluster.authenticated()) {
    opts.transport.clusterSecret = std::make_shared<const std::string>(config.cluster.secret);
  }
  opts.transport.onAuthFailure = [&registry](const std::string&) { metrics::authFailure(registry, "kv_tcp"); };
  opts.transport.onHandshakeFailure = [&registry](const char* why) {
    metrics::handshakeFailure(registry, "kv_tcp", why);
  };
  PD_ASSIGN_OR_RETURN(auto agent, kvt::TransferAgent::create(opts, *registry.native()));
  for (const MemDesc& region : kvRegions) PD_RETURN_IF_ERROR(agent->registerMemory(region).status());
  return agent;
}

proto::Hello workerHello(proto::Role role, const WorkerFlags& flags, const EngineBundle& bundle) {
  proto::Hello hello;
  hello.set_role(role);
  hello.set_worker_id(flags.workerId);
  hello.set_model_fingerprint(bundle.fingerprint);
  hello.set_block_size(static_cast<uint32_t>(bundle.engine->kv().layout().blockSize));
  hello.set_total_blocks(static_cast<uint64_t>(bundle.engine->kv().numTotalBlocks()));
  return hello;
}

kvt::BlockPool kvBlockPool(const engine::KvLayout& layout, const MemDesc& region) {
  return kvt::BlockPool{region.addr,      layout.blockBytes(), layout.numBlocks,
                        layout.numLayers, region.kind,         region.device};
}

}  // namespace pd::worker
