// pdserve-router: the OpenAI-compatible router (see router_service.h, docs/deploy.md).
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "common/base/log.h"
#include "common/base/ports_file.h"
#include "common/base/signals.h"
#include "router/api_keys.h"
#include "router/router_service.h"

namespace {

constexpr const char* kUsage =
    "usage: pdserve-router [--config FILE] [--host IP] [--port N] [--control-port N] [--model DIR]\n"
    "                      [--ports-file PATH]\n"
    "  Serves the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,\n"
    "  /metrics, /version, /tokenize, /detokenize) and routes requests to the workers that\n"
    "  register on the control port. --ports-file: once both listen, write their ports there\n"
    "  ('http N', 'control N'; common/base/ports_file.h), e.g. after --port 0.\n";

int usageError(const std::string& message) {
  std::fprintf(stderr, "pdserve-router: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t signals = pd::blockTerminationSignals();

  std::string configPath = "deploy/configs/local.yaml", host, modelPath, portsFile;
  int port = -1, controlPort = -1;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (i + 1 >= argc) return usageError(arg + ": missing value (see --help)");
    std::string value = argv[++i];
    if (arg == "--config")
      configPath = value;
    else if (arg == "--host")
      host = value;
    else if (arg == "--model")
      modelPath = value;
    else if (arg == "--ports-file")
      portsFile = value;
    else if (arg == "--port" || arg == "--control-port") {
      char* end = nullptr;
      long v = std::strtol(value.c_str(), &end, 10);
      if (*end != '\0' || v < 0 || v > 65535) return usageError(arg + ": '" + value + "' is not a port number");
      (arg == "--port" ? port : controlPort) = int(v);
    } else {
      return usageError("unknown flag '" + arg + "' (see --help)");
    }
  }
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
