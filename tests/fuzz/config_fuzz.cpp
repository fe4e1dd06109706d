// The cluster YAML loader (common/config/cluster_config.h, what `pdserve up` and every
// process read at start): any text is a ClusterConfig or an error naming the key or the line.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/config/cluster_config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view yaml(reinterpret_cast<const char*>(data), size);
  auto c = pd::config::parseClusterConfig(yaml, "fuzz.yaml");
  if (!c.ok()) PD_FUZZ_CHECK(!c.status().message().empty(), "config errors say why");
  return 0;
}
