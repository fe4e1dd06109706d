// IoPool: N threads running one Asio io_context, shared by every socket, timer and HTTP
// session of a process (the router's Beast server runs on the same context).
//
// Lifetime: the pool must outlive everything created on its context (servers, connections,
// request tables). Destroying the pool stops the context, joins the threads and destroys the
// handlers still queued, which releases the objects they kept alive.
// Threads: context(), post() and inPoolThread() may be called from any thread. stop() and the
// destructor must not be called from a pool thread (they join the pool's threads).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace boost::asio {
class io_context;
}  // namespace boost::asio

namespace pd::net {

class IoPool {
 public:
  // threads >= 1. name tags the threads ("pd-io-0") for debuggers and logs.
  explicit IoPool(int threads, std::string name = "pd-io");
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  boost::asio::io_context& context();
  int threads() const { return static_cast<int>(threads_.size()); }
  // Runs fn on a pool thread soon.
  void post(std::function<void()> fn);
  bool inPoolThread() const;
  // Stops the context and joins the threads; idempotent. Pending handlers are not run.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::thread> threads_;
};

}  // namespace pd::net
