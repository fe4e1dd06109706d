// kvt_conformance_peer <transport> <buffer bytes> <peer timeout ms>: the receiving side of
// the transport conformance suite, in its own process (stdin: commands, stdout: replies).
#include <cstdio>
#include <string>

#include "tests/conformance/kvt_peer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <transport> <buffer bytes> <peer timeout ms>\n", argv[0]);
    return 2;
  }
  return pd::kvt::conformance::runPeer(argv[1], std::stoull(argv[2]), std::stoi(argv[3]), 0, 1);
}
