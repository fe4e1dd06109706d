// The TTFT split's assembly (router/ttft_split.h): which phases a route has, where each
// worker figure goes, `other` as the remainder, and the JSON / Server-Timing renderings.
#include "router/ttft_split.h"

#include <map>

#include <catch2/catch.hpp>

using namespace pd;
using namespace pd::router;

namespace {
std::map<std::string, double> asMap(const TtftSplit& s) {
  std::map<std::string, double> m;
  for (const auto& [p, v] : s.phases) m[p] = v;
  return m;
}
}  // namespace

TEST_CASE("disaggregated split: every worker figure in its phase, other is the remainder", "[router][ttft_split]") {
  proto::Timings t;
  t.set_ttft_split(true);
  t.set_route(proto::ROUTE_DISAGGREGATED);
  t.set_queue_ms(1.5);  // decode: waiting for blocks
  t.set_kv_connect_ms(0.25);
  t.set_prefill_queue_ms(2);
  t.set_prefill_ms(30);
  t.set_transfer_ms(4);
  t.set_handoff_ms(0.125);
  t.set_first_token_ms(999);  // not a phase: the decode worker's whole interval
  const TtftSplit s = assembleTtftSplit(0.050, 0.001, t);
  CHECK(s.route == "disaggregated");
  std::vector<std::string> order;
  for (const auto& [p, v] : s.phases) order.push_back(p);
  CHECK(order == std::vector<std::string>{"router_queue", "decode_admission", "kv_connect", "prefill_queue",
                                          "prefill_compute", "kv_transfer", "decode_first_token", "other"});
  auto m = asMap(s);
  CHECK(m["router_queue"] == Approx(0.001));
  CHECK(m["decode_admission"] == Approx(0.0015));
  CHECK(m["kv_connect"] == Approx(0.00025));
  CHECK(m["prefill_queue"] == Approx(0.002));
  CHECK(m["prefill_compute"] == Approx(0.030));
  CHECK(m["kv_transfer"] == Approx(0.004));
  CHECK(m["decode_first_token"] == Approx(0.000125));
  CHECK(m["other"] == Approx(0.050 - 0.001 - 0.0015 - 0.00025 - 0.002 - 0.030 - 0.004 - 0.000125));
  double sum = 0;
  for (const auto& [p, v] : s.phases) sum += v;
  CHECK(sum == Approx(0.050));

  const auto j = ttftSplitJson(s);
  CHECK(j["route"] == "disaggregated");
  CHECK(j["ttft_ms"].get<double>() == Approx(50));
  CHECK(j["kv_transfer_ms"].get<double>() == Approx(4));
  CHECK(j["router_queue_ms"].get<double>() == Approx(1));
  CHECK(j.size() == 2 + 8);
  const std::string h = serverTimingHeader(s);
  CHECK(h.rfind("router_queue;dur=1.000, decode_admission;dur=1.500, kv_connect;dur=0.250", 0) == 0);
  CHECK(h.find("kv_transfer;dur=4.000") != std::string::npos);
  CHECK(h.find(", other;dur=") != std::string::npos);
  CHECK(h.substr(h.rfind(", ") + 2) == "ttft;dur=50.000");
}

TEST_CASE("colocated split: no remote phases, and figures clamp at 0", "[router][ttft_split]") {
  proto::Timings t;
  t.set_ttft_split(true);
  t.set_route(proto::ROUTE_COLOCATED);
  t.set_queue_ms(3);
  t.set_prefill_ms(5);
  t.set_transfer_ms(7);  // ignored: colocated has no transfer
  TtftSplit s = assembleTtftSplit(0.010, 0.0005, t);
  CHECK(s.route == "colocated");
  auto m = asMap(s);
  CHECK(m.size() == 4);
  CHECK(m.count("kv_transfer") == 0);
  CHECK(m["prefill_compute"] == Approx(0.005));
  CHECK(m["other"] == Approx(0.010 - 0.0005 - 0.003 - 0.005));

  // A worker figure above the router's TTFT (a clock-rate hair): other is 0, never negative.
  t.set_prefill_ms(20);
  s = assembleTtftSplit(0.010, -1, t);
  m = asMap(s);
  CHECK(m["router_queue"] == 0);
  CHECK(m["other"] == 0);
  for (const auto& [p, v] : s.phases) CHECK(v >= 0);
}
