#include "common/net/io_pool.h"

#include <pthread.h>

#include <exception>
#include <mutex>
#include <optional>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "common/base/log.h"

namespace pd::net {

namespace {
thread_local const IoPool* tCurrentPool = nullptr;
}  // namespace

struct IoPool::Impl {
  boost::asio::io_context context;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guard;
  std::mutex stopMutex;
  bool stopped = false;
};

IoPool::IoPool(int threads, std::string name) : impl_(std::make_unique<Impl>()) {
  if (threads < 1) threads = 1;
  impl_->guard.emplace(impl_->context.get_executor());
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, i, name] {
      std::string tname = (name + "-" + std::to_string(i)).substr(0, 15);
      pthread_setname_np(pthread_self(), tname.c_str());
      tCurrentPool = this;
      // Handlers must not throw (docs/design.md §9); if one does, log it and keep the thread
      // serving rather than take the process down from an I/O thread.
      for (;;) {
        try {
          impl_->context.run();
          break;
        } catch (const std::exception& e) {
          PD_LOG(kError, "net") << "exception escaped an I/O handler: " << e.what();
        }
      }
      tCurrentPool = nullptr;
    });
  }
}

IoPool::~IoPool() { stop(); }

boost::asio::io_context& IoPool::context() { return impl_->context; }

void IoPool::post(std::function<void()> fn) { boost::asio::post(impl_->context, std::move(fn)); }

bool IoPool::inPoolThread() const { return tCurrentPool == this; }

void IoPool::stop() {
  std::lock_guard<std::mutex> lock(impl_->stopMutex);
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->guard.reset();
  impl_->context.stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

}  // namespace pd::net
