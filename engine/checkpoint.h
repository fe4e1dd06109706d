// A Hugging Face checkpoint's tensors: model.safetensors, or the shards a
// model.safetensors.index.json names, behind one lookup by tensor name.
//
//   PD_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::open(dir));
//   PD_ASSIGN_OR_RETURN(const TensorInfo* t, ckpt.expect("model.norm.weight", {hidden}));
//   PD_RETURN_IF_ERROR(ckpt.readBytes("model.norm.weight", 0, t->end - t->begin, dst));
//
// Both the f32 host loader (model_weights.h) and the streaming device loader
// (weight_stream.h) read through it. Errors name the directory or file, the tensor and the
// shapes. Not thread-safe (as SafetensorsFile).
//
// FP8 block-scaled checkpoints (fp8_blocks.h): opened with the config's WeightQuantization, an
// F8_E4M3 tensor X is read dequantized with X_scale_inv; opened without one (a config with no
// quantization_config), reading an F8_E4M3 tensor is refused naming it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/base/status.h"
#include "engine/fp8_blocks.h"
#include "engine/safetensors.h"

namespace pd::engine {

class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir, const WeightQuantization& quantization = {});

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  // The tensor, checked to exist and to have `shape`.
  Result<const TensorInfo*> expect(const std::string& name, const std::vector<int64_t>& shape) const;
  // expect(), then the whole tensor converted to f32 into dst (an F8_E4M3 one dequantized with
  // its block scales, read in bounded chunks).
  Status readF32(const std::string& name, const std::vector<int64_t>& shape, float* dst) const;
  // The block scales of F8_E4M3 tensor `name` (whose shape is `shape`, [rows][cols]) as f32:
  // `name` + "_scale_inv" checked to exist with fp8ScaleShape's shape. Refused when the
  // checkpoint was opened without FP8 quantization, or `name` is not a 2-D F8_E4M3 tensor.
  Result<Fp8BlockScales> blockScales(const std::string& name, const std::vector<int64_t>& shape) const;
  const WeightQuantization& quantization() const { return quant_; }
  // len stored bytes of `name` from byteOffset within the tensor (SafetensorsFile::readBytes).
  Status readBytes(const std::string& name, uint64_t byteOffset, size_t len, void* dst) const;

  // The identity of these weights (docs/security.md, "Weights fingerprint"): SHA-256, first 16
  // hex digits, over every tensor in name order -- its name, dtype, shape, and a fixed sample
  // of its stored bytes (the first, middle and last kFingerprintSample bytes, or all of a
  // smaller tensor). Two checkpoints of one model that differ anywhere a training step or a
  // different seed would change them differ here; reading ~12 KiB per tensor keeps it a few
  // milliseconds however large the model. Errors: a read that fails, naming the tensor.
  Result<std::string> weightsFingerprint() const;
  static constexpr size_t kFingerprintSample = 4096;

 private:
  const SafetensorsFile* fileOf(const std::string& name) const;
  std::string dir_;
  WeightQuantization quant_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
};

}  // namespace pd::engine
