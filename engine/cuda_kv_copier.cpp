// CUDA block copier of the KV tiers: see cuda_kv_copier.h. Host code compiled by the host
// compiler against the CUDA runtime (built only when the build has CUDA; else
// cuda_kv_copier_stub.cpp).
#include "engine/cuda_kv_copier.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <string>

namespace pd::engine {

namespace {

Status cudaFail(const char* call, cudaError_t e) {
  return internalError(std::string("kv block copier: ") + call + ": " + cudaGetErrorName(e) + " (" +
                       cudaGetErrorString(e) + ")");
}

#define PD_KVC_TRY(call)                                       \
  do {                                                         \
    const cudaError_t pdErr_ = (call);                         \
    if (pdErr_ != cudaSuccess) return cudaFail(#call, pdErr_); \
  } while (0)

// Restores the calling thread's current device on scope exit: the backend on the same
// thread expects the device it set.
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&prev_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool ok_ = false;
};

class CudaKvBlockCopier final : public KvBlockCopier {
 public:
  struct Rank {
    int device = 0;
    uint8_t* base = nullptr;  // the rank's KV region (device memory)
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> events;  // one per slot
  };

  CudaKvBlockCopier(const KvLayout& layout, std::vector<Rank> ranks, int slots)
      : layout_(layout), ranks_(std::move(ranks)), numSlots_(slots) {
    rankStride_ = size_t(layout_.numLayers) * layout_.blockBytes();
    stride_ = rankStride_ * ranks_.size();
  }

  ~CudaKvBlockCopier() override {
    DeviceGuard guard;
    for (Rank& r : ranks_) {
      cudaSetDevice(r.device);
      // No copy may still write into the staging we free below.
      if (r.stream) cudaStreamSynchronize(r.stream);
      for (cudaEvent_t e : r.events) {
        if (e) cudaEventDestroy(e);
      }
      if (r.stream) cudaStreamDestroy(r.stream);
    }
    if (staging_) cudaFreeHost(staging_);
  }

  // Creates the streams, events and pinned staging (numSlots_ + 1: the last is the
  // synchronous copies' bounce buffer).
  Status init() {
    DeviceGuard guard;
    use2d_ = true;
    for (Rank& r : ranks_) {
      PD_KVC_TRY(cudaSetDevice(r.device));
      PD_KVC_TRY(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      r.events.assign(size_t(numSlots_), nullptr);
      for (cudaEvent_t& e : r.events) PD_KVC_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      int maxPitch = 0;
      PD_KVC_TRY(cudaDeviceGetAttribute(&maxPitch, cudaDevAttrMaxPitch, r.device));
      // One 2D copy per rank needs the layer stride as its source pitch.
      if (layout_.layerBytes() > size_t(maxPitch)) use2d_ = false;
    }
    PD_KVC_TRY(
        cudaHostAlloc(reinterpret_cast<void**>(&staging_), stride_ * size_t(numSlots_ + 1), cudaHostAllocPortable));
    for (int s = numSlots_ - 1; s >= 0; --s) free_.push_back(s);
    return Status::ok();
  }

  size_t strideBytes() const override { return stride_; }
  bool asynchronous() const override { return true; }
  int numSlots() const override { return numSlots_; }
  int freeSlots() const override { return int(free_.size()); }

  Status copyOut(BlockId b, uint8_t* dst) override {
    PD_RETURN_IF_ERROR(checkBlock(b));
    uint8_t* bounce = slotPtr(numSlots_);
    PD_RETURN_IF_ERROR(copySync(b, bounce, cudaMemcpyDeviceToHost));
    std::memcpy(dst, bounce, stride_);
    return Status::ok();
  }

  Status copyIn(const uint8_t* src, BlockId b) override {
    PD_RETURN_IF_ERROR(checkBlock(b));
    uint8_t* bounce = slotPtr(numSlots_);
    // The bounce buffer is free: every synchronous copy waited for its streams before its
    // call returned, on error too (asynchronous copies use the other slots).
    std::memcpy(bounce, src, stride_);
    return copySync(b, bounce, cudaMemcpyHostToDevice);
  }

  Result<int> startCopyOut(BlockId b) override {
    PD_RETURN_IF_ERROR(checkBlock(b));
    if (free_.empty()) return resourceExhausted("kv block copier: all staging slots are in flight");
    const int slot = free_.back();
    DeviceGuard guard;
    uint8_t* dst = slotPtr(slot);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = ranks_[r];
      PD_KVC_TRY(cudaSetDevice(rank.device));
      PD_RETURN_IF_ERROR(enqueue(rank, b, dst + r * rankStride_, cudaMemcpyDeviceToHost));
      PD_KVC_TRY(cudaEventRecord(rank.events[size_t(slot)], rank.stream));
    }
    // Only now, with every rank's copy enqueued: a failure above leaves the slot free (a
    // copy may have been enqueued on some rank; the next use of the slot is ordered after it
    // on the same streams).
    free_.pop_back();
    inFlight_.push_back(slot);
    return slot;
  }

  void completed(bool wait, std::vector<Done>* done) override {
    // One stream per rank: copies complete in start order, so the first unfinished slot ends
    // the scan.
    while (!inFlight_.empty()) {
      const int slot = inFlight_.front();
      Status st;
      bool finished = true;
      for (Rank& r : ranks_) {
        const cudaError_t e =
            wait ? cudaEventSynchronize(r.events[size_t(slot)]) : cudaEventQuery(r.events[size_t(slot)]);
        if (e == cudaErrorNotReady) {
          finished = false;
          break;
        }
        if (e != cudaSuccess && st.isOk()) st = cudaFail(wait ? "cudaEventSynchronize" : "cudaEventQuery", e);
      }
      if (!finished) return;
      inFlight_.pop_front();
      done->push_back({slot, std::move(st)});
    }
  }

  const uint8_t* slotData(int slot) const override { return slotPtr(slot); }

  void releaseSlot(int slot) override {
    if (slot < 0 || slot >= numSlots_) return;
    if (std::find(inFlight_.begin(), inFlight_.end(), slot) != inFlight_.end()) return;  // not completed yet
    if (std::find(free_.begin(), free_.end(), slot) != free_.end()) return;              // released twice
    free_.push_back(slot);
  }

 private:
  uint8_t* slotPtr(int slot) const { return staging_ + size_t(slot) * stride_; }

  Status checkBlock(BlockId b) const {
    if (b < 0 || b >= layout_.numBlocks) {
      return invalidArgument("kv block copier: block " + std::to_string(b) + " is outside the region's " +
                             std::to_string(layout_.numBlocks) + " blocks");
    }
    return Status::ok();
  }

  // Block b between every rank's region and the bounce buffer, then every stream
  // synchronized -- also after a failed enqueue, so no copy still uses the buffer.
  Status copySync(BlockId b, uint8_t* bounce, cudaMemcpyKind kind) {
    DeviceGuard guard;
    Status st;
    for (size_t r = 0; r < ranks_.size() && st.isOk(); ++r) {
      const cudaError_t e = cudaSetDevice(ranks_[r].device);
      st = e != cudaSuccess ? cudaFail("cudaSetDevice", e) : enqueue(ranks_[r], b, bounce + r * rankStride_, kind);
    }
    for (Rank& r : ranks_) {
      cudaError_t e = cudaSetDevice(r.device);
      if (e == cudaSuccess) e = cudaStreamSynchronize(r.stream);
      if (e != cudaSuccess && st.isOk()) st = cudaFail("cudaStreamSynchronize", e);
    }
    return st;
  }

  // Enqueues the copy of block b's layers between the rank's region and `host` (rankStride_
  // bytes: layer after layer) on the rank's stream. The current device is the rank's.
  Status enqueue(Rank& r, BlockId b, uint8_t* host, cudaMemcpyKind kind) {
    const size_t bb = layout_.blockBytes();
    uint8_t* dev = r.base + layout_.blockOffset(0, b);
    if (use2d_) {
      if (kind == cudaMemcpyDeviceToHost) {
        PD_KVC_TRY(
            cudaMemcpy2DAsync(host, bb, dev, layout_.layerBytes(), bb, size_t(layout_.numLayers), kind, r.stream));
      } else {
        PD_KVC_TRY(
            cudaMemcpy2DAsync(dev, layout_.layerBytes(), host, bb, bb, size_t(layout_.numLayers), kind, r.stream));
      }
      return Status::ok();
    }
    for (int l = 0; l < layout_.numLayers; ++l) {
      uint8_t* d = dev + size_t(l) * layout_.layerBytes();
      uint8_t* h = host + size_t(l) * bb;
      if (kind == cudaMemcpyDeviceToHost) {
        PD_KVC_TRY(cudaMemcpyAsync(h, d, bb, kind, r.stream));
      } else {
        PD_KVC_TRY(cudaMemcpyAsync(d, h, bb, kind, r.stream));
      }
    }
    return Status::ok();
  }

  KvLayout layout_;
  std::vector<Rank> ranks_;
  int numSlots_ = 0;
  size_t rankStride_ = 0, stride_ = 0;
  bool use2d_ = true;
  uint8_t* staging_ = nullptr;  // (numSlots_ + 1) * stride_, pinned
  std::vector<int> free_;       // free slots
  std::deque<int> inFlight_;    // slots copying, in start order
};

}  // namespace

Result<std::unique_ptr<KvBlockCopier>> createCudaKvBlockCopier(const KvLayout& rankLayout,
                                                               const std::vector<MemDesc>& regions,
                                                               const CudaKvCopierOptions& options) {
  if (regions.empty()) return invalidArgument("kv block copier: no KV region");
  if (rankLayout.numBlocks <= 0 || rankLayout.numLayers <= 0 || rankLayout.blockBytes() == 0) {
    return invalidArgument("kv block copier: an empty KV layout");
  }
  std::vector<CudaKvBlockCopier::Rank> ranks;
  for (size_t r = 0; r < regions.size(); ++r) {
    const MemDesc& m = regions[r];
    if (m.kind != MemKind::kCuda || m.addr == 0 || m.len < rankLayout.totalBytes()) {
      return invalidArgument("kv block copier: rank " + std::to_string(r) + "'s region " + toString(m) +
                             " is not device memory of at least " + std::to_string(rankLayout.totalBytes()) + " bytes");
    }
    CudaKvBlockCopier::Rank rank;
    rank.device = m.device;
    rank.base = static_cast<uint8_t*>(m.ptr());
    ranks.push_back(rank);
  }
  const size_t stride = size_t(rankLayout.numLayers) * rankLayout.blockBytes() * regions.size();
  const int slots = int(std::clamp<size_t>(options.stagingBytes / stride, 2, 64));
  auto copier = std::make_unique<CudaKvBlockCopier>(rankLayout, std::move(ranks), slots);
  PD_RETURN_IF_ERROR(copier->init());
  return std::unique_ptr<KvBlockCopier>(std::move(copier));
}

}  // namespace pd::engine
