// LoopInbox: how other threads hand work to a worker's loop thread. Asio callbacks (control
// connections, the router links) never touch loop state; they post closures here, and the loop
// runs them between engine steps.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace pd::worker {

// A multi-producer queue of closures that one consumer thread runs.
class LoopInbox {
 public:
  // Any thread.
  void post(std::function<void()> fn);
  // Loop thread: runs everything queued; when nothing was queued, first waits up to
  // `timeout` for something to arrive. Returns how many closures ran.
  size_t runPending(std::chrono::microseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

}  // namespace pd::worker
