// ZmqKvPublisher: the prefix cache's block events on a ZeroMQ PUB socket in the wire format
// of vLLM's KV events (`KVEventsConfig`, publisher "zmq"), so a KV-aware router built for vLLM
// (Dynamo's, llm-d's) can index a pdserve worker (docs/kv_events.md). Off unless
// engine.kv_events.zmq_endpoint is set; built only with ZeroMQ and msgpack-c (PD_WITH_ZMQ).
//
// Wire format, implemented from vLLM's published description (vllm/distributed/kv_events.py):
// every batch is one 3-part message [topic, seq, payload]: the topic bytes; seq, this
// socket's batch counter (0, 1, ...) as 8 bytes big-endian; payload, an EventBatch as msgpack
// in msgspec's array_like form: [ts (float seconds), [events...], data_parallel_rank (nil)].
// Events are tagged array_like structs, the tag (class name) first:
//   ["BlockStored", block_hashes, parent_block_hash (nil for a first block), token_ids,
//    block_size, lora_id (nil), medium, lora_name (nil)]
//   ["BlockRemoved", block_hashes, medium]
// medium: the KV region's ("GPU" on cuda, "CPU" on cpu: the constructor's), "CPU" for the
// host tier, "DISK" for the disk tier (engine/kv_tiers.h).
//   ["AllBlocksCleared"]
// Block hashes are pdserve's names (common/base/hash.h) as unsigned 64-bit integers;
// token_ids are the tokens of every block of the event, in order. No replay socket: a
// subscriber that sees seq skip has lost batches (PUB drops when its queue is full).
//
// Threads: the owner's only (the worker loop thread). Never blocks: a full queue drops.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/base/status.h"
#include "engine/kv_cache_manager.h"

namespace pd::worker {

// The msgpack payload of one batch (exposed for tests).
std::string encodeVllmEventBatch(double tsSeconds, std::span<const engine::KvBlockEvent> events, int blockSize,
                                 const std::string& medium);

class ZmqKvPublisher {
 public:
  // Binds a PUB socket to `endpoint` (tcp://host:port, ipc://path). Errors: kUnimplemented
  // in a build without ZeroMQ, kUnavailable when the bind fails (the endpoint named).
  static Result<std::unique_ptr<ZmqKvPublisher>> bind(const std::string& endpoint, std::string topic, int blockSize,
                                                      std::string medium);
  ~ZmqKvPublisher();
  ZmqKvPublisher(const ZmqKvPublisher&) = delete;
  ZmqKvPublisher& operator=(const ZmqKvPublisher&) = delete;

  // The endpoint bound (a tcp port 0 or '*' resolved).
  const std::string& endpoint() const { return endpoint_; }
  // Publishes one batch; nothing for no events.
  void publish(std::span<const engine::KvBlockEvent> events, uint64_t createdUnixUs);
  uint64_t sent() const { return seq_; }

 private:
  ZmqKvPublisher() = default;
  void* context_ = nullptr;
  void* socket_ = nullptr;
  std::string endpoint_, topic_, medium_;
  int blockSize_ = 16;
  uint64_t seq_ = 0;
};

}  // namespace pd::worker
