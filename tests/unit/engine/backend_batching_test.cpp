// CPU backend invariances: batching and chunking must not change a sequence's logits, the
// KV cache lands in the sequence's own blocks, layer callbacks arrive in order, and bad
// batches are refused with a message naming the problem.
#include "tests/unit/engine/model_test_util.h"

using namespace pd::engine;
using namespace pd::engine::test;

namespace {

std::shared_ptr<const ModelWeights> tinyModel() {
  const std::string dir = makeTestModel("llama_tiny", {});
  auto m = loadModel(dir);
  REQUIRE(m.status().toString() == "OK");
  return *m;
}

}  // namespace

TEST_CASE("a prompt prefilled in chunks of 7 gives the same logits as in one step") {
  auto model = tinyModel();
  const auto prompt = testPrompt(37, 2);
  TestKv kv1(model->config, 32), kv2(model->config, 32, 16, 99);
  auto b1 = makeBackend(model, kv1);
  auto b2 = makeBackend(model, kv2);
  std::vector<int32_t> g1, g2;
  const auto whole = runGreedy(*b1, kv1, prompt, 0, 5, &g1);
  const auto chunked = runGreedy(*b2, kv2, prompt, 7, 5, &g2);
  CHECK(g1 == g2);
  for (size_t i = 0; i < whole.size(); ++i) {
    INFO("row " << i);
    CHECK(relError(chunked[i], whole[i]) < 1e-5);
  }
}

TEST_CASE("a sequence batched with 7 others gives the same logits as alone") {
  auto model = tinyModel();
  const int vocab = model->config.vocabSize;
  // Alone: prefill 37 tokens (GEMM attention), then one decode step.
  const auto prompt = testPrompt(37, 4);
  TestKv kvA(model->config, 64);
  auto alone = makeBackend(model, kvA);
  std::vector<int32_t> g;
  const auto aloneRows = runGreedy(*alone, kvA, prompt, 0, 1, &g);

  // Batched: the same sequence's prefill and then its decode step each share a step with
  // seven other sequences doing prefill chunks (short and long) and decodes.
  TestKv kv(model->config, 128, 16, 123);
  auto backend = makeBackend(model, kv);
  struct Seq {
    std::vector<int32_t> tokens;
    std::vector<int32_t> table;
    int pos = 0;
  };
  std::vector<Seq> seqs(8);
  for (int s = 0; s < 8; ++s) {
    seqs[s].tokens = s == 3 ? prompt : testPrompt(5 + 7 * s, 100 + s);
    seqs[s].table = kv.take(6);
  }
  std::vector<float> logits(size_t(8) * vocab);
  // Step 1: everyone prefills (seq 3 all 37 tokens, the others their whole prompt).
  std::vector<SeqChunk> batch;
  for (auto& s : seqs) batch.push_back({s.tokens.data(), int(s.tokens.size()), 0, s.table.data(), 6, true});
  REQUIRE(backend->forward(batch, logits.data()).toString() == "OK");
  std::vector<float> row(logits.begin() + 3 * vocab, logits.begin() + 4 * vocab);
  CHECK(relError(row, aloneRows[0]) < 1e-5);

  // Step 2: seq 3 decodes its greedy token while others decode or prefill more.
  std::vector<int32_t> next(8);
  batch.clear();
  std::vector<int32_t> extra = testPrompt(12, 77);
  for (int s = 0; s < 8; ++s) {
    next[s] = int32_t(std::max_element(logits.begin() + s * vocab, logits.begin() + (s + 1) * vocab) -
                      (logits.begin() + s * vocab));
    const int pos = int(seqs[s].tokens.size());
    if (s % 3 == 1)  // a prefill chunk continuing at pos (wants no logits)
      batch.push_back({extra.data(), 12, pos, seqs[s].table.data(), 6, false});
    else
      batch.push_back({&next[s], 1, pos, seqs[s].table.data(), 6, true});
  }
  CHECK(next[3] == g[0]);
  REQUIRE(backend->forward(batch, logits.data()).toString() == "OK");
  // Seq 3's logits row: count the wantLogits chunks before it (0, 2 -> it is row 2).
  int rowIdx = 0;
  for (int s = 0; s < 3; ++s) rowIdx += batch[s].wantLogits ? 1 : 0;
  std::vector<float> row2(logits.begin() + rowIdx * vocab, logits.begin() + (rowIdx + 1) * vocab);
  CHECK(relError(row2, aloneRows[1]) < 1e-5);
}

TEST_CASE("K/V land in the sequence's blocks and layer callbacks come in order") {
  auto model = tinyModel();
  const auto& c = model->config;
  TestKv kv(c, 16);
  auto backend = makeBackend(model, kv);
  const auto prompt = testPrompt(20, 8);
  const std::vector<int32_t> table = {9, 4};  // 20 tokens: block 9 then block 4
  const float* base = kv.data.data();
  auto blockNonZero = [&](int layer, int block, int tokens) {
    const float* p = base + kv.layout.blockOffset(layer, block) / sizeof(float);
    const size_t te = kv.layout.tokenElems();
    int nonZeroTokens = 0;
    for (int t = 0; t < kv.layout.blockSize; ++t) {
      bool nz = false;
      for (size_t i = 0; i < te; ++i) nz |= p[kv.layout.kOffsetInBlock(t) + i] != 0.0f;
      for (size_t i = 0; i < te; ++i) nz |= p[kv.layout.vOffsetInBlock(t) + i] != 0.0f;
      nonZeroTokens += nz;
    }
    return nonZeroTokens == tokens;
  };
  std::vector<int> layers;
  std::vector<float> logits(c.vocabSize);
  SeqChunk chunk{prompt.data(), 20, 0, table.data(), 2, true};
  // When layer l is reported ready its K/V must already be in the cache (a prefill worker
  // starts pushing it right then), and layer l+1's must not be written yet.
  std::vector<int> readyAtCallback, nextEmptyAtCallback;
  REQUIRE(backend
              ->forward({&chunk, 1}, logits.data(),
                        [&](int l) {
                          layers.push_back(l);
                          readyAtCallback.push_back(blockNonZero(l, 9, 16) && blockNonZero(l, 4, 4));
                          nextEmptyAtCallback.push_back(l + 1 >= c.numLayers || blockNonZero(l + 1, 9, 0));
                        })
              .isOk());
  CHECK(layers == std::vector<int>{0, 1});
  CHECK(readyAtCallback == std::vector<int>{1, 1});
  CHECK(nextEmptyAtCallback == std::vector<int>{1, 1});
  for (int l = 0; l < c.numLayers; ++l) {
    CHECK(blockNonZero(l, 9, 16));
    CHECK(blockNonZero(l, 4, 4));
    for (int b : {0, 1, 2, 3, 5, 6, 7, 8, 10, 15}) CHECK(blockNonZero(l, b, 0));
  }
}

TEST_CASE("malformed batches are refused with a message naming the problem") {
  auto model = tinyModel();
  TestKv kv(model->config, 4);
  auto backend = makeBackend(model, kv);
  std::vector<float> logits(model->config.vocabSize);
  const std::vector<int32_t> table = {0, 1};
  const std::vector<int32_t> bad = {1, 2, 999};
  SeqChunk c{bad.data(), 3, 0, table.data(), 2, true};
  pd::Status st = backend->forward({&c, 1}, logits.data());
  CHECK(st.code() == pd::StatusCode::kOutOfRange);
  CHECK_THAT(st.message(), Catch::Contains("token id 999"));

  const auto prompt = testPrompt(40, 1);
  c = SeqChunk{prompt.data(), 40, 0, table.data(), 2, true};  // 2 blocks hold 32 tokens
  st = backend->forward({&c, 1}, logits.data());
  CHECK_THAT(st.message(), Catch::Contains("does not cover position 39"));

  const std::vector<int32_t> outside = {0, 7};
  c = SeqChunk{prompt.data(), 20, 0, outside.data(), 2, true};
  st = backend->forward({&c, 1}, logits.data());
  CHECK_THAT(st.message(), Catch::Contains("block id 7"));

  c = SeqChunk{prompt.data(), 3, 0, table.data(), 2, true};
  st = backend->forward({&c, 1}, nullptr);
  CHECK_THAT(st.message(), Catch::Contains("logits is null"));

  // A layout that does not match the model is refused at construction.
  auto layout = kv.layout;
  layout.numKvHeads = 3;
  auto b = createCpuBackend(model, layout, kv.data.data());
  CHECK(!b.ok());
  CHECK_THAT(b.status().message(), Catch::Contains("does not match the model"));
}

TEST_CASE("a 300-token prompt: GEMM tiles on the thread pool agree with the paged kernel") {
  auto model = tinyModel();
  const auto prompt = testPrompt(300, 12);
  TestKv kv1(model->config, 64), kv2(model->config, 64, 16, 5);
  CpuBackendOptions threaded;
  threaded.numThreads = 2;
  CpuBackendOptions paged = threaded;
  paged.gemmAttentionMinTokens = 1 << 30;  // never GEMM: the online-softmax kernel only
  auto b1 = makeBackend(model, kv1, threaded);
  auto b2 = makeBackend(model, kv2, paged);
  std::vector<int32_t> g1, g2;
  const auto gemmRows = runGreedy(*b1, kv1, prompt, 0, 3, &g1);
  const auto pagedRows = runGreedy(*b2, kv2, prompt, 100, 3, &g2);
  CHECK(g1 == g2);
  for (size_t i = 0; i < gemmRows.size(); ++i) {
    INFO("row " << i);
    CHECK(relError(pagedRows[i], gemmRows[i]) < 1e-5);
  }
}
