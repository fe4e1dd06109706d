// pdserve-prefill: a prefill worker (see prefill_service.h and docs/deploy.md for the flags).
#include "prefill_worker/prefill_service.h"

namespace {
constexpr const char* kDescription =
    "pdserve-prefill: prefills long prompts for decode workers and pushes their KV, layer by "
    "layer.";
}

int main(int argc, char** argv) {
  return pd::worker::runWorkerMain(
      argc, argv, "pdserve-prefill", kDescription,
      [](pd::config::ClusterConfig config,
         pd::worker::WorkerFlags flags) -> pd::Result<std::unique_ptr<pd::worker::Service>> {
        PD_ASSIGN_OR_RETURN(auto service, pd::prefill::PrefillService::create(std::move(config), std::move(flags)));
        return std::unique_ptr<pd::worker::Service>(std::move(service));
      });
}
