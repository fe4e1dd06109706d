// KV connection blobs, parse only (no network): the agent metadata a peer sends through the
// control plane into TransferAgent::loadPeer (agent.cpp: AgentMetadata, then each transport's
// connection info and keys; this agent runs the same-node transports cma and loopback, which
// parse their blobs and reach nothing outside this process), and the verbs codec's blobs
// (verbs_codec.h). Byte 0 picks the surface, the rest is the blob.
// Seeds: PD_FUZZ_WRITE_SEEDS=dir writes blobs made by the real encoders.
#include <prometheus/registry.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvtransfer/agent.h"
#include "kvtransfer/transports/verbs_codec.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace pd;
using namespace pd::kvt;

struct Agents {
  prometheus::Registry registry;
  std::vector<uint8_t> memory = std::vector<uint8_t>(4096);
  std::unique_ptr<TransferAgent> self;  // loads the fuzzed metadata
  std::unique_ptr<TransferAgent> peer;  // a live peer, so mutated real blobs reach deep paths
  std::string peerMetadata;
};

std::unique_ptr<TransferAgent> makeAgent(prometheus::Registry& registry, const std::string& name) {
  AgentOptions o;
  o.name = name;
  o.preference = {"cma", "loopback"};
  o.fallbackToTcp = false;
  auto a = TransferAgent::create(o, registry);
  PD_FUZZ_CHECK(a.ok(), "a cma+loopback agent starts");
  return std::move(*a);
}

Agents& agents() {
  static Agents* a = [] {
    auto* s = new Agents();
    s->self = makeAgent(s->registry, "fuzz-self");
    s->peer = makeAgent(s->registry, "fuzz-peer");
    auto region = s->peer->registerMemory(MemDesc{reinterpret_cast<uintptr_t>(s->memory.data()), s->memory.size()});
    PD_FUZZ_CHECK(region.ok(), "the peer registers memory");
    auto md = s->peer->localMetadata();
    PD_FUZZ_CHECK(md.ok(), "the peer has metadata");
    s->peerMetadata = *md;
    return s;
  }();
  return *a;
}

void writeSeed(const std::string& dir, const std::string& name, uint8_t surface, const std::string& blob) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.put(static_cast<char>(surface));
  out << blob;
}

void writeSeeds(const std::string& dir) {
  writeSeed(dir, "agent_metadata", 0, agents().peerMetadata);
  verbs::ConnInfo ci;
  ci.name = "decode-0";
  ci.lid = 3;
  ci.qpn = 0x1234;
  ci.psn = 0x42;
  ci.mtu = 5;
  writeSeed(dir, "verbs_conn_offer", 1, verbs::encodeConnInfo(ci));
  ci.peerQpn = 0x99;
  writeSeed(dir, "verbs_conn_reply", 1, verbs::encodeConnInfo(ci));
  writeSeed(dir, "verbs_key", 2, verbs::encodeKey({0x7f0000001000, 1 << 20, 0xabcd}));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)agents();
  if (!fuzz::seedDir().empty()) writeSeeds(fuzz::seedDir());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string blob(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: {
      auto& a = agents();
      auto peer = a.self->loadPeer(blob);
      if (peer.ok()) {
        (void)a.self->peerTransport(*peer);
        PD_FUZZ_CHECK(a.self->unloadPeer(*peer).isOk(), "a loaded peer unloads");
      } else {
        PD_FUZZ_CHECK(!peer.status().message().empty(), "loadPeer errors say why");
      }
      break;
    }
    case 1: {
      auto ci = verbs::decodeConnInfo(blob);
      if (ci.ok()) {
        // What decodes re-encodes to a blob that decodes the same.
        auto again = verbs::decodeConnInfo(verbs::encodeConnInfo(*ci));
        PD_FUZZ_CHECK(again.ok() && again->name == ci->name && again->qpn == ci->qpn && again->psn == ci->psn &&
                          again->gid == ci->gid && again->peerQpn == ci->peerQpn,
                      "verbs conn info round-trips");
        verbs::PendingQps pending;
        pending.offer(ci->qpn);
        (void)pending.choose(*ci);
      }
      break;
    }
    case 2: {
      auto k = verbs::decodeKey(blob);
      if (k.ok()) {
        auto again = verbs::decodeKey(verbs::encodeKey(*k));
        PD_FUZZ_CHECK(again.ok() && again->addr == k->addr && again->len == k->len && again->rkey == k->rkey,
                      "verbs keys round-trip");
      }
      break;
    }
  }
  return 0;
}
