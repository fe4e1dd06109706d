#include <catch2/catch.hpp>

#include <future>

#include "common/net/request_table.h"

using namespace pd;
using namespace pd::net;
using namespace std::chrono_literals;

namespace {
proto::Envelope chunk(uint64_t id, bool last) {
  proto::Envelope env;
  env.set_request_id(id);
  env.mutable_token_chunk()->add_token_ids(7);
  if (last) env.mutable_token_chunk()->set_finish_reason(proto::FINISH_STOP);
  return env;
}
}  // namespace

TEST_CASE("a deadline fires for a request nobody answers") {
  IoPool io(1);
  RequestTable table(io);
  std::promise<Status> done;
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(table.add(5, 100ms, {nullptr, [&](const Status& s) { done.set_value(s); }}).isOk());
  auto f = done.get_future();
  REQUIRE(f.wait_for(5s) == std::future_status::ready);
  auto waited = std::chrono::steady_clock::now() - t0;
  Status s = f.get();
  CHECK(s.code() == StatusCode::kDeadlineExceeded);
  CHECK(s.message() == "request 5: no answer within 100 ms");
  CHECK(waited >= 100ms);
  CHECK(waited < 2s);
  CHECK(table.size() == 0);
  // A late answer finds nothing.
  CHECK_FALSE(table.dispatch(chunk(5, true)));
}

TEST_CASE("messages stream to their request until the last one") {
  IoPool io(1);
  RequestTable table(io);
  int messages = 0;
  std::vector<Status> ends;
  REQUIRE(table.add(1, 10s, {[&](proto::Envelope&& env) {
                               ++messages;
                               return env.token_chunk().finish_reason() != proto::FINISH_NONE;
                             },
                             [&](const Status& s) { ends.push_back(s); }})
              .isOk());
  CHECK(table.dispatch(chunk(1, false)));
  CHECK(table.dispatch(chunk(1, false)));
  CHECK(ends.empty());
  CHECK(table.dispatch(chunk(1, true)));
  REQUIRE(ends.size() == 1);
  CHECK(ends[0].isOk());
  CHECK(messages == 3);
  CHECK_FALSE(table.dispatch(chunk(1, false)));
  CHECK(table.size() == 0);
}

TEST_CASE("ids, finish, failAll and destruction end each request exactly once") {
  IoPool io(1);
  std::vector<std::pair<uint64_t, Status>> ends;
  auto record = [&](uint64_t id) {
    return PendingCall{nullptr, [&ends, id](const Status& s) { ends.emplace_back(id, s); }};
  };
  {
    RequestTable table(io);
    CHECK(table.add(0, 1s, record(0)).code() == StatusCode::kInvalidArgument);
    CHECK(table.add(1, 0s, record(1)).code() == StatusCode::kInvalidArgument);
    REQUIRE(table.add(1, 10s, record(1)).isOk());
    CHECK(table.add(1, 10s, record(1)).code() == StatusCode::kAlreadyExists);
    REQUIRE(table.add(2, 10s, record(2)).isOk());
    REQUIRE(table.add(3, 10s, record(3)).isOk());
    REQUIRE(table.add(4, 10s, record(4)).isOk());
    CHECK(table.finish(1, cancelled("client went away")));
    CHECK_FALSE(table.finish(1));
    CHECK(table.size() == 3);
    table.failAll(unavailable("connection lost"));
    CHECK(table.size() == 0);
    REQUIRE(table.add(4, 10s, record(4)).isOk());  // ids can be reused once ended
  }  // destroyed with 4 in flight
  REQUIRE(ends.size() == 5);
  CHECK(ends[0].first == 1);
  CHECK(ends[0].second.code() == StatusCode::kCancelled);
  int unavailableCount = 0;
  for (int i = 1; i <= 3; ++i) unavailableCount += ends[i].second.code() == StatusCode::kUnavailable;
  CHECK(unavailableCount == 3);
  CHECK(ends[4].first == 4);
  CHECK(ends[4].second.code() == StatusCode::kCancelled);
  CHECK(ends[4].second.message() == "request table destroyed");
}

TEST_CASE("a callback may end its own request") {
  IoPool io(1);
  RequestTable table(io);
  Status end = internalError("not ended");
  REQUIRE(table.add(9, 10s, {[&](proto::Envelope&&) {
                               table.finish(9, dataLoss("bad chunk"));
                               return false;
                             },
                             [&](const Status& s) { end = s; }})
              .isOk());
  CHECK(table.dispatch(chunk(9, false)));
  CHECK(end.code() == StatusCode::kDataLoss);
  CHECK(table.size() == 0);
}
