// pdserve-decode: a decode worker (see decode_service.h and docs/deploy.md for the flags).
#include "decode_worker/decode_service.h"

namespace {
constexpr const char* kDescription =
    "pdserve-decode: serves the requests a pdserve-router gives it: colocated prefill + decode "
    "for short prompts, KV received from a prefill worker for long ones.";
}

int main(int argc, char** argv) {
  return pd::worker::runWorkerMain(
      argc, argv, "pdserve-decode", kDescription,
      [](pd::config::ClusterConfig config,
         pd::worker::WorkerFlags flags) -> pd::Result<std::unique_ptr<pd::worker::Service>> {
        PD_ASSIGN_OR_RETURN(auto service, pd::decode::DecodeService::create(std::move(config), std::move(flags)));
        return std::unique_ptr<pd::worker::Service>(std::move(service));
      });
}
