// the router's HTTP plane: bounded JSON bodies and error messages, typed content
// parts, hashed API keys, and the token buckets behind router.admission.rate_limits.
#include <catch2/catch.hpp>

#include "router/api_keys.h"
#include "router/json_body.h"
#include "router/openai_api.h"
#include "router/rate_limiter.h"

using namespace pd;
using namespace pd::router;
using namespace std::chrono_literals;

TEST_CASE("a body of 70k nested arrays is a 400 naming the depth and the offset, in a short message") {
  const std::string deep = "{\"tokens\":" + std::string(70000, '[') + std::string(70000, ']') + "}";
  auto got = parseJsonBody(deep);
  auto* e = std::get_if<ApiError>(&got);
  REQUIRE(e);
  CHECK(e->status == 400);
  CHECK(e->message.find("deeper than 64 levels") != std::string::npos);
  CHECK(e->message.find("at byte 73") !=
        std::string::npos);  // the object is level 1, so the 64th "[" (byte 73) is level 65
  CHECK(e->message.size() < 200);
  // The same for the generation endpoints, which share the parser.
  auto gen = parseGenerationRequest("{\"prompt\":" + std::string(70000, '[') + "1" + std::string(70000, ']') + "}",
                                    Endpoint::kCompletions);
  REQUIRE(std::holds_alternative<ApiError>(gen));
  CHECK(std::get<ApiError>(gen).message.find("deeper than") != std::string::npos);
  // Brackets inside strings do not count; 64 levels are fine.
  CHECK(std::holds_alternative<nlohmann::json>(parseJsonBody("{\"a\":\"" + std::string(1000, '[') + "\\\"[\"}")));
  CHECK(std::holds_alternative<nlohmann::json>(
      parseJsonBody("{\"a\":" + std::string(63, '[') + std::string(63, ']') + "}")));
  CHECK(std::holds_alternative<ApiError>(parseJsonBody("{\"a\":" + std::string(64, '[') + std::string(64, ']') + "}")));
}

TEST_CASE("error messages quote user input cut to a bound") {
  CHECK(quoteForMessage("short") == "short");
  std::string big(100000, 'x');
  std::string q = quoteForMessage(big);
  CHECK(q.size() < 100);
  CHECK(q.find("(100000 bytes)") != std::string::npos);
  // Never cut inside a UTF-8 sequence: 63 ASCII bytes and then a 2-byte character.
  std::string utf = std::string(63, 'a') + "\xC3\xA9" + std::string(10, 'b');
  CHECK(quoteForMessage(utf).substr(0, 64) == std::string(63, 'a') + ".");
  auto model = parseGenerationRequest("{\"model\":\"" + big + "\",\"prompt\":\"hi\"}", Endpoint::kCompletions);
  REQUIRE(std::holds_alternative<GenerationRequest>(model));  // unknown models are the parser's job
  CHECK(ApiError::modelNotFound(big).message.size() < 200);
  auto role = parseGenerationRequest("{\"messages\":[{\"role\":\"" + big + "\",\"content\":\"x\"}]}", Endpoint::kChat);
  REQUIRE(std::holds_alternative<ApiError>(role));
  CHECK(std::get<ApiError>(role).message.size() < 300);
}

TEST_CASE("content parts: a non-string or unknown type is a 400 naming messages[i].content[k].type") {
  auto parse = [](const std::string& parts) {
    return parseGenerationRequest(R"({"messages":[{"role":"user","content":)" + parts + "}]}", Endpoint::kChat);
  };
  auto five = parse(R"([{"type":5}])");
  REQUIRE(std::holds_alternative<ApiError>(five));
  CHECK(std::get<ApiError>(five).status == 400);
  CHECK(std::get<ApiError>(five).param == "messages[0].content[0].type");
  CHECK(std::get<ApiError>(five).message.find("messages[0].content[0].type: expected a string") == 0);
  auto image = parse(R"([{"type":"text","text":"a"},{"type":"image_url","image_url":{}}])");
  REQUIRE(std::holds_alternative<ApiError>(image));
  CHECK(std::get<ApiError>(image).param == "messages[0].content[1].type");
  CHECK(std::get<ApiError>(image).message.find("'image_url' is not supported") != std::string::npos);
  auto noText = parse(R"([{"type":"text","text":7}])");
  REQUIRE(std::holds_alternative<ApiError>(noText));
  CHECK(std::get<ApiError>(noText).param == "messages[0].content[0].text");
  auto ok = parse(R"([{"type":"text","text":"a"},{"type":"text","text":"b"}])");
  REQUIRE(std::holds_alternative<GenerationRequest>(ok));
  CHECK(std::get<GenerationRequest>(ok).messages[0].content == "ab");
}

TEST_CASE("API keys: plain and sha256: entries match the same key; only hashes are kept") {
  // printf %s sk-alpha | sha256sum
  const std::string hexAlpha = [] {
    auto h = sha256Of("sk-alpha");
    std::string s;
    const char* d = "0123456789abcdef";
    for (unsigned char c : h) s += {d[c >> 4], d[c & 15]};
    return s;
  }();
  CHECK(
      hexAlpha ==
      "2179e632e89277f18aa600491b68ad55121fd6caa045e047fdeb426088a5a5f1");  // what the documented sha256sum line prints
  auto set = KeySet::fromEntries({"sha256:" + hexAlpha, "sk-beta"}, "router.http.api_keys");
  REQUIRE(set.ok());
  CHECK(set->match("sk-alpha") == 0);
  CHECK(set->match("sk-beta") == 1);
  CHECK(set->match("sk-gamma") == -1);
  CHECK(set->match("") == -1);
  CHECK(set->match(hexAlpha) == -1);  // the hash is not a key
  auto upper = KeySet::fromEntries({"sha256:" + std::string(64, 'A')}, "k");
  CHECK(upper.ok());
  auto bad = KeySet::fromEntries({"sk-a", "sha256:abc"}, "router.http.api_keys");
  REQUIRE(!bad.ok());
  CHECK(bad.status().message().find("router.http.api_keys[1]") == 0);
  CHECK(KeySet::bearerToken("Bearer sk-1") == "sk-1");
  CHECK(KeySet::bearerToken("bearer  sk-1 ") == "sk-1");
  CHECK(KeySet::bearerToken("Basic abc").empty());
  CHECK(KeySet::bearerToken("Bearer").empty());
  std::vector<std::string> secrets{"sk-1", "sk-2"};
  wipeSecrets(&secrets);
  CHECK(secrets.empty());
}

TEST_CASE("token bucket: a burst of M out of N at once, the rest told when to retry, then they pass") {
  ManualClock clock;
  config::RateLimitConfig c;
  c.requestsPerS = 2;  // one token every 500 ms
  c.requestBurst = 5;
  RateLimiter limiter(c, clock);
  int ok = 0, refused = 0;
  for (int i = 0; i < 8; ++i) {
    auto d = limiter.admitRequest("key:0");
    if (d.ok) {
      ++ok;
    } else {
      ++refused;
      CHECK(d.limit == "requests_per_s");
      CHECK(d.retryAfterS == 1);  // 1 token at 2/s: 0.5 s, rounded up to whole seconds
      CHECK(d.message.find("requests_per_s is 2 (burst 5)") != std::string::npos);
    }
  }
  CHECK(ok == 5);
  CHECK(refused == 3);
  // Another key has its own bucket.
  CHECK(limiter.admitRequest("key:1").ok);
  clock.advance(499ms);
  CHECK(!limiter.admitRequest("key:0").ok);
  clock.advance(1ms);
  CHECK(limiter.admitRequest("key:0").ok);
  CHECK(!limiter.admitRequest("key:0").ok);
  // After the whole burst's refill time, the full burst passes again, and no more.
  clock.advance(10s);
  int again = 0;
  for (int i = 0; i < 8; ++i) again += limiter.admitRequest("key:0").ok ? 1 : 0;
  CHECK(again == 5);
}

TEST_CASE("token bucket on tokens: Retry-After from the deficit; a request above the burst passes alone into debt") {
  ManualClock clock;
  config::RateLimitConfig c;
  c.tokensPerS = 100;
  c.tokenBurst = 1000;
  RateLimiter limiter(c, clock);
  CHECK(limiter.admitRequest("a").ok);  // no request limit configured: always ok
  CHECK(limiter.admitTokens("a", 800).ok);
  auto d = limiter.admitTokens("a", 500);  // 200 left, 300 short: 3 s
  REQUIRE(!d.ok);
  CHECK(d.limit == "tokens_per_s");
  CHECK(d.retryAfterS == 3);
  clock.advance(3s);
  CHECK(limiter.admitTokens("a", 500).ok);
  // 5000 > the burst: refused until the bucket is full, then admitted, leaving a debt.
  auto big = limiter.admitTokens("a", 5000);
  REQUIRE(!big.ok);
  CHECK(big.retryAfterS == 10);  // 0 -> 1000 at 100/s
  clock.advance(10s);
  CHECK(limiter.admitTokens("a", 5000).ok);
  auto after = limiter.admitTokens("a", 1);
  REQUIRE(!after.ok);
  CHECK(after.retryAfterS == 41);  // -4000 -> 1 at 100/s: 40.01 s, rounded up
}
