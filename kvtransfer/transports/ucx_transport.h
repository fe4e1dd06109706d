// The UCX transport: UCP RMA puts into a peer's registered memory (docs/design.md §3).
//
// Data path per transfer: ucp_put_nbx for every (local, remote) segment pair, issued from
// progress() in bounded slices (post() never blocks, and a cancel stops the issuing), then
// ucp_ep_flush_nbx, whose completion is the proof that every byte is at the target.
//
// Failure: endpoints use UCP_ERR_HANDLING_MODE_PEER with an error callback, so a dead peer
// fails its transfers (kUnavailable) instead of hanging; a transfer not finished within
// UcxOptions::transferTimeout fails with kDeadlineExceeded and its endpoint is closed (it is
// re-created from the peer's address on the next post, so a slow-but-alive peer recovers).
// Only an endpoint whose peer UCX reported failed is force-closed; a stalled or healthy one
// is closed with a flush, so puts UCX already queued may still land if a stalled peer wakes
// up. (UCX 1.13's tcp transport crashed in a later ucp_worker_progress after force-closing
// a connection whose peer was alive but stopped.)
// cancel() stops issuing puts; puts already handed to UCX (at most one slice) may still land.
//
// Memory: kHost and kPinned always; kCuda only when this UCX was built with CUDA support
// (ucp_context_query memory types; caps().cudaMemory says which).
//
// Threads: UCS_THREAD_MODE_SINGLE worker; every method, the constructor and the destructor
// must be called from one thread (the owner's loop), as transport.h requires.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "common/base/status.h"
#include "kvtransfer/transport.h"

namespace pd::kvt {

struct UcxOptions {
  // A transfer not confirmed at the target within this time fails with kDeadlineExceeded.
  std::chrono::milliseconds transferTimeout{30000};
  // UCP_ERR_HANDLING_MODE_PEER on every endpoint (the default, and what production wants: a
  // dead peer becomes an error). UCX 1.13 then uses only transports that can detect peer
  // failure, which on a host without RDMA is tcp: shared memory (cma, posix) is excluded.
  // false = UCP_ERR_HANDLING_MODE_NONE: shared memory becomes eligible between processes on
  // one host (much faster), and a dead peer is noticed only through transferTimeout.
  bool peerErrorHandling = true;
  // UCX keepalive between endpoints, so a silently dead peer is noticed (UCX's default: 20 s).
  std::chrono::milliseconds keepaliveInterval{1000};
  // Puts are split into pieces of at most this size, and each progress() call issues at most
  // sliceBytes of them, bounding how long progress() runs (shared-memory puts copy inline).
  size_t maxPutBytes = size_t{8} << 20;
  size_t sliceBytes = size_t{32} << 20;
  // Bytes handed to UCX and not yet locally complete, per transfer.
  size_t maxInflightBytes = size_t{256} << 20;
};

// Creates the UCP context (feature RMA) and one worker. kUnavailable when UCX cannot
// initialise (the message carries UCX's reason).
Result<std::unique_ptr<Transport>> makeUcxTransport(const UcxOptions& options = {});

// Memory that UCX allocates and registers in one step (ucp_mem_map with UCP_MEM_MAP_ALLOCATE,
// as ucx_perftest does). On one host with peerErrorHandling off, UCX backs it with shared
// memory (posix/sysv) that peers map directly, so a put is one memcpy into the target instead
// of an active-message round trip: a KV pool meant for same-host peers should be allocated
// here. The handle behaves like registerMemory's; deregisterMemory frees the memory.
// kInvalidArgument when `transport` is not a UCX transport or len is 0.
struct UcxAllocation {
  MemDesc desc;
  MemHandle handle = 0;
};
Result<UcxAllocation> ucxAllocateRegistered(Transport& transport, size_t len);

// Blob formats (kvt.proto UcxRemoteKey / UcxConnInfo), exposed for tests and for tools that
// print them. Decoding never crashes: bytes that are not such a message or are cut short are
// kDataLoss; another blob (bad magic), another version or bad values are kInvalidArgument.
namespace ucxwire {
struct PackedKey {
  uint64_t base = 0;
  uint64_t len = 0;
  uint8_t kind = 0;
  int32_t device = 0;
  std::string rkey;  // ucp_rkey_pack bytes
};
std::string encodeKey(const PackedKey& key);
Result<PackedKey> decodeKey(const std::string& blob);
std::string encodeConnInfo(const std::string& workerAddress);
Result<std::string> decodeConnInfo(const std::string& blob);
}  // namespace ucxwire

}  // namespace pd::kvt
