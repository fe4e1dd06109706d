#include "common/engine/cpu_thread_pool.h"

#include <immintrin.h>

#include <chrono>

namespace pd::engine {
namespace {

// Spins until pred() or kSpinMicros pass; returns pred().
template <typename Pred>
bool spinFor(Pred&& pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(CpuThreadPool::kSpinMicros);
  for (int i = 0;; ++i) {
    if (pred()) return true;
    _mm_pause();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return pred();
  }
}

}  // namespace

CpuThreadPool::CpuThreadPool(int numThreads) {
  for (int i = 1; i < numThreads; ++i) workers_.emplace_back([this, i] { workerLoop(i); });
}

CpuThreadPool::~CpuThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
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
  fn_ = &fn;
  numTasks_ = numTasks;
  next_.store(0, std::memory_order_relaxed);
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  {
    // Under the lock so a worker that is about to block cannot miss the new generation.
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  drain(0);
  if (!spinFor([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  fn_ = nullptr;
}

void CpuThreadPool::workerLoop(int thread) {
  uint64_t seen = 0;
  for (;;) {
    auto ready = [&] {
      return stop_.load(std::memory_order_relaxed) || generation_.load(std::memory_order_acquire) != seen;
    };
    if (!spinFor(ready)) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, ready);
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    drain(thread);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_one();
    }
  }
}

}  // namespace pd::engine
