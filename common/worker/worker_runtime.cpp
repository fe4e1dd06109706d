#include "common/worker/worker_runtime.h"

#include <signal.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "common/base/log.h"
#include "common/base/signals.h"
#include "common/engine/cpu_backend.h"
#include "common/engine/cuda_backend.h"
#include "common/engine/kv_cache_manager.h"

namespace pd::worker {

// ---- LoopInbox -------------------------------------------------------------------------------

void LoopInbox::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

size_t LoopInbox::runPending(std::chrono::milliseconds timeout) {
  std::deque<std::function<void()>> batch;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (queue_.empty() && timeout.count() > 0) {
      cv_.wait_for(lock, timeout, [&] { return !queue_.empty(); });
    }
    batch.swap(queue_);
  }
  for (auto& fn : batch) fn();
  return batch.size();
}

// ---- Flags -----------------------------------------------------------------------------------

namespace {

Result<int> parsePort(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < 0 || v > 65535) {
    return invalidArgument(flag + ": '" + value + "' is not a port number (0..65535)");
  }
  return static_cast<int>(v);
}

}  // namespace

Result<WorkerFlags> parseWorkerFlags(int argc, char** argv, const char* usage) {
  WorkerFlags f;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage, stdout);
      return cancelled("help");
    }
    if (i + 1 >= argc) return invalidArgument(arg + ": missing value (see --help)");
    std::string value = argv[++i];
    if (arg == "--config") {
      f.configPath = value;
    } else if (arg == "--router") {
      auto colon = value.rfind(':');
      if (colon == std::string::npos) return invalidArgument("--router: expected HOST:PORT, got '" + value + "'");
      f.routerHost = value.substr(0, colon);
      PD_ASSIGN_OR_RETURN(f.routerPort, parsePort("--router", value.substr(colon + 1)));
    } else if (arg == "--id") {
      f.workerId = value;
    } else if (arg == "--advertise-host") {
      f.advertiseHost = value;
    } else if (arg == "--port") {
      PD_ASSIGN_OR_RETURN(f.port, parsePort(arg, value));
    } else if (arg == "--transfer-port") {
      PD_ASSIGN_OR_RETURN(f.transferPort, parsePort(arg, value));
    } else if (arg == "--metrics-port") {
      PD_ASSIGN_OR_RETURN(f.metricsPort, parsePort(arg, value));
    } else if (arg == "--model") {
      f.modelPath = value;
    } else {
      return invalidArgument("unknown flag '" + arg + "' (see --help)");
    }
  }
  if (f.workerId.empty()) return invalidArgument("--id: required (a unique worker name)");
  if (f.transferPort == 0 && f.port != 0) f.transferPort = f.port + 1;
  return f;
}

// ---- Engine ----------------------------------------------------------------------------------

namespace {

// The storage type of the CUDA backend's weights and KV cache: model.dtype, auto -> bf16.
engine::KvDtype cudaDtype(config::DType d) {
  switch (d) {
    case config::DType::kF32: return engine::KvDtype::kF32;
    case config::DType::kF16: return engine::KvDtype::kF16;
    case config::DType::kAuto:
    case config::DType::kBF16: return engine::KvDtype::kBF16;
  }
  return engine::KvDtype::kBF16;
}

struct BackendAndKv {
  std::unique_ptr<engine::Backend> backend;
  std::unique_ptr<engine::KvCacheManager> kv;
  std::vector<MemDesc> regions;  // one per tensor-parallel rank
};

// engine.backend: cpu -> the KV cache in host memory the manager maps; cuda -> in device
// memory the backend allocates, which the manager only keeps the books of.
Result<BackendAndKv> makeBackend(const config::ClusterConfig& config,
                                 std::shared_ptr<const engine::ModelWeights> model,
                                 const engine::KvLayout& layout) {
  BackendAndKv out;
  if (config.engine.backend == config::Backend::kCpu) {
    PD_ASSIGN_OR_RETURN(out.kv, engine::KvCacheManager::create(layout));
    engine::CpuBackendOptions cpu;
    cpu.numThreads = config.engine.threads;
    PD_ASSIGN_OR_RETURN(out.backend, engine::createCpuBackend(std::move(model), layout, out.kv->data(), cpu));
    out.regions = {out.kv->region()};
    return out;
  }
  engine::CudaBackendOptions cuda;
  cuda.weightDtype = layout.dtype;
  cuda.tensorParallelSize = config.engine.tensorParallelSize;
  PD_ASSIGN_OR_RETURN(auto backend, engine::createCudaBackend(std::move(model), layout, cuda));
  // Every rank's region has the same layout and block ids: the books are kept once, over
  // rank 0's region, in the per-rank layout that transfer offsets are computed in.
  out.regions = backend->kvRegions();
  PD_ASSIGN_OR_RETURN(out.kv, engine::KvCacheManager::createOver(backend->rankKvLayout(), out.regions[0]));
  out.backend = std::move(backend);
  return out;
}

}  // namespace

Result<EngineBundle> buildEngine(const config::ClusterConfig& config, bool releaseKvOnFinish) {
  if (config.engine.backend == config::Backend::kCuda) {
    // Before the model is loaded: without a device there is nothing to load it onto.
    Status device = engine::cudaDeviceAvailable();
    if (!device.isOk()) return Status(device.code(), "engine.backend: cuda: " + device.message());
  }
  EngineBundle b;
  PD_ASSIGN_OR_RETURN(b.model, engine::loadModel(config.model.path));
  const auto& mc = b.model->config;
  b.modelName = config.model.name.empty()
                    ? std::filesystem::path(config.model.path).filename().string()
                    : config.model.name;
  b.maxModelLen = config.model.maxModelLen > 0 ? config.model.maxModelLen : mc.maxPositionEmbeddings;

  const engine::KvDtype kvDtype = config.engine.backend == config::Backend::kCuda
                              ? cudaDtype(config.model.dtype)
                              : engine::KvDtype::kF32;
  engine::KvLayout probe = engine::kvLayoutFor(mc, 1, config.engine.blockSize, kvDtype);
  int64_t numBlocks = config.engine.numBlocks > 0
                          ? config.engine.numBlocks
                          : config.engine.kvCacheBytes / int64_t(probe.blockBytes());
  if (numBlocks < 1) {
    return invalidArgument("engine.kv_cache_bytes: " + std::to_string(config.engine.kvCacheBytes) +
                           " bytes hold no block of " + std::to_string(probe.blockBytes()) +
                           " bytes for this model");
  }
  auto layout = engine::kvLayoutFor(mc, static_cast<int>(numBlocks), config.engine.blockSize, kvDtype);
  PD_ASSIGN_OR_RETURN(auto parts, makeBackend(config, b.model, layout));
  engine::EngineOptions opts;
  opts.scheduler.maxBatchTokens = static_cast<int>(config.engine.maxBatchTokens);
  opts.scheduler.maxNumSeqs = config.engine.maxRunningRequests;
  opts.scheduler.enablePrefixCaching = config.engine.enablePrefixCaching;
  opts.releaseKvOnFinish = releaseKvOnFinish;
  PD_RETURN_IF_ERROR(opts.scheduler.validate());
  // Peers must agree on what one region's blocks hold: the per-rank layout and the rank count.
  b.fingerprint = b.modelName + "/" + parts.kv->layout().fingerprint();
  if (parts.regions.size() > 1) b.fingerprint += ".tp" + std::to_string(parts.regions.size());
  b.kvRegions = std::move(parts.regions);
  b.engine = std::make_unique<engine::Engine>(std::move(parts.backend), std::move(parts.kv), opts);
  return b;
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
  opts.transport.listenPort = static_cast<uint16_t>(flags.transferPort);
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

void publishLoad(proto::Role role, const std::string& workerId, const engine::EngineLoad& load,
                 uint32_t inflightTransfers, metrics::WorkerMetrics& metrics, RouterLink& router) {
  metrics.running.set(load.running);
  metrics.waiting.set(load.waiting);
  metrics.queuedPrefillTokens.set(double(load.queuedPrefillTokens));
  metrics.kvFreeBlocks.set(load.freeBlocks);
  metrics.kvCacheUsage.set(load.totalBlocks ? 1.0 - double(load.freeBlocks) / load.totalBlocks : 0);
  metrics.transfersInFlight.set(inflightTransfers);
  metrics.syncEngineCounters(load.preemptions, load.prefixQueryTokens, load.prefixHitTokens);
  if (!router.isUp()) return;
  proto::Envelope env;
  auto* r = env.mutable_load_report();
  r->set_role(role);
  r->set_worker_id(workerId);
  r->set_queued_prefill_tokens(static_cast<uint64_t>(load.queuedPrefillTokens));
  r->set_running(static_cast<uint32_t>(load.running + load.remote));
  r->set_waiting(static_cast<uint32_t>(load.waiting));
  r->set_free_blocks(static_cast<uint64_t>(load.freeBlocks));
  r->set_total_blocks(static_cast<uint64_t>(load.totalBlocks));
  r->set_inflight_transfers(inflightTransfers);
  r->set_sent_at_unix_us(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                   std::chrono::system_clock::now().time_since_epoch())
                                                   .count()));
  (void)router.send(std::move(env));
}

// ---- Conversions -----------------------------------------------------------------------------

engine::SamplingParams fromProto(const proto::SamplingParams& p) {
  engine::SamplingParams s;
  s.temperature = p.temperature();
  s.topK = p.top_k();
  s.topP = p.top_p() <= 0.0f ? 1.0f : p.top_p();
  s.minP = p.min_p();
  if (p.has_seed()) s.seed = p.seed();
  s.logprobs = static_cast<int>(p.logprobs());
  s.stopTokenIds.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.maxTokens = static_cast<int>(p.max_tokens());
  s.ignoreEos = p.ignore_eos();
  return s;
}

proto::SamplingParams toProto(const engine::SamplingParams& s) {
  proto::SamplingParams p;
  p.set_temperature(s.temperature);
  p.set_top_k(s.topK);
  p.set_top_p(s.topP);
  p.set_min_p(s.minP);
  if (s.seed) p.set_seed(*s.seed);
  p.set_logprobs(static_cast<uint32_t>(s.logprobs));
  for (int32_t id : s.stopTokenIds) p.add_stop_token_ids(static_cast<uint32_t>(id));
  p.set_max_tokens(static_cast<uint32_t>(s.maxTokens));
  p.set_ignore_eos(s.ignoreEos);
  return p;
}

proto::TokenLogprob toProto(const engine::SampledToken& t) {
  proto::TokenLogprob lp;
  lp.set_token_id(static_cast<uint32_t>(t.id));
  lp.set_logprob(t.logprob);
  for (const auto& [id, logprob] : t.topLogprobs) {
    auto* top = lp.add_top();
    top->set_token_id(static_cast<uint32_t>(id));
    top->set_logprob(logprob);
  }
  return lp;
}

engine::SampledToken fromProto(uint32_t tokenId, const proto::TokenLogprob& lp) {
  engine::SampledToken t;
  t.id = static_cast<int32_t>(tokenId);
  t.logprob = lp.logprob();
  for (const auto& top : lp.top()) t.topLogprobs.emplace_back(int32_t(top.token_id()), top.logprob());
  return t;
}

// ---- RouterLink ------------------------------------------------------------------------------

RouterLink::RouterLink(net::IoPool& io, LoopInbox& inbox, std::string host, int port,
                       proto::Hello hello, Handlers handlers)
    : io_(io), inbox_(inbox), host_(std::move(host)), port_(port), hello_(std::move(hello)),
      handlers_(std::move(handlers)) {}

RouterLink::~RouterLink() { stop(); }

void RouterLink::start() { thread_ = std::thread([this] { connectLoop(); }); }

void RouterLink::stop() {
  stopping_ = true;
  cv_.notify_all();
  net::ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = conn_;
  }
  if (conn) conn->close(cancelled("worker shutting down"));
  if (thread_.joinable()) thread_.join();
}

Status RouterLink::send(proto::Envelope env) {
  net::ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = conn_;
  }
  if (!conn) return unavailable("router " + host_ + ":" + std::to_string(port_) + ": not connected");
  return conn->send(std::move(env));
}

// Dials until connected, waits while the connection lives, and dials again after a drop.
void RouterLink::connectLoop() {
  while (!stopping_) {
    net::ConnectionOptions opts;
    opts.hello = hello_;
    net::ConnectionCallbacks cb;
    cb.onMessage = [this](const net::ConnectionPtr&, proto::Envelope&& env) {
      auto shared = std::make_shared<proto::Envelope>(std::move(env));
      inbox_.post([this, shared] { handlers_.onMessage(std::move(*shared)); });
    };
    cb.onClose = [this](const net::ConnectionPtr&, const Status& why) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        conn_.reset();
      }
      up_ = false;
      cv_.notify_all();
      inbox_.post([this, why] { handlers_.onState(false, why); });
    };
    net::RetryPolicy retry;
    retry.totalTimeout = std::chrono::seconds(5);
    auto conn = net::FramedClient::connectWithRetry(io_, host_, port_, opts, cb, retry);
    if (!conn.ok()) {
      PD_LOG(kWarn, "worker") << "router " << host_ << ":" << port_ << ": "
                              << conn.status().toString() << "; retrying";
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_.load(); });
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn_ = conn.value();
    }
    up_ = true;
    PD_LOG(kInfo, "worker") << "registered with router " << host_ << ":" << port_;
    inbox_.post([this] { handlers_.onState(true, Status::ok()); });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return stopping_.load() || !conn_; });
  }
}

// ---- StatusEndpoint --------------------------------------------------------------------------

StatusEndpoint::StatusEndpoint(net::IoPool& io, metrics::Registry& registry,
                               std::function<bool()> healthy)
    : io_(io), registry_(registry), healthy_(std::move(healthy)) {}

Status StatusEndpoint::start(const std::string& host, int port) {
  net::HttpServerOptions opts;
  opts.host = host;
  opts.port = static_cast<uint16_t>(port);
  server_ = std::make_unique<net::HttpServer>(
      io_.context(), opts, [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
        if (req.path() == "/health") {
          bool ok = healthy_();
          r->sendFull(ok ? 200 : 503, {{"content-type", "text/plain"}}, ok ? "ok\n" : "not ready\n");
        } else if (req.path() == "/metrics") {
          r->sendFull(200, {{"content-type", "text/plain; version=0.0.4"}}, registry_.serialize());
        } else {
          r->sendFull(404, {{"content-type", "text/plain"}}, "not found\n");
        }
      });
  return server_->start();
}

int StatusEndpoint::port() const { return server_ ? server_->port() : 0; }

// ---- WorkerParts ----------------------------------------------------------------------------

WorkerParts::WorkerParts(config::ClusterConfig config, WorkerFlags flags, EngineBundle bundle,
                         const std::string& role)
    : config_(std::move(config)),
      flags_(std::move(flags)),
      bundle_(std::move(bundle)),
      engine_(*bundle_.engine),
      io_(2, role + "-io"),
      registry_(metrics::Labels{{"role", role}, {"worker", flags_.workerId}}),
      metrics_(registry_),
      status_(io_, registry_, [this] { return ready_.load(); }) {}

// ---- main ------------------------------------------------------------------------------------

int runWorkerMain(int argc, char** argv, const char* program, const char* usage,
                  const ServiceFactory& create) {
  const sigset_t signals = blockTerminationSignals();

  auto flags = parseWorkerFlags(argc - 1, argv + 1, usage);
  if (!flags.ok()) {
    if (flags.status().code() == StatusCode::kCancelled) return 0;
    std::fprintf(stderr, "%s: %s\n", program, flags.status().message().c_str());
    return 2;
  }
  auto config = config::loadClusterConfig(flags->configPath);
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, config.status().message().c_str());
    return 2;
  }
  setLogLevel(config->logging.level);
  auto service = create(config.value(), flags.value());
  Status started = service.ok() ? service.value()->start() : service.status();
  if (!started.isOk()) {
    std::fprintf(stderr, "%s: %s\n", program, started.toString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  PD_LOG(kInfo, "worker") << program << ": signal " << sig << ", shutting down";
  service.value()->stop();
  return 0;
}

}  // namespace pd::worker
