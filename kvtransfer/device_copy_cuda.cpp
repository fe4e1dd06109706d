// The CUDA copier and the dma-buf export: compiled only when the build has CUDA. Uses the
// runtime API only; the one driver call (cuMemGetHandleForAddressRange) is fetched through
// cudaGetDriverEntryPointByVersion, so nothing links libcuda directly.
#include <cuda.h>  // driver types and enums only; no cu* symbol is linked
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvtransfer/device_copy.h"

namespace pd::kvt {

namespace {

std::string cudaText(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }

class CudaCopier final : public DeviceCopier {
 public:
  explicit CudaCopier(int devices) : devices_(devices), perDevice_(size_t(devices)) {}

  ~CudaCopier() override {
    std::lock_guard lock(mu_);
    for (size_t d = 0; d < perDevice_.size(); ++d) {
      auto& pd = perDevice_[d];
      if (!pd.stream) continue;
      cudaStreamSynchronize(pd.stream);
      for (cudaEvent_t e : pd.freeEvents) cudaEventDestroy(e);
      cudaStreamDestroy(pd.stream);
    }
    for (auto& [t, e] : tickets_) cudaEventDestroy(e.event);
  }

  std::string describe() const override { return "cuda (" + std::to_string(devices_) + " device(s))"; }

  Status checkDeviceMemory(const MemDesc& desc) override {
    if (desc.kind != MemKind::kCuda) return invalidArgument("device copier: " + toString(desc) + " is not kCuda");
    if (desc.device < 0 || desc.device >= devices_) {
      return invalidArgument("device copier: " + toString(desc) + " names device " + std::to_string(desc.device) +
                             ", this process sees " + std::to_string(devices_));
    }
    cudaPointerAttributes a{};
    cudaError_t e = cudaPointerGetAttributes(&a, desc.ptr());
    if (e != cudaSuccess) {
      cudaGetLastError();
      return invalidArgument("device copier: " + toString(desc) + " is not CUDA memory (" + cudaText(e) + ")");
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
      return invalidArgument("device copier: " + toString(desc) + " is labelled kCuda but is not CUDA device memory");
    }
    if (a.device != desc.device) {
      return invalidArgument("device copier: " + toString(desc) + " lives on device " + std::to_string(a.device));
    }
    return Status::ok();
  }

  Result<void*> allocPinned(size_t bytes) override {
    void* p = nullptr;
    // Portable: the bounce buffer serves copies to and from every device of the process.
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      return resourceExhausted("device copier: cudaHostAlloc of " + std::to_string(bytes) + " bytes: " + cudaText(e));
    }
    return p;
  }

  void freePinned(void* p) override {
    if (p) cudaFreeHost(p);
  }

  Result<CopyTicket> enqueue(CopyDirection dir, int device, std::span<const CopyPiece> pieces) override {
    std::lock_guard lock(mu_);
    if (device < 0 || device >= devices_) return invalidArgument("device copier: no device " + std::to_string(device));
    // The calling thread's current device is put back afterwards: the copier must not change
    // what a backend sharing the thread computes on.
    int previous = -1;
    cudaGetDevice(&previous);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
      return internalError("device copier: cudaSetDevice(" + std::to_string(device) + "): " + cudaText(e));
    struct Restore {
      int dev;
      ~Restore() {
        if (dev >= 0) cudaSetDevice(dev);
      }
    } restore{previous == device ? -1 : previous};
    auto& pd = perDevice_[size_t(device)];
    if (!pd.stream) {
      e = cudaStreamCreateWithFlags(&pd.stream, cudaStreamNonBlocking);
      if (e != cudaSuccess) return internalError("device copier: cudaStreamCreate: " + cudaText(e));
    }
    // cudaMemcpyDefault (UVA): a staged transfer may mix host and device segments.
    (void)dir;
    const cudaMemcpyKind kind = cudaMemcpyDefault;
    for (const CopyPiece& p : pieces) {
      e = cudaMemcpyAsync(p.dst, p.src, p.len, kind, pd.stream);
      if (e != cudaSuccess) {
        return internalError("device copier: cudaMemcpyAsync of " + std::to_string(p.len) + " bytes: " + cudaText(e));
      }
    }
    cudaEvent_t ev = nullptr;
    if (!pd.freeEvents.empty()) {
      ev = pd.freeEvents.back();
      pd.freeEvents.pop_back();
    } else if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess) {
      return internalError("device copier: cudaEventCreate: " + cudaText(e));
    }
    if ((e = cudaEventRecord(ev, pd.stream)) != cudaSuccess) {
      pd.freeEvents.push_back(ev);
      return internalError("device copier: cudaEventRecord: " + cudaText(e));
    }
    CopyTicket t = next_++;
    tickets_[t] = {ev, device};
    return t;
  }

  Status query(CopyTicket ticket) override {
    std::lock_guard lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return notFound("device copier: unknown copy ticket " + std::to_string(ticket));
    cudaError_t e = cudaEventQuery(it->second.event);
    if (e == cudaErrorNotReady) return Status(StatusCode::kInProgress, "");
    perDevice_[size_t(it->second.device)].freeEvents.push_back(it->second.event);
    tickets_.erase(it);
    if (e != cudaSuccess)
      return internalError("device copier: copy batch " + std::to_string(ticket) + ": " + cudaText(e));
    return Status::ok();
  }

  // cudaEventSynchronize has no deadline, so wait polls; a staging chunk takes well under a
  // millisecond, so the sleep is short and grows only for long waits.
  Status wait(CopyTicket ticket, SteadyTime deadline) override {
    auto nap = std::chrono::microseconds(5);
    for (;;) {
      Status st = query(ticket);
      if (!st.inProgress()) return st;
      if (steadyNow() >= deadline) {
        return deadlineExceeded("device copier: copy batch " + std::to_string(ticket) + " did not finish in time");
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  struct Device {
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> freeEvents;
  };
  struct Ticket {
    cudaEvent_t event;
    int device;
  };
  const int devices_;
  std::mutex mu_;
  std::vector<Device> perDevice_;
  std::unordered_map<CopyTicket, Ticket> tickets_;
  CopyTicket next_ = 1;
};

template <typename Fn>
Status driverEntry(const char* symbol, Fn** fn) {
  cudaDriverEntryPointQueryResult q{};
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, reinterpret_cast<void**>(fn), 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn) {
    cudaGetLastError();
    return unimplemented(std::string("the CUDA driver does not provide ") + symbol +
                         (e != cudaSuccess ? " (" + cudaText(e) + ")" : std::string()));
  }
  return Status::ok();
}

}  // namespace

bool cudaDeviceAvailable(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (e != cudaSuccess) cudaGetLastError();
    if (why)
      *why = "no CUDA device (cudaGetDeviceCount: " + (e != cudaSuccess ? cudaText(e) : std::string("0 devices")) + ")";
    return false;
  }
  return true;
}

Result<std::shared_ptr<DeviceCopier>> makeCudaCopier() {
  std::string why;
  if (!cudaDeviceAvailable(&why)) return unavailable("device copier: " + why);
  int n = 0;
  cudaGetDeviceCount(&n);
  return std::shared_ptr<DeviceCopier>(std::make_shared<CudaCopier>(n));
}

Status dmaBufSupported(int device) {
  std::string why;
  if (!cudaDeviceAvailable(&why)) return unavailable("dma-buf export: " + why);
  using GetAttr = CUresult CUDAAPI(int*, CUdevice_attribute, CUdevice);
  GetAttr* getAttr = nullptr;
  PD_RETURN_IF_ERROR(driverEntry("cuDeviceGetAttribute", &getAttr));
  int supported = 0;
  // The runtime's ordinal is the driver's CUdevice for the default (unmasked) enumeration.
  if (getAttr(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, CUdevice(device)) != CUDA_SUCCESS || !supported) {
    return unimplemented("dma-buf export: device " + std::to_string(device) +
                         " (or its driver) does not support dma-buf");
  }
  return Status::ok();
}

Result<DmaBufHandle> exportDmaBuf(const MemDesc& desc) {
  PD_RETURN_IF_ERROR(dmaBufSupported(desc.device));
  using GetHandle = CUresult CUDAAPI(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  GetHandle* getHandle = nullptr;
  PD_RETURN_IF_ERROR(driverEntry("cuMemGetHandleForAddressRange", &getHandle));
  DmaBufHandle h;
  h.range = dmaBufRange(desc.addr, desc.len, size_t(::sysconf(_SC_PAGESIZE)));
  int fd = -1;
  CUresult r = getHandle(&fd, CUdeviceptr(h.range.base), h.range.size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    return unimplemented("dma-buf export of " + toString(desc) + ": cuMemGetHandleForAddressRange failed (CUresult " +
                         std::to_string(int(r)) + ")");
  }
  h.fd = fd;
  return h;
}

}  // namespace pd::kvt
