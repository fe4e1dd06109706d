// LoopInbox: how other threads hand work to a worker's loop thread. Asio callbacks (control
// connections, the router links) never touch loop state; they post closures here, and the loop
// runs them between engine steps.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

#include "common/base/clock.h"

namespace pd::worker {

// A multi-producer queue of closures that one consumer thread runs.
class LoopInbox {
 public:
  // Any thread.
  void post(std::function<void()> fn);
  // Loop thread: runs everything queued; when nothing was queued, first waits up to
  // `timeout` for something to arrive. Returns how many closures ran.
  size_t runPending(std::chrono::microseconds timeout);
  // Loop thread, inside a closure runPending runs: when that closure was posted. A message
  // handler reads it as the message's arrival on this host: the time it then waited for the
  // loop (an engine step running) belongs to the request's latency (the TTFT split).
  SteadyTime postedAt() const { return runningPostedAt_; }

 private:
  struct Item {
    SteadyTime postedAt;
    std::function<void()> fn;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  SteadyTime runningPostedAt_{};  // loop thread only
};

}  // namespace pd::worker
