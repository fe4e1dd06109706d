// The KV TCP transport's connection handshake on the cluster secret (docs/security.md): a writer that
// cannot prove the secret never writes a byte.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <catch2/catch.hpp>

#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/transport_factory.h"
#include "kvtransfer/transports/tcp_transport.h"

using namespace pd;
using namespace pd::kvt;
using namespace std::chrono_literals;

namespace {

const std::string kSecret = "kv-secret-0123456789abcdef0123456789";
const std::string kOther = "kv-secret-9876543210fedcba9876543210";

struct Side {
  Side(const std::string& name, const std::string& secret, size_t bytes) : buf(bytes, 0) {
    TransportOptions o;
    o.localName = name;
    o.connectTimeout = 1500ms;
    o.handshakeTimeout = 500ms;
    o.peerTimeout = 1500ms;
    if (!secret.empty()) o.clusterSecret = std::make_shared<const std::string>(secret);
    o.onAuthFailure = [this](const std::string&) { ++authFailures; };
    o.onHandshakeFailure = [this](const char* why) {
      std::lock_guard<std::mutex> lock(mu);
      ++handshakeFailures[why];
    };
    auto t = makeTransport("tcp", o);
    REQUIRE(t.ok());
    transport = std::move(t).value();
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(buf.data());
    d.len = bytes;
    auto h = transport->registerMemory(d);
    REQUIRE(h.ok());
    handle = *h;
  }
  PeerInfo info(const std::string& name) {
    PeerInfo p;
    p.name = name;
    p.connInfo = transport->localConnInfo().value();
    p.remoteKeys.push_back(transport->packRemoteKey(handle).value());
    return p;
  }
  MemDesc at(size_t off, size_t len) {
    MemDesc d;
    d.addr = reinterpret_cast<uintptr_t>(buf.data()) + off;
    d.len = len;
    return d;
  }
  std::vector<uint8_t> buf;
  std::unique_ptr<Transport> transport;
  MemHandle handle = 0;
  std::atomic<int> authFailures{0};
  std::mutex mu;
  std::map<std::string, int> handshakeFailures;  // by reason
  int failures(const std::string& why) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (handshakeFailures[why] > 0) return handshakeFailures[why];
      }
      std::this_thread::sleep_for(10ms);
    }
    return 0;
  }
};

// Posts writer.buf[0, n) -> reader.buf[0, n) and polls it to its end (bounded).
Status writeAll(Side& writer, Side& reader, size_t n) {
  auto peer = writer.transport->loadPeer(reader.info("reader"));
  if (!peer.ok()) return peer.status();
  auto id = writer.transport->post({writer.at(0, n)}, {reader.at(0, n)}, *peer, {});
  if (!id.ok()) return id.status();
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  for (;;) {
    writer.transport->progress();
    reader.transport->progress();
    Status s = writer.transport->poll(*id);
    if (s.code() != StatusCode::kInProgress) return s;
    if (std::chrono::steady_clock::now() > deadline) return deadlineExceeded("transfer did not end");
    std::this_thread::sleep_for(1ms);
  }
}

}  // namespace

TEST_CASE("kv tcp auth: a writer with the cluster secret writes") {
  Side reader("reader", kSecret, 1 << 16), writer("writer", kSecret, 1 << 16);
  std::memset(writer.buf.data(), 0x5a, writer.buf.size());
  Status s = writeAll(writer, reader, 1 << 16);
  INFO(s.toString());
  REQUIRE(s.isOk());
  CHECK(reader.buf[0] == 0x5a);
  CHECK(reader.buf.back() == 0x5a);
  CHECK(reader.authFailures == 0);
}

TEST_CASE("kv tcp auth: a writer with another secret, or none, writes nothing and is counted") {
  SECTION("another secret") {
    Side reader("reader", kSecret, 4096), writer("writer", kOther, 4096);
    std::memset(writer.buf.data(), 0x5a, writer.buf.size());
    Status s = writeAll(writer, reader, 4096);
    CHECK_FALSE(s.isOk());
    CHECK(reader.buf[0] == 0);
    CHECK(reader.authFailures == 1);
  }
  SECTION("no secret on the writer") {
    Side reader("reader", kSecret, 4096), writer("writer", "", 4096);
    std::memset(writer.buf.data(), 0x5a, writer.buf.size());
    Status s = writeAll(writer, reader, 4096);
    CHECK_FALSE(s.isOk());
    CHECK_THAT(s.message(), Catch::Contains("authentication failed"));
    CHECK(reader.buf[0] == 0);
  }
  SECTION("a secret on the writer, none on the receiver: fails closed") {
    Side reader("reader", "", 4096), writer("writer", kSecret, 4096);
    std::memset(writer.buf.data(), 0x5a, writer.buf.size());
    Status s = writeAll(writer, reader, 4096);
    CHECK_FALSE(s.isOk());
    CHECK_THAT(s.message(), Catch::Contains("authentication failed"));
    CHECK(reader.buf[0] == 0);
  }
}

TEST_CASE("kv tcp auth: a raw writer with the old clear-text hello is closed, a silent one at the handshake timeout") {
  Side reader("reader", kSecret, 4096);
  pd::kvt::proto::TcpConnInfo info;
  REQUIRE(info.ParseFromString(reader.transport->localConnInfo().value()));
  auto dial = [&] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{3, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(info.port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    return fd;
  };
  auto closedWithin = [](int fd) {
    char b[256];
    for (;;) {
      ssize_t r = ::recv(fd, b, sizeof b, 0);
      if (r == 0) return true;
      if (r < 0) return errno == ECONNRESET;
    }
  };
  {
    // The instance token is known (it is in the connection info), the secret is not.
    int fd = dial();
    char hdr[40] = {};
    const uint32_t magic = 0x544b4450;
    const uint16_t version = 2;
    const uint64_t instance = info.instance(), stream = 0, len = 4;
    std::memcpy(hdr, &magic, 4);
    hdr[4] = 1;  // kHello
    std::memcpy(hdr + 6, &version, 2);
    std::memcpy(hdr + 16, &instance, 8);
    std::memcpy(hdr + 24, &stream, 8);
    std::memcpy(hdr + 32, &len, 8);
    std::string hello(hdr, 40);
    hello += "evil";
    REQUIRE(::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) == ssize_t(hello.size()));
    CHECK(closedWithin(fd));
    ::close(fd);
    for (int i = 0; i < 100 && reader.authFailures == 0; ++i) std::this_thread::sleep_for(10ms);
    CHECK(reader.authFailures == 1);
    CHECK(reader.failures("auth") == 1);
  }
  {
    int fd = dial();
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(closedWithin(fd));  // handshakeTimeout is 500 ms here
    CHECK(std::chrono::steady_clock::now() - t0 < 2500ms);
    ::close(fd);
    CHECK(reader.failures("timeout") == 1);
  }
  {
    // Not a hello at all (bad magic): counted, not only logged.
    int fd = dial();
    const std::string junk(40, 'x');
    REQUIRE(::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL) == ssize_t(junk.size()));
    CHECK(closedWithin(fd));
    ::close(fd);
    CHECK(reader.failures("protocol") == 1);
  }
  {
    // Connected and gone without a word.
    int fd = dial();
    ::close(fd);
    CHECK(reader.failures("closed") == 1);
  }
}
