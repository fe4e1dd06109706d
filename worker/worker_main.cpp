#include "worker/worker_main.h"

#include <signal.h>

#include <cstdio>

#include "common/base/cli.h"
#include "common/base/log.h"
#include "common/base/ports_file.h"
#include "common/base/signals.h"

namespace pd::worker {

Status writeServicePorts(const WorkerFlags& flags, const Service& service) {
  if (flags.portsFile.empty()) return Status::ok();
  return writePortsFile(flags.portsFile, {{"metrics", service.metricsPort()}});
}

int runWorkerMain(int argc, char** argv, const char* program, const char* description, const ServiceFactory& create) {
  const sigset_t signals = blockTerminationSignals();

  CLI::App app{description, program};
  cli::configure(app);
  WorkerFlags flags;
  addWorkerFlags(app, flags);
  if (int rc = cli::parse(app, argc, argv); rc >= 0) return rc;
  applyWorkerFlagDefaults(flags);
  auto config = config::loadClusterConfig(flags.configPath);
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, config.status().message().c_str());
    return 2;
  }
  setLogLevel(config->logging.level);
  auto service = create(config.value(), flags);
  Status started = service.ok() ? service.value()->start() : service.status();
  if (started.isOk()) started = writeServicePorts(flags, *service.value());
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
