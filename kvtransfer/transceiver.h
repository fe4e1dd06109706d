// KvTransceiver: KV-cache transfers in the workers' terms (requests, layers, blocks) over a
// TransferAgent (DESIGN.md §1 steps 3-4).
//
// Prefill side: send(R, source, target, a, b) pushes request R's KV for layers [a, b) of its
// blocks into the decode worker's blocks; call it per layer as layers are computed. Runs of
// consecutive block ids (on both sides) become one segment per layer. Each transfer carries
// a KvNotify{R, a, b, numLayers}. An event kSent is reported once every layer of the model
// was confirmed at the target; kSendFailed once, at the first failure (the request's other
// transfers are cancelled).
// Decode side: expect(R, numLayers, deadline) then poll(): kReceived once notifications for
// every layer arrived (a notification is delivered only after its data), kReceiveFailed
// with kDeadlineExceeded naming the missing layers when the deadline passes first.
//
// Byte ranges only: this module includes engine/kv_layout.h (header-only) and links nothing
// of engine. Threads: one owner thread, the same that drives the agent.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/base/clock.h"
#include "common/engine/kv_layout.h"
#include "kvtransfer/agent.h"

namespace pd::kvt {

using RequestId = uint64_t;

// The local side: a KV region (registered with the agent) and the request's block ids.
struct KvSource {
  uintptr_t base = 0;
  engine::KvLayout layout;
  std::vector<int> blockIds;
  MemKind kind = MemKind::kHost;  // kCuda for a GPU KV cache (the agent then picks a GPU path)
  int device = 0;                 // CUDA ordinal for kCuda
};

// The remote side, as the decode worker described it: its peer (loaded into the agent), the
// base address of its KV region in ITS address space, its layout and the reserved blocks.
struct KvTarget {
  AgentPeer peer = 0;
  uintptr_t base = 0;
  engine::KvLayout layout;
  std::vector<int> blockIds;
  MemKind kind = MemKind::kHost;  // the memory kind of the peer's KV region, as it described it
  int device = 0;
};

enum class KvEventKind { kSent, kSendFailed, kReceived, kReceiveFailed };
const char* kvEventKindName(KvEventKind kind);

struct KvEvent {
  RequestId request = 0;
  KvEventKind kind = KvEventKind::kSent;
  Status status;  // the error for the *Failed kinds
};

struct Segments {
  DescList local;
  DescList remote;
};

class KvTransceiver {
 public:
  explicit KvTransceiver(TransferAgent& agent, const Clock& clock = SystemClock::instance());

  // The (local, remote) segments for layers [layerBegin, layerEnd); kInvalidArgument when the
  // two layouts disagree on the block shape or layer count, a block id or layer is out of
  // range, or the block lists differ in length.
  static Result<Segments> buildSegments(const KvSource& source, const KvTarget& target, int layerBegin,
                                        int layerEnd);

  Status send(RequestId request, const KvSource& source, const KvTarget& target, int layerBegin,
              int layerEnd);
  // Cancels the request's transfers still in flight; no event follows for it.
  Status cancelSend(RequestId request);

  Status expect(RequestId request, int numLayers, Deadline deadline);
  Status cancelExpect(RequestId request);

  // Progresses the agent, harvests completions and notifications, checks deadlines.
  std::vector<KvEvent> poll();

  size_t pendingSends() const { return sends_.size(); }
  size_t pendingExpects() const { return expects_.size(); }

 private:
  struct SendState {
    int numLayers = 0;
    std::vector<bool> done;
    std::vector<std::pair<AgentTransfer, std::pair<int, int>>> inFlight;
  };
  struct ExpectState {
    std::vector<bool> arrived;
    Deadline deadline;
  };
  void onNotification(const Notification& n, std::vector<KvEvent>& events);

  TransferAgent& agent_;
  const Clock& clock_;
  std::unordered_map<RequestId, SendState> sends_;
  std::unordered_map<RequestId, ExpectState> expects_;
  // Notifications that arrived before expect() (bounded; the oldest are dropped).
  std::map<RequestId, std::vector<std::pair<int, int>>> early_;
};

}  // namespace pd::kvt
