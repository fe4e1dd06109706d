// Support for the transport conformance suite: the receiving peer (run as a child process
// or, for same-process transports, on a thread), a line channel over pipes, and the
// deterministic payload layouts both sides regenerate from a seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pd::kvt::conformance {

// One transfer's shape: segment i copies src[srcOff[i], +len[i]) to dst[dstOff[i], +len[i]).
// Destination segments are scattered in a shuffled order with gaps, so a transport that
// mixes segments up or writes past one is caught.
struct Layout {
  std::vector<size_t> srcOff, dstOff, len;
};
// Deterministic in (seed, totalBytes, segments); kept within the capacities given.
Layout makeLayout(uint64_t seed, size_t totalBytes, size_t segments, size_t srcCapacity, size_t dstCapacity);
// Fills base[off, +len) of every source segment with bytes derived from seed.
void fillSource(uint64_t seed, uint8_t* base, const Layout& layout);
// A hash over the bytes of the segments, in segment order.
uint64_t checksumSegments(const uint8_t* base, const std::vector<size_t>& offsets, const std::vector<size_t>& lens);
uint64_t checksumRange(const uint8_t* p, size_t len);

std::string toHex(const std::string& bytes);
std::string fromHex(const std::string& hex);

// Line-oriented channel over two file descriptors (owned: closed on destruction).
class LineChannel {
 public:
  LineChannel(int readFd, int writeFd) : readFd_(readFd), writeFd_(writeFd) {}
  ~LineChannel();
  LineChannel(const LineChannel&) = delete;
  LineChannel& operator=(const LineChannel&) = delete;
  bool writeLine(const std::string& line);
  // A complete line (without '\n') or nullopt after timeoutMs or EOF.
  std::optional<std::string> readLine(int timeoutMs);
  bool eof() const { return eof_; }

 private:
  int readFd_, writeFd_;
  std::string buf_;
  bool eof_ = false;
};

// The receiving peer: creates `transport`, registers and exposes a buffer of bufBytes
// (between two unregistered guard zones of kGuardBytes), prints
//   INFO <connInfo hex> <key hex> <guard bytes> <address of the exposed buffer>
// then serves commands until QUIT, DIE or EOF:
//   SUM <off> <len>             -> SUM <checksum of allocation[off, +len)> (guards included)
//   LAYSUM <seed> <size> <segs> [shift] -> SUM <checksum of that layout's destination
//                                  segments, shifted by `shift` bytes>
//   GRANT <off> <len>           -> GRANT <hex of grantWrite({buffer + off, len})> ("-" if empty)
//   REVOKE <hex | ->            -> REVOKED <StatusCode of revokeWrite, as an int>
// DIE destroys the transport at once (the in-process stand-in for a killed process).
constexpr size_t kGuardBytes = 1 << 16;
int runPeer(const std::string& transport, size_t bufBytes, int peerTimeoutMs, int inFd, int outFd);

}  // namespace pd::kvt::conformance
