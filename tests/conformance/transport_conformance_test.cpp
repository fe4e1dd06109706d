// The transport conformance suite (docs/design.md §8): the semantics of kvtransfer/transport.h,
// checked against every transport compiled in, between two processes on loopback (the peer
// is tests/conformance/kvt_peer_main.cpp, spawned with pipes for its connection info and
// commands). Same-process transports (loopback) run the identical peer on a thread.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "engine/kv_layout.h"
#include "kvtransfer/block_segments.h"
#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/transport_factory.h"
#include "tests/conformance/kvt_peer.h"
#include "tests/faults/fault_report.h"

extern char** environ;

namespace pd::kvt::conformance {
namespace {

using namespace std::chrono_literals;
constexpr size_t kMiB = 1 << 20;
constexpr int kPeerTimeoutMs = 2500;  // generous: CI machines are shared and slow

// Transports under test: everything built in that initialises here (verbs needs a device).
std::vector<std::string> transportsUnderTest() {
  std::vector<std::string> out;
  for (const auto& name : builtTransports()) {
    TransportOptions o;
    if (makeTransport(name, o).ok()) out.push_back(name);
  }
  return out;
}

bool sameProcessOnly(const std::string& name) { return name == "loopback"; }

class Peer {
 public:
  Peer(const std::string& transport, size_t bufBytes) : transport_(transport), bufBytes_(bufBytes) {
    ::signal(SIGPIPE, SIG_IGN);  // a killed peer's pipe must not kill the suite
    int p2c[2], c2p[2];
    REQUIRE(::pipe(p2c) == 0);
    REQUIRE(::pipe(c2p) == 0);
    if (sameProcessOnly(transport)) {
      thread_ = std::thread([=] { runPeer(transport, bufBytes, kPeerTimeoutMs, p2c[0], c2p[1]); });
    } else {
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_adddup2(&fa, p2c[0], 0);
      posix_spawn_file_actions_adddup2(&fa, c2p[1], 1);
      posix_spawn_file_actions_addclose(&fa, p2c[1]);
      posix_spawn_file_actions_addclose(&fa, c2p[0]);
      std::string exe = KVT_PEER_EXE;
      std::string buf = std::to_string(bufBytes);
      std::string to = std::to_string(kPeerTimeoutMs);
      char* argv[] = {exe.data(), const_cast<char*>(transport.c_str()), buf.data(), to.data(), nullptr};
      int rc = posix_spawn(&pid_, exe.c_str(), &fa, nullptr, argv, environ);
      posix_spawn_file_actions_destroy(&fa);
      REQUIRE(rc == 0);
      ::close(p2c[0]);
      ::close(c2p[1]);
    }
    ch_ = std::make_unique<LineChannel>(c2p[0], p2c[1]);
    auto line = ch_->readLine(10000);
    REQUIRE(line);
    INFO(*line);
    REQUIRE(line->rfind("INFO ", 0) == 0);
    std::istringstream in(line->substr(5));
    std::string conn, key;
    in >> conn >> key >> guard_ >> addr_;
    REQUIRE(addr_ != 0);
    info_.name = "conformance-peer";
    info_.connInfo = fromHex(conn);
    info_.remoteKeys.push_back(fromHex(key));
  }
  ~Peer() {
    if (ch_) ch_->writeLine("QUIT");
    if (thread_.joinable()) thread_.join();
    if (pid_ > 0) {
      for (int i = 0; i < 200; ++i) {
        if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
        std::this_thread::sleep_for(10ms);
      }
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  const PeerInfo& info() const { return info_; }
  size_t guard() const { return guard_; }
  uintptr_t addr() const { return addr_; }
  size_t bufBytes() const { return bufBytes_; }
  LineChannel& ch() { return *ch_; }

  // The peer dies at once: SIGKILL for a process, its transport destroyed for a thread.
  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    } else {
      ch_->writeLine("DIE");
      auto l = ch_->readLine(5000);
      REQUIRE(l == std::optional<std::string>("DEAD"));
    }
  }
  void stop() {
    REQUIRE(pid_ > 0);
    ::kill(pid_, SIGSTOP);
  }

  // A command whose one answer line starts with `prefix`; returns the rest.
  std::string ask(const std::string& cmd, const std::string& prefix) {
    REQUIRE(ch_->writeLine(cmd));
    auto l = ch_->readLine(20000);
    REQUIRE(l);
    INFO(*l);
    REQUIRE(l->rfind(prefix, 0) == 0);
    return l->substr(prefix.size());
  }

  uint64_t query(const std::string& cmd) { return std::stoull(ask(cmd, "SUM ")); }

 private:
  std::string transport_;
  size_t bufBytes_;
  pid_t pid_ = -1;
  std::thread thread_;
  std::unique_ptr<LineChannel> ch_;
  PeerInfo info_;
  size_t guard_ = 0;
  uintptr_t addr_ = 0;
};

struct Sender {
  Sender(const std::string& name, size_t bytes, const PeerInfo& peerInfo, TransportOptions opts = {}) {
    opts.localName = "conformance-sender";
    opts.peerTimeout = std::chrono::milliseconds(kPeerTimeoutMs);
    auto t = makeTransport(name, opts);
    REQUIRE(t.ok());
    transport = std::move(t).value();
    buf.reset(new uint8_t[bytes]);
    size = bytes;
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(buf.get());
    d.len = bytes;
    auto h = transport->registerMemory(d);
    REQUIRE(h.ok());
    auto p = transport->loadPeer(peerInfo);
    INFO(p.status().toString());
    REQUIRE(p.ok());
    peer = *p;
  }
  // Declared before the transport so it outlives the transport's I/O thread.
  std::unique_ptr<uint8_t[]> buf;
  std::unique_ptr<Transport> transport;
  size_t size = 0;
  PeerId peer = 0;

  void describe(const Layout& l, uintptr_t remoteBase, DescList& local, DescList& remote) const {
    for (size_t i = 0; i < l.len.size(); ++i) {
      MemDesc a;
      a.addr = reinterpret_cast<uintptr_t>(buf.get()) + l.srcOff[i];
      a.len = l.len[i];
      MemDesc b;
      b.addr = remoteBase + l.dstOff[i];
      b.len = l.len[i];
      local.push_back(a);
      remote.push_back(b);
    }
  }
  Status wait(TransferId id, std::chrono::milliseconds timeout) {
    auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      transport->progress();
      Status st = transport->poll(id);
      if (!st.inProgress()) return st;
      std::this_thread::sleep_for(50us);
    }
    return deadlineExceeded("test: transfer " + std::to_string(id) + " still pending after the test's timeout");
  }
};

struct Sent {
  uint64_t seed;
  size_t size, segs;
  uint64_t sum;
  TransferId id;
  std::string layout;  // "<seed> <size> <segs>": the peer's LAYSUM arguments
};

Sent postLayout(Sender& s, Peer& peer, const std::string& name, uint64_t seed, size_t size, size_t segs) {
  Layout l = makeLayout(seed, size, segs, s.size, peer.bufBytes());
  fillSource(seed, s.buf.get(), l);
  Sent out{seed, size, segs, checksumSegments(s.buf.get(), l.srcOff, l.len), 0, ""};
  DescList local, remote;
  s.describe(l, peer.addr(), local, remote);
  out.layout = std::to_string(seed) + " " + std::to_string(size) + " " + std::to_string(l.len.size());
  auto id = s.transport->post(local, remote, s.peer, {});
  INFO(id.status().toString());
  REQUIRE(id.ok());
  out.id = *id;
  out.segs = l.len.size();
  return out;
}

// Every destination segment of `sent` holds its bytes (checked by the peer, after poll() ok).
void expectLanded(Peer& peer, const Sent& sent) { CHECK(peer.query("LAYSUM " + sent.layout) == sent.sum); }

}  // namespace

TEST_CASE("conformance: random payloads arrive byte-exact, all there once poll() says ok", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  Peer peer(name, 256 * kMiB + kMiB);
  Sender s(name, 256 * kMiB + kMiB, peer.info());

  std::mt19937_64 rng(42);
  std::vector<std::pair<size_t, size_t>> cases = {
      {1, 1}, {7, 3}, {4096, 1}, {65536, 16}, {kMiB, 4096}, {3 * kMiB + 17, 1000}, {9 * kMiB + 3, 4096}};
  for (int i = 0; i < 6; ++i) {
    size_t size = 1 + rng() % (8 * kMiB);
    cases.push_back({size, 1 + rng() % std::min<size_t>(size, 4096)});
  }
  uint64_t seed = 1000;
  for (auto [size, segs] : cases) {
    CAPTURE(size, segs);
    Sent sent = postLayout(s, peer, name, ++seed, size, segs);
    Status st = s.wait(sent.id, 20s);
    INFO(st.toString());
    REQUIRE(st.isOk());
    // poll() said ok: every byte is at the target already.
    expectLanded(peer, sent);
    // An id is forgotten after its outcome was reported once.
    CHECK(s.transport->poll(sent.id).code() == StatusCode::kNotFound);
  }

  SECTION("several transfers in flight at once complete in full") {
    std::vector<Sent> batch;
    size_t srcUsed = 0;
    // Disjoint source and destination areas: layouts of 1 MiB each, shifted per transfer.
    for (int i = 0; i < 8; ++i) {
      uint64_t sd = 5000 + i;
      Layout l = makeLayout(sd, kMiB, 64, 2 * kMiB, 2 * kMiB);
      for (auto& o : l.srcOff) o += srcUsed;
      std::vector<size_t> dst = l.dstOff;
      for (auto& o : dst) o += size_t(i) * 2 * kMiB;
      fillSource(sd, s.buf.get(), l);
      DescList local, remote;
      Layout shifted = l;
      shifted.dstOff = dst;
      s.describe(shifted, peer.addr(), local, remote);
      auto id = s.transport->post(local, remote, s.peer, {});
      REQUIRE(id.ok());
      batch.push_back({sd, kMiB, 64, checksumSegments(s.buf.get(), l.srcOff, l.len), *id, ""});
      srcUsed += 2 * kMiB;
    }
    for (auto& b : batch) REQUIRE(s.wait(b.id, 20s).isOk());
    for (int i = 0; i < 8; ++i) {
      const Sent& b = batch[size_t(i)];
      CHECK(peer.query("LAYSUM " + std::to_string(b.seed) + " " + std::to_string(kMiB) + " 64 " +
                       std::to_string(size_t(i) * 2 * kMiB)) == b.sum);
    }
  }

  SECTION("256 MiB in 64 segments, once") {
    Sent sent = postLayout(s, peer, name, 77, 256 * kMiB, 64);
    Status st = s.wait(sent.id, 30s);
    INFO(st.toString());
    REQUIRE(st.isOk());
    expectLanded(peer, sent);
  }
}

// What a prefill worker pushes per layer (prefill_jobs.cpp): runs of KV blocks described by the
// engine's KvLayout, to other block ids on the peer. A latent layout (multi-head latent
// attention: one vector of kv_lora_rank + rope values per token, no V) is bytes like any other:
// each block lands whole, at its block id, and its bytes are half those of a K|V block of the
// same per-token width.
TEST_CASE("conformance: KV blocks of a latent (MLA) and a K|V layout arrive block for block", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  engine::KvLayout latent;
  latent.numLayers = 3;
  latent.numBlocks = 24;
  latent.blockSize = 16;
  latent.numKvHeads = 1;
  latent.headDim = 512 + 64;  // DeepSeek-V3's kv_lora_rank + qk_rope_head_dim
  latent.dtype = engine::KvDtype::kBF16;
  latent.latent = true;
  engine::KvLayout kv = latent;
  kv.latent = false;
  kv.numKvHeads = 8;
  kv.headDim = 128;  // Llama-3-70B's K and V per layer
  CHECK(latent.blockBytes() * 2 == size_t(16) * 576 * 2 * 2);
  CHECK(kv.blockBytes() == size_t(2) * 16 * 8 * 128 * 2);
  const size_t bytes = std::max(latent.totalBytes(), kv.totalBytes()) + kMiB;
  Peer peer(name, bytes);
  Sender s(name, bytes, peer.info());
  const std::vector<int> srcBlocks{5, 6, 7, 0, 23, 11}, dstBlocks{9, 10, 11, 2, 3, 17};
  uint64_t seed = 70;
  for (const engine::KvLayout& l : {latent, kv}) {
    CAPTURE(l.fingerprint());
    const BlockPool src{reinterpret_cast<uintptr_t>(s.buf.get()), l.blockBytes(), l.numBlocks, l.numLayers};
    const BlockPool dst{peer.addr(), l.blockBytes(), l.numBlocks, l.numLayers};
    std::mt19937_64 rng(++seed);
    for (size_t i = 0; i < l.totalBytes(); ++i) s.buf[i] = uint8_t(rng());
    auto segs = blockSegments(src, srcBlocks, dst, dstBlocks, 0, l.numLayers);
    REQUIRE(segs.ok());
    size_t total = 0;
    for (const auto& d : segs->local) total += d.len;
    CHECK(total == srcBlocks.size() * l.blockBytes() * l.numLayers);
    auto id = s.transport->post(segs->local, segs->remote, s.peer, {});
    REQUIRE(id.ok());
    const Status st = s.wait(*id, 20s);
    INFO(st.toString());
    REQUIRE(st.isOk());
    for (int layer = 0; layer < l.numLayers; ++layer) {
      for (size_t b = 0; b < srcBlocks.size(); ++b) {
        const uint64_t want = checksumRange(s.buf.get() + src.blockOffset(layer, srcBlocks[b]), l.blockBytes());
        CHECK(peer.query("SUM " + std::to_string(peer.guard() + dst.blockOffset(layer, dstBlocks[b])) + " " +
                         std::to_string(l.blockBytes())) == want);
      }
    }
  }
}

TEST_CASE("conformance: invalid descriptors are refused at post", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  Peer peer(name, kMiB);
  Sender s(name, kMiB, peer.info());
  uintptr_t base = peer.addr();
  MemDesc local{reinterpret_cast<uintptr_t>(s.buf.get()), 4096};
  SECTION("remote range beyond the exposed region") {
    MemDesc remote{base + kMiB - 100, 4096};
    auto id = s.transport->post({local}, {remote}, s.peer, {});
    REQUIRE_FALSE(id.ok());
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(id.status().message(), Catch::Contains("segment 0"));
  }
  SECTION("local range not registered") {
    std::vector<uint8_t> other(4096);
    MemDesc bad{reinterpret_cast<uintptr_t>(other.data()), 4096};
    auto id = s.transport->post({bad}, {MemDesc{base, 4096}}, s.peer, {});
    REQUIRE_FALSE(id.ok());
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("length mismatch") {
    auto id = s.transport->post({local}, {MemDesc{base, 4095}}, s.peer, {});
    REQUIRE_FALSE(id.ok());
    CHECK(id.status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("conformance: cancel stops a transfer, the transport stays usable", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  Peer peer(name, 192 * kMiB);
  Sender s(name, 192 * kMiB, peer.info());
  Sent big = postLayout(s, peer, name, 31, 128 * kMiB, 8);
  Status c = s.transport->cancel(big.id);
  INFO(c.toString());
  REQUIRE(c.isOk());
  CHECK(s.transport->poll(big.id).code() == StatusCode::kCancelled);
  CHECK(s.transport->poll(big.id).code() == StatusCode::kNotFound);
  for (int i = 0; i < 20; ++i) {
    s.transport->progress();
    std::this_thread::sleep_for(10ms);
  }
  if (name == "tcp" || name == "loopback" || name == "cma") {
    // Cancelled right after post: most of the 128 MiB never went out.
    CHECK(peer.query("LAYSUM " + big.layout) != big.sum);
  }
  // The transport stays usable: the next transfer lands whole.
  Sent small = postLayout(s, peer, name, 32, 64 * 1024, 4);
  REQUIRE(s.wait(small.id, 10s).isOk());
  expectLanded(peer, small);
}

TEST_CASE("conformance: a peer killed mid-transfer fails every pending transfer within the deadline", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  Peer peer(name, 64 * kMiB + kMiB);
  Sender s(name, 64 * kMiB + kMiB, peer.info());
  std::vector<TransferId> ids;
  Sent first = postLayout(s, peer, name, 91, 64 * kMiB, 16);
  ids.push_back(first.id);
  // 32 x 64 MiB: seconds of work on loopback, so the kill lands mid-transfer.
  Layout l = makeLayout(91, 64 * kMiB, 16, s.size, peer.bufBytes());
  DescList local, remote;
  s.describe(l, peer.addr(), local, remote);
  for (int i = 0; i < 31; ++i) {
    auto id = s.transport->post(local, remote, s.peer, {});
    REQUIRE(id.ok());
    ids.push_back(*id);
  }
  if (!sameProcessOnly(name)) {
    for (int i = 0; i < 5; ++i) {
      s.transport->progress();
      std::this_thread::sleep_for(5ms);
    }
  }
  peer.kill();
  auto killedAt = std::chrono::steady_clock::now();
  int ok = 0, unavailable = 0, other = 0;
  std::string otherMsg;
  for (TransferId id : ids) {
    Status st = s.wait(id, std::chrono::milliseconds(kPeerTimeoutMs + 3000));
    if (st.isOk()) {
      ++ok;
    } else if (st.code() == StatusCode::kUnavailable) {
      ++unavailable;
    } else {
      ++other;
      otherMsg = st.toString();
    }
  }
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count();
  INFO("ok " << ok << " unavailable " << unavailable << " other " << other << " " << otherMsg << " took " << took);
  CHECK(unavailable >= 1);
  CHECK(other == 0);
  CHECK(ok + unavailable == int(ids.size()));   // nothing left pending
  CHECK(took < kPeerTimeoutMs / 1000.0 + 2.0);  // the deadline plus scheduling slack on a loaded CI box
  // Later posts to the dead peer fail instead of hanging.
  auto late = s.transport->post(local, remote, s.peer, {});
  if (late.ok()) {
    Status st = s.wait(*late, std::chrono::milliseconds(kPeerTimeoutMs + 3000));
    CHECK(st.code() == StatusCode::kUnavailable);
  } else {
    CHECK(late.status().code() == StatusCode::kUnavailable);
  }
}

TEST_CASE("conformance: a hung peer (SIGSTOP) fails pending transfers within the deadline", "[conformance]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  if (sameProcessOnly(name)) return;  // a thread cannot be stopped on its own
  Peer peer(name, 64 * kMiB + kMiB);
  Sender s(name, 64 * kMiB + kMiB, peer.info());
  Layout l = makeLayout(5, 64 * kMiB, 16, s.size, peer.bufBytes());
  DescList local, remote;
  s.describe(l, peer.addr(), local, remote);
  peer.stop();
  auto stoppedAt = std::chrono::steady_clock::now();
  std::vector<TransferId> ids;
  for (int i = 0; i < 8; ++i) {
    auto id = s.transport->post(local, remote, s.peer, {});
    REQUIRE(id.ok());
    ids.push_back(*id);
  }
  for (TransferId id : ids) {
    Status st = s.wait(id, std::chrono::milliseconds(kPeerTimeoutMs + 3000));
    INFO(st.toString());
    // A hung peer is not known dead: tcp declares it unreachable after its progress
    // timeout, ucx reports the missed transfer deadline. Either way the transfer fails in time.
    CHECK((st.code() == StatusCode::kUnavailable || st.code() == StatusCode::kDeadlineExceeded));
  }
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - stoppedAt).count();
  CHECK(took < kPeerTimeoutMs / 1000.0 + 2.0);  // the deadline plus scheduling slack on a loaded CI box
  peer.kill();
  char measured[96];
  std::snprintf(measured, sizeof measured, "8 pending transfers failed %.2f s after the stop", took);
  pd::test::recordFault({"transport stalled: the receiving peer stopped (SIGSTOP), " + name,
                         "every pending transfer fails within the transport deadline (+2 s slack); later posts fail, "
                         "never hang",
                         "the transport's progress deadline (" + std::to_string(kPeerTimeoutMs) + " ms here)",
                         measured});
}

// Write grants (transport.h, KV fencing, docs/reliability.md). Every transport: a granted write lands.
// Receiver-fenced ones (caps().receiverFenced) also refuse, before a byte lands, a write
// outside the grant's ranges and any write under the grant after its revoke (a replay of the
// captured capability); the others return an empty grant, which fences nothing.
TEST_CASE("conformance: write grants: revoked, replayed and out-of-range writes are refused where receiver-fenced",
          "[conformance][grant]") {
  const std::string name = GENERATE(from_range(transportsUnderTest()));
  CAPTURE(name);
  Peer peer(name, kMiB);
  Sender s(name, 64 * 1024, peer.info());
  const bool fenced = s.transport->caps().receiverFenced;
  CAPTURE(fenced);
  const std::string grantHex = peer.ask("GRANT 4096 8192", "GRANT ");
  const std::string grant = grantHex == "-" ? std::string() : fromHex(grantHex);
  CHECK(grant.empty() != fenced);
  auto send = [&](size_t dstOff, uint8_t fill) {
    std::memset(s.buf.get(), fill, 8192);
    MemDesc local{reinterpret_cast<uintptr_t>(s.buf.get()), 8192};
    MemDesc remote{peer.addr() + dstOff, 8192};
    auto id = s.transport->post({local}, {remote}, s.peer, grant);
    REQUIRE(id.ok());
    return s.wait(*id, 10s);
  };
  auto sumAt = [&](size_t off) { return peer.query("SUM " + std::to_string(peer.guard() + off) + " 8192"); };
  const uint64_t beyond = sumAt(16384);
  Status first = send(4096, 0x11);
  INFO(first.toString());
  REQUIRE(first.isOk());
  const uint64_t landed = sumAt(4096);
  CHECK(landed == checksumRange(s.buf.get(), 8192));
  if (!fenced) {
    CHECK(peer.ask("REVOKE -", "REVOKED ") == "0");
    return;
  }
  Status outside = send(16384, 0x22);
  CHECK(outside.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(outside.message(), Catch::Contains("outside the memory its write grant covers"));
  CHECK(sumAt(16384) == beyond);
  CHECK(peer.ask("REVOKE " + grantHex, "REVOKED ") == "0");
  Status replay = send(4096, 0x33);
  CHECK(replay.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(replay.message(), Catch::Contains("revoked write grant"));
  CHECK(sumAt(4096) == landed);
  CHECK(peer.ask("REVOKE " + grantHex, "REVOKED ") == std::to_string(int(StatusCode::kNotFound)));
}

TEST_CASE("conformance(tcp): the receiver refuses writes outside what it exposed", "[conformance][tcp]") {
  Peer peer("tcp", kMiB);
  proto::TcpRemoteKey real;
  REQUIRE(real.ParseFromString(peer.info().remoteKeys[0]));
  const uint64_t guardSum =
      peer.query("SUM " + std::to_string(peer.guard() + kMiB) + " " + std::to_string(peer.guard()));

  // A sender that believes the region is larger / has another token than the receiver exposed.
  PeerInfo forged = peer.info();
  proto::TcpRemoteKey big = real;
  big.set_len(real.len() + 8192);
  proto::TcpRemoteKey other = real;
  other.set_token(real.token() ^ 0x1234567);
  other.set_addr(real.addr() + 2 * kMiB);
  forged.remoteKeys = {big.SerializeAsString(), other.SerializeAsString()};
  Sender s("tcp", 64 * 1024, forged);
  std::memset(s.buf.get(), 0x3C, 64 * 1024);
  MemDesc local{reinterpret_cast<uintptr_t>(s.buf.get()), 8192};

  SECTION("past the end of the exposed region") {
    MemDesc remote{real.addr() + kMiB - 4096, 8192};
    auto id = s.transport->post({local}, {remote}, s.peer, {});
    REQUIRE(id.ok());  // the forged key lets it past the sender's own check
    Status st = s.wait(*id, 10s);
    INFO(st.toString());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("outside the exposed region"));
  }
  SECTION("an unknown token") {
    MemDesc remote{real.addr() + 2 * kMiB, 4096};
    auto id = s.transport->post({MemDesc{local.addr, 4096}}, {remote}, s.peer, {});
    REQUIRE(id.ok());
    Status st = s.wait(*id, 10s);
    INFO(st.toString());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("unknown or withdrawn exposure token"));
  }
  // Nothing landed in the guard zone past the region.
  CHECK(peer.query("SUM " + std::to_string(peer.guard() + kMiB) + " " + std::to_string(peer.guard())) == guardSum);
  // The connection survives a refusal: a valid write still goes through.
  MemDesc ok{real.addr(), 4096};
  auto id = s.transport->post({MemDesc{local.addr, 4096}}, {ok}, s.peer, {});
  REQUIRE(id.ok());
  REQUIRE(s.wait(*id, 10s).isOk());
  CHECK(peer.query("SUM " + std::to_string(peer.guard()) + " 4096") == checksumRange(s.buf.get(), 4096));
}

TEST_CASE("conformance(tcp): a transfer striped over 3 streams arrives whole", "[conformance][tcp]") {
  Peer peer("tcp", 64 * kMiB + kMiB);
  TransportOptions opts;
  opts.tcpStreams = 3;
  Sender s("tcp", 64 * kMiB + kMiB, peer.info(), opts);
  for (uint64_t seed : {7u, 8u}) {
    Sent sent = postLayout(s, peer, "tcp", seed, 48 * kMiB + 5, seed == 7 ? 3 : 4096);
    REQUIRE(s.wait(sent.id, 20s).isOk());
    expectLanded(peer, sent);
  }
}

#if PD_HAVE_CMA
TEST_CASE("conformance(cma): a peer that is not on this node is refused at loadPeer, with the reason",
          "[conformance][cma]") {
  Peer peer("cma", kMiB);
  proto::CmaConnInfo real;
  REQUIRE(real.ParseFromString(peer.info().connInfo));
  auto refused = [&](proto::CmaConnInfo forged) {
    PeerInfo pi = peer.info();
    pi.connInfo = forged.SerializeAsString();
    auto t = makeTransport("cma", TransportOptions{});
    REQUIRE(t.ok());
    auto id = (*t)->loadPeer(pi);
    REQUIRE_FALSE(id.ok());
    CHECK(id.status().code() == StatusCode::kUnavailable);  // the agent moves on to the next transport
    return id.status().message();
  };
  proto::CmaConnInfo other = real;
  other.set_boot_id("00000000-0000-0000-0000-000000000000");
  CHECK_THAT(refused(other), Catch::Contains("is on another node"));
  other = real;
  other.set_pid_ns(real.pid_ns() + 1);
  CHECK_THAT(refused(other), Catch::Contains("another pid namespace"));
  other = real;
  other.set_instance(real.instance() ^ 1);  // the pid is alive but is not that transport
  CHECK_THAT(refused(other), Catch::Contains("is not that peer"));
  other = real;
  other.set_socket("pdserve-kvt-cma-nobody");
  CHECK_THAT(refused(other), Catch::Contains("cannot reach its control socket"));
  // The real blob still connects and moves bytes.
  Sender s("cma", 4096, peer.info());
  std::memset(s.buf.get(), 0x5A, 4096);
  auto id = s.transport->post({MemDesc{reinterpret_cast<uintptr_t>(s.buf.get()), 4096}}, {MemDesc{peer.addr(), 4096}},
                              s.peer, {});
  REQUIRE(id.ok());
  REQUIRE(s.wait(*id, 10s).isOk());
  CHECK(peer.query("SUM " + std::to_string(peer.guard()) + " 4096") == checksumRange(s.buf.get(), 4096));
}
#endif

}  // namespace pd::kvt::conformance
