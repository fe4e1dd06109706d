#include "common/engine/cpu_thread_pool.h"

namespace pd::engine {

CpuThreadPool::CpuThreadPool(int numThreads) {
  for (int i = 1; i < numThreads; ++i) workers_.emplace_back([this, i] { workerLoop(i); });
}

CpuThreadPool::~CpuThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void CpuThreadPool::drain(int thread) {
  for (;;) {
    const int task = next_.fetch_add(1, std::memory_order_relaxed);
    if (task >= numTasks_) return;
    (*fn_)(task, thread);
  }
}

void CpuThreadPool::run(int numTasks, const TaskFn& fn) {
  if (numTasks <= 0) return;
  if (workers_.empty() || numTasks == 1) {
    for (int i = 0; i < numTasks; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    numTasks_ = numTasks;
    next_.store(0, std::memory_order_relaxed);
    pending_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  drain(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return pending_ == 0; });
  fn_ = nullptr;
}

void CpuThreadPool::workerLoop(int thread) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(thread);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

}  // namespace pd::engine
