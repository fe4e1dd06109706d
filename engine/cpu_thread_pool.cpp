#include "engine/cpu_thread_pool.h"

#include <immintrin.h>

#include <chrono>

namespace pd::engine {
namespace {

constexpr uint64_t kFieldMask = (uint64_t(1) << 20) - 1;
constexpr uint64_t kGenMask = (uint64_t(1) << 24) - 1;

uint64_t pack(uint32_t gen, uint32_t numTasks, uint32_t next) {
  return (uint64_t(gen & kGenMask) << 40) | (uint64_t(numTasks) << 20) | next;
}
uint32_t genOf(uint64_t s) { return uint32_t(s >> 40); }
uint32_t numTasksOf(uint64_t s) { return uint32_t((s >> 20) & kFieldMask); }
uint32_t nextOf(uint64_t s) { return uint32_t(s & kFieldMask); }

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

uint32_t CpuThreadPool::claimAndRun(uint64_t s, int thread) {
  for (;;) {
    const uint32_t n = numTasksOf(s), next = nextOf(s);
    if (next >= n) return genOf(s);
    // A successful CAS proves the run is still current; it stays current until this task
    // finishes (the caller waits for every task), so fn_ is that run's function.
    if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      (*fn_.load(std::memory_order_acquire))(int(next), thread);
      if (finished_.fetch_add(1, std::memory_order_acq_rel) + 1 == int(n)) {
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_one();
      }
      s = state_.load(std::memory_order_acquire);
    }
  }
}

void CpuThreadPool::run(int numTasks, const TaskFn& fn) {
  if (numTasks <= 0) return;
  if (workers_.empty() || numTasks == 1 || numTasks > kMaxTasks) {
    for (int i = 0; i < numTasks; ++i) fn(i, 0);
    return;
  }
  fn_.store(&fn, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  ++generation_;
  const uint64_t s = pack(generation_, uint32_t(numTasks), 0);
  {
    // Under the lock so a worker about to sleep cannot miss the new run.
    std::lock_guard<std::mutex> lock(mu_);
    state_.store(s, std::memory_order_release);
  }
  wake_.notify_all();
  claimAndRun(s, 0);
  auto allDone = [&] { return finished_.load(std::memory_order_acquire) == numTasks; };
  if (!spinFor(allDone)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, allDone);
  }
}

void CpuThreadPool::workerLoop(int thread) {
  uint32_t seen = 0;
  for (;;) {
    auto ready = [&] {
      return stop_.load(std::memory_order_relaxed) || genOf(state_.load(std::memory_order_acquire)) != seen;
    };
    if (!spinFor(ready)) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, ready);
    }
    if (stop_.load()) return;
    seen = claimAndRun(state_.load(std::memory_order_acquire), thread);
  }
}

}  // namespace pd::engine
