// kvt::Transport: moves bytes described by MemDesc lists from this process's registered
// memory into a peer's registered memory (docs/design.md §3). It knows nothing about models.
//
// Lifecycle, as UCX and NIXL split it:
//   1. registerMemory(desc)           -> MemHandle   (pin / ibv_reg_mr / ucp_mem_map)
//   2. packRemoteKey(handle)          -> bytes       (exposes that region to peers)
//      localConnInfo()                -> bytes       (how a peer reaches this transport)
//      Both blobs travel to the peer over the control plane (protobuf, not our business here).
//   3. peer: loadPeer({connInfo, keys}) -> PeerId    (connects, unpacks keys)
//      peerConnInfo(peerId)           -> bytes       (what that peer needs to connect back:
//      transports whose connections are pairs, like verbs RC QPs, answer an offer with the
//      endpoint made for it; the others return localConnInfo())
//   4. post(local, remote, peer, grant) -> TransferId; progress(); poll(id)
//
// Scoped write grants (KV fencing and per-request write capabilities;
// docs/kvtransfer.md "Write grants"): the receiving side calls grantWrite(ranges) for the
// memory one writer may fill (a request's blocks), hands the grant to that writer over the
// control plane, and calls revokeWrite(grant) when the request ends. The writer passes the
// grant to post(). What a revoked grant guarantees depends on caps().receiverFenced:
//   true  (tcp; loopback): the receiver checks every write against its live grants before a
//         byte lands; once revokeWrite() returned, no write under that grant lands (a write of
//         it still in flight is refused, its transfer fails on the sender naming why, and the
//         refusal is counted through TransportOptions::onWriteRejected). The memory may be
//         reused at once.
//   false (cma, ucx, verbs): writes are one-sided (the receiver never sees them); a grant is
//         the empty string (the region keys authorise the write) and revoking it guarantees
//         nothing: the owner must keep the memory out of reuse until the writer is known done
//         (its acknowledgement, or its death), see docs/kvtransfer.md.
//
// Semantics every transport keeps (the conformance suite checks them):
// - Registered memory stays valid until deregisterMemory() or the transport's destruction:
//   the destructor winds connections down and may still read it.
// - post() never blocks. local[i] is copied to remote[i]; lengths must match pairwise; every
//   local desc must lie inside a registration of this transport, every remote desc inside a
//   key loaded for that peer, or post() returns kInvalidArgument naming the segment.
// - poll() returns ok only once every byte is at the target (a flush / ack confirms it),
//   kInProgress while running, and the transfer's error otherwise. A finished or failed
//   transfer's id is forgotten after poll() reported the outcome once. Transports tell the
//   target nothing: the writer's owner says "KV in place" over the control plane after
//   poll() returned ok (the workers' PrefillDone message).
// - cancel() stops a transfer: afterwards poll() reports kCancelled and no more bytes of it
//   are written. Bytes already written may stay.
//   When it returns ok the transport no longer reads the transfer's local memory (bytes
//   already handed to the network may still land shortly after). A transfer that already
//   finished, or (depending on the transport) whose last write is already out, cannot be
//   cancelled: cancel() returns kFailedPrecondition and poll() reports the real outcome.
// - A dead peer turns every pending transfer to it into an error (kUnavailable) within
//   the transport's deadline; nothing stays pending forever. A post() to a peer already
//   known dead may return kUnavailable at once instead of an id.
// - Transports are created by name through makeTransport() (transport_factory.h), which
//   also defines TransportOptions (peer deadline, names, transport-specific knobs).
// - Threads: a Transport is driven by one thread (its owner's loop); every method is called
//   from that thread. Implementations may run I/O threads inside; progress() is where their
//   completions become visible.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/base/mem_desc.h"
#include "common/base/status.h"

namespace pd::kvt {

using MemHandle = uint64_t;
using PeerId = uint64_t;
using TransferId = uint64_t;

struct TransportCaps {
  std::string name;         // "cma", "tcp", "ucx", "verbs", "loopback", "fault(tcp)"
  bool hostMemory = true;   // can move kHost / kPinned memory
  bool cudaMemory = false;  // can move kCuda memory (registerMemory accepts it)
  bool cudaStaged = false;  // ... by staging it through pinned host memory (tcp), not directly
  std::string cudaPath;     // how, for the log: "direct GPU memory", "GPUDirect dma-buf",
                            // "staged through pinned host memory"; empty when !cudaMemory
  bool oneSided = false;    // writes land without the target CPU touching the bytes
  // The receiver checks every incoming write against its live write grants (grantWrite), so
  // revokeWrite() fences a writer at once. False: revoking a grant fences nothing.
  bool receiverFenced = false;
  std::string details;  // e.g. the UCX transports in use: "tcp, sysv, posix"
};

// Everything a peer needs to reach us and write into what we exposed.
struct PeerInfo {
  std::string name;                     // for logs and metrics: "decode-0"
  std::string connInfo;                 // from localConnInfo()
  std::vector<std::string> remoteKeys;  // from packRemoteKey(), one per exposed region
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual TransportCaps caps() const = 0;

  virtual Result<MemHandle> registerMemory(const MemDesc& desc) = 0;
  virtual Status deregisterMemory(MemHandle handle) = 0;
  virtual Result<std::string> packRemoteKey(MemHandle handle) = 0;
  virtual Result<std::string> localConnInfo() = 0;

  virtual Result<PeerId> loadPeer(const PeerInfo& peer) = 0;
  // The connection info a peer loaded here needs to load us back (the reply of a two-step
  // exchange, agent.h). Transports with symmetric endpoints need nothing per peer.
  virtual Result<std::string> peerConnInfo(PeerId /*peer*/) { return localConnInfo(); }
  virtual Status unloadPeer(PeerId peer) = 0;
  // False once the transport gave up on a loaded peer (its connection failed or died): posts
  // to it fail at once. The agent then connects again at the next loadPeer of that peer.
  virtual bool peerAlive(PeerId /*peer*/) const { return true; }

  // Receiving side: a capability (opaque bytes for the writer) that lets a peer write only
  // into `ranges`, each inside memory registered here. receiverFenced transports make a fresh
  // unguessable one per call; the others return "" (nothing per grant: the region keys
  // authorise writes). kInvalidArgument names a range outside every registration.
  virtual Result<std::string> grantWrite(const DescList& /*ranges*/) { return std::string(); }
  // Withdraws a grant: on receiverFenced transports no write under it lands after this
  // returns (later and replayed writes are refused); kNotFound for an unknown grant. The
  // others return ok and fence nothing.
  virtual Status revokeWrite(const std::string& /*grant*/) { return Status::ok(); }
  // Writing side: copies local[i] to remote[i] at `peer` (the semantics above). The writes
  // carry `grant`, the receiver's grantWrite() bytes for this writer, or "" where the receiver
  // is not fenced (the region keys authorise the write). Transports without receiver-checked
  // grants (caps().receiverFenced false) ignore it.
  virtual Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                                  const std::string& grant) = 0;
  virtual Status poll(TransferId id) = 0;
  virtual Status cancel(TransferId id) = 0;

  // Advances I/O; returns true when something happened (for callers that spin or sleep).
  virtual bool progress() = 0;
};

}  // namespace pd::kvt
