#include "worker/zmq_kv_publisher.h"

#include "worker/kv_event_publisher.h"

#if PD_HAVE_ZMQ
#include <msgpack.h>
#include <zmq.h>
#endif

namespace pd::worker {

#if PD_HAVE_ZMQ

namespace {

void packStr(msgpack_packer* pk, const std::string& s) {
  msgpack_pack_str(pk, s.size());
  msgpack_pack_str_body(pk, s.data(), s.size());
}

void packHashes(msgpack_packer* pk, std::span<const engine::KvBlockEvent> run) {
  msgpack_pack_array(pk, run.size());
  for (const auto& e : run) msgpack_pack_uint64(pk, e.hash);
}

// vLLM's `medium` of a tier: the region's is the worker's (GPU on cuda, CPU on cpu), the
// lower tiers' are CPU and DISK.
const std::string& mediumOf(engine::KvTier tier, const std::string& regionMedium) {
  static const std::string kCpu = "CPU", kDisk = "DISK";
  switch (tier) {
    case engine::KvTier::kHost:
      return kCpu;
    case engine::KvTier::kDisk:
      return kDisk;
    case engine::KvTier::kRegion:
      break;
  }
  return regionMedium;
}

}  // namespace

std::string encodeVllmEventBatch(double tsSeconds, std::span<const engine::KvBlockEvent> events, int blockSize,
                                 const std::string& medium) {
  using Kind = engine::KvBlockEvent::Kind;
  msgpack_sbuffer buf;
  msgpack_sbuffer_init(&buf);
  msgpack_packer pk;
  msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
  const auto runs = kvEventRuns(events);
  msgpack_pack_array(&pk, 3);  // EventBatch: ts, events, data_parallel_rank
  msgpack_pack_double(&pk, tsSeconds);
  msgpack_pack_array(&pk, runs.size());
  for (const auto run : runs) {
    switch (run.front().kind) {
      case Kind::kStored: {
        msgpack_pack_array(&pk, 8);
        packStr(&pk, "BlockStored");
        packHashes(&pk, run);
        if (run.front().parentHash == kRootBlockHash)
          msgpack_pack_nil(&pk);
        else
          msgpack_pack_uint64(&pk, run.front().parentHash);
        size_t tokens = 0;
        for (const auto& e : run) tokens += e.tokens.size();
        msgpack_pack_array(&pk, tokens);
        for (const auto& e : run)
          for (int32_t t : e.tokens) msgpack_pack_int32(&pk, t);
        msgpack_pack_int32(&pk, blockSize);
        msgpack_pack_nil(&pk);  // lora_id
        packStr(&pk, mediumOf(run.front().tier, medium));
        msgpack_pack_nil(&pk);  // lora_name
        break;
      }
      case Kind::kRemoved:
        msgpack_pack_array(&pk, 3);
        packStr(&pk, "BlockRemoved");
        packHashes(&pk, run);
        packStr(&pk, mediumOf(run.front().tier, medium));
        break;
      case Kind::kAllCleared:
        msgpack_pack_array(&pk, 1);
        packStr(&pk, "AllBlocksCleared");
        break;
    }
  }
  msgpack_pack_nil(&pk);  // data_parallel_rank: a pdserve worker is not a data-parallel rank
  std::string out(buf.data, buf.size);
  msgpack_sbuffer_destroy(&buf);
  return out;
}

Result<std::unique_ptr<ZmqKvPublisher>> ZmqKvPublisher::bind(const std::string& endpoint, std::string topic,
                                                             int blockSize, std::string medium) {
  std::unique_ptr<ZmqKvPublisher> p(new ZmqKvPublisher());
  p->context_ = zmq_ctx_new();
  p->socket_ = p->context_ ? zmq_socket(p->context_, ZMQ_PUB) : nullptr;
  if (!p->socket_) return unavailable(std::string("kv events: zmq socket: ") + zmq_strerror(zmq_errno()));
  const int linger = 0;  // a stopping worker does not wait for slow subscribers
  zmq_setsockopt(p->socket_, ZMQ_LINGER, &linger, sizeof linger);
  if (zmq_bind(p->socket_, endpoint.c_str()) != 0) {
    return unavailable("engine.kv_events.zmq_endpoint: cannot bind '" + endpoint + "': " + zmq_strerror(zmq_errno()));
  }
  char last[256] = {};
  size_t len = sizeof last;
  if (zmq_getsockopt(p->socket_, ZMQ_LAST_ENDPOINT, last, &len) == 0)
    p->endpoint_ = last;
  else
    p->endpoint_ = endpoint;
  p->topic_ = std::move(topic);
  p->blockSize_ = blockSize;
  p->medium_ = std::move(medium);
  return p;
}

ZmqKvPublisher::~ZmqKvPublisher() {
  if (socket_) zmq_close(socket_);
  if (context_) zmq_ctx_term(context_);
}

void ZmqKvPublisher::publish(std::span<const engine::KvBlockEvent> events, uint64_t createdUnixUs) {
  if (events.empty()) return;
  const std::string payload = encodeVllmEventBatch(double(createdUnixUs) / 1e6, events, blockSize_, medium_);
  unsigned char seq[8];
  for (int i = 0; i < 8; ++i) seq[i] = static_cast<unsigned char>(seq_ >> (8 * (7 - i)));
  ++seq_;
  // PUB never blocks: with no subscriber, or a full queue, the message is dropped.
  zmq_send(socket_, topic_.data(), topic_.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
  zmq_send(socket_, seq, sizeof seq, ZMQ_SNDMORE | ZMQ_DONTWAIT);
  zmq_send(socket_, payload.data(), payload.size(), ZMQ_DONTWAIT);
}

#else  // no ZeroMQ in this build

std::string encodeVllmEventBatch(double, std::span<const engine::KvBlockEvent>, int, const std::string&) { return {}; }

Result<std::unique_ptr<ZmqKvPublisher>> ZmqKvPublisher::bind(const std::string& endpoint, std::string, int,
                                                             std::string) {
  return unimplemented("engine.kv_events.zmq_endpoint ('" + endpoint +
                       "'): this build has no ZeroMQ publisher (install libzmq3-dev and libmsgpack-dev, "
                       "scripts/setup, and configure with PD_WITH_ZMQ=AUTO or ON)");
}

ZmqKvPublisher::~ZmqKvPublisher() = default;
void ZmqKvPublisher::publish(std::span<const engine::KvBlockEvent>, uint64_t) {}

#endif

}  // namespace pd::worker
