// Requests and waits the e2e tests of the KV cache share (kv_tiers, multiturn, peer_pull,
// prefill_pull): a greedy completion over a token-id prompt with its ids, cached tokens and
// headers; a response header; waiting for a condition, a worker metric or the router's exact
// index.
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/e2e/e2e_util.h"
#include "tools/local_cluster.h"

namespace pd::test {

struct Completion {
  std::vector<int32_t> ids;
  int cachedTokens = -1;  // usage.prompt_tokens_details.cached_tokens; -1: not in the response
  std::string headers;
  double seconds = 0;  // the request's wall time
};

// A greedy completion of `prompt` (ids), `maxTokens` tokens with EOS ignored; REQUIREs a 200.
inline Completion complete(tools::LocalCluster& c, const std::vector<int32_t>& prompt, int maxTokens) {
  using namespace std::chrono_literals;
  nlohmann::json req{{"model", "small"}, {"prompt", prompt},   {"max_tokens", maxTokens},
                     {"temperature", 0}, {"ignore_eos", true}, {"return_token_ids", true}};
  const auto t0 = std::chrono::steady_clock::now();
  auto r = tools::httpRequest(c.httpPort(), "POST", "/v1/completions", req.dump(), 120s);
  REQUIRE(r.ok());
  INFO(r->body);
  REQUIRE(r->status == 200);
  nlohmann::json body = nlohmann::json::parse(r->body);
  Completion out;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.ids = body["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  if (body["usage"].contains("prompt_tokens_details"))
    out.cachedTokens = body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
  out.headers = r->headers;
  return out;
}

// The value of response header `name` in `headers` ("" when absent).
inline std::string header(const std::string& headers, const std::string& name) {
  const size_t at = headers.find(name + ": ");
  if (at == std::string::npos) return "";
  const size_t end = headers.find("\r\n", at);
  return headers.substr(at + name.size() + 2,
                        end == std::string::npos ? std::string::npos : end - at - name.size() - 2);
}

// Waits until `pred` holds (or `timeout` passes); returns whether it held.
template <typename F>
bool waitFor(F pred, std::chrono::milliseconds timeout) {
  for (const auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

// Waits until the worker's series reaches `atLeast` (or `timeout` passes); returns its last value.
inline double waitWorkerMetric(tools::LocalCluster& c, const std::string& worker, const std::string& series,
                               double atLeast, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  double v = -1;
  waitFor(
      [&] {
        v = workerMetric(c, worker, series);
        return v >= atLeast;
      },
      timeout);
  return v;
}

// Waits until the router's exact index of `worker` holds at least `blocks` block names (in any
// tier); returns whether it did.
inline bool waitIndexed(tools::LocalCluster& c, const std::string& worker, double blocks,
                        std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return waitFor(
      [&] {
        return routerMetric(c, "pdserve_router_prefix_index_blocks{index=\"exact\",worker=\"" + worker + "\"}") >=
               blocks;
      },
      timeout);
}

}  // namespace pd::test
