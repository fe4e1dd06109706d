// DeviceCopier: asynchronous chunk copies between device memory and pinned host memory, the
// one piece of CUDA that kvtransfer's staging needs (a transport that cannot touch
// GPU memory itself stages it through pinned bounce buffers, overlapped with the network).
//
// Two implementations:
//   - makeCudaCopier(): the product. cudaMemcpyAsync on one non-blocking stream per device,
//     one event per enqueued batch, pinned buffers from cudaHostAlloc. Built when the build
//     has CUDA (PD_HAVE_CUDA); kUnavailable (with the reason) when no device is present.
//   - makeHostCopier(): memcpy on a worker thread, for CPU unit tests of the staging logic
//     only ("device" memory there is host memory labelled kCuda). It can inject a delay per
//     copy and a failure, and counts what is outstanding so tests can check for leaks.
//
// Contract:
//   - enqueue() never blocks on the copy; batches complete in enqueue order (one stream), so a
//     later ticket being done implies every earlier one is.
//   - query() returns ok, kInProgress, or the copy's error; wait() the same but blocks until
//     `deadline` (kDeadlineExceeded, the ticket stays valid). Once ok or an error has been
//     reported, the ticket is forgotten (a second query says kNotFound).
//   - Threads: every method is thread-safe (the tcp transport enqueues from its I/O thread and
//     may free buffers from whichever thread drops the last reference).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/base/clock.h"
#include "common/base/mem_desc.h"
#include "common/base/status.h"

namespace pd::kvt {

using CopyTicket = uint64_t;

// One contiguous copy. For toHost: src is device (or host) memory, dst pinned host memory;
// for toDevice the other way round. Addresses are plain pointers (UVA: the runtime knows).
struct CopyPiece {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t len = 0;
};

enum class CopyDirection : uint8_t { kToHost, kToDevice };

class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;

  // For logs: "cuda (2 devices)" or "host memcpy (tests only)".
  virtual std::string describe() const = 0;

  // ok when `desc` is memory this copier can copy from/to as kCuda (the pointer is device
  // memory of desc.device); kInvalidArgument naming the problem otherwise.
  virtual Status checkDeviceMemory(const MemDesc& desc) = 0;

  // Page-locked host memory of `bytes` (the bounce buffers). Owned by the caller, returned
  // through freePinned().
  virtual Result<void*> allocPinned(size_t bytes) = 0;
  virtual void freePinned(void* p) = 0;

  // Queues `pieces` on `device`'s copy stream and returns one ticket for the whole batch.
  virtual Result<CopyTicket> enqueue(CopyDirection dir, int device, std::span<const CopyPiece> pieces) = 0;
  virtual Status query(CopyTicket ticket) = 0;
  virtual Status wait(CopyTicket ticket, SteadyTime deadline) = 0;
};

// True when this build has CUDA and a device is present at run time; otherwise false and
// *why says which ("built without CUDA", "cudaGetDeviceCount: cudaErrorNoDevice").
bool cudaDeviceAvailable(std::string* why);

// The CUDA copier; kUnavailable when the build lacks CUDA or no device is present.
Result<std::shared_ptr<DeviceCopier>> makeCudaCopier();

struct HostCopierOptions {
  std::chrono::microseconds delayPerBatch{0};  // simulated copy time, per enqueued batch
  uint64_t failBatch = 0;                      // 1-based batch that completes with an error
  bool failAlloc = false;                      // allocPinned() fails
};

// The memcpy copier for CPU tests; see the counters on HostCopier.
class HostCopier final : public DeviceCopier {
 public:
  explicit HostCopier(HostCopierOptions options = {});
  ~HostCopier() override;

  std::string describe() const override;
  Status checkDeviceMemory(const MemDesc& desc) override;
  Result<void*> allocPinned(size_t bytes) override;
  void freePinned(void* p) override;
  Result<CopyTicket> enqueue(CopyDirection dir, int device, std::span<const CopyPiece> pieces) override;
  Status query(CopyTicket ticket) override;
  Status wait(CopyTicket ticket, SteadyTime deadline) override;

  // Pinned buffers allocated and not yet freed; tickets enqueued and not yet reported.
  size_t pinnedOutstanding() const;
  size_t ticketsOutstanding() const;
  uint64_t batches() const;      // batches enqueued so far
  uint64_t bytesCopied() const;  // bytes copied by finished batches
  size_t maxInFlight() const;    // most batches queued at once (overlap evidence)

  class State;

 private:
  std::shared_ptr<State> state_;
};

// dma-buf export of device memory for GPUDirect RDMA (verbs): the fd covers the page-aligned
// range around desc; `offset` is where desc.addr lies inside it. The caller closes fd.
struct DmaBufRange {
  uintptr_t base = 0;  // page-aligned start
  size_t size = 0;     // page-aligned length
  size_t offset = 0;   // desc.addr - base
};
// Pure arithmetic (tested without a device): the aligned range cuMemGetHandleForAddressRange
// needs around [addr, addr+len).
DmaBufRange dmaBufRange(uintptr_t addr, size_t len, size_t pageSize);
struct DmaBufHandle {
  int fd = -1;
  DmaBufRange range;
};
// kUnimplemented when the build lacks CUDA, the driver lacks the entry point, or the device
// does not support dma-buf; kUnavailable without a device. The message says which.
Result<DmaBufHandle> exportDmaBuf(const MemDesc& desc);
// ok when `device` can export dma-bufs (the same reasons as exportDmaBuf otherwise).
Status dmaBufSupported(int device);

}  // namespace pd::kvt
