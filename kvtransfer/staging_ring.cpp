#include "kvtransfer/staging_ring.h"

#include "common/base/log.h"

namespace pd::kvt {

StagingRing::StagingRing(std::shared_ptr<DeviceCopier> copier, size_t slotBytes, size_t slots,
                         std::chrono::milliseconds drainTimeout)
    : copier_(std::move(copier)), slotBytes_(slotBytes), drainTimeout_(drainTimeout), slots_(slots) {}

StagingRing::~StagingRing() {
  const SteadyTime deadline = steadyNow() + drainTimeout_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.copies.empty()) {
      std::vector<uint64_t> ignored;
      Status st = wait(i, deadline, &ignored);
      if (st.code() == StatusCode::kDeadlineExceeded) {
        PD_LOG(kError, "kvt.stage") << "a device copy into bounce buffer " << i << " did not finish within "
                                    << drainTimeout_.count() << " ms; leaking its " << slotBytes_
                                    << " pinned bytes rather than freeing memory a device may still write";
        continue;
      }
    }
    copier_->freePinned(s.buf);
  }
}

Result<char*> StagingRing::buffer(size_t slot) {
  Slot& s = slots_[slot];
  if (!s.buf) {
    PD_ASSIGN_OR_RETURN(void* p, copier_->allocPinned(slotBytes_));
    s.buf = static_cast<char*>(p);
  }
  return s.buf;
}

Status StagingRing::launch(size_t slot, CopyDirection dir, int device, std::span<const CopyPiece> pieces,
                           uint64_t tag) {
  Slot& s = slots_[slot];
  PD_ASSIGN_OR_RETURN(CopyTicket t, copier_->enqueue(dir, device, pieces));
  if (s.copies.empty()) s.launched = steadyNow();
  s.copies.emplace_back(t, tag);
  return Status::ok();
}

Status StagingRing::finish(Slot& s, std::vector<uint64_t>* failedTags) {
  Status st = std::move(s.firstError);
  s.firstError = Status::ok();
  if (failedTags) failedTags->insert(failedTags->end(), s.failedTags.begin(), s.failedTags.end());
  s.failedTags.clear();
  return st;
}

Status StagingRing::query(size_t slot, std::vector<uint64_t>* failedTags) {
  Slot& s = slots_[slot];
  size_t done = 0;
  for (; done < s.copies.size(); ++done) {
    Status st = copier_->query(s.copies[done].first);
    if (st.inProgress()) break;
    if (!st.isOk()) {
      if (s.firstError.isOk()) s.firstError = st;
      s.failedTags.push_back(s.copies[done].second);
    }
  }
  s.copies.erase(s.copies.begin(), s.copies.begin() + ptrdiff_t(done));
  if (!s.copies.empty()) {
    if (done > 0) s.launched = steadyNow();
    return Status(StatusCode::kInProgress, "");
  }
  return finish(s, failedTags);
}

Status StagingRing::wait(size_t slot, SteadyTime deadline, std::vector<uint64_t>* failedTags) {
  Slot& s = slots_[slot];
  while (!s.copies.empty()) {
    Status st = copier_->wait(s.copies.front().first, deadline);
    if (st.code() == StatusCode::kDeadlineExceeded) return st;
    if (!st.isOk()) {
      if (s.firstError.isOk()) s.firstError = st;
      s.failedTags.push_back(s.copies.front().second);
    }
    s.copies.erase(s.copies.begin());
  }
  return finish(s, failedTags);
}

Status StagingRing::waitAll(SteadyTime deadline, std::vector<uint64_t>* failedTags) {
  Status first;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Status st = wait(i, deadline, failedTags);
    if (st.code() == StatusCode::kDeadlineExceeded) return st;
    if (!st.isOk() && first.isOk()) first = st;
  }
  return first;
}

}  // namespace pd::kvt
