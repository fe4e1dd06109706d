// worker::ZmqKvPublisher: a real ZeroMQ SUB socket receives what a real KV cache manager
// recorded, and this test decodes it by vLLM's published description of the KV-event wire
// format (3 parts: topic, 8-byte big-endian seq, msgpack EventBatch in msgspec array_like
// form with tagged events), not with the publisher's own code.
#include "worker/zmq_kv_publisher.h"

#include <chrono>
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/test_skip.h"
#include "tests/unit/worker/small_kv.h"
#include "worker/kv_event_publisher.h"

#if PD_HAVE_ZMQ
#include <msgpack.h>
#include <zmq.h>
#endif

using namespace pd;
using namespace pd::worker;

#if PD_HAVE_ZMQ
namespace {

struct Message {
  std::string topic;
  uint64_t seq = 0;
  std::string payload;
};

// One multipart message within `timeoutMs`, or nullopt.
std::optional<Message> receive(void* sub, int timeoutMs) {
  zmq_pollitem_t item{sub, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&item, 1, timeoutMs) <= 0) return std::nullopt;
  std::vector<std::string> parts;
  int more = 1;
  while (more) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    REQUIRE(zmq_msg_recv(&m, sub, 0) >= 0);
    parts.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
    more = zmq_msg_more(&m);
    zmq_msg_close(&m);
  }
  REQUIRE(parts.size() == 3);
  REQUIRE(parts[1].size() == 8);
  uint64_t seq = 0;
  for (unsigned char c : parts[1]) seq = (seq << 8) | c;
  return Message{parts[0], seq, parts[2]};
}

// The decoded EventBatch, as a consumer of vLLM's events would see it.
struct Event {
  std::string tag;
  std::vector<uint64_t> hashes;
  std::optional<uint64_t> parent;
  std::vector<int64_t> tokens;
  int64_t blockSize = 0;
  std::string medium;
};
struct Batch {
  double ts = 0;
  std::vector<Event> events;
  bool rankIsNil = false;
};

std::string str(const msgpack_object& o) {
  REQUIRE(o.type == MSGPACK_OBJECT_STR);
  return std::string(o.via.str.ptr, o.via.str.size);
}
std::vector<uint64_t> u64s(const msgpack_object& o) {
  REQUIRE(o.type == MSGPACK_OBJECT_ARRAY);
  std::vector<uint64_t> out;
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    REQUIRE(o.via.array.ptr[i].type == MSGPACK_OBJECT_POSITIVE_INTEGER);
    out.push_back(o.via.array.ptr[i].via.u64);
  }
  return out;
}

Batch decode(const std::string& payload) {
  msgpack_unpacked u;
  msgpack_unpacked_init(&u);
  size_t off = 0;
  REQUIRE(msgpack_unpack_next(&u, payload.data(), payload.size(), &off) == MSGPACK_UNPACK_SUCCESS);
  CHECK(off == payload.size());
  const msgpack_object& root = u.data;
  REQUIRE(root.type == MSGPACK_OBJECT_ARRAY);
  REQUIRE(root.via.array.size >= 2);  // ts, events[, data_parallel_rank]
  Batch b;
  REQUIRE(root.via.array.ptr[0].type == MSGPACK_OBJECT_FLOAT64);
  b.ts = root.via.array.ptr[0].via.f64;
  b.rankIsNil = root.via.array.size < 3 || root.via.array.ptr[2].type == MSGPACK_OBJECT_NIL;
  const msgpack_object& evs = root.via.array.ptr[1];
  REQUIRE(evs.type == MSGPACK_OBJECT_ARRAY);
  for (uint32_t i = 0; i < evs.via.array.size; ++i) {
    const msgpack_object& e = evs.via.array.ptr[i];
    REQUIRE(e.type == MSGPACK_OBJECT_ARRAY);
    REQUIRE(e.via.array.size >= 1);
    const msgpack_object* f = e.via.array.ptr;
    Event ev;
    ev.tag = str(f[0]);
    if (ev.tag == "BlockStored") {
      // block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
      REQUIRE(e.via.array.size >= 7);
      ev.hashes = u64s(f[1]);
      if (f[2].type != MSGPACK_OBJECT_NIL) ev.parent = f[2].via.u64;
      REQUIRE(f[3].type == MSGPACK_OBJECT_ARRAY);
      for (uint32_t t = 0; t < f[3].via.array.size; ++t) ev.tokens.push_back(f[3].via.array.ptr[t].via.i64);
      ev.blockSize = int64_t(f[4].via.u64);
      CHECK(f[5].type == MSGPACK_OBJECT_NIL);  // lora_id
      ev.medium = str(f[6]);
    } else if (ev.tag == "BlockRemoved") {
      REQUIRE(e.via.array.size >= 3);  // block_hashes, medium
      ev.hashes = u64s(f[1]);
      ev.medium = str(f[2]);
    } else {
      CHECK(ev.tag == "AllBlocksCleared");
    }
    b.events.push_back(ev);
  }
  msgpack_unpacked_destroy(&u);
  return b;
}

}  // namespace
#endif

TEST_CASE("zmq kv events: a SUB socket decodes stored and removed blocks in vLLM's wire format") {
#if !PD_HAVE_ZMQ
  pd::test::skipTest("built without ZeroMQ and msgpack-c (scripts/setup installs libzmq3-dev, libmsgpack-dev)");
#else
  auto pub = ZmqKvPublisher::bind("tcp://127.0.0.1:*", "kv-events", 2, "CPU");
  INFO(pub.status().toString());
  REQUIRE(pub.ok());
  auto kv = pd::test::smallAccountingKv(4, 2);
  metrics::Registry reg;
  KvEventPublisher events(*kv,
                          KvEventPublisher::Sink{[](const proto::Envelope&) {}, [](RouterId, proto::Envelope) {},
                                                 [&](std::span<const engine::KvBlockEvent> ev, uint64_t us) {
                                                   pub.value()->publish(ev, us);
                                                 }},
                          reg);

  void* ctx = zmq_ctx_new();
  void* sub = zmq_socket(ctx, ZMQ_SUB);
  REQUIRE(zmq_connect(sub, pub.value()->endpoint().c_str()) == 0);
  REQUIRE(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "kv-events", 9) == 0);
  // PUB drops what it sends before the subscription arrived: publish throw-away batches
  // (a new block stored each time, older ones evicted) until one comes through.
  std::optional<Message> got;
  for (int i = 0; i < 200 && (!got || i < 4); ++i) {  // 4+: every block ends cached
    const std::vector<int32_t> warm = {100 + i, 101};
    REQUIRE(kv->allocate(1000 + i, 2).isOk());
    REQUIRE(kv->cacheComputedBlocks(1000 + i, warm, 2).isOk());
    REQUIRE(kv->free(1000 + i).isOk());
    events.flush();
    if (!got) got = receive(sub, 20);
  }
  REQUIRE(got);
  while (receive(sub, 50)) {
  }  // drain the warm-up
  // The stream restarts from here: the next batch's seq follows the last one sent.
  const uint64_t nextSeq = pub.value()->sent();

  std::vector<int32_t> a = {1, 2, 3, 4, 5, 6};
  REQUIRE(kv->numCachedFreeBlocks() >= 3);
  const size_t evicted = size_t(3 - (kv->numFreeBlocks() - kv->numCachedFreeBlocks()));
  REQUIRE(kv->allocate(1, 6).isOk());  // evicts warm-up blocks: a removed event first
  REQUIRE(kv->cacheComputedBlocks(1, a, 6).isOk());
  const auto before = std::chrono::system_clock::now();
  events.flush();
  auto m = receive(sub, 2000);
  REQUIRE(m);
  CHECK(m->topic == "kv-events");
  CHECK(m->seq == nextSeq);
  const Batch b = decode(m->payload);
  CHECK(b.rankIsNil);
  const double now = std::chrono::duration<double>(before.time_since_epoch()).count();
  CHECK(b.ts <= now + 1);
  CHECK(b.ts > now - 60);
  const auto names = blockHashChain(a, 2);
  REQUIRE(b.events.size() == 2);
  CHECK(b.events[0].tag == "BlockRemoved");
  CHECK(b.events[0].hashes.size() == evicted);  // the warm-up blocks that made room
  CHECK(b.events[0].medium == "CPU");
  CHECK(b.events[1].tag == "BlockStored");
  CHECK(b.events[1].hashes == names);  // the chain in one event
  CHECK_FALSE(b.events[1].parent);     // a first block has none
  CHECK(b.events[1].tokens == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  CHECK(b.events[1].blockSize == 2);
  CHECK(b.events[1].medium == "CPU");

  // A prompt sharing a's first block: one block stored, its parent named.
  std::vector<int32_t> c = {1, 2, 9, 9};
  REQUIRE(kv->free(1).isOk());
  auto cached = kv->attachCachedPrefix(3, c, 3);
  REQUIRE(cached.ok());
  REQUIRE(kv->extend(3, 4).isOk());
  REQUIRE(kv->cacheComputedBlocks(3, c, 4).isOk());
  events.flush();
  m = receive(sub, 2000);
  REQUIRE(m);
  CHECK(m->seq == nextSeq + 1);
  const Batch b2 = decode(m->payload);
  REQUIRE(!b2.events.empty());
  const Event& stored = b2.events.back();
  CHECK(stored.tag == "BlockStored");
  CHECK(stored.hashes == std::vector<uint64_t>{blockHashChain(c, 2)[1]});
  REQUIRE(stored.parent);
  CHECK(*stored.parent == names[0]);
  CHECK(stored.tokens == std::vector<int64_t>{9, 9});

  zmq_close(sub);
  zmq_ctx_term(ctx);
#endif
}

TEST_CASE("zmq kv events: a bad endpoint is refused by name") {
  auto pub = ZmqKvPublisher::bind("tcp://256.1.1.1:1", "kv-events", 16, "CPU");
  REQUIRE_FALSE(pub.ok());
  CHECK(pub.status().message().find("zmq_endpoint") != std::string::npos);
}

TEST_CASE("zmq kv events: the lower tiers' blocks carry medium CPU and DISK") {
#if !PD_HAVE_ZMQ
  pd::test::skipTest("built without ZeroMQ and msgpack-c (scripts/setup installs libzmq3-dev, libmsgpack-dev)");
#else
  using engine::KvBlockEvent;
  using engine::KvTier;
  const std::vector<KvBlockEvent> ev = {
      {KvBlockEvent::Kind::kStored, 1, kRootBlockHash, {5, 6}, KvTier::kRegion},
      {KvBlockEvent::Kind::kStored, 1, kRootBlockHash, {5, 6}, KvTier::kHost},
      {KvBlockEvent::Kind::kStored, 1, kRootBlockHash, {5, 6}, KvTier::kDisk},
      {KvBlockEvent::Kind::kRemoved, 1, kRootBlockHash, {}, KvTier::kDisk},
  };
  const Batch b = decode(encodeVllmEventBatch(1.5, ev, 2, "GPU"));
  REQUIRE(b.events.size() == 4);
  CHECK(b.events[0].medium == "GPU");
  CHECK(b.events[1].medium == "CPU");
  CHECK(b.events[2].medium == "DISK");
  CHECK(b.events[3].tag == "BlockRemoved");
  CHECK(b.events[3].medium == "DISK");
#endif
}
