// makeTransport(name, options): the one place that knows which transports are compiled in.
// The agent, the conformance suite and the benchmark create transports only through here,
// so a new transport (ucx, verbs) plugs in by adding a block to transport_factory.cpp.
//
// Threads: the functions are thread-safe (they hold no state). The returned Transport keeps
// the threading contract of transport.h.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/base/cluster_auth.h"
#include "common/base/status.h"
#include "kvtransfer/device_copy.h"
#include "kvtransfer/transport.h"

namespace pd::kvt {

struct TransportOptions {
  // This side's name, announced to peers for their logs and error messages.
  std::string localName = "pdserve";
  // tcp: the address the transport accepts on (tests and benchmarks use loopback only).
  std::string listenHost = "127.0.0.1";
  uint16_t listenPort = 0;  // 0 = an ephemeral port
  // tcp: the address put in the connection info, which peers dial. Empty: listenHost, which
  // must then not be a wildcard (localConnInfo() refuses: a peer dialling 0.0.0.0 reaches
  // itself). A worker sets it from --advertise-host. ucx and verbs advertise what their
  // devices have (the UCX worker address, the verbs GID/LID), restricted by UCX_NET_DEVICES.
  std::string advertiseHost;
  // tcp: sockets per peer; a large transfer is striped across them.
  int tcpStreams = 1;
  // A peer that makes no progress on pending transfers for this long is declared dead:
  // every pending transfer to it fails with kUnavailable.
  std::chrono::milliseconds peerTimeout{5000};
  std::chrono::milliseconds connectTimeout{3000};
  // tcp: the cluster secret (cluster.secret_file; docs/security.md). Set: every
  // incoming connection must answer the receiver's challenge with HMAC-SHA256 over it before
  // it may write; a writer without it (or with another) is closed and counted. Null: the
  // port is open (no cluster secret). Both ends must agree: a mixed pair fails closed.
  // ucx / verbs / cma take no secret: their connection info only travels inside the
  // authenticated control plane (KvConnect, PrefillRequest).
  std::shared_ptr<const std::string> clusterSecret;
  // tcp: runs on the transport's I/O thread for each incoming connection refused for
  // authentication, with the reason (the worker counts pdserve_auth_failures_total{plane="kv_tcp"}).
  std::function<void(const std::string& why)> onAuthFailure;
  // tcp: runs on the transport's I/O thread for each incoming connection closed before its hello
  // was accepted, with why: "auth" (also onAuthFailure), "protocol" (bad magic, version or
  // hello; data before the hello), "timeout" (no hello within handshakeTimeout), "closed" (the
  // peer closed first). The worker counts pdserve_handshake_failures_total{plane="kv_tcp"}.
  std::function<void(const char* why)> onHandshakeFailure;
  // tcp: an incoming connection that has not sent a valid hello within this long is closed.
  std::chrono::milliseconds handshakeTimeout{3000};
  // tcp: how kCuda memory is staged (docs/kvtransfer.md). Null = the CUDA copier when a device is present
  // at run time (otherwise kCuda registration fails with the reason); tests pass a HostCopier.
  std::shared_ptr<DeviceCopier> deviceCopier;
  // tcp: the pinned bounce buffers per stream / per incoming connection, and their count. A
  // chunk's device copy overlaps the socket I/O of the chunks before it.
  size_t stageChunkBytes = 4 << 20;
  int stageBuffers = 4;
  // Receiving side, transports with caps().receiverFenced (tcp): when true, a region key
  // (packRemoteKey) names a region but does not authorise writes: every write must carry a
  // live grant (Transport::grantWrite). A decode worker sets it, so a forged or stale write
  // without its request's grant is refused. Others ignore it.
  bool requireWriteGrant = false;
  // Called (on a transport I/O thread) once per refused incoming write, with the reason:
  // "unknown_grant" (never granted or revoked: a stale or replayed write), "outside_grant",
  // "grant_required" (a region key without a grant while requireWriteGrant),
  // "outside_region", "unknown_key". The agent counts them in
  // pdserve_kv_writes_rejected_total{reason}. Must be thread-safe.
  std::function<void(const std::string& reason)> onWriteRejected;
  // Transport-specific knobs ("ucx.tls" = "tcp,sm"; "cma.threads" = "2", "cma.slice_bytes");
  // unknown keys are ignored by others.
  std::map<std::string, std::string> extra;
};

// Names compiled into this build, in the default preference order ("cma", "ucx", "verbs",
// "tcp", "loopback"; cma only on Linux). A name listed here may still fail to initialise (no RDMA device).
std::vector<std::string> builtTransports();

// kNotFound for a name that is not compiled in (the message lists the ones that are);
// kUnavailable when it is compiled in but cannot initialise here (the message says why).
Result<std::unique_ptr<Transport>> makeTransport(const std::string& name, const TransportOptions& options);

}  // namespace pd::kvt
