// The tcp transport's like-for-like ceiling (docs/kvtransfer.md): raw loopback TCP that moves the bytes
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
//     group into a scratch buffer) together with the next header in one readv;
//   - memory: the same source segments, and the receiving thread runs in the transport's own
//     receiver process, landing in the buffer the transport lands in.
// Left out: everything the transport does beyond moving bytes: validating headers against
// exposures and grants, scattering group frames, per-transfer acks (one 40-byte "done" per
// stream ends a measurement instead, as cheap as the transport's ack), the owner thread. So
// it bounds the transport from above on the same lane.
//
// Threads: TcpLike on the driver's thread; TcpLikeReceiver's own reader thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "kvtransfer/bench/bench_util.h"
#include "kvtransfer/transport.h"

namespace pd::kvt::bench {

// The receiving end, inside the transport's own receiver process (kvtransfer-bench --role
// recv), landing in the very memory the transport lands in: same process, same pages. Listens
// on loopback at construction; one thread accepts `streams` connections and then reads them
// until destruction.
class TcpLikeReceiver {
 public:
  TcpLikeReceiver(int streams, uint8_t* dest, size_t destBytes);
  ~TcpLikeReceiver();
  TcpLikeReceiver(const TcpLikeReceiver&) = delete;
  TcpLikeReceiver& operator=(const TcpLikeReceiver&) = delete;
  int port() const { return port_; }  // 0: could not listen

 private:
  int listenFd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread reader_;
};

// The sending end, in the driver.
class TcpLike {
 public:
  // Connects `streams` sockets to a TcpLikeReceiver on loopback `port`; ok() is false when
  // that failed.
  TcpLike(int streams, int port);
  ~TcpLike();
  TcpLike(const TcpLike&) = delete;
  TcpLike& operator=(const TcpLike&) = delete;
  bool ok() const { return !fds_.empty(); }

  // GB/s of moving local[i] to offset remote[i].addr - remoteBase of the receiver's memory the
  // way the transport moves that transfer; 0 on error.
  double measure(const DescList& local, const DescList& remote, uintptr_t remoteBase);

  // Several transfers posted back to back (the transport pipelines them: no wait between
  // them), timed until the last one's "done".
  struct Transfer {
    DescList local, remote;
  };
  double measureMany(const std::vector<Transfer>& transfers, uintptr_t remoteBase);

 private:
  std::vector<int> fds_;
};

}  // namespace pd::kvt::bench
