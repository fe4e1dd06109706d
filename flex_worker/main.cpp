// pdserve-worker: a worker that runs either role and switches between them in-process on
// SIGUSR1 (flex_worker.h; docs/serving.md "Role switching"). SIGTERM and SIGINT drain and
// exit 0, as pdserve-prefill and pdserve-decode do, also in the middle of a switch.
#include <signal.h>
#include <time.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/base/log.h"
#include "common/config/cluster_config.h"
#include "flex_worker/flex_worker.h"
#include "worker/flags.h"

namespace {
constexpr const char* kProgram = "pdserve-worker";
constexpr const char* kUsage =
    "usage: pdserve-worker --role prefill|decode --id NAME [--config FILE] [--router "
    "HOST:PORT[,HOST:PORT...]]\n"
    "                      [--advertise-host IP] [--bind-host IP] [--port N] [--transfer-port N] "
    "[--metrics-port N]\n"
    "                      [--model DIR] [--ports-file PATH]\n"
    "  A worker that starts in --role and switches to the other role on SIGUSR1: it drains (as on\n"
    "  SIGTERM), then serves the other role on the same weights and ports, under the same id.\n"
    "  --port is the prefill role's control port (the decode role takes no inbound control).\n";
}  // namespace

int main(int argc, char** argv) {
  // Before any thread starts: every thread inherits the mask, only the loop below sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // --role is ours; everything else is the common worker flags.
  std::string roleText;
  std::vector<char*> rest;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--role") == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: --role: missing value (prefill or decode)\n", kProgram);
        return 2;
      }
      roleText = argv[++i];
    } else {
      rest.push_back(argv[i]);
    }
  }
  auto flags = pd::worker::parseWorkerFlags(int(rest.size()), rest.data(), kUsage);
  if (!flags.ok()) {
    if (flags.status().code() == pd::StatusCode::kCancelled) return 0;
    std::fprintf(stderr, "%s: %s\n", kProgram, flags.status().message().c_str());
    return 2;
  }
  if (roleText.empty()) {
    std::fprintf(stderr, "%s: --role: required (prefill or decode)\n", kProgram);
    return 2;
  }
  auto role = pd::flex::parseRole(roleText);
  if (!role.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, role.status().message().c_str());
    return 2;
  }
  auto config = pd::config::loadClusterConfig(flags->configPath);
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, config.status().message().c_str());
    return 2;
  }
  pd::setLogLevel(config->logging.level);
  const int64_t drainMs = config->engine.drainTimeoutMs;
  pd::flex::FlexWorker worker(std::move(config).value(), std::move(flags).value(), role.value());
  if (pd::Status s = worker.start(); !s.isOk()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, s.toString().c_str());
    return 1;
  }
  // sigtimedwait, not sigwait: a switch that failed ends the process even with no signal.
  const timespec tick{0, 200 * 1000 * 1000};
  for (;;) {
    if (auto failed = worker.failure()) {
      std::fprintf(stderr, "%s: %s\n", kProgram, failed->toString().c_str());
      worker.shutdown();
      return 1;
    }
    const int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig < 0) continue;  // EAGAIN (the tick) or EINTR
    if (sig == SIGUSR1) {
      (void)worker.requestSwitch();  // logs why when it is refused
      continue;
    }
    PD_LOG(kInfo, "worker") << kProgram << ": signal " << sig << ", draining (up to " << drainMs
                            << " ms), then shutting down"
                            << (worker.switching() ? " (after the role switch's drain)" : "");
    worker.shutdown();
    return worker.failure() ? 1 : 0;
  }
}
