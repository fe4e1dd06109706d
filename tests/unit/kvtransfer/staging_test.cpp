// Staging of GPU memory over tcp (docs/kvtransfer.md), on the CPU: the tcp transport's pipeline runs
// against HostCopier, whose "device" memory is host memory labelled kCuda and whose copies run
// on a worker thread (so the overlap, the ordering of acks and copies, failures and cancel
// are exercised for real; only cudaMemcpyAsync is replaced).
#include <algorithm>
#include <numeric>
#include <random>

#include "kvtransfer/device_copy.h"
#include "kvtransfer/staging_ring.h"
#include "tests/unit/kvtransfer/kvt_test_util.h"

namespace pd::kvt {
namespace {

using namespace testing;
using namespace std::chrono_literals;

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

std::unique_ptr<Transport> stagedTcp(const std::string& name, std::shared_ptr<HostCopier> copier,
                                     size_t chunk = 64 * kKiB, int buffers = 3, int streams = 1) {
  TransportOptions o;
  o.localName = name;
  o.peerTimeout = 2000ms;
  o.deviceCopier = std::move(copier);
  o.stageChunkBytes = chunk;
  o.stageBuffers = buffers;
  o.tcpStreams = streams;
  auto t = TcpTransport::create(o);
  INFO(t.status().toString());
  REQUIRE(t.ok());
  return std::move(t).value();
}

MemDesc desc(const std::vector<uint8_t>& b, MemKind kind, size_t off = 0, size_t len = SIZE_MAX) {
  MemDesc d;
  d.addr = reinterpret_cast<uintptr_t>(b.data()) + off;
  d.len = len == SIZE_MAX ? b.size() - off : len;
  d.kind = kind;
  d.device = 0;
  return d;
}

void fillRandom(std::vector<uint8_t>& b, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = uint8_t(rng());
}

// Sender `a` -> receiver `b`, each with one registered buffer; the receiver's buffer is exposed.
struct Pair {
  Pair(std::shared_ptr<HostCopier> ca, std::shared_ptr<HostCopier> cb, size_t bytes, MemKind srcKind, MemKind dstKind,
       size_t chunk = 64 * kKiB, int buffers = 3, int streams = 1)
      : src(bytes), dst(bytes), srcKind(srcKind), dstKind(dstKind) {
    a = stagedTcp("a", std::move(ca), chunk, buffers, streams);
    b = stagedTcp("b", std::move(cb), chunk, buffers, streams);
    fillRandom(src, bytes);
    std::fill(dst.begin(), dst.end(), 0xee);
    auto ha = a->registerMemory(desc(src, srcKind));
    INFO(ha.status().toString());
    REQUIRE(ha.ok());
    auto hb = b->registerMemory(desc(dst, dstKind));
    INFO(hb.status().toString());
    REQUIRE(hb.ok());
    PeerInfo pi;
    pi.name = "b";
    pi.connInfo = b->localConnInfo().value();
    pi.remoteKeys = {b->packRemoteKey(*hb).value()};
    auto p = a->loadPeer(pi);
    REQUIRE(p.ok());
    peer = *p;
  }
  Status wait(TransferId id, std::chrono::milliseconds timeout = 20000ms) {
    auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      a->progress();
      b->progress();
      Status st = a->poll(id);
      if (!st.inProgress()) return st;
      std::this_thread::sleep_for(100us);
    }
    return deadlineExceeded("test: transfer still pending");
  }
  // Segment i: len[i] bytes from src offset so[i] to dst offset do[i].
  Result<TransferId> post(const std::vector<std::array<size_t, 3>>& segs) {
    DescList l, r;
    for (auto [so, dof, len] : segs) {
      l.push_back(desc(src, srcKind, so, len));
      r.push_back(desc(dst, dstKind, dof, len));
    }
    return a->post(l, r, peer, {});
  }
  std::vector<uint8_t> src, dst;
  MemKind srcKind, dstKind;
  std::unique_ptr<Transport> a, b;
  PeerId peer = 0;
};

TEST_CASE("staging: dma-buf range arithmetic aligns to pages around the region", "[kvt][staging]") {
  auto r = dmaBufRange(0x10000 + 100, 5000, 4096);
  CHECK(r.base == 0x10000);
  CHECK(r.offset == 100);
  CHECK(r.size == 8192);
  r = dmaBufRange(0x20000, 4096, 4096);
  CHECK(r.base == 0x20000);
  CHECK(r.offset == 0);
  CHECK(r.size == 4096);
  r = dmaBufRange(0x20fff, 2, 4096);
  CHECK(r.base == 0x20000);
  CHECK(r.offset == 0xfff);
  CHECK(r.size == 8192);
}

TEST_CASE("staging: dma-buf export without a device is a clear error", "[kvt][staging]") {
  std::string why;
  if (cudaDeviceAvailable(&why)) {
    WARN("a CUDA device is present; this case checks the device-free path only");
    return;
  }
  std::vector<uint8_t> buf(4096);
  auto h = exportDmaBuf(desc(buf, MemKind::kCuda));
  REQUIRE(!h.ok());
  CHECK((h.status().code() == StatusCode::kUnavailable || h.status().code() == StatusCode::kUnimplemented));
  CHECK_THAT(h.status().message(), Catch::Contains("dma-buf export"));
  CHECK_FALSE(dmaBufSupported(0).isOk());
}

TEST_CASE("staging: ring reuses a slot only after its copies and reports failed tags", "[kvt][staging]") {
  auto copier = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 2ms, .failBatch = 2});
  {
    StagingRing ring(copier, 4096, 2, 1000ms);
    std::vector<uint8_t> dev(8192, 0);
    std::vector<uint8_t> host(4096);
    fillRandom(host, 1);
    char* b0 = ring.buffer(0).value();
    std::memcpy(b0, host.data(), 4096);
    CopyPiece p0{dev.data(), b0, 4096};
    REQUIRE(ring.launch(0, CopyDirection::kToDevice, 0, {&p0, 1}, 11).isOk());
    CHECK(ring.busy(0));
    std::vector<uint64_t> failed;
    CHECK(ring.query(0, &failed).inProgress());
    REQUIRE(ring.wait(0, steadyNow() + 1000ms, &failed).isOk());
    CHECK(failed.empty());
    CHECK(std::memcmp(dev.data(), host.data(), 4096) == 0);
    CopyPiece p1{dev.data() + 4096, ring.buffer(1).value(), 4096};
    REQUIRE(ring.launch(1, CopyDirection::kToDevice, 0, {&p1, 1}, 22).isOk());  // batch 2 fails
    Status st = ring.waitAll(steadyNow() + 1000ms, &failed);
    CHECK(st.code() == StatusCode::kInternal);
    CHECK(failed == std::vector<uint64_t>{22});
    CHECK(!ring.busy(1));
    CHECK(copier->pinnedOutstanding() == 2);
  }
  CHECK(copier->pinnedOutstanding() == 0);
  CHECK(copier->ticketsOutstanding() == 0);
}

TEST_CASE("staging: tcp moves kCuda memory byte-exact, 1 B to several MiB, chunks not dividing", "[kvt][staging]") {
  const std::vector<size_t> lens = {1, 7, 4095, 64 * kKiB, 64 * kKiB + 1, 100000, 3 * kMiB + 13};
  const size_t bytes = 8 * kMiB;
  struct Kinds {
    MemKind src, dst;
    const char* what;
  };
  for (Kinds k :
       {Kinds{MemKind::kCuda, MemKind::kCuda, "gpu -> gpu"}, Kinds{MemKind::kHost, MemKind::kCuda, "host -> gpu"},
        Kinds{MemKind::kCuda, MemKind::kHost, "gpu -> host"}}) {
    DYNAMIC_SECTION(k.what) {
      auto ca = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 50us});
      auto cb = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 50us});
      {
        Pair pr(ca, cb, bytes, k.src, k.dst, 64 * kKiB + 3000);  // a chunk size that divides nothing
        size_t off = 0;
        for (size_t len : lens) {
          INFO("length " << len);
          auto id = pr.post({{{off, bytes - off - len, len}}});
          REQUIRE(id.ok());
          REQUIRE(pr.wait(*id).isOk());
          CHECK(std::memcmp(pr.dst.data() + (bytes - off - len), pr.src.data() + off, len) == 0);
          off += 1;
        }
        CHECK(pr.dst[0] == 0xee);  // below every target: untouched
        const uint64_t total = std::accumulate(lens.begin(), lens.end(), uint64_t(0));
        if (k.src == MemKind::kCuda) {
          CHECK(ca->bytesCopied() == total);
          CHECK(ca->maxInFlight() >= 2);  // chunks copied ahead of the socket (overlap)
        } else {
          CHECK(ca->batches() == 0);  // host memory is never staged
        }
        if (k.dst == MemKind::kCuda) {
          CHECK(cb->bytesCopied() == total);
        } else {
          CHECK(cb->batches() == 0);
        }
      }
      CHECK(ca->pinnedOutstanding() == 0);
      CHECK(cb->pinnedOutstanding() == 0);
      CHECK(ca->ticketsOutstanding() == 0);
      CHECK(cb->ticketsOutstanding() == 0);
    }
  }
}

TEST_CASE("staging: many scattered segments over striped streams, all in place once poll() says ok", "[kvt][staging]") {
  // The receiver's copies are slow (300 us per piece, ~1,000 pieces): an ack sent before they
  // finish would show up with target bytes still missing.
  auto ca = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 100us});
  auto cb = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 300us});
  const size_t bytes = 16 * kMiB;
  Pair pr(ca, cb, bytes, MemKind::kCuda, MemKind::kCuda, 256 * kKiB, 4, 3);
  std::mt19937_64 rng(42);
  std::vector<std::array<size_t, 3>> segs;
  std::vector<size_t> slots(1000);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  const size_t slotBytes = bytes / 1000;  // 16,777 bytes: segments never overlap
  size_t total = 0;
  for (size_t i = 0; i < 1000; ++i) {
    const size_t len = 1 + rng() % slotBytes;
    segs.push_back({i * slotBytes, slots[i] * slotBytes, len});
    total += len;
  }
  auto id = pr.post(segs);
  REQUIRE(id.ok());
  Status st = pr.wait(*id);
  INFO(st.toString());
  REQUIRE(st.isOk());
  // At the moment poll() says ok, every byte is already in place.
  for (auto [so, dof, len] : segs) {
    REQUIRE(std::memcmp(pr.dst.data() + dof, pr.src.data() + so, len) == 0);
  }
  CHECK(cb->bytesCopied() == total);
}

TEST_CASE("staging: a failing device copy fails the transfer cleanly, the next one succeeds, nothing leaks",
          "[kvt][staging]") {
  SECTION("on the sender (device -> host copy)") {
    auto ca = std::make_shared<HostCopier>(HostCopierOptions{.failBatch = 3});
    auto cb = std::make_shared<HostCopier>();
    {
      Pair pr(ca, cb, 4 * kMiB, MemKind::kCuda, MemKind::kCuda);
      auto id = pr.post({{{0, 0, 2 * kMiB}}});
      REQUIRE(id.ok());
      Status st = pr.wait(*id);
      CHECK(st.code() == StatusCode::kInternal);
      CHECK_THAT(st.message(), Catch::Contains("copying GPU memory out"));
      auto id2 = pr.post({{{kMiB, 2 * kMiB, kMiB + 5}}});
      REQUIRE(id2.ok());
      REQUIRE(pr.wait(*id2).isOk());
      CHECK(std::memcmp(pr.dst.data() + 2 * kMiB, pr.src.data() + kMiB, kMiB + 5) == 0);
    }
    CHECK(ca->pinnedOutstanding() == 0);
    CHECK(ca->ticketsOutstanding() == 0);
    CHECK(cb->pinnedOutstanding() == 0);
  }
  SECTION("on the receiver (host -> device copy)") {
    auto ca = std::make_shared<HostCopier>();
    auto cb = std::make_shared<HostCopier>(HostCopierOptions{.failBatch = 2});
    {
      Pair pr(ca, cb, 4 * kMiB, MemKind::kCuda, MemKind::kCuda);
      auto id = pr.post({{{0, 0, 2 * kMiB}}});
      REQUIRE(id.ok());
      Status st = pr.wait(*id);
      CHECK(st.code() == StatusCode::kInvalidArgument);  // the receiver refused it, with the reason
      CHECK_THAT(st.message(), Catch::Contains("copying into GPU memory failed"));
      auto id2 = pr.post({{{0, 0, 3 * kMiB}}});
      REQUIRE(id2.ok());
      REQUIRE(pr.wait(*id2).isOk());
      CHECK(std::memcmp(pr.dst.data(), pr.src.data(), 3 * kMiB) == 0);
    }
    CHECK(cb->pinnedOutstanding() == 0);
    CHECK(cb->ticketsOutstanding() == 0);
  }
  SECTION("pinned allocation fails") {
    auto ca = std::make_shared<HostCopier>(HostCopierOptions{.failAlloc = true});
    auto cb = std::make_shared<HostCopier>();
    Pair pr(ca, cb, kMiB, MemKind::kCuda, MemKind::kCuda);
    auto id = pr.post({{{0, 0, kMiB}}});
    REQUIRE(id.ok());
    Status st = pr.wait(*id);
    CHECK(st.code() == StatusCode::kResourceExhausted);
    CHECK_THAT(st.message(), Catch::Contains("staging buffer"));
  }
}

TEST_CASE("staging: cancel mid-stage stops the copies, the next transfer works", "[kvt][staging]") {
  auto ca = std::make_shared<HostCopier>(HostCopierOptions{.delayPerBatch = 10ms});
  auto cb = std::make_shared<HostCopier>();
  {
    Pair pr(ca, cb, 8 * kMiB, MemKind::kCuda, MemKind::kCuda);
    auto id = pr.post({{{0, 0, 8 * kMiB}}});  // 128 chunks x 10 ms
    REQUIRE(id.ok());
    for (int i = 0; i < 50; ++i) {
      pr.a->progress();
      std::this_thread::sleep_for(1ms);
    }
    REQUIRE(ca->batches() >= 1);
    REQUIRE(pr.a->cancel(*id).isOk());
    // cancel() returned: no copy of the transfer still reads its device memory.
    CHECK(ca->ticketsOutstanding() == 0);
    const uint64_t batchesAtCancel = ca->batches();
    CHECK(pr.a->poll(*id).code() == StatusCode::kCancelled);
    for (int i = 0; i < 100; ++i) {
      pr.a->progress();
      pr.b->progress();
      std::this_thread::sleep_for(2ms);
    }
    CHECK(ca->batches() == batchesAtCancel);  // no more copies of it were started
    CHECK(ca->bytesCopied() < 8 * kMiB);

    auto id2 = pr.post({{{kMiB, 0, 200 * kKiB}}});
    REQUIRE(id2.ok());
    REQUIRE(pr.wait(*id2).isOk());
    CHECK(std::memcmp(pr.dst.data(), pr.src.data() + kMiB, 200 * kKiB) == 0);
  }
  CHECK(ca->pinnedOutstanding() == 0);
  CHECK(ca->ticketsOutstanding() == 0);
}

TEST_CASE("staging: tcp without a CUDA device refuses kCuda memory with the reason", "[kvt][staging]") {
  TransportOptions o;
  auto t = TcpTransport::create(o);
  REQUIRE(t.ok());
  std::vector<uint8_t> buf(4096);
  auto h = (*t)->registerMemory(desc(buf, MemKind::kCuda));
  REQUIRE(!h.ok());
  std::string why;
  if (!cudaDeviceAvailable(&why)) {
    CHECK_FALSE((*t)->caps().cudaMemory);
    CHECK(h.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(h.status().message(), Catch::Contains("needs a CUDA device"));
  } else {
    // A device exists: host memory labelled kCuda is caught by the pointer check.
    CHECK((*t)->caps().cudaMemory);
    CHECK(h.status().code() == StatusCode::kInvalidArgument);
  }
  // Host memory is unaffected.
  CHECK((*t)->registerMemory(desc(buf, MemKind::kHost)).ok());
}

TEST_CASE("staging: bad staging options are refused", "[kvt][staging]") {
  TransportOptions o;
  o.stageBuffers = 1;
  auto t = TcpTransport::create(o);
  REQUIRE(!t.ok());
  CHECK_THAT(t.status().message(), Catch::Contains("stageBuffers"));
}

// The agent: a kCuda region goes over the first transport that can move GPU memory (here tcp,
// staged), host memory over the preferred one; the path is counted.
TEST_CASE("staging: the agent sends GPU memory over the staging transport and counts the path",
          "[kvt][staging][agent]") {
  auto ca = std::make_shared<HostCopier>();
  auto cb = std::make_shared<HostCopier>();
  auto lanesFor = [](const std::string& who, std::shared_ptr<HostCopier> c) {
    std::vector<NamedTransport> v;
    v.push_back({"loopback", make("loopback", who)});  // preferred, no GPU memory
    v.push_back({"tcp", stagedTcp(who, std::move(c))});
    return v;
  };
  Node a("prefill-0", lanesFor("prefill-0", ca), kMiB);
  Node b("decode-0", lanesFor("decode-0", cb), kMiB);
  std::vector<uint8_t> gpuA(2 * kMiB), gpuB(2 * kMiB, 0);
  fillRandom(gpuA, 9);
  REQUIRE(a.agent->registerMemory(desc(gpuA, MemKind::kCuda)).ok());
  REQUIRE(b.agent->registerMemory(desc(gpuB, MemKind::kCuda)).ok());
  AgentPeer p = connect(a, b);
  CHECK(a.agent->peerTransport(p).value() == "loopback");

  auto id = a.agent->post({desc(gpuA, MemKind::kCuda, 10, kMiB + 3)}, {desc(gpuB, MemKind::kCuda, 77, kMiB + 3)}, p);
  INFO(id.status().toString());
  REQUIRE(id.ok());
  REQUIRE(waitAgent(*a.agent, *b.agent, *id).isOk());
  CHECK(std::memcmp(gpuB.data() + 77, gpuA.data() + 10, kMiB + 3) == 0);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_gpu_path_total", {{"path", "staged"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfers_total", {{"transport", "tcp"}, {"outcome", "ok"}}) == 1);
  CHECK(ca->bytesCopied() == kMiB + 3);
  CHECK(cb->bytesCopied() == kMiB + 3);

  // Host memory still takes the preferred transport and is not counted as GPU.
  fillRandom(a.buf, 3);
  auto hid = a.agent->post({MemDesc{a.base(), 4096}}, {MemDesc{b.base(), 4096}}, p);
  REQUIRE(hid.ok());
  REQUIRE(waitAgent(*a.agent, *b.agent, *hid).isOk());
  CHECK(metricValue(a.registry, "pdserve_kv_transfers_total", {{"transport", "loopback"}, {"outcome", "ok"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_gpu_path_total", {{"path", "staged"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_gpu_path_total", {{"path", "direct"}}) == 0);
}

TEST_CASE("staging: a transport that claims GPU memory but refuses it is skipped, tcp carries it",
          "[kvt][staging][agent]") {
  // fault(loopback) stands in for verbs on a NIC without dma-buf: caps() says GPU memory,
  // ibv_reg_dmabuf_mr says no. The peer is loaded BEFORE the refusal is known.
  auto lanesFor = [](const std::string& who) {
    std::vector<NamedTransport> v;
    FaultOptions f;
    f.claimCudaButRefuse = true;
    v.push_back({"loopback", std::make_unique<FaultTransport>(make("loopback", who), f)});
    v.push_back({"tcp", stagedTcp(who, std::make_shared<HostCopier>())});
    return v;
  };
  Node a("prefill-0", lanesFor("prefill-0"), 4096);
  Node b("decode-0", lanesFor("decode-0"), 4096);
  std::vector<uint8_t> gpuA(512 * kKiB), gpuB(512 * kKiB, 0);
  fillRandom(gpuA, 4);
  REQUIRE(b.agent->registerMemory(desc(gpuB, MemKind::kCuda)).ok());
  AgentPeer p = connect(a, b);
  REQUIRE(a.agent->registerMemory(desc(gpuA, MemKind::kCuda)).ok());  // refused by fault, taken by tcp
  auto id = a.agent->post({desc(gpuA, MemKind::kCuda)}, {desc(gpuB, MemKind::kCuda)}, p);
  INFO(id.status().toString());
  REQUIRE(id.ok());
  REQUIRE(waitAgent(*a.agent, *b.agent, *id).isOk());
  CHECK(gpuA == gpuB);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_gpu_path_total", {{"path", "staged"}}) == 1);
  CHECK(metricValue(a.registry, "pdserve_kv_transfer_gpu_path_total", {{"path", "direct"}}) == 0);
}

TEST_CASE("staging: an agent with no GPU-capable transport refuses kCuda regions naming each transport",
          "[kvt][staging][agent]") {
  std::vector<NamedTransport> v;
  v.push_back({"loopback", make("loopback", "x")});
  Node a("x", std::move(v), 4096);
  std::vector<uint8_t> gpu(4096);
  auto r = a.agent->registerMemory(desc(gpu, MemKind::kCuda));
  REQUIRE(!r.ok());
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(r.status().message(), Catch::Contains("no transport can move GPU memory"));
  CHECK_THAT(r.status().message(), Catch::Contains("loopback"));
}

}  // namespace
}  // namespace pd::kvt
