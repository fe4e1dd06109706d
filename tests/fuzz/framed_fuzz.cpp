// The control plane's frame decoding (common/net/frame_codec.h, what every FramedConnection
// runs on the bytes it reads): length headers, Envelope parses, the first-frame Hello check.
// The input is the byte stream a peer sends. A small frame limit is used as well as the
// default, so the over-limit path is reached by small inputs.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "common/net/frame_codec.h"
#include "common/net/framed.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

std::string frame(const pd::proto::Envelope& env) {
  std::string body = env.SerializeAsString();
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(body.size() >> (24 - 8 * i));
  return out + body;
}

// Seeds: a worker's hello, then a few of the frames that follow it.
void writeSeeds(const std::string& dir) {
  using namespace pd;
  proto::Envelope hello;
  hello.set_version(net::kProtocolVersion);
  hello.mutable_hello()->set_protocol_version(net::kProtocolVersion);
  hello.mutable_hello()->set_role(proto::ROLE_DECODE);
  hello.mutable_hello()->set_worker_id("decode-0");
  std::ofstream(dir + "/hello", std::ios::binary) << frame(hello);
  proto::Envelope cancel;
  cancel.set_version(net::kProtocolVersion);
  cancel.set_request_id(7);
  cancel.mutable_cancel()->set_request_id(7);
  proto::Envelope error;
  error.set_version(net::kProtocolVersion);
  *error.mutable_error() = net::toProtoError(invalidArgument("bad request"));
  std::ofstream(dir + "/hello_cancel_error", std::ios::binary) << frame(hello) + frame(cancel) + frame(error);
  std::ofstream(dir + "/cancel_first", std::ios::binary) << frame(cancel);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!pd::fuzz::seedDir().empty()) writeSeeds(pd::fuzz::seedDir());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pd;
  for (size_t limit : {net::kDefaultMaxFrameBytes, size_t{256}}) {
    size_t consumed = 0;
    size_t frames = 0;
    Status st = net::decodeFrameStream(
        data, size, limit,
        [&](proto::Envelope&& env) {
          ++frames;
          PD_FUZZ_CHECK(env.body_case() != proto::Envelope::BODY_NOT_SET, "frames past the hello have a body");
          (void)net::bodyName(env);
          // What a peer's Error frame becomes on this side.
          if (env.has_error()) (void)net::fromProtoError(env.error()).toString();
          // Re-encoding what was decoded must work (the router forwards some bodies).
          std::string again;
          PD_FUZZ_CHECK(env.SerializeToString(&again), "a decoded envelope re-serializes");
        },
        &consumed);
    PD_FUZZ_CHECK(consumed <= size, "never reads past the bytes");
    if (!st.isOk()) {
      PD_FUZZ_CHECK(!st.message().empty(), "errors say why");
      // The Error frame the connection sends back must serialize.
      proto::Envelope reply;
      *reply.mutable_error() = net::toProtoError(st);
      std::string out;
      PD_FUZZ_CHECK(reply.SerializeToString(&out), "the reject frame serializes");
    }
  }
  return 0;
}
