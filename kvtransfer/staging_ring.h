// StagingRing: a ring of pinned bounce buffers ("slots", allocated on first use) and the
// device copies outstanding on each, for transports that stage kCuda memory through host
// memory (tcp). The caller decides the order slots are used in; the ring tracks, per slot, the
// copy batches launched on it (each tagged with the caller's transfer id) so a slot is reused
// only after its copies finished and a failed copy names the transfers it belongs to.
//
// Threads: not thread-safe; one owner (a tcp stream or connection, on the I/O thread).
// Waits are bounded by the deadline given. The destructor waits (up to drainTimeout) for the
// copies still outstanding and frees the buffers; a buffer whose copy never finished is not
// freed (a device may still write into it) and the leak is logged.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kvtransfer/device_copy.h"

namespace pd::kvt {

class StagingRing {
 public:
  StagingRing(std::shared_ptr<DeviceCopier> copier, size_t slotBytes, size_t slots,
              std::chrono::milliseconds drainTimeout);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  size_t slots() const { return slots_.size(); }
  size_t slotBytes() const { return slotBytes_; }

  // The slot's buffer (slotBytes), allocated with the copier's allocPinned() on first use.
  Result<char*> buffer(size_t slot);
  // Queues one copy batch whose host side lies in `slot`'s buffer.
  Status launch(size_t slot, CopyDirection dir, int device, std::span<const CopyPiece> pieces, uint64_t tag);
  bool busy(size_t slot) const { return !slots_[slot].copies.empty(); }
  // When the slot's oldest outstanding batch was launched (for the caller's deadline).
  SteadyTime launchedAt(size_t slot) const { return slots_[slot].launched; }

  // ok once every batch of the slot finished without error; kInProgress; or the first error
  // once every batch finished, with the tags of the failed batches appended to *failedTags.
  // A finished slot is free again either way.
  Status query(size_t slot, std::vector<uint64_t>* failedTags);
  // The same, blocking until `deadline` (kDeadlineExceeded leaves the slot busy).
  Status wait(size_t slot, SteadyTime deadline, std::vector<uint64_t>* failedTags);
  Status waitAll(SteadyTime deadline, std::vector<uint64_t>* failedTags);

 private:
  struct Slot {
    char* buf = nullptr;
    std::vector<std::pair<CopyTicket, uint64_t>> copies;  // in launch order
    SteadyTime launched{};
    Status firstError;
    std::vector<uint64_t> failedTags;
  };
  Status finish(Slot& s, std::vector<uint64_t>* failedTags);

  std::shared_ptr<DeviceCopier> copier_;
  size_t slotBytes_;
  std::chrono::milliseconds drainTimeout_;
  std::vector<Slot> slots_;
};

}  // namespace pd::kvt
