// The tcp transport's like-for-like ceiling (issue 18): raw loopback TCP that moves the bytes
// the transport moves, in the same I/O calls, and does nothing else.
//
// Same as the transport (kvtransfer/transports/tcp, its constants in tcp/tcp_batching.h):
//   - streams: the transport's count, with its striping (1 MiB chunks round robin from 4 MiB
//     transfers up), all on ONE sender thread and ONE receiver thread (Asio's I/O threads);
//   - sockets: loopback, TCP_NODELAY on both ends, kernel-default buffer sizes, non-blocking,
//     poll() when a call would block (Asio's reactor does the same with epoll);
//   - writes: the same batches (<= 4 MiB and <= 256 buffers, a 40-byte header before every
//     payload, payloads under 16 KiB in group frames, the end header in the last batch),
//     gathered straight from the same source segments, <= 64 iovecs per writev (Asio's limit);
//   - reads: header, then for every frame its payload (into place at the frame's offset, or a
//     group into a scratch buffer) together with the next header in one readv.
// Left out: everything the transport does beyond moving bytes: validating headers against
// exposures and grants, scattering group frames, per-transfer acks (one 40-byte "done" per
// stream ends a measurement instead, as cheap as the transport's ack), notifications, the
// owner thread. So it bounds the transport from above on the same lane.
//
// Threads: one object on the driver's thread; the receiver is a child process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvtransfer/bench/bench_util.h"
#include "kvtransfer/transport.h"

namespace pd::kvt::bench {

class TcpLike {
 public:
  // Spawns the receiver (this binary, --role tcplike) with `destBytes` of destination memory
  // and connects `streams` sockets to it; ok() is false when that failed.
  TcpLike(int streams, size_t destBytes);
  ~TcpLike();
  TcpLike(const TcpLike&) = delete;
  TcpLike& operator=(const TcpLike&) = delete;
  bool ok() const { return !fds_.empty(); }

  // GB/s of moving local[i] to offset remote[i].addr - remoteBase of the receiver's memory the
  // way the transport moves that transfer (its end header carries `notification`); 0 on error.
  double measure(const DescList& local, const DescList& remote, uintptr_t remoteBase,
                 const std::optional<std::string>& notification = std::nullopt);

 private:
  Child child_;
  std::vector<int> fds_;
};

// The receiver process (--role tcplike --streams N --bytes B): prints "PORT <p>", accepts N
// connections, reads frames on one thread until QUIT or EOF on stdin.
int runTcpLikeReceiver(int streams, size_t destBytes);

}  // namespace pd::kvt::bench
