// safetensors files: reading tensors into caller-owned f32 memory, and writing files.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32"|"F16"|"BF16"|"F8_E4M3", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"k": "v"}}
// then the data section; offsets are relative to its start.
//
// The reader uses pread() into the caller's buffers: weights the backend computes from must
// live in ordinary anonymous memory, not file-mapped pages (decoding from mapped pages
// measured 2-5x slower on these VMs). A SafetensorsFile is not thread-safe; open one per
// thread if loading in parallel.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/base/enum_names.h"
#include "common/base/status.h"

namespace pd::engine {

// kF8E4M3 is float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 the only NaN; largest finite 448): the weights of FP8 block-scaled
// checkpoints, meaningful only with their block scales (fp8_blocks.h).
enum class TensorDtype { kF32, kF16, kBF16, kF8E4M3 };

// The header's dtype strings, which loading parses with too.
inline constexpr EnumNames<TensorDtype, 4> kTensorDtypeNames{{{TensorDtype::kF32, "F32"},
                                                              {TensorDtype::kF16, "F16"},
                                                              {TensorDtype::kBF16, "BF16"},
                                                              {TensorDtype::kF8E4M3, "F8_E4M3"}}};
inline const char* tensorDtypeName(TensorDtype d) { return enumName(kTensorDtypeNames, d); }
size_t tensorDtypeBytes(TensorDtype d);

struct TensorInfo {
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data section
  uint64_t end = 0;
  int64_t numel() const;
};

std::string shapeToString(const std::vector<int64_t>& shape);  // "[64, 259]"

class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Opens and validates the header (offsets inside the file, sizes matching dtype * shape).
  static Result<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;

  // Reads tensor `name` converted to f32 into dst (numel floats). An F8_E4M3 tensor is
  // refused (kFailedPrecondition): its values mean nothing without the block scales, which
  // Checkpoint::readF32 applies.
  Status readF32(const std::string& name, float* dst) const;
  // Reads len bytes of tensor `name` in its stored dtype, from byteOffset within the
  // tensor, into dst. kOutOfRange when the range leaves the tensor.
  Status readBytes(const std::string& name, uint64_t byteOffset, size_t len, void* dst) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t dataStart_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: raw little-endian bytes already in `dtype`.
struct TensorToWrite {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// Writes a safetensors file (header padded with spaces to an 8-byte multiple, tensors in
// the given order).
Status writeSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata);

// Conversions used by the reader and by make-model.
float bf16ToF32(uint16_t v);
uint16_t f32ToBf16(float f);  // round to nearest even
float f16ToF32(uint16_t v);
uint16_t f32ToF16(float f);  // round to nearest even; overflow -> inf, NaN stays NaN
// float8_e4m3fn: e4m3ToF32 is exact for every code (0x7f and 0xff are NaN). f32ToE4m3 rounds
// to nearest even and saturates: a finite value or infinity past 448 in magnitude becomes
// +-448 (the format has no infinity; quantizers scale into range first), NaN stays NaN, the
// sign of zero is kept.
float e4m3ToF32(uint8_t v);
uint8_t f32ToE4m3(float f);

}  // namespace pd::engine
