#include "worker/loop_inbox.h"

namespace pd::worker {

void LoopInbox::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({steadyNow(), std::move(fn)});
  }
  cv_.notify_one();
}

size_t LoopInbox::runPending(std::chrono::microseconds timeout) {
  std::deque<Item> batch;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (queue_.empty() && timeout.count() > 0) {
      cv_.wait_for(lock, timeout, [&] { return !queue_.empty(); });
    }
    batch.swap(queue_);
  }
  for (auto& item : batch) {
    runningPostedAt_ = item.postedAt;
    item.fn();
  }
  return batch.size();
}

}  // namespace pd::worker
