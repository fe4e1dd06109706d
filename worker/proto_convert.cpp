#include "worker/proto_convert.h"

namespace pd::worker {

constraint::ConstraintSpec fromProto(const proto::Constraint& p) {
  constraint::ConstraintSpec s;
  // An unknown kind (a newer router) is refused by the compiler rather than dropped here.
  s.kind = static_cast<constraint::SpecKind>(p.kind());
  s.body = p.body();
  s.prefix = p.prefix();
  s.suffix = p.suffix();
  return s;
}

proto::Constraint toProto(const constraint::ConstraintSpec& s) {
  proto::Constraint p;
  p.set_kind(static_cast<proto::Constraint::Kind>(s.kind));
  p.set_body(s.body);
  p.set_prefix(s.prefix);
  p.set_suffix(s.suffix);
  return p;
}

engine::SamplingParams fromProto(const proto::SamplingParams& p) {
  engine::SamplingParams s;
  s.temperature = p.temperature();
  s.topK = p.top_k();
  s.topP = p.top_p() <= 0.0f ? 1.0f : p.top_p();
  s.minP = p.min_p();
  if (p.has_seed()) s.seed = p.seed();
  s.logprobs = static_cast<int>(p.logprobs());
  s.stopTokenIds.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.maxTokens = static_cast<int>(p.max_tokens());
  s.ignoreEos = p.ignore_eos();
  s.presencePenalty = p.presence_penalty();
  s.frequencyPenalty = p.frequency_penalty();
  s.repetitionPenalty = p.repetition_penalty() == 0.0f ? 1.0f : p.repetition_penalty();
  for (const auto& b : p.logit_bias()) s.logitBias.emplace_back(static_cast<int32_t>(b.token_id()), b.bias());
  s.minTokens = static_cast<int>(p.min_tokens());
  s.generatedInPrompt = static_cast<int>(p.generated_in_prompt());
  s.constraint = fromProto(p.constraint());
  return s;
}

proto::SamplingParams toProto(const engine::SamplingParams& s) {
  proto::SamplingParams p;
  p.set_temperature(s.temperature);
  p.set_top_k(s.topK);
  p.set_top_p(s.topP);
  p.set_min_p(s.minP);
  if (s.seed) p.set_seed(*s.seed);
  p.set_logprobs(static_cast<uint32_t>(s.logprobs));
  for (int32_t id : s.stopTokenIds) p.add_stop_token_ids(static_cast<uint32_t>(id));
  p.set_max_tokens(static_cast<uint32_t>(s.maxTokens));
  p.set_ignore_eos(s.ignoreEos);
  p.set_presence_penalty(s.presencePenalty);
  p.set_frequency_penalty(s.frequencyPenalty);
  p.set_repetition_penalty(s.repetitionPenalty);
  for (const auto& [id, bias] : s.logitBias) {
    auto* b = p.add_logit_bias();
    b->set_token_id(static_cast<uint32_t>(id));
    b->set_bias(bias);
  }
  p.set_min_tokens(static_cast<uint32_t>(s.minTokens));
  p.set_generated_in_prompt(static_cast<uint32_t>(s.generatedInPrompt));
  if (s.constraint.active()) *p.mutable_constraint() = toProto(s.constraint);
  return p;
}

proto::TokenLogprob toProto(const engine::SampledToken& t) {
  proto::TokenLogprob lp;
  lp.set_token_id(static_cast<uint32_t>(t.id));
  lp.set_logprob(t.logprob);
  for (const auto& [id, logprob] : t.topLogprobs) {
    auto* top = lp.add_top();
    top->set_token_id(static_cast<uint32_t>(id));
    top->set_logprob(logprob);
  }
  return lp;
}

engine::SampledToken fromProto(uint32_t tokenId, const proto::TokenLogprob& lp) {
  engine::SampledToken t;
  t.id = static_cast<int32_t>(tokenId);
  t.logprob = lp.logprob();
  for (const auto& top : lp.top()) t.topLogprobs.emplace_back(int32_t(top.token_id()), top.logprob());
  return t;
}

void toProto(const KvTargetLayout& t, proto::KvConnect* out) {
  out->set_num_blocks(static_cast<uint32_t>(t.numBlocks));
  for (const MemDesc& region : t.regions) {
    auto* r = out->add_regions();
    r->set_base(region.addr);
    r->set_kind(static_cast<uint32_t>(region.kind));
    r->set_device(static_cast<uint32_t>(region.device));
  }
}

Result<KvTargetLayout> fromProto(const proto::KvConnect& p) {
  if (p.num_blocks() == 0) return invalidArgument("KvConnect: num_blocks is 0");
  KvTargetLayout t;
  t.numBlocks = static_cast<int>(p.num_blocks());
  for (const auto& r : p.regions()) {
    if (r.kind() > static_cast<uint32_t>(MemKind::kCuda)) {
      return invalidArgument("KvConnect.regions: kind " + std::to_string(r.kind()) +
                             " is not a memory kind (0 host, 1 pinned, 2 cuda)");
    }
    t.regions.push_back(
        MemDesc{static_cast<uintptr_t>(r.base()), 0, static_cast<int>(r.device()), static_cast<MemKind>(r.kind())});
  }
  return t;
}

proto::KvTarget toProto(const KvTargetBlocks& t) {
  proto::KvTarget p;
  auto* layer = p.add_layers();
  for (int b : t.blockIds) layer->add_block_ids(static_cast<uint32_t>(b));
  p.set_write_grant(t.writeGrant);
  return p;
}

Result<KvTargetBlocks> fromProto(const proto::KvTarget& p, int numBlocks) {
  if (p.layers_size() != 1) {
    return invalidArgument("kv_target: expected one block table for all layers, got " +
                           std::to_string(p.layers_size()));
  }
  KvTargetBlocks t;
  t.writeGrant = p.write_grant();
  for (uint32_t b : p.layers(0).block_ids()) {
    if (b >= uint32_t(numBlocks)) {
      return invalidArgument("kv_target: block " + std::to_string(b) + " is outside the target's " +
                             std::to_string(numBlocks) + " blocks");
    }
    t.blockIds.push_back(static_cast<int>(b));
  }
  return t;
}

}  // namespace pd::worker
