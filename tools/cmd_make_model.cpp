// pdserve make-model: writes a small Llama-shaped HF model directory with seeded random
// weights and a byte-level BPE tokenizer (engine/model_maker.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/model_maker.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

void usage() {
  std::fprintf(stderr,
               "usage: pdserve make-model --out DIR [--preset tiny|small] [--seed N]\n"
               "                          [--tie-embeddings] [--qkv-bias] [--dtype f32|bf16]\n"
               "  --preset          tiny: hidden 64, 2 layers, 4 heads, 2 kv heads, ffn 172\n"
               "                    small: hidden 512, 8 layers, 8 heads, 4 kv heads, ffn 1376\n"
               "                    (both: vocab 259 = 256 bytes + BOS/EOS/pad)\n"
               "  --qkv-bias        q/k/v biases; writes a Qwen2ForCausalLM config\n"
               "  --tie-embeddings  no lm_head.weight; the output layer reuses the embeddings\n"
               "The weights are random: the model's text is noise.\n");
}

}  // namespace

int runMakeModel(int argc, char** argv) {
  engine::MakeModelOptions o;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "make-model: %s needs a value\n", name);
        return nullptr;
      }
      return argv[++i];
    };
    const char* v = nullptr;
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (a == "--out") {
      if (!(v = value("--out"))) return 2;
      out = v;
    } else if (a == "--preset") {
      if (!(v = value("--preset"))) return 2;
      o.preset = v;
    } else if (a == "--seed") {
      if (!(v = value("--seed"))) return 2;
      o.seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--dtype") {
      if (!(v = value("--dtype"))) return 2;
      o.dtype = v;
    } else if (a == "--tie-embeddings") {
      o.tieEmbeddings = true;
    } else if (a == "--qkv-bias") {
      o.qkvBias = true;
    } else if (a == "--kv-heads") {  // hidden: test variants
      if (!(v = value("--kv-heads"))) return 2;
      o.numKvHeads = std::atoi(v);
    } else if (a == "--rope-llama3") {  // hidden: test variants
      o.ropeLlama3 = true;
    } else if (a == "--shards") {  // hidden: test variants
      if (!(v = value("--shards"))) return 2;
      o.shards = std::atoi(v);
    } else {
      std::fprintf(stderr, "make-model: unknown option '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (out.empty()) {
    std::fprintf(stderr, "make-model: --out DIR is required\n");
    usage();
    return 2;
  }
  const Status st = engine::makeModel(o, out);
  if (!st.isOk()) {
    std::fprintf(stderr, "make-model: %s\n", st.toString().c_str());
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("wrote %s model to %s\n", o.preset.c_str(), out.c_str());
  return 0;
}

}  // namespace pd::tools
