#include "common/net/frame_codec.h"

#include "common/net/framed.h"

namespace pd::net {

Status checkFrameLength(uint32_t len, size_t maxFrameBytes, const std::string& remote) {
  if (len <= maxFrameBytes) return Status::ok();
  return resourceExhausted("peer " + remote + " announced a frame of " + std::to_string(len) + " bytes, over the " +
                           std::to_string(maxFrameBytes) + "-byte limit");
}

Status decodeEnvelope(const uint8_t* data, uint32_t len, bool established, const std::string& remote,
                      proto::Envelope* out) {
  if (!out->ParseFromArray(data, static_cast<int>(len))) {
    return dataLoss("peer " + remote + " sent a frame of " + std::to_string(len) +
                    " bytes that is not a valid Envelope");
  }
  if (!established) return Status::ok();
  if (out->body_case() == proto::Envelope::BODY_NOT_SET) {
    return invalidArgument("peer " + remote + " sent an envelope with no known body (newer protocol?)");
  }
  if (out->has_hello()) return failedPrecondition("peer " + remote + " sent a second hello");
  return Status::ok();
}

Status checkHello(const proto::Envelope& env, const std::string& remote) {
  if (!env.has_hello()) {
    return failedPrecondition("peer " + remote + " sent " + bodyName(env) + " as its first frame; expected hello");
  }
  uint32_t v = env.hello().protocol_version();
  if (v != kProtocolVersion || env.version() != kProtocolVersion) {
    return failedPrecondition("protocol version mismatch: peer " + remote + " speaks " +
                              std::to_string(v != kProtocolVersion ? v : env.version()) + ", this side speaks " +
                              std::to_string(kProtocolVersion));
  }
  return Status::ok();
}

Status decodeFrameStream(const uint8_t* data, size_t size, size_t maxFrameBytes,
                         const std::function<void(proto::Envelope&&)>& onFrame, size_t* consumed) {
  const std::string remote = "fuzz";
  bool established = false;
  size_t at = 0;
  *consumed = 0;
  while (size - at >= kFrameHeaderBytes) {
    uint32_t len = frameLengthAt(data + at);
    PD_RETURN_IF_ERROR(checkFrameLength(len, maxFrameBytes, remote));
    if (size - at - kFrameHeaderBytes < len) break;
    proto::Envelope env;
    PD_RETURN_IF_ERROR(decodeEnvelope(data + at + kFrameHeaderBytes, len, established, remote, &env));
    at += kFrameHeaderBytes + size_t{len};
    *consumed = at;
    if (!established) {
      PD_RETURN_IF_ERROR(checkHello(env, remote));
      established = true;
      continue;
    }
    if (onFrame) onFrame(std::move(env));
  }
  return Status::ok();
}

}  // namespace pd::net
