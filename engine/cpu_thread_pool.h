// A small fork-join pool for the CPU backend's attention, element-wise and linear work.
//
// run() publishes tasks [0, numTasks) and returns when every task has FINISHED: the caller
// claims tasks too, and a join never waits for a worker that has not claimed anything. On a
// busy machine a descheduled worker therefore costs nothing (the others drain its share)
// instead of stalling each of the ~40 runs of a decode step for a scheduler time slice.
// Between runs a worker spins for kSpinMicros (decode issues a run every few tens of
// microseconds; a futex wake-up costs about as much as the work), then sleeps on a condition
// variable so idle workers do not steal cycles from long GEMMs.
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
  static constexpr int kMaxTasks = (1 << 20) - 1;

  // numThreads counts the caller: numThreads - 1 workers are started (none when <= 1).
  explicit CpuThreadPool(int numThreads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // fn(task, thread): thread in [0, size()) identifies the executing thread (0 = caller), so
  // tasks can use per-thread scratch. numTasks must be <= kMaxTasks.
  using TaskFn = std::function<void(int task, int thread)>;
  void run(int numTasks, const TaskFn& fn);

 private:
  void workerLoop(int thread);
  // Claims and runs tasks of the run in `state` (and of any run that replaces it while
  // claiming); returns the generation it last saw.
  uint32_t claimAndRun(uint64_t state, int thread);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // One word so a claim is one CAS that also proves which run it belongs to:
  // [generation:24][numTasks:20][next task:20].
  std::atomic<uint64_t> state_{0};
  std::atomic<const TaskFn*> fn_{nullptr};
  std::atomic<int> finished_{0};
  std::atomic<bool> stop_{false};
  uint32_t generation_ = 0;  // caller only
};

}  // namespace pd::engine
