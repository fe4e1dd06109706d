// The one place where the control protocol's messages (common/proto/pdserve.proto) and the
// engine's and the workers' structs meet: sampling parameters, sampled tokens, and the KV
// target a decode worker names in a PrefillRequest.
//
// Pure functions; safe from any thread.
#pragma once

#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "engine/sampling.h"
#include "common/proto/pdserve.pb.h"

namespace pd::worker {

engine::SamplingParams fromProto(const proto::SamplingParams& p);
proto::SamplingParams toProto(const engine::SamplingParams& p);
proto::TokenLogprob toProto(const engine::SampledToken& t);
engine::SampledToken fromProto(uint32_t tokenId, const proto::TokenLogprob& lp);

// The blocks a decode worker reserved for one remote prefill (PrefillRequest.kv_target): one
// block table for every layer of each tensor-parallel rank's region.
struct KvTargetSpec {
  std::string connInfo;         // the decode worker's kvtransfer offer on that connection
  std::string fingerprint;      // model + KV layout; must equal the prefill worker's
  int blockSize = 0;            // tokens per block
  int numBlocks = 0;            // blocks per layer in the target's pool (its layer stride)
  std::vector<int> blockIds;
  std::vector<MemDesc> regions;  // base, kind and device per rank (len is not sent)
  std::string writeGrant;        // the decode agent's grant for these blocks (opaque here)
};
proto::KvTarget toProto(const KvTargetSpec& t);
// kInvalidArgument naming the field when the table is not exactly one, a block id is outside
// num_blocks, or a region's memory kind is unknown.
Result<KvTargetSpec> fromProto(const proto::KvTarget& t);

}  // namespace pd::worker
