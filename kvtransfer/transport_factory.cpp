#include "kvtransfer/transport_factory.h"

#include "kvtransfer/transports/loopback_transport.h"
#include "kvtransfer/transports/tcp_transport.h"

// The fabric transports, guarded by the build options so a build without UCX or libibverbs
// still links.
#if PD_HAVE_CMA
#include "kvtransfer/transports/cma_transport.h"
#endif
#if PD_HAVE_UCX
#include "kvtransfer/transports/ucx_transport.h"
#endif
#if PD_HAVE_VERBS
#include "kvtransfer/transports/verbs_transport.h"
#endif

namespace pd::kvt {

namespace {
// In preference order; the agent's default preference list is a subset of this.
std::vector<std::string> compiledNames() {
  std::vector<std::string> names;
#if PD_HAVE_CMA
  // First: it refuses any peer not on this node at loadPeer, so the agent moves on to the
  // next name for those, and same-node peers get memory-speed transfers (docs/kvtransfer.md).
  names.push_back("cma");
#endif
#if PD_HAVE_UCX
  names.push_back("ucx");
#endif
#if PD_HAVE_VERBS
  names.push_back("verbs");
#endif
  names.push_back("tcp");
  names.push_back("loopback");
  return names;
}
}  // namespace

std::vector<std::string> builtTransports() { return compiledNames(); }

Result<std::unique_ptr<Transport>> makeTransport(const std::string& name, const TransportOptions& options) {
  if (name == "tcp") return TcpTransport::create(options);
  if (name == "loopback") return LoopbackTransport::create(options);
#if PD_HAVE_CMA
  if (name == "cma") return makeCmaTransport(cmaOptionsFrom(options));
#endif
#if PD_HAVE_UCX
  if (name == "ucx") {
    UcxOptions ucx;
    ucx.transferTimeout = options.peerTimeout;
    return makeUcxTransport(ucx);
  }
#endif
#if PD_HAVE_VERBS
  if (name == "verbs") {
    VerbsOptions verbs;
    verbs.localName = options.localName;
    verbs.transferTimeout = options.peerTimeout;
    return makeVerbsTransport(verbs);
  }
#endif
  std::string known;
  for (const auto& n : compiledNames()) known += (known.empty() ? "" : ", ") + n;
  return notFound("kvtransfer: transport '" + name + "' is not built into this binary (built: " + known + ")");
}

}  // namespace pd::kvt
