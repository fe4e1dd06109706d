// Peer-pull cost model: pull exactly when the predicted pull is faster than recomputing the
// same tokens on the target; no figure, no pull.
#include "router/pull_cost.h"

#include <catch2/catch.hpp>

namespace pd::router {
namespace {

// The small model: 16 KiB of KV a token.
constexpr int64_t kBytesPerToken = 16 * 1024;

LaneCost cma(double gbps, double setupMs = 0.5) { return {"cma", gbps * 1e9, setupMs}; }
LaneCost tcp(double gbps, double setupMs = 2) { return {"tcp", gbps * 1e9, setupMs}; }

PullCandidate peer(std::string id, int64_t cached, std::vector<LaneCost> lanes, std::string host = "127.0.0.1") {
  PullCandidate c;
  c.id = std::move(id);
  c.healthy = true;
  c.servesPulls = true;
  c.host = std::move(host);
  c.cachedTokens = cached;
  c.lanes = std::move(lanes);
  return c;
}

TEST_CASE("pull cost: the comparison is set-up plus bytes over bandwidth against tokens over prefill rate") {
  // 2,000 tokens = 32 MiB; at 8 GB/s that is ~4.2 ms + 0.5 ms set-up, against 1 s at 2,000 tok/s.
  PullDecision d = decidePull({2000, 0, kBytesPerToken, 2000, cma(8)});
  CHECK(d.pull);
  CHECK(d.pullMs == Approx(0.5 + 1e3 * 2000.0 * kBytesPerToken / 8e9));
  CHECK(d.recomputeMs == Approx(1000));
  // The crossover moves with the figures, not a threshold: a prefill rate so fast that the
  // tokens compute sooner than they move, and the same tokens pulled when it is slower.
  const double bytesMs = 1e3 * 2000.0 * kBytesPerToken / 8e9;
  const double breakEvenRate = 2000 / ((0.5 + bytesMs) / 1e3);
  CHECK_FALSE(decidePull({2000, 0, kBytesPerToken, breakEvenRate * 1.01, cma(8)}).pull);
  CHECK(decidePull({2000, 0, kBytesPerToken, breakEvenRate * 0.99, cma(8)}).pull);
  // A large fixed cost beats a short prefix: one block of 16 tokens at 2,000 tok/s is 8 ms.
  CHECK_FALSE(decidePull({16, 0, kBytesPerToken, 2000, tcp(1, 10)}).pull);
  CHECK(decidePull({16, 0, kBytesPerToken, 2000, tcp(1, 5)}).pull);
}

TEST_CASE("pull cost: a figure not known means no prediction and no pull") {
  CHECK_FALSE(decidePull({0, 0, kBytesPerToken, 2000, cma(8)}).pull);
  PullDecision noRate = decidePull({2000, 0, kBytesPerToken, 0, cma(8)});
  CHECK_FALSE(noRate.pull);
  CHECK(noRate.why.find("prefill rate") != std::string::npos);
  PullDecision noLane = decidePull({2000, 0, kBytesPerToken, 2000, LaneCost{"tcp", 0, 1}});
  CHECK_FALSE(noLane.pull);
  CHECK(noLane.why.find("bandwidth") != std::string::npos);
  CHECK_FALSE(decidePull({2000, 0, 0, 2000, cma(8)}).pull);
}

TEST_CASE("pull lane: cma only between processes of one host, else the fastest measured lane") {
  PullCandidate c = peer("decode-1", 1000, {cma(8), tcp(1)}, "10.0.0.1");
  REQUIRE(pullLane(c, "10.0.0.1"));
  CHECK(pullLane(c, "10.0.0.1")->transport == "cma");
  REQUIRE(pullLane(c, "10.0.0.2"));
  CHECK(pullLane(c, "10.0.0.2")->transport == "tcp");
  c.lanes = {cma(8)};
  CHECK_FALSE(pullLane(c, "10.0.0.2"));
  c.lanes = {tcp(1), LaneCost{"ucx", 12e9, 1}, LaneCost{"verbs", 0, 0}};
  CHECK(pullLane(c, "10.0.0.2")->transport == "ucx");
}

TEST_CASE("pull choice: the source saving the most, never the target, a sick or non-serving worker") {
  std::vector<PullCandidate> peers = {peer("decode-0", 2000, {cma(8)}), peer("decode-1", 1024, {cma(8)}),
                                      peer("decode-2", 1600, {tcp(0.5)})};
  // decode-0 is the target: the best source is the one saving the most time.
  std::string why;
  auto c = choosePull("decode-0", "127.0.0.1", 0, 2000, kBytesPerToken, peers, &why);
  REQUIRE(c);
  CHECK(c->source == "decode-2");  // 1,600 tokens over tcp still saves more than 1,024 over cma
  CHECK(c->pullTokens == 1600);
  CHECK(c->lane.transport == "tcp");
  // The target already holds 1,500: decode-2 adds only 100 tokens (50 ms to compute), but a
  // pull moves the prefix from its start, all 1,600 tokens (~54 ms over this tcp): no pull.
  // Over a faster lane it pays, and the choice says what moves.
  CHECK_FALSE(choosePull("decode-0", "127.0.0.1", 1500, 2000, kBytesPerToken, peers, &why));
  CHECK(why.find("decode-2: 100 tokens over tcp: pull 54.4 ms >= recompute 50.0 ms") != std::string::npos);
  peers[2].lanes = {tcp(2)};
  c = choosePull("decode-0", "127.0.0.1", 1500, 2000, kBytesPerToken, peers, &why);
  REQUIRE(c);
  CHECK(c->source == "decode-2");
  CHECK(c->pullTokens == 100);
  CHECK(c->prefixTokens == 1600);
  CHECK(c->decision.pullMs == Approx(2 + 1e3 * 1600.0 * kBytesPerToken / 2e9));
  CHECK(c->decision.recomputeMs == Approx(50));
  // Unhealthy, not serving pulls, index not current (-1): never a source.
  peers[2].healthy = false;
  peers[1].servesPulls = false;
  CHECK_FALSE(choosePull("decode-0", "127.0.0.1", 0, 2000, kBytesPerToken, peers, &why));
  CHECK(why == "no other worker holds more of the prompt");
  peers[1].servesPulls = true;
  peers[1].cachedTokens = -1;
  CHECK_FALSE(choosePull("decode-0", "127.0.0.1", 0, 2000, kBytesPerToken, peers, &why));
  // A prefill rate far above the lane: no pull, and the reason names the comparison.
  peers[1].cachedTokens = 1024;
  CHECK_FALSE(choosePull("decode-0", "127.0.0.1", 0, 1e9, kBytesPerToken, peers, &why));
  CHECK(why.find("decode-1: 1024 tokens over cma: pull") != std::string::npos);
}

TEST_CASE("pull cost: blocks only a source's disk tier holds add a read at the documented rate") {
  // 1,000 tokens = 16 MiB: 0.5 ms + 2.0 ms over cma at 8 GB/s, against 50 ms at 20,000 tok/s.
  PullDecision host = decidePull({1000, 0, kBytesPerToken, 20000, cma(8)});
  CHECK(host.pull);
  CHECK(host.pullMs == Approx(0.5 + 1e3 * 1000.0 * kBytesPerToken / 8e9));
  // The same prefix, all of it read from disk first: + 16 MiB / 200 MB/s = 81.9 ms: recomputed.
  PullInputs in{1000, 0, kBytesPerToken, 20000, cma(8)};
  in.diskTokens = 1000;
  PullDecision disk = decidePull(in);
  CHECK_FALSE(disk.pull);
  CHECK(disk.pullMs == Approx(host.pullMs + 1e3 * 1000.0 * kBytesPerToken / kDiskReadBytesPerS));
  CHECK(disk.why.find("(1000 read from disk)") != std::string::npos);
  // Only its last 200 tokens on disk: 16.4 ms more, still a pull.
  in.diskTokens = 200;
  CHECK(decidePull(in).pull);
  // The choice: a source holding the prompt in its region wins over one holding more of it
  // only on disk when the disk read costs more than the extra tokens save.
  std::vector<PullCandidate> peers = {peer("decode-0", 0, {cma(8)}), peer("decode-1", 1000, {cma(8)}),
                                      peer("decode-2", 1500, {cma(8)})};
  peers[2].diskTokens = 1500;
  auto c = choosePull("decode-0", "127.0.0.1", 0, 20000, kBytesPerToken, peers);
  REQUIRE(c);
  CHECK(c->source == "decode-1");
  peers[2].diskTokens = 100;  // its first 1,400 in its host tier: the extra 500 tokens pay
  c = choosePull("decode-0", "127.0.0.1", 0, 20000, kBytesPerToken, peers);
  REQUIRE(c);
  CHECK(c->source == "decode-2");
}

}  // namespace
}  // namespace pd::router
