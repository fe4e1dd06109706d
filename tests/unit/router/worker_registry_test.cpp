// The router's worker table: Hello checks, and the per-worker report timer that takes a
// silent worker out of routing and puts it back on its next report (no polling).
#include "router/worker_registry.h"

#include <thread>

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

namespace pd::router {
namespace {

using namespace std::chrono_literals;

class FakeConnection final : public net::FramedConnection {
 public:
  FakeConnection(proto::Role role, std::string id, std::string fingerprint) {
    hello_.set_role(role);
    hello_.set_worker_id(std::move(id));
    hello_.set_model_fingerprint(std::move(fingerprint));
    hello_.set_total_blocks(64);
  }
  Status send(const proto::Envelope&) override { return open_ ? Status::ok() : unavailable("closed"); }
  void close(Status) override { open_ = false; }
  bool isOpen() const override { return open_; }
  const proto::Hello& peerHello() const override { return hello_; }
  std::string remoteAddress() const override { return "127.0.0.1:1"; }
  uint64_t id() const override { return 1; }

 private:
  proto::Hello hello_;
  bool open_ = true;
};

net::ConnectionPtr worker(proto::Role role, std::string id, std::string fingerprint = "m/abc") {
  return std::make_shared<FakeConnection>(role, std::move(id), std::move(fingerprint));
}

bool healthy(const WorkerRegistry& r, const std::string& id) {
  for (const auto& v : r.snapshot())
    if (v.id == id) return v.healthy;
  return false;
}

struct Fixture {
  boost::asio::io_context io;
  metrics::Registry registry;
  metrics::RouterMetrics metrics{registry, metrics::LatencyBuckets{}};
  WorkerRegistry workers{io.get_executor(), "m", 60ms, registry, metrics};
  // run_for leaves the context stopped once it ran out of timers: restart it every time.
  void runFor(std::chrono::milliseconds d) {
    io.restart();
    io.run_for(d);
  }
};

}  // namespace

TEST_CASE("workers register once, for this model, as prefill or decode") {
  Fixture f;
  auto d0 = worker(proto::ROLE_DECODE, "decode-0");
  REQUIRE(f.workers.add(d0).isOk());
  CHECK(f.workers.add(worker(proto::ROLE_DECODE, "decode-0")).code() == StatusCode::kFailedPrecondition);
  CHECK(f.workers.add(worker(proto::ROLE_DECODE, "decode-1", "other/abc")).code() == StatusCode::kFailedPrecondition);
  CHECK(f.workers.add(worker(proto::ROLE_ROUTER, "r")).code() == StatusCode::kFailedPrecondition);
  REQUIRE(f.workers.find("decode-0") != nullptr);
  CHECK(f.workers.totalBlocks("decode-0") == 64);
  CHECK(healthy(f.workers, "decode-0"));
  CHECK(f.workers.remove(worker(proto::ROLE_DECODE, "x")).empty());
  CHECK(f.workers.remove(d0) == "decode-0");
  CHECK(f.workers.snapshot().empty());
}

TEST_CASE("a worker silent past the report timeout gets no work until it reports again") {
  Fixture f;
  auto p0 = worker(proto::ROLE_PREFILL, "prefill-0");
  REQUIRE(f.workers.add(p0).isOk());
  proto::LoadReport report;
  report.set_worker_id("prefill-0");
  report.set_queued_prefill_tokens(7);
  // Reports inside the timeout keep it healthy: the timer re-arms from the last report.
  for (int i = 0; i < 4; ++i) {
    f.runFor(30ms);
    f.workers.onLoadReport(p0, report);
    CHECK(healthy(f.workers, "prefill-0"));
  }
  f.runFor(150ms);
  CHECK_FALSE(healthy(f.workers, "prefill-0"));
  // A report from another connection claiming its id does not count.
  f.workers.onLoadReport(worker(proto::ROLE_PREFILL, "prefill-0"), report);
  CHECK_FALSE(healthy(f.workers, "prefill-0"));
  f.workers.onLoadReport(p0, report);
  CHECK(healthy(f.workers, "prefill-0"));
  CHECK(f.workers.snapshot().at(0).queuedPrefillTokens == 7);
  f.runFor(150ms);
  CHECK_FALSE(healthy(f.workers, "prefill-0"));
  // A closed connection is unhealthy whatever its reports said.
  f.workers.onLoadReport(p0, report);
  p0->close(unavailable("gone"));
  CHECK_FALSE(healthy(f.workers, "prefill-0"));
}

TEST_CASE("a worker id held by a silent connection is released to the worker's new registration") {
  Fixture f;
  auto old = worker(proto::ROLE_DECODE, "decode-0");
  REQUIRE(f.workers.add(old).isOk());
  // While the old connection reports, the id stays its own.
  proto::LoadReport report;
  report.set_worker_id("decode-0");
  f.workers.onLoadReport(old, report);
  CHECK(f.workers.add(worker(proto::ROLE_DECODE, "decode-0")).code() == StatusCode::kFailedPrecondition);
  // Silent past the report timeout (a restarted worker whose old connection TCP has not
  // noticed yet): the new registration wins and the old connection is closed.
  f.runFor(150ms);
  auto fresh = worker(proto::ROLE_DECODE, "decode-0");
  REQUIRE(f.workers.add(fresh).isOk());
  CHECK_FALSE(old->isOpen());
  f.workers.onLoadReport(fresh, report);
  CHECK(healthy(f.workers, "decode-0"));
}

}  // namespace pd::router

namespace pd::router {
namespace {
WorkerView viewOf(const WorkerRegistry& r, const std::string& id) {
  for (const auto& v : r.snapshot())
    if (v.id == id) return v;
  FAIL("no worker " << id);
  return {};
}
}  // namespace

TEST_CASE("the router's outstanding work per worker: routed until the first token or the end, and off a stale report") {
  Fixture f;
  auto p0 = worker(proto::ROLE_PREFILL, "prefill-0");
  auto d0 = worker(proto::ROLE_DECODE, "decode-0");
  REQUIRE(f.workers.add(p0).isOk());
  REQUIRE(f.workers.add(d0).isOk());
  f.workers.noteRouted("prefill-0", 1500, "decode-0", 1);
  f.workers.noteRouted("prefill-0", 700, "decode-0", 2);  // n = 2
  CHECK(viewOf(f.workers, "prefill-0").routedPrefillTokens == 2200);
  CHECK(viewOf(f.workers, "decode-0").routedStreams == 3);
  // A report taken while both were queued, then the first one's first token arrives: the
  // report still says 2,200 queued, the view takes the 1,500 prefilled since off it.
  proto::LoadReport report;
  report.set_worker_id("prefill-0");
  report.set_queued_prefill_tokens(2200);
  f.workers.onLoadReport(p0, report);
  f.workers.prefillSettled("prefill-0", 1500);
  CHECK(viewOf(f.workers, "prefill-0").routedPrefillTokens == 700);
  CHECK(viewOf(f.workers, "prefill-0").queuedPrefillTokens == 700);
  // The next report is the worker's word again.
  report.set_queued_prefill_tokens(900);  // another router's prompt arrived too
  f.workers.onLoadReport(p0, report);
  CHECK(viewOf(f.workers, "prefill-0").queuedPrefillTokens == 900);
  // Streams end one by one; nothing goes below zero, unknown workers are ignored.
  for (int i = 0; i < 5; ++i) f.workers.streamEnded("decode-0");
  f.workers.prefillSettled("prefill-0", 10000);
  f.workers.noteRouted("gone", 5, "gone", 1);
  CHECK(viewOf(f.workers, "decode-0").routedStreams == 0);
  CHECK(viewOf(f.workers, "prefill-0").routedPrefillTokens == 0);
}

TEST_CASE("a report taken before a first token but arriving after it does not count the prompt as queued") {
  Fixture f;
  auto d0 = worker(proto::ROLE_DECODE, "decode-0");
  REQUIRE(f.workers.add(d0).isOk());
  f.workers.noteRouted("decode-0", 1050, "decode-0", 1);
  proto::LoadReport report;
  report.set_worker_id("decode-0");
  report.set_queued_prefill_tokens(1050);
  f.workers.onLoadReport(d0, report);
  f.workers.prefillSettled("decode-0", 1050);
  CHECK(viewOf(f.workers, "decode-0").queuedPrefillTokens == 0);
  // The next report went out after the first token, with figures the loop took before the
  // step that computed it (80 ms earlier): the prompt is still done (a 429 for the next
  // request on an idle cluster before).
  report.set_snapshot_age_us(80'000);
  f.workers.onLoadReport(d0, report);
  CHECK(viewOf(f.workers, "decode-0").queuedPrefillTokens == 0);
  // A report taken after the first token is the worker's word again.
  std::this_thread::sleep_for(2ms);
  report.set_snapshot_age_us(0);
  report.set_queued_prefill_tokens(300);
  f.workers.onLoadReport(d0, report);
  CHECK(viewOf(f.workers, "decode-0").queuedPrefillTokens == 300);
  f.workers.prefillSettled("decode-0", 100);
  CHECK(viewOf(f.workers, "decode-0").queuedPrefillTokens == 200);
}

TEST_CASE("the router knows the longest prompt a decode worker's KV cache can ever run") {
  Fixture f;
  auto d0 = worker(proto::ROLE_DECODE, "decode-0");
  auto d1 = worker(proto::ROLE_DECODE, "decode-1");
  auto p0 = worker(proto::ROLE_PREFILL, "prefill-0");
  for (const auto& c : {d0, d1, p0}) REQUIRE(f.workers.add(c).isOk());
  proto::LoadReport report;
  auto reportFrom = [&](const net::ConnectionPtr& c, const std::string& id, uint64_t maxPrompt) {
    report.set_worker_id(id);
    report.set_max_prompt_tokens(maxPrompt);
    f.workers.onLoadReport(c, report);
  };
  reportFrom(d0, "decode-0", 48);
  CHECK_FALSE(longestServablePrompt(f.workers.snapshot()));  // decode-1 has not said
  reportFrom(d1, "decode-1", 4000);
  reportFrom(p0, "prefill-0", 10);  // a prefill worker's cache does not bound the request
  CHECK(longestServablePrompt(f.workers.snapshot()) == 4000);
  reportFrom(d1, "decode-1", 0);  // an older worker: not known, the workers check themselves
  CHECK_FALSE(longestServablePrompt(f.workers.snapshot()));
}

TEST_CASE("a worker whose weights or KV layout differ from the cluster's is refused, naming both sides") {
  Fixture f;
  const std::string base = "m/L2.B16.H2.D32.f32/w";
  REQUIRE(f.workers.add(worker(proto::ROLE_DECODE, "decode-0", base + "91bc")).isOk());
  auto weights = f.workers.add(worker(proto::ROLE_PREFILL, "prefill-1", base + "3fa2"));
  CHECK(weights.code() == StatusCode::kFailedPrecondition);
  CHECK(weights.message().find("worker 'prefill-1' serves weights 3fa2") != std::string::npos);
  CHECK(weights.message().find("'decode-0'") != std::string::npos);
  CHECK(weights.message().find("serves 91bc") != std::string::npos);
  auto block = f.workers.add(worker(proto::ROLE_PREFILL, "prefill-2", "m/L2.B32.H2.D32.f32/w91bc"));
  CHECK(block.message().find("KV block size 32 but the cluster has 16") != std::string::npos);
  auto dtype = f.workers.add(worker(proto::ROLE_PREFILL, "prefill-3", "m/L2.B16.H2.D32.bf16/w91bc"));
  CHECK(dtype.message().find("in bf16 but the cluster in f32") != std::string::npos);
  auto int8 = f.workers.add(worker(proto::ROLE_PREFILL, "prefill-3", "m/L2.B16.H2.D32.int8-tks32/w91bc"));
  CHECK(int8.message().find("in int8-tks32 but the cluster in f32") != std::string::npos);
  CHECK(int8.message().find("engine.kv_cache_dtype must match") != std::string::npos);
  auto shape = f.workers.add(worker(proto::ROLE_DECODE, "decode-4", "m/L2.B16.H4.D32.f32/w91bc"));
  CHECK(shape.message().find("another KV layout") != std::string::npos);
  // A latent-KV (MLA, KvLayout::fingerprint) worker against the cluster's K and V layout.
  auto latent = f.workers.add(worker(proto::ROLE_PREFILL, "prefill-7", "m/MLA.L2.B16.H1.D40.f32/w91bc"));
  CHECK(latent.code() == StatusCode::kFailedPrecondition);
  CHECK(latent.message().find("worker 'prefill-7' keeps latent KV (multi-head latent attention) but the cluster K "
                              "and V per kv head") != std::string::npos);
  CHECK(latent.message().find("MLA.L2.B16.H1.D40.f32") != std::string::npos);
  auto duplicate = f.workers.add(worker(proto::ROLE_DECODE, "decode-0", base + "91bc"));
  CHECK(duplicate.message().find("already registered") != std::string::npos);
  // Refused: none registered, each counted under its reason.
  CHECK(f.workers.snapshot().size() == 1);
  const std::string text = f.registry.serialize();
  for (const char* series : {R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="weights"} 1)",
                             R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="block_size"} 1)",
                             R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="dtype"} 2)",
                             R"(pdserve_worker_registrations_refused_total{pool="prefill",reason="layout"} 1)",
                             R"(pdserve_worker_registrations_refused_total{pool="decode",reason="layout"} 1)",
                             R"(pdserve_worker_registrations_refused_total{pool="decode",reason="duplicate_id"} 1)"}) {
    INFO(series);
    CHECK(text.find(series) != std::string::npos);
  }
  // The same identity joins; once the cluster is empty, the next worker sets it anew.
  CHECK(f.workers.add(worker(proto::ROLE_PREFILL, "prefill-5", base + "91bc")).isOk());
  f.workers.remove(f.workers.find("decode-0")->conn);
  f.workers.remove(f.workers.find("prefill-5")->conn);
  CHECK(f.workers.add(worker(proto::ROLE_PREFILL, "prefill-6", base + "3fa2")).isOk());
}

}  // namespace pd::router
