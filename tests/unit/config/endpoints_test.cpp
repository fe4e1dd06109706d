#include "common/config/endpoints.h"

#include <catch2/catch.hpp>

using namespace pd::config;

namespace {

WorkerEndpoints podEndpoints() {
  // What the Helm chart gives a prefill pod.
  return WorkerEndpoints{"prefill", "0.0.0.0", "--bind-host", "0.0.0.0", "10.231.0.11", {"pdserve-router-control"}};
}

std::string problemsOf(const WorkerEndpoints& e) {
  auto s = checkEndpoints(e);
  REQUIRE_FALSE(s.isOk());
  return s.message();
}

}  // namespace

TEST_CASE("wildcard and loopback addresses are recognised") {
  for (const char* h : {"0.0.0.0", "::", "[::]", ""}) CHECK(isWildcardHost(h));
  for (const char* h : {"127.0.0.1", "10.0.0.1", "::1", "pdserve-router"}) CHECK_FALSE(isWildcardHost(h));
  for (const char* h : {"127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost"}) CHECK(isLoopbackHost(h));
  for (const char* h : {"0.0.0.0", "10.231.0.2", "128.0.0.1", "fe80::1", "router"}) CHECK_FALSE(isLoopbackHost(h));
}

TEST_CASE("the chart's endpoints and a one-machine cluster pass") {
  CHECK(checkEndpoints(podEndpoints()).isOk());
  CHECK(checkEndpoints({"prefill", "127.0.0.1", "pools.prefill.host", "127.0.0.1", "127.0.0.1", {"127.0.0.1"}}).isOk());
  // Binding exactly the advertised address is fine too.
  CHECK(checkEndpoints({"prefill", "10.0.0.5", "pools.prefill.host", "10.0.0.5", "10.0.0.5", {"10.0.0.1"}}).isOk());
}

TEST_CASE("a wildcard is never advertised") {
  auto e = podEndpoints();
  e.advertiseHost = "0.0.0.0";
  CHECK_THAT(problemsOf(e), Catch::Contains("--advertise-host: '0.0.0.0' is a wildcard address"));
}

TEST_CASE("a loopback address is not advertised to peers on other hosts") {
  auto e = podEndpoints();
  e.advertiseHost = "127.0.0.1";
  CHECK_THAT(problemsOf(e), Catch::Contains("--advertise-host: 127.0.0.1 is a loopback address, but the router "
                                            "pdserve-router-control is on another host"));
  e.routers = {"127.0.0.1"};
  CHECK_THAT(problemsOf(e), Catch::Contains("--bind-host: 0.0.0.0 accepts other hosts"));
}

TEST_CASE("a loopback bind behind a routable advertised address names its key (docs/deploy.md)") {
  // The chart once left pools.prefill.host at its default: decode pods were refused.
  auto e = podEndpoints();
  e.bindHost = "127.0.0.1";
  e.bindKey = "pools.prefill.host";
  CHECK_THAT(problemsOf(e), Catch::Contains("pools.prefill.host: 127.0.0.1 is not the advertised address "
                                            "10.231.0.11 (--advertise-host) but a loopback one"));
  e = podEndpoints();
  e.kvBindHost = "127.0.0.1";
  CHECK_THAT(problemsOf(e), Catch::Contains("kv_transfer.listen_host: 127.0.0.1"));
  // A decode worker has no control server: its bind only carries metrics.
  e = podEndpoints();
  e.role = "decode";
  e.bindHost = "127.0.0.1";
  CHECK(checkEndpoints(e).isOk());
}
