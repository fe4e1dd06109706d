// pdserve-worker: a worker that runs either role and switches between them in-process on
// SIGUSR1 (flex_worker.h; docs/serving.md "Role switching"). SIGTERM and SIGINT drain and
// exit 0, as pdserve-prefill and pdserve-decode do, also in the middle of a switch.
#include <signal.h>
#include <time.h>

#include <cstdio>
#include <string>

#include "common/base/cli.h"
#include "common/base/log.h"
#include "common/config/cluster_config.h"
#include "flex_worker/flex_worker.h"
#include "worker/flags.h"

namespace {
constexpr const char* kProgram = "pdserve-worker";
constexpr const char* kDescription =
    "pdserve-worker: a worker that starts in --role and switches to the other role on SIGUSR1: "
    "it drains (as on SIGTERM), then serves the other role on the same weights and ports, under "
    "the same id. --port is the prefill role's control port (the decode role takes no inbound "
    "control).";
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
  CLI::App app{kDescription, kProgram};
  pd::cli::configure(app);
  std::string roleText;
  app.add_option("--role", roleText, "prefill|decode: the role the worker starts in")
      ->required()
      ->check([](const std::string& text) {
        auto role = pd::flex::parseRole(text);
        return role.ok() ? std::string() : pd::cli::withoutFlag(role.status().message(), "--role");
      });
  pd::worker::WorkerFlags flags;
  pd::worker::addWorkerFlags(app, flags);
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  pd::worker::applyWorkerFlagDefaults(flags);
  const auto role = pd::flex::parseRole(roleText);
  auto config = pd::config::loadClusterConfig(flags.configPath);
  if (!config.ok()) {
    std::fprintf(stderr, "%s: %s\n", kProgram, config.status().message().c_str());
    return 2;
  }
  pd::setLogLevel(config->logging.level);
  const int64_t drainMs = config->engine.drainTimeoutMs;
  pd::flex::FlexWorker worker(std::move(config).value(), std::move(flags), role.value());
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
