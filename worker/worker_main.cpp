#include "worker/worker_main.h"

#include <signal.h>

#include <cstdio>

#include "common/base/log.h"
#include "common/base/ports_file.h"
#include "common/base/signals.h"

namespace pd::worker {

Status writeServicePorts(const WorkerFlags& flags, const Service& service) {
  if (flags.portsFile.empty()) return Status::ok();
  return writePortsFile(flags.portsFile, {{"metrics", service.metricsPort()}});
}

int runWorkerMain(int argc, char** argv, const char* program, const char* usage, const ServiceFactory& create) {
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
  if (started.isOk()) started = writeServicePorts(flags.value(), *service.value());
  if (!started.isOk()) {
    std::fprintf(stderr, "%s: %s\n", program, started.toString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  // SIGTERM (Kubernetes, pdserve up) drains first; a second signal during the drain is not
  // waited for: the drain has its own deadline, engine.drain_timeout_ms.
  PD_LOG(kInfo, "worker") << program << ": signal " << sig << ", draining (up to " << config->engine.drainTimeoutMs
                          << " ms), then shutting down";
  service.value()->drain(std::chrono::milliseconds(config->engine.drainTimeoutMs));
  service.value()->stop();
  return 0;
}

}  // namespace pd::worker
