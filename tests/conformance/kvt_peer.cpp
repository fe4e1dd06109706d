#include "tests/conformance/kvt_peer.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "kvtransfer/transport_factory.h"

namespace pd::kvt::conformance {

namespace {
uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

Layout makeLayout(uint64_t seed, size_t total, size_t segments, size_t srcCapacity, size_t dstCapacity) {
  std::mt19937_64 rng(seed);
  segments = std::max<size_t>(1, std::min(segments, total));
  std::set<size_t> cuts;
  while (cuts.size() < segments - 1) cuts.insert(1 + rng() % (total - 1));
  Layout l;
  size_t prev = 0;
  for (size_t c : cuts) {
    l.len.push_back(c - prev);
    prev = c;
  }
  l.len.push_back(total - prev);
  // Gaps only while they fit; large transfers stay dense.
  const size_t n = l.len.size();
  const size_t srcSlack = srcCapacity > total ? (srcCapacity - total) / n : 0;
  const size_t dstSlack = dstCapacity > total ? (dstCapacity - total) / n : 0;
  size_t off = 0;
  for (size_t i = 0; i < n; ++i) {
    off += std::min<size_t>(srcSlack, rng() % 64);
    l.srcOff.push_back(off);
    off += l.len[i];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  l.dstOff.assign(n, 0);
  off = 0;
  for (size_t k : order) {
    off += std::min<size_t>(dstSlack, rng() % 64);
    l.dstOff[k] = off;
    off += l.len[k];
  }
  return l;
}

void fillSource(uint64_t seed, uint8_t* base, const Layout& layout) {
  uint64_t s = seed ^ 0x5eed;
  for (size_t i = 0; i < layout.len.size(); ++i) {
    uint8_t* p = base + layout.srcOff[i];
    size_t n = layout.len[i];
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
      uint64_t v = splitmix(s);
      std::memcpy(p + k, &v, 8);
    }
    uint64_t v = splitmix(s);
    for (; k < n; ++k, v >>= 8) p[k] = uint8_t(v);
  }
}

uint64_t checksumRange(const uint8_t* p, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull ^ len;
  size_t k = 0;
  for (; k + 8 <= len; k += 8) {
    uint64_t v;
    std::memcpy(&v, p + k, 8);
    h = (h ^ v) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; k < len; ++k) h = (h ^ p[k]) * 0x100000001b3ull;
  return h;
}

uint64_t checksumSegments(const uint8_t* base, const std::vector<size_t>& offsets, const std::vector<size_t>& lens) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < lens.size(); ++i) {
    h ^= checksumRange(base + offsets[i], lens[i]) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  }
  return h;
}

std::string toHex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out.empty() ? "-" : out;
}

std::string fromHex(const std::string& hex) {
  if (hex == "-") return {};
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

LineChannel::~LineChannel() {
  if (readFd_ >= 0) ::close(readFd_);
  if (writeFd_ >= 0 && writeFd_ != readFd_) ::close(writeFd_);
}

bool LineChannel::writeLine(const std::string& line) {
  std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(writeFd_, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += size_t(n);
  }
  return true;
}

std::optional<std::string> LineChannel::readLine(int timeoutMs) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
  while (true) {
    auto nl = buf_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    if (eof_) return std::nullopt;
    int left =
        int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left < 0) return std::nullopt;
    pollfd pfd{readFd_, POLLIN, 0};
    int r = ::poll(&pfd, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char tmp[4096];
    ssize_t n = ::read(readFd_, tmp, sizeof tmp);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      eof_ = true;
      continue;
    }
    buf_.append(tmp, size_t(n));
  }
}

int runPeer(const std::string& name, size_t bufBytes, int peerTimeoutMs, int inFd, int outFd) {
  LineChannel ch(inFd, outFd);
  TransportOptions opts;
  opts.localName = "conformance-peer";
  opts.peerTimeout = std::chrono::milliseconds(peerTimeoutMs);
  auto made = makeTransport(name, opts);
  if (!made.ok()) {
    ch.writeLine("ERROR " + made.status().toString());
    return 2;
  }
  std::unique_ptr<Transport> t = std::move(made).value();
  const size_t allocBytes = bufBytes + 2 * kGuardBytes;
  std::unique_ptr<uint8_t[]> alloc(new uint8_t[allocBytes]);
  std::memset(alloc.get(), 0xA5, allocBytes);
  uint8_t* buf = alloc.get() + kGuardBytes;
  MemDesc d;
  d.addr = reinterpret_cast<uintptr_t>(buf);
  d.len = bufBytes;
  auto h = t->registerMemory(d);
  auto key = h.ok() ? t->packRemoteKey(*h) : Result<std::string>(h.status());
  auto conn = t->localConnInfo();
  if (!key.ok() || !conn.ok()) {
    ch.writeLine("ERROR " + (!key.ok() ? key.status() : conn.status()).toString());
    return 2;
  }
  ch.writeLine("INFO " + toHex(*conn) + " " + toHex(*key) + " " + std::to_string(kGuardBytes) + " " +
               std::to_string(d.addr));

  auto layoutSum = [&](uint64_t seed, size_t size, size_t segs, size_t shift = 0) {
    Layout l = makeLayout(seed, size, segs, bufBytes, bufBytes);
    for (auto& o : l.dstOff) o += shift;
    for (size_t i = 0; i < l.len.size(); ++i) {
      if (l.dstOff[i] + l.len[i] > bufBytes) return uint64_t(0);
    }
    return checksumSegments(buf, l.dstOff, l.len);
  };
  while (true) {
    t->progress();
    auto line = ch.readLine(1);
    if (!line) {
      if (ch.eof()) break;
      continue;
    }
    std::istringstream in(*line);
    std::string cmd;
    in >> cmd;
    if (cmd == "QUIT") break;
    if (cmd == "DIE") {
      t.reset();
      ch.writeLine("DEAD");
      break;
    }
    if (cmd == "SUM") {
      size_t off = 0, len = 0;
      in >> off >> len;
      if (off + len > allocBytes) {
        ch.writeLine("ERROR range outside the allocation");
        continue;
      }
      ch.writeLine("SUM " + std::to_string(checksumRange(alloc.get() + off, len)));
    } else if (cmd == "LAYSUM") {
      uint64_t seed = 0;
      size_t size = 0, segs = 0, shift = 0;
      in >> seed >> size >> segs;
      if (!(in >> shift)) shift = 0;
      ch.writeLine("SUM " + std::to_string(layoutSum(seed, size, segs, shift)));
    } else if (cmd == "GRANT") {
      size_t off = 0, len = 0;
      in >> off >> len;
      auto g = t->grantWrite({MemDesc{reinterpret_cast<uintptr_t>(buf) + off, len}});
      ch.writeLine(g.ok() ? "GRANT " + (g->empty() ? std::string("-") : toHex(*g)) : "ERROR " + g.status().toString());
    } else if (cmd == "REVOKE") {
      std::string hex;
      in >> hex;
      Status st = t->revokeWrite(hex == "-" ? std::string() : fromHex(hex));
      ch.writeLine("REVOKED " + std::to_string(int(st.code())));
    } else {
      ch.writeLine("ERROR unknown command " + cmd);
    }
  }
  // The transport's I/O thread may still be writing into the buffer: stop it first.
  t.reset();
  return 0;
}

}  // namespace pd::kvt::conformance
