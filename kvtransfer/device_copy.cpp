// The host-memcpy copier (tests), the dma-buf range arithmetic, and the CUDA entry points'
// fallbacks for a build without CUDA (device_copy_cuda.cpp defines them otherwise).
#include "kvtransfer/device_copy.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace pd::kvt {

DmaBufRange dmaBufRange(uintptr_t addr, size_t len, size_t pageSize) {
  DmaBufRange r;
  if (pageSize == 0 || len == 0) return r;
  r.base = addr - addr % pageSize;
  const uintptr_t end = addr + len;
  const uintptr_t alignedEnd = end % pageSize == 0 ? end : end + (pageSize - end % pageSize);
  r.size = alignedEnd - r.base;
  r.offset = addr - r.base;
  return r;
}

// ---- HostCopier -------------------------------------------------------------------------------
// A worker thread runs the batches in order; the state is shared with it so the copier can be
// destroyed while the thread drains (the destructor joins it).
class HostCopier::State {
 public:
  explicit State(HostCopierOptions o) : options(o) {}

  HostCopierOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;      // work for the worker / stop
  std::condition_variable doneCv;  // a batch finished
  struct Batch {
    CopyTicket ticket;
    std::vector<CopyPiece> pieces;
    bool fail;
  };
  std::deque<Batch> queue;
  std::unordered_map<CopyTicket, Status> finished;  // reported once, then erased
  std::unordered_set<CopyTicket> pending;
  std::unordered_set<void*> pinned;
  CopyTicket next = 1;
  uint64_t batches = 0;
  uint64_t bytes = 0;
  size_t maxInFlight = 0;
  bool stop = false;
  std::thread worker;

  void run() {
    std::unique_lock lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop with nothing left
      Batch b = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      if (options.delayPerBatch.count() > 0) std::this_thread::sleep_for(options.delayPerBatch);
      size_t n = 0;
      if (!b.fail) {
        for (const auto& p : b.pieces) {
          std::memcpy(p.dst, p.src, p.len);
          n += p.len;
        }
      }
      lock.lock();
      bytes += n;
      pending.erase(b.ticket);
      finished[b.ticket] =
          b.fail ? internalError("host copier: injected failure of copy batch " + std::to_string(b.ticket))
                 : Status::ok();
      doneCv.notify_all();
    }
  }

  Status takeLocked(CopyTicket t) {
    auto it = finished.find(t);
    if (it != finished.end()) {
      Status st = std::move(it->second);
      finished.erase(it);
      return st;
    }
    if (pending.count(t)) return Status(StatusCode::kInProgress, "");
    return notFound("host copier: unknown or already reported copy ticket " + std::to_string(t));
  }
};

HostCopier::HostCopier(HostCopierOptions options) : state_(std::make_shared<State>(options)) {
  state_->worker = std::thread([s = state_] { s->run(); });
}

HostCopier::~HostCopier() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  state_->worker.join();
  for (void* p : state_->pinned) std::free(p);
}

std::string HostCopier::describe() const { return "host memcpy (tests only)"; }

Status HostCopier::checkDeviceMemory(const MemDesc& desc) {
  if (desc.kind != MemKind::kCuda) return invalidArgument("host copier: " + toString(desc) + " is not kCuda");
  return Status::ok();
}

Result<void*> HostCopier::allocPinned(size_t bytes) {
  if (state_->options.failAlloc) return resourceExhausted("host copier: injected allocation failure");
  void* p = std::malloc(bytes);
  if (!p) return resourceExhausted("host copier: malloc of " + std::to_string(bytes) + " bytes failed");
  std::lock_guard lock(state_->mu);
  state_->pinned.insert(p);
  return p;
}

void HostCopier::freePinned(void* p) {
  if (!p) return;
  {
    std::lock_guard lock(state_->mu);
    if (state_->pinned.erase(p) == 0) return;
  }
  std::free(p);
}

Result<CopyTicket> HostCopier::enqueue(CopyDirection, int, std::span<const CopyPiece> pieces) {
  std::lock_guard lock(state_->mu);
  CopyTicket t = state_->next++;
  state_->batches++;
  const bool fail = state_->options.failBatch != 0 && state_->batches == state_->options.failBatch;
  state_->queue.push_back({t, std::vector<CopyPiece>(pieces.begin(), pieces.end()), fail});
  state_->pending.insert(t);
  state_->maxInFlight = std::max(state_->maxInFlight, state_->pending.size());
  state_->cv.notify_all();
  return t;
}

Status HostCopier::query(CopyTicket ticket) {
  std::lock_guard lock(state_->mu);
  return state_->takeLocked(ticket);
}

Status HostCopier::wait(CopyTicket ticket, SteadyTime deadline) {
  std::unique_lock lock(state_->mu);
  if (!state_->doneCv.wait_until(lock, deadline, [&] { return state_->pending.count(ticket) == 0; })) {
    return deadlineExceeded("host copier: copy batch " + std::to_string(ticket) + " did not finish in time");
  }
  return state_->takeLocked(ticket);
}

size_t HostCopier::pinnedOutstanding() const {
  std::lock_guard lock(state_->mu);
  return state_->pinned.size();
}
size_t HostCopier::ticketsOutstanding() const {
  std::lock_guard lock(state_->mu);
  return state_->pending.size() + state_->finished.size();
}
uint64_t HostCopier::batches() const {
  std::lock_guard lock(state_->mu);
  return state_->batches;
}
uint64_t HostCopier::bytesCopied() const {
  std::lock_guard lock(state_->mu);
  return state_->bytes;
}
size_t HostCopier::maxInFlight() const {
  std::lock_guard lock(state_->mu);
  return state_->maxInFlight;
}

#if !PD_HAVE_CUDA
bool cudaDeviceAvailable(std::string* why) {
  if (why) *why = "this build has no CUDA (PD_WITH_CUDA=OFF or no toolkit)";
  return false;
}
Result<std::shared_ptr<DeviceCopier>> makeCudaCopier() {
  return unavailable("device copier: this build has no CUDA (PD_WITH_CUDA=OFF or no toolkit)");
}
Result<DmaBufHandle> exportDmaBuf(const MemDesc& desc) {
  return unimplemented("dma-buf export of " + toString(desc) + ": this build has no CUDA");
}
Status dmaBufSupported(int) { return unimplemented("dma-buf export: this build has no CUDA"); }
#endif

}  // namespace pd::kvt
