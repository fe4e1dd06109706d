// RequestTable: the requests in flight on a multiplexed connection, each with a deadline, so
// that no wait is unbounded (DESIGN.md §1).
//
//   RequestTable calls(io);
//   calls.add(id, std::chrono::seconds(30), {
//       .onMessage = [](proto::Envelope&& env) { ...; return env.token_chunk().finish_reason()
//                                                       != proto::FINISH_NONE; },
//       .onDone = [](const Status& s) { /* ok, or why it ended */ }});
//   conn->send(generateEnvelope(id));
//   // in the connection's onMessage:  calls.dispatch(std::move(env));
//   // in the connection's onClose:    calls.failAll(unavailable("router connection lost"));
//
// Every added request ends exactly once, through onDone, with:
//   ok                     onMessage returned true (the last message arrived), or finish(id)
//   kDeadlineExceeded      its deadline passed first ("request 42: no answer within 500 ms")
//   the given status       finish(id, status), failAll(status)
//   kCancelled             the table was destroyed with the request still in it
// After onDone ran, no onMessage runs for that request; dispatch() of its id returns false.
//
// Threads: every method may be called from any thread. onMessage runs on the thread that
// calls dispatch() (for a connection: its strand); onDone runs on the thread that ends the
// request: dispatch()'s, finish()'s, failAll()'s, or an IoPool thread for deadlines. For one
// request, onMessage and onDone never run at the same time. They may call finish() and add()
// (also for their own id) but must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "common/base/status.h"
#include "common/net/io_pool.h"
#include "common/proto/pdserve.pb.h"

namespace pd::net {

struct PendingCall {
  // Returns true when env is the request's last message.
  std::function<bool(proto::Envelope&&)> onMessage;
  std::function<void(const Status&)> onDone;
};

class RequestTable {
 public:
  // The pool runs the deadline timers; it must outlive the table.
  explicit RequestTable(IoPool& pool);
  ~RequestTable();  // ends what is left with kCancelled
  RequestTable(const RequestTable&) = delete;
  RequestTable& operator=(const RequestTable&) = delete;

  // kAlreadyExists when id is in flight; kInvalidArgument for id 0 (reserved for
  // connection-level messages) or a timeout <= 0.
  Status add(uint64_t id, std::chrono::steady_clock::duration timeout, PendingCall call);
  // Routes env to its request by env.request_id(); false if no such request (late or
  // unknown: the caller decides whether that is worth a log line).
  bool dispatch(proto::Envelope&& env);
  // Ends the request with status (ok by default); false if it had already ended.
  bool finish(uint64_t id, const Status& status = Status::ok());
  void failAll(const Status& status);
  size_t size() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace pd::net
