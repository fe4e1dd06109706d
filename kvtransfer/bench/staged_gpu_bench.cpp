// kvtransfer-bench, GPU part: tcp staged through pinned host memory, device memory to device
// memory (cudaMalloc on device 0 on both ends, two tcp transports in this process over
// loopback), next to the device<->host cudaMemcpy bandwidth measured in the same run.
// Without a device it prints "skipped: no CUDA device" and measures nothing.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kvtransfer/device_copy.h"
#include "kvtransfer/transports/tcp_transport.h"

#if PD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace pd::kvt::bench {

void runStagedGpu(bool quick) {
  std::printf("\n== tcp staged GPU memory (device -> pinned -> tcp -> pinned -> device, one process)\n");
  std::string why;
  if (!cudaDeviceAvailable(&why)) {
    std::printf("  skipped: %s\n", why.c_str());
    return;
  }
#if PD_HAVE_CUDA
  using Clock = std::chrono::steady_clock;
  const size_t bytes = size_t(quick ? 128 : 512) << 20;
  const size_t seg = 64 << 10;
  void *src = nullptr, *dst = nullptr, *host = nullptr;
  if (cudaMalloc(&src, bytes) != cudaSuccess || cudaMalloc(&dst, bytes) != cudaSuccess ||
      cudaHostAlloc(&host, bytes, cudaHostAllocDefault) != cudaSuccess) {
    std::printf("  skipped: cannot allocate %zu MiB on device 0 and pinned host\n", bytes >> 20);
    cudaFree(src);
    cudaFree(dst);
    return;
  }
  cudaMemset(src, 0x5a, bytes);
  auto copyGbps = [&](void* to, const void* from) {
    double best = 0;
    for (int r = 0; r < 3; ++r) {
      auto t0 = Clock::now();
      cudaMemcpy(to, from, bytes, cudaMemcpyDefault);
      best = std::max(best, double(bytes) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    }
    return best;
  };
  const double d2h = copyGbps(host, src), h2d = copyGbps(dst, host);
  std::printf("  ceilings: cudaMemcpy device->pinned %.2f GB/s, pinned->device %.2f GB/s\n", d2h, h2d);

  TransportOptions o;
  o.localName = "bench";
  o.peerTimeout = std::chrono::milliseconds(10000);
  auto a = TcpTransport::create(o), b = TcpTransport::create(o);
  if (!a.ok() || !b.ok()) {
    std::printf("  ERROR %s\n", (a.ok() ? b.status() : a.status()).toString().c_str());
    return;
  }
  MemDesc sd{reinterpret_cast<uintptr_t>(src), bytes, 0, MemKind::kCuda};
  MemDesc dd{reinterpret_cast<uintptr_t>(dst), bytes, 0, MemKind::kCuda};
  auto ha = (*a)->registerMemory(sd);
  auto hb = (*b)->registerMemory(dd);
  if (!ha.ok() || !hb.ok()) {
    std::printf("  ERROR %s\n", (ha.ok() ? hb.status() : ha.status()).toString().c_str());
    return;
  }
  PeerInfo pi{"bench", (*b)->localConnInfo().value(), {(*b)->packRemoteKey(*hb).value()}};
  auto peer = (*a)->loadPeer(pi);
  if (!peer.ok()) {
    std::printf("  ERROR %s\n", peer.status().toString().c_str());
    return;
  }
  DescList l, r;
  for (size_t off = 0; off < bytes; off += seg) {
    l.push_back({sd.addr + off, seg, 0, MemKind::kCuda});
    r.push_back({dd.addr + off, seg, 0, MemKind::kCuda});
  }
  double best = 0;
  for (int round = 0; round < (quick ? 2 : 4); ++round) {
    auto t0 = Clock::now();
    auto id = (*a)->post(l, r, *peer, {});
    if (!id.ok()) {
      std::printf("  ERROR %s\n", id.status().toString().c_str());
      return;
    }
    Status st(StatusCode::kInProgress, "");
    while (st.inProgress()) {
      (*a)->progress();
      (*b)->progress();
      st = (*a)->poll(*id);
      if (st.inProgress()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (!st.isOk()) {
      std::printf("  ERROR %s\n", st.toString().c_str());
      return;
    }
    best = std::max(best, double(bytes) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  std::printf("  %zu MiB in %zu segments of 64 KiB: %.2f GB/s (best of %d rounds; %s)\n", bytes >> 20, l.size(), best,
              quick ? 2 : 4, (*a)->caps().details.c_str());
  a->reset();
  b->reset();
  cudaFree(src);
  cudaFree(dst);
  cudaFreeHost(host);
#endif
}

}  // namespace pd::kvt::bench
