// How the tcp transport cuts a stream's segments into writes (tcp_sender.cpp pump(), post()
// striping), as plain constants without Asio: the transport and its like-for-like ceiling in
// kvtransfer-bench (bench/tcp_like.cpp) read the same numbers, so the ceiling moves
// its bytes in the same I/O sizes.
#pragma once

#include <cstddef>

namespace pd::kvt::tcpimpl {

inline constexpr size_t kMaxBatchBytes = 4 << 20;   // bounds cancel latency and interleaving
inline constexpr size_t kMaxBatchBuffers = 256;     // per gathered write (Asio issues 64 per writev)
inline constexpr size_t kSmallPayload = 16 << 10;   // smaller payloads travel in group frames
inline constexpr size_t kStripeMinBytes = 4 << 20;  // smaller transfers stay on one stream
inline constexpr size_t kStripeChunk = 1 << 20;
inline constexpr size_t kWireHeaderBytes = 40;  // every frame's header (WireHeader)

}  // namespace pd::kvt::tcpimpl
