// Bind and advertised addresses of a process's endpoints (docs/design.md §10: every endpoint has
// both). A process binds its sockets to a bind address, which may be a wildcard (0.0.0.0, ::)
// or a loopback address; it tells peers another address, the advertised one, which they dial.
// A wildcard is never advertised (a peer dialling 0.0.0.0 reaches itself), and a loopback
// address is never advertised to a peer on another host.
//
// The shared cluster YAML holds the bind addresses (pools.<pool>.host, kv_transfer.listen_host);
// the advertised address is per host and comes from a flag (--advertise-host, the pod IP in the
// Helm chart). checkEndpoints() joins the two at start and refuses, naming the key or flag, a
// combination that would hand peers an address they cannot reach.
//
// Plain functions over strings: thread-safe, no network access (no name is resolved; a host
// name is taken to be routable).
#pragma once

#include <string>
#include <vector>

#include "common/base/status.h"
#include "common/config/cluster_config.h"

namespace pd::config {

// "0.0.0.0", "::", "[::]", "" (an empty bind means any address to Asio).
bool isWildcardHost(const std::string& host);
// 127.0.0.0/8, ::1, "localhost".
bool isLoopbackHost(const std::string& host);

// One worker's endpoints as its flags and the config resolve them.
struct WorkerEndpoints {
  std::string role;                  // "prefill" | "decode": which pools.<role>.host applies
  std::string bindHost;              // control and metrics bind (pools.<role>.host or --bind-host)
  std::string bindKey;               // what set bindHost, for messages ("pools.prefill.host", "--bind-host")
  std::string kvBindHost;            // kv_transfer.listen_host
  std::string advertiseHost;         // --advertise-host
  std::vector<std::string> routers;  // the --router hosts this worker dials
};

// OK, or kInvalidArgument listing every problem, one per line, each naming the key or flag:
//  - --advertise-host is empty or a wildcard;
//  - peers are on other hosts (a router that is not loopback, or a bind that accepts other
//    hosts) and --advertise-host is loopback;
//  - a bind address that is neither a wildcard nor the advertised address while peers are on
//    other hosts (e.g. pools.prefill.host: 127.0.0.1 with --advertise-host 10.0.0.7: decode
//    workers would get "connection refused").
Status checkEndpoints(const WorkerEndpoints& e);

// True when the endpoints face peers on other hosts (see checkEndpoints).
bool facesOtherHosts(const WorkerEndpoints& e);

}  // namespace pd::config
