// The one place where the control protocol's messages (common/proto/pdserve.proto) and the
// engine's and the workers' structs meet: sampling parameters, sampled tokens, and the KV
// target a decode worker offers on a connection (KvConnect) and names per request.
//
// Pure functions; safe from any thread.
#pragma once

#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"
#include "common/proto/pdserve.pb.h"
#include "engine/sampling.h"

namespace pd::worker {

// The constraint travels field for field (common/constraint/spec.h).
constraint::ConstraintSpec fromProto(const proto::Constraint& p);
proto::Constraint toProto(const constraint::ConstraintSpec& s);
engine::SamplingParams fromProto(const proto::SamplingParams& p);
proto::SamplingParams toProto(const engine::SamplingParams& p);
proto::TokenLogprob toProto(const engine::SampledToken& t);
engine::SampledToken fromProto(uint32_t tokenId, const proto::TokenLogprob& lp);

// Where a decode worker's KV blocks live, as a prefill worker writes them: the facts of one
// decode -> prefill connection, sent once in its KvConnect offer (the model and KV layout
// were already compared in the hello's fingerprint).
struct KvTargetLayout {
  int numBlocks = 0;             // blocks per layer in the target's pool (its layer stride)
  std::vector<MemDesc> regions;  // base, kind and device per tensor-parallel rank (len not sent)
};
void toProto(const KvTargetLayout& t, proto::KvConnect* out);
// kInvalidArgument naming the field when there are no blocks or a region's memory kind is
// unknown.
Result<KvTargetLayout> fromProto(const proto::KvConnect& p);

// One remote prefill's blocks inside that target (PrefillRequest.kv_target): one block table
// for every layer of every rank's region, and the decode worker's write grant for them.
struct KvTargetBlocks {
  std::vector<int> blockIds;
  std::string writeGrant;  // opaque here (TransferAgent::grantWrite)
};
proto::KvTarget toProto(const KvTargetBlocks& t);
// kInvalidArgument naming the field when the table is not exactly one or a block id is
// outside the connection's `numBlocks`.
Result<KvTargetBlocks> fromProto(const proto::KvTarget& p, int numBlocks);

}  // namespace pd::worker
