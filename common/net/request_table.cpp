#include "common/net/request_table.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace pd::net {

namespace {

struct Entry {
  explicit Entry(boost::asio::io_context& ctx) : timer(ctx) {}
  // Serializes onMessage and onDone of one request; recursive so that a callback may end its
  // own request (finish(id) from inside onMessage).
  std::recursive_mutex mutex;
  PendingCall call;
  bool done = false;
  boost::asio::steady_timer timer;  // touched only under the table's mutex
};

}  // namespace

struct RequestTable::State : std::enable_shared_from_this<RequestTable::State> {
  explicit State(boost::asio::io_context& c) : ctx(c) {}

  // Removes id; returns its entry (null if absent). Cancels the timer.
  std::shared_ptr<Entry> take(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = entries.find(id);
    if (it == entries.end()) return nullptr;
    auto e = std::move(it->second);
    entries.erase(it);
    e->timer.cancel();
    return e;
  }

  static void end(const std::shared_ptr<Entry>& e, const Status& status) {
    std::lock_guard<std::recursive_mutex> lock(e->mutex);
    if (e->done) return;
    e->done = true;
    auto onDone = std::move(e->call.onDone);
    e->call = {};
    if (onDone) onDone(status);
  }

  boost::asio::io_context& ctx;
  mutable std::mutex mutex;
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> entries;
};

RequestTable::RequestTable(IoPool& pool) : state_(std::make_shared<State>(pool.context())) {}

RequestTable::~RequestTable() { failAll(cancelled("request table destroyed")); }

Status RequestTable::add(uint64_t id, std::chrono::steady_clock::duration timeout,
                         PendingCall call) {
  if (id == 0) return invalidArgument("request id 0 is reserved for connection messages");
  if (timeout <= std::chrono::steady_clock::duration::zero()) {
    return invalidArgument("request " + std::to_string(id) + ": timeout must be positive");
  }
  auto e = std::make_shared<Entry>(state_->ctx);
  e->call = std::move(call);
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->entries.emplace(id, e).second) {
    return Status(StatusCode::kAlreadyExists, "request " + std::to_string(id) + " is in flight");
  }
  int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
  e->timer.expires_after(timeout);
  std::weak_ptr<State> weak = state_;
  e->timer.async_wait([weak, id, ms, e](const boost::system::error_code& ec) {
    if (ec) return;  // cancelled: the request ended first
    auto state = weak.lock();
    if (!state) return;
    // Take it only if it is still this entry (the id may have been reused after it ended).
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      auto it = state->entries.find(id);
      if (it == state->entries.end() || it->second != e) return;
      state->entries.erase(it);
    }
    State::end(e, deadlineExceeded("request " + std::to_string(id) + ": no answer within " +
                                   std::to_string(ms) + " ms"));
  });
  return Status::ok();
}

bool RequestTable::dispatch(proto::Envelope&& env) {
  uint64_t id = env.request_id();
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto it = state_->entries.find(id);
    if (it == state_->entries.end()) return false;
    e = it->second;
  }
  bool last = false;
  {
    std::lock_guard<std::recursive_mutex> lock(e->mutex);
    if (e->done) return false;
    if (e->call.onMessage) last = e->call.onMessage(std::move(env));
  }
  if (last) {
    // Remove only this entry (onMessage may have ended it and a new one taken the id).
    bool mine = false;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      auto it = state_->entries.find(id);
      if (it != state_->entries.end() && it->second == e) {
        state_->entries.erase(it);
        e->timer.cancel();
        mine = true;
      }
    }
    if (mine) State::end(e, Status::ok());
  }
  return true;
}

bool RequestTable::finish(uint64_t id, const Status& status) {
  auto e = state_->take(id);
  if (!e) return false;
  State::end(e, status);
  return true;
}

void RequestTable::failAll(const Status& status) {
  std::vector<std::shared_ptr<Entry>> all;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (auto& [id, e] : state_->entries) {
      e->timer.cancel();
      all.push_back(std::move(e));
    }
    state_->entries.clear();
  }
  for (auto& e : all) State::end(e, status);
}

size_t RequestTable::size() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->entries.size();
}

}  // namespace pd::net
