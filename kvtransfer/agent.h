// TransferAgent: the one object a worker talks to for KV transfers (docs/design.md §3).
//
// It owns the transports (created by name through makeTransport()), registers every region
// in all of them, and describes itself to peers as ONE protobuf blob (localMetadata():
// name, regions, and per transport its connection info and remote keys) that the control
// plane carries. loadPeer(blob) picks, per peer, the first transport of the preference list
// (default cma, ucx, verbs, tcp) that both sides have and that connects (cma: only a peer on
// this node); the lane is logged and counted in pdserve_kv_peers{transport}; when that is a fabric
// transport and both sides also have tcp, tcp is loaded too as the fallback lane. A fabric
// transfer that fails while the peer is alive on tcp is retried once over tcp, counted in
// pdserve_kv_transfer_fallbacks_total and logged with the reason.
//
// Connecting two agents is a two-step exchange, because some transports (verbs RC QPs) make
// one endpoint per peer pair and each end must know the other's:
//   1. OFFER: the connecting side (a decode worker) calls localMetadata() once PER PEER; each
//      call makes fresh endpoints (a new verbs QP) and the blob goes to that peer only;
//   2. REPLY: the peer calls loadPeer(offer) (verbs: a fresh QP connected to the offered one),
//      then peerMetadata(peer): its own metadata with, per transport it loaded, the connection
//      info that peer needs (verbs: its QP, naming the offered QP);
//   3. the connecting side calls loadPeer(reply): verbs connects exactly the QP it offered to
//      that peer; tcp and ucx load as usual.
// Only after step 3 can fabric transfers flow in either direction. Loading the offer again on
// the answering side (the same blob in every request) returns the same peer.
//
// GPU memory (kCuda): a kCuda region is registered only with the transports whose
// caps().cudaMemory is true (kFailedPrecondition naming each transport's reason when none
// is), and a transfer with a kCuda segment on either side goes over the first preferred
// transport the peer offers whose caps().cudaMemory is true: ucx (direct GPU memory, when UCX
// was built with CUDA), verbs (GPUDirect dma-buf), or tcp (staged through pinned host
// memory). The path is logged once per peer and counted in pdserve_kv_transfer_gpu_path_total
// {path="direct"|"staged"}. A failed direct GPU transfer falls back to tcp only when tcp can
// stage GPU memory here. A transport that claims GPU memory but refuses a kCuda region (verbs on a NIC
// without dma-buf) is logged and skipped for GPU memory from then on.
//
// Threads: one owner thread calls everything (the worker's loop). Errors are Status values
// with messages for a person; nothing throws.
#pragma once

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/base/clock.h"
#include "kvtransfer/lane_rates.h"
#include "kvtransfer/metrics.h"
#include "kvtransfer/transport.h"
#include "kvtransfer/transport_factory.h"

namespace pd::kvt {
namespace proto {
class AgentMetadata;
}

using RegionId = uint64_t;
using AgentPeer = uint64_t;
using AgentTransfer = uint64_t;

struct AgentOptions {
  std::string name = "pdserve";  // announced to peers (their logs and metrics name us so)
  // cma first: it loads only peers on this node (kUnavailable otherwise, and the next name is
  // tried), so same-node peers move KV at memory speed and the rest are unaffected.
  std::vector<std::string> preference = {"cma", "ucx", "verbs", "tcp"};
  TransportOptions transport;  // passed to every transport; localName is set to `name`
  bool fallbackToTcp = true;
};

struct NamedTransport {
  std::string name;  // the factory name it stands for ("ucx", "tcp", ...)
  std::unique_ptr<Transport> transport;
};

class TransferAgent {
 public:
  // Creates the transports of options.preference in order. A name that is not built in or
  // cannot initialise here is skipped with a log line saying why; kUnavailable if none is left.
  static Result<std::unique_ptr<TransferAgent>> create(const AgentOptions& options, prometheus::Registry& registry);
  // Takes ready transports (tests wrap them in FaultTransport); their order is the preference.
  static Result<std::unique_ptr<TransferAgent>> createWith(const AgentOptions& options,
                                                           std::vector<NamedTransport> transports,
                                                           prometheus::Registry& registry);
  ~TransferAgent();

  std::vector<std::string> transportNames() const;
  // What each lane's completed transfers cost (LaneRates; the load reports' lanes).
  const LaneRates& laneRates() const { return laneRates_; }

  // Registers `desc` in every transport and exposes it to peers. Regions registered after
  // localMetadata() was handed out need a fresh exchange before peers can write into them.
  Result<RegionId> registerMemory(const MemDesc& desc);
  Status deregisterMemory(RegionId region);

  // The blob the control plane carries to peers (serialized proto::AgentMetadata).
  Result<std::string> localMetadata();

  // Loads a peer from its metadata blob (an offer or a reply, see above). Loading the same
  // name again returns the same id when the blob is unchanged and its lane alive
  // (Transport::peerAlive), and reconnects (a new id) when the blob changed or the lane died.
  // It never waits for a connection: tcp connects in the background.
  Result<AgentPeer> loadPeer(const std::string& metadata);
  // The peer name a metadata blob carries (what loadPeer keys peers by), without loading it:
  // a caller that must not let one peer replace another checks it first. kInvalidArgument
  // when the blob does not parse.
  static Result<std::string> metadataName(const std::string& metadata);
  // The reply to a loaded peer's offer (serialized proto::AgentMetadata): this agent's regions
  // and, for each transport with a lane to that peer, Transport::peerConnInfo() and our keys.
  // kNotFound for an unknown peer.
  Result<std::string> peerMetadata(AgentPeer peer);
  Status unloadPeer(AgentPeer peer);
  // The transport chosen for a peer ("ucx", "tcp", ...).
  Result<std::string> peerTransport(AgentPeer peer) const;
  Result<std::string> peerName(AgentPeer peer) const;

  // Copies local[i] (inside a region registered here) to remote[i] (inside a region the peer
  // exposed, in the peer's address space); poll() says when all of it is there (the peer
  // hears nothing from the transport: the caller tells it over the control plane).
  // `grant` is the target's grantWrite() blob for this transfer (KvTarget carries it), empty
  // where the target is not fenced: each lane's writes carry that transport's grant, and
  // transports without receiver-checked grants ignore it.
  Result<AgentTransfer> post(const DescList& local, const DescList& remote, AgentPeer peer,
                             const std::string& grant = {});

  // Write grants (transport.h, KV fencing): the receiving side grants `peer` writes into
  // `ranges` (inside regions registered here) over every lane it has to that peer, as one
  // blob (serialized proto::AgentGrant) for the writer's post(). revokeWrite() withdraws it
  // on every transport; the first error is returned, the rest are still revoked.
  Result<std::string> grantWrite(AgentPeer peer, const DescList& ranges);
  Status revokeWrite(const std::string& grant);
  // True when every lane to `peer` is receiverFenced (tcp): a revoked grant fences its writes
  // at once. False for an unknown peer (nothing is known, so nothing is fenced).
  bool receiverFenced(AgentPeer peer) const;
  // True when `peer` is loaded and every lane to it that is not receiver-fenced is dead
  // (Transport::peerAlive false: its connection failed, or for cma its process exited), so
  // none of its one-sided writes can still land (receiver-fenced lanes are fenced by the
  // revoke). False for an unknown peer (unloaded or replaced: that says nothing about the
  // writer).
  bool unfencedLanesDead(AgentPeer peer) const;
  // ok once all data is at the target; kInProgress; or the error (a fallback retry, when
  // one happens, is invisible here except in the metric and the log).
  Status poll(AgentTransfer id);
  Status cancel(AgentTransfer id);

  bool progress();

  // Transfers posted whose outcome poll() has not reported yet (shutdown drains this to 0,
  // with a deadline; tests check nothing is left pending).
  size_t inFlight() const { return entries_.size(); }

 private:
  struct Lane {
    size_t transport = 0;  // index into transports_
    PeerId peer = 0;
  };
  struct PeerState {
    std::string name;
    std::string metadata;
    Lane primary;
    std::optional<Lane> tcpLane;  // only when primary is not tcp
    std::optional<Lane> gpuLane;  // the lane for kCuda transfers (may equal one of the above)
    bool gpuLaneOwned = false;    // gpuLane was loaded for GPU memory alone (unload it too)
    std::string noGpuWhy;         // why there is no gpuLane
    bool gpuPathLogged = false;
  };
  struct Entry {
    AgentPeer peer = 0;
    Lane lane;
    TransferId inner = 0;
    DescList local, remote;  // kept for the fallback retry
    std::string grant;       // kept for the fallback retry
    bool fellBack = false;
    bool canFallBack = false;  // a tcp lane exists that is not this lane and can move the memory
    bool gpu = false;
    SteadyTime start;
    size_t bytes = 0;
  };

  TransferAgent(const AgentOptions& options, std::vector<NamedTransport> transports, prometheus::Registry& registry);
  const std::string& laneName(const Lane& lane) const { return transports_[lane.transport].name; }
  std::optional<size_t> indexOf(const std::string& name) const;
  // The grant bytes of `lane`'s transport inside an agent grant blob ("" when none).
  std::string grantFor(const std::string& grant, const Lane& lane) const;
  proto::AgentMetadata metadataHead() const;
  void addTransport(proto::AgentMetadata* md, size_t transport, std::string connInfo) const;
  // Picks ps.gpuLane (see the header comment), loading an extra lane when needed.
  void resolveGpuLane(PeerState& ps);
  // Counts a GPU transfer's path and logs it the first time for this peer.
  void notePath(PeerState& ps, const Lane& lane);

  AgentOptions options_;
  std::vector<NamedTransport> transports_;
  TransferMetrics metrics_;
  LaneRates laneRates_;
  struct RegionState {
    MemDesc desc;
    std::vector<MemHandle> handles;  // per transport
    std::vector<std::string> keys;   // per transport; empty where not registered (kCuda)
    std::vector<bool> registered;    // per transport
  };
  std::unordered_map<RegionId, RegionState> regions_;
  std::vector<RegionId> regionOrder_;
  std::set<size_t> gpuRefused_;  // transports that claimed GPU memory but refused a kCuda region
  std::unordered_map<AgentPeer, PeerState> peers_;
  std::unordered_map<AgentTransfer, Entry> entries_;
  RegionId nextRegion_ = 1;
  AgentPeer nextPeer_ = 1;
  AgentTransfer nextTransfer_ = 1;
};

}  // namespace pd::kvt
