// The device-independent half of the verbs transport: blob formats and how segment pairs
// become RDMA WRITE work requests. Pure functions over plain values, so CI (which has no RDMA
// device) tests all of it; verbs_transport.cpp only turns these plans into ibv_* calls.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "common/base/status.h"

namespace pd::kvt::verbs {

// ---- blobs -----------------------------------------------------------------------------------
// Serialized as kvt.proto's VerbsRemoteKey / VerbsConnInfo. Decoding never crashes on any
// input: bytes that are not such a message, or are cut short, are kDataLoss; another blob
// (bad magic), another version or out-of-range values are kInvalidArgument, naming which.
// Unknown fields are skipped (protobuf's rule), so trailing bytes that happen to form valid
// fields are not detected.
struct PackedKey {
  uint64_t addr = 0;
  uint64_t len = 0;
  uint32_t rkey = 0;
};
std::string encodeKey(const PackedKey& key);
Result<PackedKey> decodeKey(const std::string& blob);

struct ConnInfo {
  std::string name;               // the sender's name, for the peer's logs
  uint16_t lid = 0;               // InfiniBand LID (0 on RoCE)
  std::array<uint8_t, 16> gid{};  // GID (RoCE, or global routing on IB)
  uint8_t gidIndex = 0;
  uint8_t port = 1;
  uint8_t mtu = 0;   // enum ibv_mtu value of the port's active MTU
  uint32_t qpn = 0;  // 24-bit queue pair number
  uint32_t psn = 0;  // 24-bit initial packet sequence number
  // Set in a REPLY: the QP number of the receiver's QP that `qpn` is already connected to.
  // Absent in an OFFER (a QP waiting for its partner).
  std::optional<uint32_t> peerQpn;
};
std::string encodeConnInfo(const ConnInfo& info);
Result<ConnInfo> decodeConnInfo(const std::string& blob);

// ---- QP pairing ------------------------------------------------------------------------------
// Which local QP a loaded connection info connects (verbs_transport.h, "Connection set-up").
// localConnInfo() creates a QP and offers it (offer()); loadPeer() asks choose():
//   - a REPLY (peerQpn set) connects exactly the pending QP it names; a QP number that is not
//     pending here (never offered, already connected, or from another transport instance) is
//     kFailedPrecondition, never a guess;
//   - an OFFER connects the oldest pending QP when there is one (the symmetric protocol: both
//     sides called localConnInfo() once per peer), and otherwise needs a fresh QP (nullopt):
//     the answering side of the two-step exchange creates one per offer.
// Device-free so CI tests it; the transport keeps the ibv_qp* per QP number.
class PendingQps {
 public:
  void offer(uint32_t qpn) { order_.push_back(qpn); }
  Result<std::optional<uint32_t>> choose(const ConnInfo& remote) const;
  // The QP got connected (or destroyed): it is no longer pending.
  void take(uint32_t qpn);
  size_t size() const { return order_.size(); }
  const std::deque<uint32_t>& all() const { return order_; }

 private:
  std::deque<uint32_t> order_;  // oldest first
};

// ---- work requests -------------------------------------------------------------------------
struct SegmentPair {
  uint64_t localAddr = 0;
  uint32_t lkey = 0;
  uint64_t remoteAddr = 0;
  uint32_t rkey = 0;
  uint64_t len = 0;
};

struct Sge {
  uint64_t addr = 0;
  uint32_t len = 0;
  uint32_t lkey = 0;
};

// One RDMA WRITE: a contiguous remote range filled from up to maxSge local pieces.
struct WritePlan {
  uint64_t remoteAddr = 0;
  uint32_t rkey = 0;
  uint64_t bytes = 0;
  std::vector<Sge> sges;
};

struct BatchLimits {
  uint32_t maxSge = 1;                // device's max_sge (capped by the QP's cap.max_send_sge)
  uint64_t maxMsgBytes = 1ull << 30;  // port's max_msg_sz; also split below 2^32 (sge.length)
};

// Packs segment pairs into as few WRITEs as the limits allow: a pair joins the previous WRITE
// when its remote range continues it with the same rkey (locally contiguous pieces with the
// same lkey merge into one SGE); a segment longer than maxMsgBytes is split. Zero-length
// pairs are skipped. kInvalidArgument when a limit is zero.
Result<std::vector<WritePlan>> planWrites(const std::vector<SegmentPair>& pairs, const BatchLimits& limits);

// Selective signalling: WR `index` of `total` is signalled every `every` WRs and always last,
// so the send queue is reclaimed regularly and the last completion proves the whole transfer.
inline bool shouldSignal(size_t index, size_t total, uint32_t every) {
  return index + 1 == total || (every > 0 && (index + 1) % every == 0);
}

// Send-queue bookkeeping for one RC QP. A QP holds at most `depth` outstanding WRs; with
// selective signalling an unsignalled WR's slot comes back only with the next signalled
// completion, and completions arrive in posting order. The window decides which WRs to signal
// (every `signalEvery`-th on the QP, and each transfer's last) and accounts the slots, so the
// transport never overfills the queue and learns when a transfer's last WR completed.
// A cancelled transfer's unsignalled tail is covered by the next signalled WR on the QP.
class SendWindow {
 public:
  // signalEvery is clamped to [1, depth / 2] so room always comes back; depth >= 2.
  SendWindow(uint32_t depth, uint32_t signalEvery);
  uint32_t room() const { return depth_ - used_; }
  uint32_t used() const { return used_; }
  size_t signalledOutstanding() const { return fifo_.size(); }
  // Records WR `index` of a transfer of `total` WRs as posted (room() must be > 0); returns
  // true when it must carry IBV_SEND_SIGNALED.
  bool onPost(uint64_t transfer, size_t index, size_t total);
  struct Completed {
    uint64_t transfer;
    bool last;  // the transfer's final WR: every byte of it is at the target
  };
  // A (signalled) completion arrived; returns what it completed, nullopt when none was
  // outstanding (a protocol error the caller reports).
  std::optional<Completed> onCompletion();

 private:
  struct Entry {
    uint64_t transfer;
    uint32_t wrs;
    bool last;
  };
  uint32_t depth_;
  uint32_t every_;
  uint32_t used_ = 0;
  uint32_t sinceSignal_ = 0;
  std::deque<Entry> fifo_;
};

}  // namespace pd::kvt::verbs
