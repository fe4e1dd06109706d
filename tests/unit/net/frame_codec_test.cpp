// frame_codec.h: the decode rules framed.cpp's connections apply, on bytes alone.
#include "common/net/frame_codec.h"

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/net/framed.h"

namespace pd::net {
namespace {

std::string frame(const proto::Envelope& env) {
  std::string body = env.SerializeAsString();
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(body.size() >> (24 - 8 * i));
  return out + body;
}

proto::Envelope hello(uint32_t version = kProtocolVersion) {
  proto::Envelope env;
  env.set_version(version);
  env.mutable_hello()->set_protocol_version(version);
  env.mutable_hello()->set_worker_id("decode-0");
  return env;
}

proto::Envelope cancel(uint64_t id) {
  proto::Envelope env;
  env.set_version(kProtocolVersion);
  env.mutable_cancel()->set_request_id(id);
  return env;
}

Status decode(const std::string& bytes, std::vector<proto::Envelope>* got, size_t* consumed,
              size_t maxFrame = kDefaultMaxFrameBytes) {
  return decodeFrameStream(
      reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), maxFrame,
      [&](proto::Envelope&& e) { got->push_back(std::move(e)); }, consumed);
}

TEST_CASE("frame codec: a hello, then frames in order; a partial frame waits") {
  std::string bytes = frame(hello()) + frame(cancel(7)) + frame(cancel(8));
  std::string partial = frame(cancel(9)).substr(0, 5);
  std::vector<proto::Envelope> got;
  size_t consumed = 0;
  REQUIRE(decode(bytes + partial, &got, &consumed).isOk());
  REQUIRE(got.size() == 2);
  CHECK(got[0].cancel().request_id() == 7);
  CHECK(got[1].cancel().request_id() == 8);
  CHECK(consumed == bytes.size());
}

TEST_CASE("frame codec: the errors framed.h lists, with the connection's messages") {
  std::vector<proto::Envelope> got;
  size_t consumed = 0;
  Status st = decode(frame(cancel(1)), &got, &consumed);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message() == "peer fuzz sent cancel as its first frame; expected hello");
  st = decode(frame(hello(2)), &got, &consumed);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message() == "protocol version mismatch: peer fuzz speaks 2, this side speaks 1");
  st = decode(frame(hello()) + frame(hello()), &got, &consumed);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message() == "peer fuzz sent a second hello");
  proto::Envelope empty;
  empty.set_version(kProtocolVersion);
  st = decode(frame(hello()) + frame(empty), &got, &consumed);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  st = decode(std::string("\0\0\0\2\xff\xff", 6), &got, &consumed);
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK(st.message() == "peer fuzz sent a frame of 2 bytes that is not a valid Envelope");
  st = decode(std::string("\0\0\1\0", 4), &got, &consumed, 255);
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK(st.message() == "peer fuzz announced a frame of 256 bytes, over the 255-byte limit");
  CHECK(got.empty());
}

}  // namespace
}  // namespace pd::net
