// GPU memory over tcp with the real CUDA copier (label gpu): cudaMalloc'd buffers on both
// sides, two tcp transports in one process, bytes checked after copying back. Nothing timed.
// Without a device every case skips with a message (and fails under PD_REQUIRE_GPU=1).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "kvtransfer/agent.h"
#include "kvtransfer/device_copy.h"
#include "kvtransfer/transports/tcp_transport.h"
#include "tests/test_skip.h"

namespace pd::kvt {
namespace {

using namespace std::chrono_literals;

// A ctest skip without a device, a failure under PD_REQUIRE_GPU=1 (tests/test_skip.h).
bool haveGpu() {
  std::string why;
  if (!cudaDeviceAvailable(&why)) pd::test::requireGpu(why.empty() ? "no CUDA device" : why);
  return true;
}

#define PD_CUDA_OK(call) REQUIRE(std::string(cudaGetErrorName(call)) == "cudaSuccess")

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n) { PD_CUDA_OK(cudaMalloc(&p, n)); }
  ~DeviceBuffer() { cudaFree(p); }
  MemDesc desc(size_t off = 0, size_t len = SIZE_MAX) const {
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(p) + off;
    d.len = len == SIZE_MAX ? bytes - off : len;
    d.kind = MemKind::kCuda;
    d.device = 0;
    return d;
  }
  void* p = nullptr;
  size_t bytes;
};

std::unique_ptr<Transport> tcp(const std::string& name) {
  TransportOptions o;
  o.localName = name;
  o.stageChunkBytes = 1 << 20;
  auto t = TcpTransport::create(o);
  REQUIRE(t.ok());
  return std::move(t).value();
}

TEST_CASE("gpu: tcp stages cudaMalloc'd memory to cudaMalloc'd memory byte-exact", "[kvt][gpu]") {
  if (!haveGpu()) return;
  const size_t bytes = 24 << 20;
  std::vector<uint8_t> host(bytes);
  std::mt19937_64 rng(5);
  for (auto& x : host) x = uint8_t(rng());
  DeviceBuffer src(bytes), dst(bytes);
  PD_CUDA_OK(cudaMemcpy(src.p, host.data(), bytes, cudaMemcpyHostToDevice));
  PD_CUDA_OK(cudaMemset(dst.p, 0xee, bytes));

  auto a = tcp("a"), b = tcp("b");
  REQUIRE(a->caps().cudaMemory);
  REQUIRE(a->caps().cudaStaged);
  auto ha = a->registerMemory(src.desc());
  INFO(ha.status().toString());
  REQUIRE(ha.ok());
  auto hb = b->registerMemory(dst.desc());
  REQUIRE(hb.ok());
  PeerInfo pi{"b", b->localConnInfo().value(), {b->packRemoteKey(*hb).value()}};
  auto peer = a->loadPeer(pi);
  REQUIRE(peer.ok());

  // Segments of awkward sizes, scattered, plus one of many chunks.
  DescList l, r;
  const std::vector<size_t> lens = {1, 4097, (1 << 20) + 3, 5 << 20, 11 << 20};
  size_t off = 0;
  for (size_t len : lens) {
    l.push_back(src.desc(off, len));
    r.push_back(dst.desc(bytes - off - len, len));
    off += len + 1;
  }
  auto id = a->post(l, r, *peer, {});
  REQUIRE(id.ok());
  Status st(StatusCode::kInProgress, "");
  auto end = std::chrono::steady_clock::now() + 30s;
  while (st.inProgress() && std::chrono::steady_clock::now() < end) {
    a->progress();
    b->progress();
    st = a->poll(*id);
    std::this_thread::sleep_for(100us);
  }
  INFO(st.toString());
  REQUIRE(st.isOk());
  std::vector<uint8_t> got(bytes);
  PD_CUDA_OK(cudaMemcpy(got.data(), dst.p, bytes, cudaMemcpyDeviceToHost));
  off = 0;
  for (size_t len : lens) {
    INFO("segment of " << len << " bytes");
    CHECK(std::memcmp(got.data() + (bytes - off - len), host.data() + off, len) == 0);
    off += len + 1;
  }
}

TEST_CASE("gpu: host memory labelled kCuda is refused by the pointer check", "[kvt][gpu]") {
  if (!haveGpu()) return;
  auto a = tcp("a");
  std::vector<uint8_t> buf(4096);
  MemDesc d{reinterpret_cast<uintptr_t>(buf.data()), buf.size(), 0, MemKind::kCuda};
  auto h = a->registerMemory(d);
  REQUIRE(!h.ok());
  CHECK(h.status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pd::kvt
