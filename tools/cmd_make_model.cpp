// pdserve make-model: writes a small Llama-shaped HF model directory with seeded random
// weights and a byte-level BPE tokenizer (engine/model_maker.h).
#include <cstdio>
#include <memory>
#include <string>

#include "engine/model_maker.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

struct MakeModelArgs {
  engine::MakeModelOptions o;
  std::string out;
};

int runMakeModel(const MakeModelArgs& args) {
  const engine::MakeModelOptions& o = args.o;
  const std::string& out = args.out;
  const Status st = engine::makeModel(o, out);
  if (!st.isOk()) {
    std::fprintf(stderr, "make-model: %s\n", st.toString().c_str());
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("wrote %s model to %s\n", o.preset.c_str(), out.c_str());
  return 0;
}

}  // namespace

void addMakeModelCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd = pdserve.add_subcommand("make-model", "write a small random-weight HF model directory");
  cmd->footer(
      "A Llama-shaped model with seeded random weights and a byte-level BPE tokenizer. The "
      "weights are random: the model's text is noise.");
  auto args = std::make_shared<MakeModelArgs>();
  engine::MakeModelOptions& o = args->o;
  cmd->add_option("--out", args->out, "the model directory to write")->required();
  cmd->add_option("--preset", o.preset,
                  "tiny: hidden 64, 2 layers, 4 heads, 2 kv heads, ffn 172; small: hidden 512, "
                  "8 layers, 8 heads, 4 kv heads, ffn 1376 (both: vocab 259 = 256 bytes + "
                  "BOS/EOS/pad)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "the weights' seed")->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "f32|bf16: the weights' type")->capture_default_str();
  cmd->add_option("--quantization", o.quantization,
                  "fp8: an FP8 block-scaled checkpoint (the DeepSeek-V3 / Qwen3-FP8 format): every linear "
                  "projection as F8_E4M3 with F32 weight_scale_inv per 128x128 block, the rest in --dtype")
      ->check(CLI::IsMember({"fp8"}));
  cmd->add_flag("--tie-embeddings", o.tieEmbeddings, "no lm_head.weight; the output layer reuses the embeddings");
  cmd->add_flag("--qkv-bias", o.qkvBias, "q/k/v biases; writes a Qwen2ForCausalLM config");
  cmd->add_option("--arch", o.arch,
                  "llama: LlamaForCausalLM; qwen2: Qwen2ForCausalLM (q/k/v bias); qwen3: Qwen3ForCausalLM "
                  "(per-head q/k RMSNorm, head_dim twice hidden/heads); mixtral: MixtralForCausalLM (8 experts "
                  "of ffn/2, top 2: the active size of the dense preset); qwen3_moe: Qwen3MoeForCausalLM (16 "
                  "experts of ffn/4, top 4; tiny: layer 0 dense); deepseek_v3: DeepseekV3ForCausalLM (multi-head "
                  "latent attention; 16 (small: 32) routed experts of ffn/4 in 4 groups, top 4, 1 shared expert, "
                  "layer 0 dense; small: YaRN)")
      ->check(CLI::IsMember({"llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"}))
      ->capture_default_str();
  // Hidden (no description, group ""): test variants.
  cmd->add_option("--kv-heads", o.numKvHeads)->group("");
  cmd->add_flag("--rope-llama3", o.ropeLlama3)->group("");
  cmd->add_option("--shards", o.shards)->group("");
  cmd->add_flag("--mla-no-q-lora", o.mlaNoQLora)->group("");
  cmd->add_option("--mla-yarn", o.mlaYarn)->group("");
  cmd->add_option("--moe-groups", o.moeGroups)->group("");
  cmd->add_option("--first-dense-layers", o.firstDenseLayers)->group("");
  cmd->callback([args, &run] { run = [args] { return runMakeModel(*args); }; });
}

}  // namespace pd::tools
