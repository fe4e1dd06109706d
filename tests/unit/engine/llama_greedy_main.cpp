// pd_llama_greedy: runs llama.cpp (libllama, linked from the tree PD_LLAMA_CPP_DIR names) over
// a GGUF on token ids and decodes greedily, so test_engine_gguf_llama can compare llama.cpp's
// continuation and logits with the CPU backend's on the same weights. Built only when the
// configure step is given PD_LLAMA_CPP_DIR; never part of the product.
//
//   pd_llama_greedy MODEL.gguf STEPS LOGITS_OUT ID[,ID...]
//
// Decodes the prompt in one batch, then STEPS greedy (argmax) steps one token at a time.
// Prints the STEPS generated ids on one line; writes STEPS + 1 logits rows (after the prompt,
// then after each generated token; f32, vocab floats each) to LOGITS_OUT. The KV cache is f32
// (llama.cpp's default F16 would round what ours keeps in f32), flash attention off; one
// thread.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

void quietLog(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int fail(const std::string& what) {
  std::fprintf(stderr, "pd_llama_greedy: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return fail("usage: pd_llama_greedy MODEL.gguf STEPS LOGITS_OUT ID[,ID...]");
  const int steps = std::atoi(argv[2]);
  std::vector<llama_token> prompt;
  std::stringstream ids(argv[4]);
  for (std::string id; std::getline(ids, id, ',');) prompt.push_back(llama_token(std::stoi(id)));
  if (prompt.empty() || steps < 0) return fail("need a prompt of at least one id and STEPS >= 0");

  llama_log_set(quietLog, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return fail(std::string("cannot load ") + argv[1]);
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = uint32_t(prompt.size() + steps + 16);
  cp.n_batch = cp.n_ubatch = uint32_t(prompt.size());
  cp.n_threads = cp.n_threads_batch = 1;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  // Its CPU flash attention rounds q.k to f16 (4e-4 of the logits' range here); without it
  // llama.cpp's logits are ours to f32 rounding.
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("cannot create a context");
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  std::ofstream out(argv[3], std::ios::binary | std::ios::trunc);
  if (!out) return fail(std::string("cannot create ") + argv[3]);
  std::vector<llama_token> generated;
  llama_batch batch = llama_batch_get_one(prompt.data(), int32_t(prompt.size()));
  llama_token next = 0;
  for (int s = 0; s <= steps; ++s) {
    if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed at step " + std::to_string(s));
    const float* logits = llama_get_logits_ith(ctx, -1);
    out.write(reinterpret_cast<const char*>(logits), std::streamsize(sizeof(float) * vocab));
    if (s == steps) break;
    next = 0;
    for (int i = 1; i < vocab; ++i)
      if (logits[i] > logits[next]) next = i;
    generated.push_back(next);
    batch = llama_batch_get_one(&next, 1);
  }
  out.close();
  for (size_t i = 0; i < generated.size(); ++i) std::printf("%s%d", i ? " " : "", generated[i]);
  std::printf("\n");
  llama_free(ctx);
  llama_model_free(model);
  return out ? 0 : fail("write failed");
}
