// A small fork-join pool for the CPU backend's attention, element-wise and decode-linear work.
//
// run() hands tasks [0, numTasks) to the pool's workers and to the calling thread and
// returns when every task has finished. Between runs a worker spins for a short while
// (kSpinMicros: decode issues a run every few tens of microseconds, and a futex wake-up
// costs about as much as the work) and then blocks on a condition variable, so idle
// workers do not steal cycles from OpenBLAS's own threads during long GEMMs.
// One caller at a time: run() is not reentrant and must not be called from a task.
// Tasks must not throw.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pd::engine {

class CpuThreadPool {
 public:
  static constexpr int kSpinMicros = 100;

  // numThreads counts the caller: numThreads - 1 workers are started (none when <= 1).
  explicit CpuThreadPool(int numThreads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // fn(task, thread): thread in [0, size()) identifies the executing thread (0 = caller), so
  // tasks can use per-thread scratch.
  using TaskFn = std::function<void(int task, int thread)>;
  void run(int numTasks, const TaskFn& fn);

 private:
  void workerLoop(int thread);
  void drain(int thread);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};  // workers that have not yet finished the current run
  std::atomic<bool> stop_{false};
  const TaskFn* fn_ = nullptr;
  int numTasks_ = 0;
  std::atomic<int> next_{0};
};

}  // namespace pd::engine
