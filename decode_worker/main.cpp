// pdserve-decode: a decode worker (see decode_service.h and docs/deploy.md for the flags).
#include <cstdio>

#include "common/base/log.h"
#include "common/config/cluster_config.h"
#include "decode_worker/decode_service.h"

namespace {
constexpr const char* kUsage =
    "usage: pdserve-decode --id NAME [--config FILE] [--router HOST:PORT] [--advertise-host IP]\n"
    "                      [--transfer-port N] [--metrics-port N] [--model DIR]\n"
    "  Serves the requests a pdserve-router gives it: colocated prefill + decode for short\n"
    "  prompts, KV received from a prefill worker for long ones.\n";
}

int main(int argc, char** argv) {
  auto waitForSignal = pd::worker::blockTerminationSignals();
  auto flags = pd::worker::parseWorkerFlags(argc - 1, argv + 1, kUsage);
  if (!flags.ok()) {
    if (flags.status().code() == pd::StatusCode::kCancelled) return 0;
    std::fprintf(stderr, "pdserve-decode: %s\n", flags.status().message().c_str());
    return 2;
  }
  auto config = pd::config::loadClusterConfig(flags->configPath);
  if (!config.ok()) {
    std::fprintf(stderr, "pdserve-decode: %s\n", config.status().message().c_str());
    return 2;
  }
  pd::setLogLevel(config->logging.level);
  auto service = pd::decode::DecodeService::create(config.value(), flags.value());
  if (!service.ok()) {
    std::fprintf(stderr, "pdserve-decode: %s\n", service.status().toString().c_str());
    return 1;
  }
  if (auto s = service.value()->start(); !s.isOk()) {
    std::fprintf(stderr, "pdserve-decode: %s\n", s.toString().c_str());
    return 1;
  }
  int sig = waitForSignal();
  PD_LOG(kInfo, "decode") << "signal " << sig << ": shutting down";
  service.value()->stop();
  return 0;
}
