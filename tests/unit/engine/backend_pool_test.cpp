// CpuThreadPool: every task runs exactly once per run, runs never overlap, and a join does
// not wait for a worker that claimed nothing.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "engine/cpu_thread_pool.h"

using pd::engine::CpuThreadPool;

TEST_CASE("every task of every run executes exactly once") {
  for (int threads : {1, 2, 4}) {
    CpuThreadPool pool(threads);
    CHECK(pool.size() == threads);
    for (int run = 0; run < 2000; ++run) {
      const int n = 1 + (run * 7919) % 37;
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> badThread{0};
      pool.run(n, [&](int task, int thread) {
        hits[task].fetch_add(1);
        if (thread < 0 || thread >= threads) badThread.fetch_add(1);
      });
      for (int i = 0; i < n; ++i) REQUIRE(hits[i].load() == 1);
      REQUIRE(badThread.load() == 0);
    }
  }
}

TEST_CASE("a slow task delays only its own run, and the others drain the rest") {
  CpuThreadPool pool(3);
  // Which thread takes which task is up to the scheduler (on 2 cores the pool's threads may
  // take them all before the caller starts): check that every task ran once, not who ran it.
  std::vector<std::atomic<int>> ran(64);
  const auto t0 = std::chrono::steady_clock::now();
  pool.run(64, [&](int task, int) {
    if (task == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran[task].fetch_add(1);
  });
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms >= 20.0);
  CHECK(ms < 2000.0);
  for (auto& r : ran) CHECK(r.load() == 1);
}
