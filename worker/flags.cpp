#include "worker/flags.h"

#include <cstdio>
#include <cstdlib>

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
      f.routers.clear();
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
        f.routers.push_back(std::move(t));
        at = comma + 1;
      }
    } else if (arg == "--id") {
      f.workerId = value;
    } else if (arg == "--advertise-host") {
      f.advertiseHost = value;
    } else if (arg == "--bind-host") {
      if (value.empty()) return invalidArgument("--bind-host: empty (give an address, 0.0.0.0 for all interfaces)");
      f.bindHost = value;
    } else if (arg == "--port") {
      PD_ASSIGN_OR_RETURN(f.port, parsePort(arg, value));
    } else if (arg == "--transfer-port") {
      PD_ASSIGN_OR_RETURN(f.transferPort, parsePort(arg, value));
    } else if (arg == "--metrics-port") {
      PD_ASSIGN_OR_RETURN(f.metricsPort, parsePort(arg, value));
    } else if (arg == "--model") {
      f.modelPath = value;
    } else if (arg == "--ports-file") {
      f.portsFile = value;
    } else {
      return invalidArgument("unknown flag '" + arg + "' (see --help)");
    }
  }
  if (f.workerId.empty()) return invalidArgument("--id: required (a unique worker name)");
  if (f.transferPort == 0 && f.port != 0) f.transferPort = f.port + 1;
  return f;
}

}  // namespace pd::worker
