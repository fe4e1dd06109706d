// Helpers for the kvtransfer unit tests: agents in one process over real loopback / tcp
// transports (optionally wrapped in FaultTransport), and metric lookups.
#pragma once

#include <prometheus/registry.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "kvtransfer/agent.h"
#include "kvtransfer/transports/fault_transport.h"
#include "kvtransfer/transports/tcp_transport.h"

namespace pd::kvt::testing {

// The value of a counter (or a histogram's sample count) with exactly these labels; 0 when
// the series does not exist yet.
inline double metricValue(const prometheus::Registry& registry, const std::string& name,
                          const std::map<std::string, std::string>& labels) {
  for (const auto& fam : registry.Collect()) {
    if (fam.name != name) continue;
    for (const auto& m : fam.metric) {
      std::map<std::string, std::string> have;
      for (const auto& l : m.label) have[l.name] = l.value;
      if (have != labels) continue;
      if (fam.type == prometheus::MetricType::Histogram) return double(m.histogram.sample_count);
      return fam.type == prometheus::MetricType::Gauge ? m.gauge.value : m.counter.value;
    }
  }
  return 0;
}

inline std::unique_ptr<Transport> make(const std::string& name, const std::string& localName) {
  TransportOptions o;
  o.localName = localName;
  o.peerTimeout = std::chrono::milliseconds(1500);
  auto t = makeTransport(name, o);
  REQUIRE(t.ok());
  return std::move(t).value();
}

// An agent plus one registered buffer.
struct Node {
  Node(const std::string& name, std::vector<NamedTransport> transports, size_t bytes, bool fallback = true)
      : buf(bytes) {
    AgentOptions o;
    o.name = name;
    o.fallbackToTcp = fallback;
    auto a = TransferAgent::createWith(o, std::move(transports), registry);
    REQUIRE(a.ok());
    agent = std::move(a).value();
    MemDesc d;
    d.addr = base();
    d.len = bytes;
    auto r = agent->registerMemory(d);
    REQUIRE(r.ok());
  }
  uintptr_t base() const { return reinterpret_cast<uintptr_t>(buf.data()); }
  prometheus::Registry registry;
  std::vector<uint8_t> buf;
  std::unique_ptr<TransferAgent> agent;
};

// Connects a -> b (a can write into b).
inline AgentPeer connect(Node& a, Node& b) {
  auto md = b.agent->localMetadata();
  REQUIRE(md.ok());
  auto p = a.agent->loadPeer(*md);
  INFO(p.status().toString());
  REQUIRE(p.ok());
  return *p;
}

// Progresses both agents until poll() leaves kInProgress (bounded).
inline Status waitAgent(TransferAgent& a, TransferAgent& b, AgentTransfer id,
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    a.progress();
    b.progress();
    Status st = a.poll(id);
    if (!st.inProgress()) return st;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return deadlineExceeded("test: transfer still pending");
}

}  // namespace pd::kvt::testing
