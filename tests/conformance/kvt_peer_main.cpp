// kvt_conformance_peer <transport> <buffer bytes> <peer timeout ms>: the receiving side of
// the transport conformance suite, in its own process (stdin: commands, stdout: replies).
#include <cstdint>
#include <string>

#include "common/base/cli.h"
#include "tests/conformance/kvt_peer.h"

int main(int argc, char** argv) {
  std::string transport;
  uint64_t bufferBytes = 0;
  int peerTimeoutMs = 0;
  CLI::App app{
      "kvt_conformance_peer: the receiving side of the transport conformance suite "
      "(stdin: commands, stdout: replies)",
      "kvt_conformance_peer"};
  pd::cli::configure(app);
  app.add_option("transport", transport, "the transport under test")->required();
  app.add_option("buffer_bytes", bufferBytes, "the receive buffer's bytes")->required();
  app.add_option("peer_timeout_ms", peerTimeoutMs, "the peer timeout in ms")->required();
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  return pd::kvt::conformance::runPeer(transport, bufferBytes, peerTimeoutMs, 0, 1);
}
