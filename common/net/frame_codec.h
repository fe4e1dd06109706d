// The pure decode steps of the framed protocol (framed.h's wire rules), apart from the socket:
// the length header check, the Envelope parse and the first-frame Hello check. framed.cpp's
// connections call exactly these on every frame they read; the fuzz target
// (tests/fuzz/framed_fuzz.cpp) feeds them arbitrary bytes through decodeFrameStream().
//
// Threads: no state; any thread. Errors are the ones framed.h lists, with the messages the
// connection logs (`remote` is the peer's address as the connection names it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/base/status.h"
#include "common/proto/pdserve.pb.h"

namespace pd::net {

inline constexpr size_t kFrameHeaderBytes = 4;

// The 4-byte big-endian length at p.
inline uint32_t frameLengthAt(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// kResourceExhausted when a peer announces a frame over maxFrameBytes.
Status checkFrameLength(uint32_t len, size_t maxFrameBytes, const std::string& remote);

// Parses one frame's payload into *out. Before the handshake (established false) any
// well-formed Envelope passes (checkHello judges it); after it, an Envelope with no known body
// is kInvalidArgument and a second Hello kFailedPrecondition. Bytes that are not an Envelope:
// kDataLoss.
Status decodeEnvelope(const uint8_t* data, uint32_t len, bool established, const std::string& remote,
                      proto::Envelope* out);

// The first frame must be a Hello of kProtocolVersion (framed.h): kFailedPrecondition naming
// what came instead. The connection answers this error with an Error frame before closing.
Status checkHello(const proto::Envelope& env, const std::string& remote);

// Runs the rules above over a whole byte stream the way a connection reads it: frames in
// order, the first one must pass checkHello, every later one reaches onFrame. Returns the
// first error, or OK when the bytes end (whole frames or a partial one; *consumed says how
// far whole frames went). For tests and the fuzzer; the connection reads incrementally.
Status decodeFrameStream(const uint8_t* data, size_t size, size_t maxFrameBytes,
                         const std::function<void(proto::Envelope&&)>& onFrame, size_t* consumed);

}  // namespace pd::net
