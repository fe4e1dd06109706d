#include "worker/flags.h"

#include <cstdlib>

#include "common/base/cli.h"

namespace pd::worker {

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

Result<std::vector<RouterTarget>> parseRouterTargets(const std::string& value) {
  std::vector<RouterTarget> routers;
  for (size_t at = 0; at <= value.size();) {
    size_t comma = value.find(',', at);
    if (comma == std::string::npos) comma = value.size();
    const std::string one = value.substr(at, comma - at);
    const auto colon = one.rfind(':');
    if (one.empty() || colon == std::string::npos || colon == 0) {
      return invalidArgument("--router: expected HOST:PORT[,HOST:PORT...], got '" + value + "'");
    }
    RouterTarget t;
    t.host = one.substr(0, colon);
    PD_ASSIGN_OR_RETURN(t.port, parsePort("--router", one.substr(colon + 1)));
    routers.push_back(std::move(t));
    at = comma + 1;
  }
  return routers;
}

void addWorkerFlags(CLI::App& app, WorkerFlags& f) {
  app.add_option("--id", f.workerId, "this worker's unique name")->required();
  app.add_option("--config", f.configPath, "the cluster YAML")->capture_default_str();
  app.add_option_function<std::string>(
         "--router", [&f](const std::string& value) { f.routers = parseRouterTargets(value).value(); },
         "HOST:PORT[,HOST:PORT...]: the routers' control endpoints (a host that resolves to "
         "several addresses is one router per address; default 127.0.0.1 at the config's "
         "router.workers.control_port)")
      ->check([](const std::string& value) {
        auto routers = parseRouterTargets(value);
        return routers.ok() ? std::string() : cli::withoutFlag(routers.status().message(), "--router");
      });
  app.add_option("--advertise-host", f.advertiseHost, "the address peers on other hosts dial (never a wildcard)")
      ->capture_default_str();
  app.add_option("--bind-host", f.bindHost,
                 "where the control and metrics endpoints bind (default: the config's "
                 "pools.<role>.host)")
      ->check([](const std::string& value) {
        return value.empty() ? std::string("empty (give an address, 0.0.0.0 for all interfaces)") : std::string();
      });
  cli::addPort(app, "--port", f.port, "control RPC port for peers (prefill); 0: OS-chosen");
  cli::addPort(app, "--transfer-port", f.transferPort, "kvtransfer tcp data port; 0: --port + 1 when --port is set");
  cli::addPort(app, "--metrics-port", f.metricsPort, "/health and /metrics port; 0: OS-chosen");
  app.add_option("--model", f.modelPath, "model directory (overrides the config's model.path)");
  app.add_option("--ports-file", f.portsFile, "once started, write the bound ports there (common/base/ports_file.h)");
}

void applyWorkerFlagDefaults(WorkerFlags& f) {
  if (f.transferPort == 0 && f.port != 0) f.transferPort = f.port + 1;
}

}  // namespace pd::worker
