// pdserve-router: the OpenAI-compatible router (see router_service.h, docs/deploy.md).
#include <signal.h>

#include <cstdio>
#include <string>

#include "common/base/cli.h"
#include "common/base/log.h"
#include "common/base/ports_file.h"
#include "common/base/signals.h"
#include "router/api_keys.h"
#include "router/router_service.h"

namespace {

constexpr const char* kDescription =
    "pdserve-router: serves the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, "
    "/health, /metrics, /version, /tokenize, /detokenize) and routes requests to the workers "
    "that register on the control port.";

int usageError(const std::string& message) {
  std::fprintf(stderr, "pdserve-router: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t signals = pd::blockTerminationSignals();

  std::string configPath = "deploy/configs/local.yaml", host, modelPath, portsFile;
  int port = -1, controlPort = -1;  // -1: the config's router.http.port / router.workers.control_port
  CLI::App app{kDescription, "pdserve-router"};
  pd::cli::configure(app);
  app.add_option("--config", configPath, "the cluster YAML")->capture_default_str();
  app.add_option("--host", host, "the address the HTTP API binds (default: the config's)");
  pd::cli::addPort(app, "--port", port, "HTTP API port (default: the config's router.http.port)");
  pd::cli::addPort(app, "--control-port", controlPort,
                   "worker control port (default: the config's router.workers.control_port)");
  app.add_option("--model", modelPath, "model directory (overrides the config's model.path)");
  app.add_option("--ports-file", portsFile,
                 "once both listen, write their ports there ('http N', 'control N'; "
                 "common/base/ports_file.h), e.g. after --port 0");
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  auto config = pd::config::loadClusterConfig(configPath);
  if (!config.ok()) return usageError(config.status().message());
  if (!modelPath.empty()) config->model.path = modelPath;
  pd::setLogLevel(config->logging.level);
  auto service = pd::router::RouterService::create({config.value(), host, port, controlPort});
  pd::router::wipeSecrets(&config->router.apiKeys);  // the service keeps their hashes only
  pd::Status started = service.ok() ? service.value()->start() : service.status();
  if (started.isOk() && !portsFile.empty()) {
    started = pd::writePortsFile(portsFile,
                                 {{"http", service.value()->httpPort()}, {"control", service.value()->controlPort()}});
  }
  if (!started.isOk()) {
    std::fprintf(stderr, "pdserve-router: %s\n", started.toString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  PD_LOG(kInfo, "router") << "signal " << sig << ": draining (up to " << config->router.drainTimeoutMs
                          << " ms), then shutting down";
  service.value()->drain(std::chrono::milliseconds(config->router.drainTimeoutMs));
  service.value()->stop();
  return 0;
}
