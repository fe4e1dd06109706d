// The libibverbs transport: RC queue pairs, RDMA WRITE into the peer's ibv_reg_mr memory
// (work-request planning: verbs_codec.h).
//
// Connection set-up: an RC QP must know its partner's QP number, so every peer pair needs a
// two-way exchange, one QP per pair on each side (pairing rules: verbs::PendingQps):
//   1. the offering side calls localConnInfo() once per peer: it creates a fresh QP (INIT) and
//      returns an OFFER (LID/GID, QP number, PSN, this side's name);
//   2. the answering side calls loadPeer() with the offer: it creates a fresh QP, connects it
//      to the offered one (INIT -> RTR -> RTS) and peerConnInfo(peer) returns the REPLY, which
//      also names the offered QP number;
//   3. the offering side calls loadPeer() with the reply: it connects exactly the QP named
//      there, so replies from many peers may come back in any order.
// The older symmetric form still works: both sides call localConnInfo() and load each other's
// offer; an offer then connects the oldest pending QP (so an agent that both offers and
// answers must not mix the two forms). Both sides need the peer loaded even when only one
// writes: an RC WRITE needs the target's QP connected to the writer's.
// An offered QP that is never answered stays pending until the transport is destroyed.
//
// Completion: the last WRITE of a transfer is always signalled; RC completes a QP's work
// requests in order and only after the target acknowledged them, so its completion means every
// byte is in the target's memory. A transfer past VerbsOptions::transferTimeout fails with
// kDeadlineExceeded and its QP goes to the error state (re-exchange connection info to
// reconnect); a dead peer shows up as a retry-exceeded completion -> kUnavailable.
// cancel() stops posting; WRITEs already posted may still land.
//
// No device: makeVerbsTransport() returns kUnavailable "verbs: no RDMA device found ..." and
// the agent moves on to the next transport. Threads: one owner thread, as transport.h says.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/base/status.h"
#include "kvtransfer/transport.h"

namespace pd::kvt {

struct VerbsOptions {
  std::string localName = "verbs";  // announced to peers (for their logs)
  std::string deviceName;           // e.g. "mlx5_0"; empty = the first device found
  uint8_t port = 1;
  int gidIndex = 0;  // RoCE needs a GID; on InfiniBand the LID is used
  std::chrono::milliseconds transferTimeout{30000};
  uint32_t maxSendWr = 1024;  // send queue depth per QP
  uint32_t signalEvery = 64;  // selective signalling period
  uint32_t maxSge = 16;       // capped by the device's limit
};

Result<std::unique_ptr<Transport>> makeVerbsTransport(const VerbsOptions& options = {});

}  // namespace pd::kvt
