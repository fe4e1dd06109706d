// UCX transport between two processes on this machine: the target is a forked child that
// registers a buffer, hands its connection info and key over a socketpair, and answers hashes
// of its buffer on request (so "all data is there once poll() says ok" is checked byte for
// byte).
#include "kvtransfer/transports/ucx_transport.h"

#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include <catch2/catch.hpp>

#include "common/base/clock.h"

using namespace pd;
using namespace pd::kvt;
using namespace std::chrono_literals;

namespace {

constexpr size_t kTargetBytes = size_t{64} << 20;

bool writeAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool sendMsg(int fd, const std::string& m) {
  uint32_t len = static_cast<uint32_t>(m.size());
  return writeAll(fd, &len, sizeof len) && writeAll(fd, m.data(), m.size());
}

// Reads exactly n bytes or gives up at the deadline.
bool readAll(int fd, void* p, size_t n, Deadline d) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d.at() - steadyNow()).count());
    if (ms <= 0) return false;
    if (::poll(&pfd, 1, ms) <= 0) continue;
    ssize_t r = ::recv(fd, c, n, 0);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool recvMsg(int fd, std::string* m, Deadline d) {
  uint32_t len = 0;
  if (!readAll(fd, &len, sizeof len, d)) return false;
  m->resize(len);
  return readAll(fd, m->data(), len, d);
}

uint64_t hashBytes(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// The child's whole life: serve a registered buffer until the parent says quit or goes away.
[[noreturn]] void targetMain(int fd, const char* tls) {
  if (tls) setenv("UCX_TLS", tls, 1);
  auto made = makeUcxTransport();
  if (!made.ok()) {
    sendMsg(fd, "ERR " + made.status().toString());
    _exit(1);
  }
  auto t = std::move(made).value();
  void* mem = mmap(nullptr, kTargetBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  auto* buf = static_cast<uint8_t*>(mem);
  auto h = t->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(buf), kTargetBytes});
  auto key = h.ok() ? t->packRemoteKey(*h) : Result<std::string>(h.status());
  auto conn = t->localConnInfo();
  if (!key.ok() || !conn.ok()) {
    sendMsg(fd, "ERR " + (key.ok() ? conn.status() : key.status()).toString());
    _exit(1);
  }
  sendMsg(fd, *conn);
  sendMsg(fd, *key);
  for (;;) {
    t->progress();
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 0) > 0) {
      std::string cmd;
      if (!recvMsg(fd, &cmd, Deadline::in(5s)) || cmd == "quit") _exit(0);
      if (cmd.rfind("hash", 0) == 0) {  // "hash" + u64 offset + u64 len
        uint64_t off = 0, len = 0;
        std::memcpy(&off, cmd.data() + 4, 8);
        std::memcpy(&len, cmd.data() + 12, 8);
        uint64_t hash = hashBytes(buf + off, len);
        sendMsg(fd, "H" + std::string(reinterpret_cast<const char*>(&hash), 8));
      }
    }
  }
}

struct Target {
  pid_t pid = -1;
  int fd = -1;
  PeerInfo info;
  uint64_t base = 0;

  explicit Target(const char* tls = nullptr) {
    int sv[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(sv[0]);
      targetMain(sv[1], tls);
    }
    ::close(sv[1]);
    fd = sv[0];
    std::string conn, key;
    REQUIRE(recvMsg(fd, &conn, Deadline::in(10s)));
    REQUIRE(conn.rfind("ERR", 0) != 0);
    REQUIRE(recvMsg(fd, &key, Deadline::in(10s)));
    info = PeerInfo{"target", conn, {key}};
    auto k = ucxwire::decodeKey(key);
    REQUIRE(k.ok());
    base = k->base;
    REQUIRE(k->len == kTargetBytes);
  }
  ~Target() {
    if (pid > 0) {
      sendMsg(fd, "quit");
      Deadline d = Deadline::in(5s);
      while (!d.expired() && ::waitpid(pid, nullptr, WNOHANG) == 0) std::this_thread::sleep_for(5ms);
      if (::waitpid(pid, nullptr, WNOHANG) == 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
    ::close(fd);
  }
  void kill() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
  uint64_t rangeHash(uint64_t off, uint64_t len) {
    std::string cmd = "hash";
    cmd.append(reinterpret_cast<const char*>(&off), 8);
    cmd.append(reinterpret_cast<const char*>(&len), 8);
    REQUIRE(sendMsg(fd, cmd));
    std::string r;
    REQUIRE(recvMsg(fd, &r, Deadline::in(10s)));
    REQUIRE(r.size() == 9);
    REQUIRE(r[0] == 'H');
    uint64_t h;
    std::memcpy(&h, r.data() + 1, 8);
    return h;
  }
};

struct Initiator {
  std::vector<uint8_t> src;  // registered with t: declared first so that it outlives t
  std::unique_ptr<Transport> t;
  PeerId peer = 0;

  Initiator(Target& target, UcxOptions o = {}) : src(kTargetBytes) {
    auto made = makeUcxTransport(o);
    REQUIRE(made.ok());
    t = std::move(made).value();
    std::mt19937_64 rng(42);
    for (size_t i = 0; i < src.size(); i += 8) {
      uint64_t v = rng();
      std::memcpy(src.data() + i, &v, 8);
    }
    auto h = t->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(src.data()), src.size()});
    REQUIRE(h.ok());
    auto p = t->loadPeer(target.info);
    REQUIRE(p.ok());
    peer = *p;
  }
  // Drives progress() until the transfer leaves kInProgress; returns its outcome.
  Status wait(TransferId id, Duration limit = 30s) {
    Deadline d = Deadline::in(limit);
    for (;;) {
      t->progress();
      Status s = t->poll(id);
      if (!s.inProgress()) return s;
      if (d.expired()) return deadlineExceeded("test: transfer still in progress");
    }
  }
};

// Splits [0, total) into `count` random pieces; the source is read in order, the destination
// gets the same pieces in shuffled order, so every segment pair differs in offset.
void makeSegments(std::mt19937_64& rng, size_t total, size_t count, uintptr_t srcBase, uintptr_t dstBase,
                  DescList* local, DescList* remote, std::vector<std::pair<size_t, size_t>>* dstOffsets) {
  std::vector<size_t> cuts;
  std::uniform_int_distribution<size_t> pick(1, total - 1);
  std::set<size_t> s;
  while (s.size() + 1 < count) s.insert(pick(rng));
  cuts.assign(s.begin(), s.end());
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(total);
  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<size_t> dstStart(count);
  size_t at = 0;
  for (size_t i : order) {
    dstStart[i] = at;
    at += cuts[i + 1] - cuts[i];
  }
  for (size_t i = 0; i < count; ++i) {
    size_t len = cuts[i + 1] - cuts[i];
    local->push_back(MemDesc{srcBase + cuts[i], len});
    remote->push_back(MemDesc{dstBase + dstStart[i], len});
    dstOffsets->push_back({dstStart[i], cuts[i]});
  }
}

void byteExactRounds(const char* tls) {
  if (tls) setenv("UCX_TLS", tls, 1);
  Target target(tls);
  Initiator ini(target);
  if (tls) unsetenv("UCX_TLS");
  std::vector<uint8_t> mirror(kTargetBytes, 0);  // what the target's buffer must hold
  std::mt19937_64 rng(7);
  struct Case {
    size_t bytes, segments;
  };
  const Case cases[] = {{1, 1},
                        {4096, 1},
                        {(1 << 20) + 13, 4096},
                        {3 << 20, 17},
                        {kTargetBytes, 1},
                        {kTargetBytes - 4096, 4096},
                        {kTargetBytes, 64}};
  int round = 0;
  for (const Case& c : cases) {
    INFO("round " << round << ": " << c.bytes << " bytes in " << c.segments << " segments");
    size_t srcOff = std::uniform_int_distribution<size_t>(0, kTargetBytes - c.bytes)(rng);
    size_t dstOff = std::uniform_int_distribution<size_t>(0, kTargetBytes - c.bytes)(rng);
    DescList local, remote;
    std::vector<std::pair<size_t, size_t>> offs;
    makeSegments(rng, c.bytes, c.segments, reinterpret_cast<uintptr_t>(ini.src.data()) + srcOff, target.base + dstOff,
                 &local, &remote, &offs);
    for (size_t i = 0; i < local.size(); ++i)
      std::memcpy(mirror.data() + dstOff + offs[i].first, ini.src.data() + srcOff + offs[i].second, local[i].len);
    auto id = ini.t->post(local, remote, ini.peer, {});
    REQUIRE(id.ok());
    Status s = ini.wait(*id);
    REQUIRE(s.toString() == "OK");
    // poll() said ok: all data is already at the target.
    REQUIRE(target.rangeHash(0, kTargetBytes) == hashBytes(mirror.data(), mirror.size()));
    CHECK(ini.t->poll(*id).code() == StatusCode::kNotFound);  // reported once, then forgotten
    ++round;
  }
  TransportCaps caps = ini.t->caps();
  CHECK(caps.name == "ucx");
  CHECK(caps.oneSided);
  CHECK(caps.details.find("peer target: ") != std::string::npos);
  UNSCOPED_INFO("ucx caps: " << caps.details);
}

}  // namespace

TEST_CASE("ucx: random payloads arrive byte-exact once poll() says ok (default transports)") {
  byteExactRounds(nullptr);
}

TEST_CASE("ucx: random payloads arrive byte-exact over UCX_TLS=tcp") { byteExactRounds("tcp"); }

TEST_CASE("ucx: blobs are validated and bad posts name the segment") {
  auto made = makeUcxTransport();
  REQUIRE(made.ok());
  auto& t = *made;
  std::vector<uint8_t> a(1 << 16), b(1 << 16);
  auto ha = t->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(a.data()), a.size()});
  auto hb = t->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(b.data()), b.size()});
  REQUIRE(ha.ok());
  REQUIRE(hb.ok());
  auto key = t->packRemoteKey(*hb);
  auto conn = t->localConnInfo();
  REQUIRE(key.ok());
  REQUIRE(conn.ok());

  CHECK(t->loadPeer(PeerInfo{"x", "garbage", {}}).status().code() == StatusCode::kInvalidArgument);
  CHECK(t->loadPeer(PeerInfo{"x", *conn, {key->substr(0, key->size() - 3)}}).status().code() == StatusCode::kDataLoss);
  CHECK(t->registerMemory(MemDesc{0, 0}).status().code() == StatusCode::kInvalidArgument);
  CHECK(t->packRemoteKey(999).status().code() == StatusCode::kNotFound);

  // This transport loads itself as its peer: a real one-process transfer through UCX.
  auto self = t->loadPeer(PeerInfo{"self", *conn, {*key}});
  REQUIRE(self.ok());
  const uintptr_t A = reinterpret_cast<uintptr_t>(a.data()), B = reinterpret_cast<uintptr_t>(b.data());
  std::vector<uint8_t> outside(64);
  auto bad = t->post({MemDesc{reinterpret_cast<uintptr_t>(outside.data()), 64}}, {MemDesc{B, 64}}, *self, {});
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("segment 0") != std::string::npos);
  bad = t->post({MemDesc{A, 64}, MemDesc{A, 64}}, {MemDesc{B, 64}, MemDesc{B + b.size() - 32, 64}}, *self, {});
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("segment 1") != std::string::npos);
  bad = t->post({MemDesc{A, 64}}, {MemDesc{B, 65}}, *self, {});
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(t->post({MemDesc{A, 64}}, {MemDesc{B, 64}}, 12345, {}).status().code() == StatusCode::kNotFound);
  CHECK(t->poll(777).code() == StatusCode::kNotFound);

  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 7 + 1);
  auto id = t->post({MemDesc{A + 100, 5000}}, {MemDesc{B + 3, 5000}}, *self, {});
  REQUIRE(id.ok());
  Deadline d = Deadline::in(10s);
  Status s;
  do {
    t->progress();
    s = t->poll(*id);
  } while (s.inProgress() && !d.expired());
  REQUIRE(s.isOk());
  CHECK(std::memcmp(a.data() + 100, b.data() + 3, 5000) == 0);
  CHECK(b[2] == 0);
  CHECK(b[5003] == 0);
  CHECK(t->deregisterMemory(*ha).isOk());
  CHECK(t->deregisterMemory(*ha).code() == StatusCode::kNotFound);
  CHECK(t->unloadPeer(*self).isOk());
}

TEST_CASE("ucx: cancel stops a transfer, the endpoint stays usable") {
  Target target;
  UcxOptions o;
  o.sliceBytes = 256 << 10;  // many progress() calls per transfer, so cancel lands mid-way
  o.maxPutBytes = 64 << 10;
  Initiator ini(target, o);
  const uintptr_t src = reinterpret_cast<uintptr_t>(ini.src.data());
  const uint64_t half = kTargetBytes / 2;
  const uint64_t before = target.rangeHash(0, half);

  // Cancelled before any progress: not one byte may move.
  auto id = ini.t->post({MemDesc{src, half}}, {MemDesc{target.base, half}}, ini.peer, {});
  REQUIRE(id.ok());
  REQUIRE(ini.t->cancel(*id).isOk());
  CHECK(ini.wait(*id).code() == StatusCode::kCancelled);
  // Cancelled mid-way: bytes already written may stay, the rest stops.
  id = ini.t->post({MemDesc{src, half}}, {MemDesc{target.base, half}}, ini.peer, {});
  REQUIRE(id.ok());
  for (int i = 0; i < 3; ++i) ini.t->progress();
  REQUIRE(ini.t->cancel(*id).isOk());
  CHECK(ini.wait(*id).code() == StatusCode::kCancelled);
  CHECK(ini.t->poll(*id).code() == StatusCode::kNotFound);
  CHECK(ini.t->cancel(*id).code() == StatusCode::kNotFound);
  Deadline settle = Deadline::in(300ms);
  while (!settle.expired()) ini.t->progress();
  CHECK(target.rangeHash(0, half) != hashBytes(ini.src.data(), half));  // it did stop early
  (void)before;

  // The endpoint is still healthy: a later transfer into the other half completes.
  id = ini.t->post({MemDesc{src + half, half}}, {MemDesc{target.base + half, half}}, ini.peer, {});
  REQUIRE(id.ok());
  REQUIRE(ini.wait(*id).isOk());
  CHECK(target.rangeHash(half, half) == hashBytes(ini.src.data() + half, half));
}

TEST_CASE("ucx: a peer killed mid-transfer fails the transfer within the deadline") {
  Target target;
  UcxOptions o;
  o.transferTimeout = 3s;
  o.sliceBytes = 256 << 10;
  o.maxPutBytes = 64 << 10;
  Initiator ini(target, o);
  const uintptr_t src = reinterpret_cast<uintptr_t>(ini.src.data());
  // A first transfer proves the endpoint works before the peer dies.
  auto id = ini.t->post({MemDesc{src, 4096}}, {MemDesc{target.base, 4096}}, ini.peer, {});
  REQUIRE(id.ok());
  REQUIRE(ini.wait(*id).isOk());

  id = ini.t->post({MemDesc{src, kTargetBytes}}, {MemDesc{target.base, kTargetBytes}}, ini.peer, {});
  REQUIRE(id.ok());
  for (int i = 0; i < 4; ++i) ini.t->progress();
  REQUIRE(ini.t->poll(*id).inProgress());
  const SteadyTime killedAt = steadyNow();
  target.kill();
  Status s = ini.wait(*id, 10s);
  const double took = secondsBetween(killedAt, steadyNow());
  INFO("outcome " << s.toString() << " after " << took << " s");
  CHECK((s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded));
  CHECK(took < 5.0);                                        // transferTimeout (3 s) plus slack for a loaded CI machine
  CHECK(ini.t->poll(*id).code() == StatusCode::kNotFound);  // nothing left pending

  // Whatever comes next to the dead peer fails too, within the deadline.
  auto again = ini.t->post({MemDesc{src, 4096}}, {MemDesc{target.base, 4096}}, ini.peer, {});
  if (again.ok()) {
    Status s2 = ini.wait(*again, 10s);
    CHECK(!s2.isOk());
    CHECK(!s2.inProgress());
  } else {
    CHECK(again.status().code() == StatusCode::kUnavailable);
  }
}

TEST_CASE("ucx: a stalled peer misses the deadline and a later post reconnects") {
  // Over tcp the target must progress for puts to land; SIGSTOP freezes it. Keepalive is set
  // long so that the transfer deadline, not UCX's keepalive, is what fires.
  setenv("UCX_TLS", "tcp", 1);
  Target target("tcp");
  UcxOptions o;
  o.transferTimeout = 1500ms;
  o.keepaliveInterval = 60s;
  Initiator ini(target, o);
  unsetenv("UCX_TLS");
  const uintptr_t src = reinterpret_cast<uintptr_t>(ini.src.data());
  auto id = ini.t->post({MemDesc{src, 4096}}, {MemDesc{target.base, 4096}}, ini.peer, {});
  REQUIRE(id.ok());
  REQUIRE(ini.wait(*id).isOk());

  REQUIRE(::kill(target.pid, SIGSTOP) == 0);
  id = ini.t->post({MemDesc{src, kTargetBytes}}, {MemDesc{target.base, kTargetBytes}}, ini.peer, {});
  REQUIRE(id.ok());
  const SteadyTime start = steadyNow();
  Status s = ini.wait(*id, 10s);
  const double took = secondsBetween(start, steadyNow());
  INFO("outcome " << s.toString() << " after " << took << " s");
  CHECK(s.code() == StatusCode::kDeadlineExceeded);
  CHECK(took >= 1.4);
  CHECK(took < 4.5);
  REQUIRE(::kill(target.pid, SIGCONT) == 0);

  // The peer is alive again: the next post re-creates the endpoint and completes.
  id = ini.t->post({MemDesc{src + 8192, 4096}}, {MemDesc{target.base + 8192, 4096}}, ini.peer, {});
  REQUIRE(id.ok());
  REQUIRE(ini.wait(*id, 15s).isOk());
  CHECK(target.rangeHash(8192, 4096) == hashBytes(ini.src.data() + 8192, 4096));
}

namespace {
// Only for checking that ucxAllocateRegistered refuses other transports.
class NotUcx final : public Transport {
 public:
  TransportCaps caps() const override {
    TransportCaps c;
    c.name = "loopback";
    return c;
  }
  Result<MemHandle> registerMemory(const MemDesc&) override { return unimplemented("x"); }
  Status deregisterMemory(MemHandle) override { return unimplemented("x"); }
  Result<std::string> packRemoteKey(MemHandle) override { return unimplemented("x"); }
  Result<std::string> localConnInfo() override { return unimplemented("x"); }
  Result<PeerId> loadPeer(const PeerInfo&) override { return unimplemented("x"); }
  Status unloadPeer(PeerId) override { return unimplemented("x"); }
  Result<TransferId> post(const DescList&, const DescList&, PeerId, const std::string&) override {
    return unimplemented("x");
  }
  Status poll(TransferId) override { return unimplemented("x"); }
  Status cancel(TransferId) override { return unimplemented("x"); }
  bool progress() override { return false; }
};
}  // namespace

TEST_CASE("ucx: memory UCX allocates is registered and usable as both ends of a put") {
  NotUcx other;
  CHECK(ucxAllocateRegistered(other, 4096).status().code() == StatusCode::kInvalidArgument);
  auto made = makeUcxTransport();
  REQUIRE(made.ok());
  auto& t = *made;
  CHECK(ucxAllocateRegistered(*t, 0).status().code() == StatusCode::kInvalidArgument);
  auto a = ucxAllocateRegistered(*t, 1 << 20);
  auto b = ucxAllocateRegistered(*t, 1 << 20);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->desc.len == (1u << 20));
  auto* pa = static_cast<uint8_t*>(a->desc.ptr());
  auto* pb = static_cast<uint8_t*>(b->desc.ptr());
  for (size_t i = 0; i < a->desc.len; ++i) pa[i] = static_cast<uint8_t>(i * 31 + 7);
  std::memset(pb, 0, b->desc.len);
  auto self = t->loadPeer(PeerInfo{"self", *t->localConnInfo(), {*t->packRemoteKey(b->handle)}});
  REQUIRE(self.ok());
  auto id = t->post({a->desc}, {b->desc}, *self, {});
  REQUIRE(id.ok());
  Deadline d = Deadline::in(10s);
  Status s;
  do {
    t->progress();
    s = t->poll(*id);
  } while (s.inProgress() && !d.expired());
  REQUIRE(s.isOk());
  CHECK(std::memcmp(pa, pb, a->desc.len) == 0);
  CHECK(t->deregisterMemory(a->handle).isOk());
}

TEST_CASE("ucx: key and connection blobs (kvt.proto) round-trip; damaged ones are refused, never misread") {
  ucxwire::PackedKey k;
  k.base = 0x7f0000001000ull;
  k.len = 1 << 20;
  k.kind = static_cast<uint8_t>(MemKind::kPinned);
  k.device = 0;
  k.rkey = std::string("\x01\x00\x02rkey-bytes", 13);
  const std::string key = ucxwire::encodeKey(k);
  auto back = ucxwire::decodeKey(key);
  REQUIRE(back.ok());
  CHECK(back->base == k.base);
  CHECK(back->len == k.len);
  CHECK(back->kind == k.kind);
  CHECK(back->rkey == k.rkey);
  for (size_t n = 0; n < key.size(); ++n) {
    auto cut = ucxwire::decodeKey(key.substr(0, n));
    CHECK(cut.status().code() == (n < 5 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss));
  }
  CHECK_THAT(ucxwire::decodeKey("garbage").status().message(), Catch::Contains("not a UCX key"));
  ucxwire::PackedKey badKind = k;
  badKind.kind = 7;
  CHECK_THAT(ucxwire::decodeKey(ucxwire::encodeKey(badKind)).status().message(), Catch::Contains("memory kind 7"));
  ucxwire::PackedKey empty = k;
  empty.len = 0;
  CHECK(ucxwire::decodeKey(ucxwire::encodeKey(empty)).status().code() == StatusCode::kInvalidArgument);

  const std::string conn = ucxwire::encodeConnInfo("worker-address-bytes");
  auto addr = ucxwire::decodeConnInfo(conn);
  REQUIRE(addr.ok());
  CHECK(*addr == "worker-address-bytes");
  for (size_t n = 0; n < conn.size(); ++n) CHECK(!ucxwire::decodeConnInfo(conn.substr(0, n)).ok());
  CHECK_THAT(ucxwire::decodeConnInfo(key).status().message(), Catch::Contains("not a UCX worker address"));
  CHECK(ucxwire::decodeConnInfo(ucxwire::encodeConnInfo("")).status().code() == StatusCode::kDataLoss);
}
