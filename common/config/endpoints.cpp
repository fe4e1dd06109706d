#include "common/config/endpoints.h"

#include <arpa/inet.h>

namespace pd::config {

namespace {

std::string stripBrackets(const std::string& h) {
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') return h.substr(1, h.size() - 2);
  return h;
}

}  // namespace

bool isWildcardHost(const std::string& host) {
  const std::string h = stripBrackets(host);
  if (h.empty()) return true;
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return false;
}

bool isLoopbackHost(const std::string& host) {
  const std::string h = stripBrackets(host);
  if (h == "localhost" || h.ends_with(".localhost")) return true;
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

bool facesOtherHosts(const WorkerEndpoints& e) {
  for (const auto& r : e.routers) {
    if (!isLoopbackHost(r)) return true;
  }
  // A bind that accepts other hosts says the operator expects peers there.
  return !isLoopbackHost(e.bindHost) || !isLoopbackHost(e.kvBindHost);
}

Status checkEndpoints(const WorkerEndpoints& e) {
  std::string problems;
  auto add = [&](const std::string& p) { problems += (problems.empty() ? "" : "\n") + p; };
  const bool remote = facesOtherHosts(e);
  if (isWildcardHost(e.advertiseHost)) {
    add("--advertise-host: '" + e.advertiseHost +
        "' is a wildcard address; peers dialling it reach themselves (give this host's address, "
        "in Kubernetes the pod IP)");
  } else if (remote && isLoopbackHost(e.advertiseHost)) {
    std::string why;
    for (const auto& r : e.routers) {
      if (!isLoopbackHost(r)) why = "the router " + r + " is on another host";
    }
    if (why.empty()) {
      why = !isLoopbackHost(e.bindHost) ? e.bindKey + ": " + e.bindHost + " accepts other hosts"
                                        : "kv_transfer.listen_host: " + e.kvBindHost + " accepts other hosts";
    }
    add("--advertise-host: " + e.advertiseHost + " is a loopback address, but " + why +
        "; peers there cannot reach it (give this host's address, in Kubernetes the pod IP)");
  } else if (remote) {
    // The advertised address is routable: every bind must accept connections made to it.
    auto checkBind = [&](const std::string& key, const std::string& bind, const char* what) {
      if (isWildcardHost(bind) || bind == e.advertiseHost) return;
      add(key + ": " + bind + " is not the advertised address " + e.advertiseHost + " (--advertise-host)" +
          (isLoopbackHost(bind) ? " but a loopback one" : "") + ": peers on other hosts dialling " + e.advertiseHost +
          " would be refused by the " + what + " (bind 0.0.0.0 or " + e.advertiseHost + ")");
    };
    if (e.role == "prefill") checkBind(e.bindKey, e.bindHost, "control and metrics endpoints");
    checkBind("kv_transfer.listen_host", e.kvBindHost, "tcp KV endpoint");
  }
  if (problems.empty()) return Status::ok();
  return invalidArgument(problems);
}

}  // namespace pd::config
