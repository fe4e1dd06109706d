#include "engine/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/sha256.h"

namespace pd::engine {

namespace {
bool fileExists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
}  // namespace

Result<Checkpoint> Checkpoint::open(const std::string& dir, const WeightQuantization& quantization) {
  Checkpoint c;
  c.dir_ = dir;
  c.quant_ = quantization;
  const std::string index = dir + "/model.safetensors.index.json";
  if (fileExists(index)) {
    std::ifstream in(index);
    std::stringstream ss;
    ss << in.rdbuf();
    std::map<std::string, std::string> weightMap;
    try {
      const auto j = nlohmann::json::parse(ss.str());
      for (const auto& [name, file] : j.at("weight_map").items()) weightMap[name] = file.get<std::string>();
    } catch (const std::exception& e) {
      return invalidArgument(index + ": malformed index: " + e.what());
    }
    std::set<std::string> shardNames;
    for (const auto& [name, file] : weightMap) shardNames.insert(file);
    for (const auto& file : shardNames) {
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        return invalidArgument(index + ": shard name \"" + file + "\" must be a plain file name");
      PD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(dir + "/" + file));
      c.files_.push_back(std::move(f));
    }
    for (size_t i = 0; i < c.files_.size(); ++i)
      for (const auto& [name, info] : c.files_[i].tensors()) c.where_[name] = i;
    for (const auto& [name, file] : weightMap)
      if (!c.where_.count(name))
        return notFound(index + ": tensor " + name + " is listed for " + file + " but not in it");
    return c;
  }
  const std::string single = dir + "/model.safetensors";
  if (!fileExists(single)) return notFound(dir + ": no model.safetensors and no model.safetensors.index.json");
  PD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(single));
  c.files_.push_back(std::move(f));
  for (const auto& [name, info] : c.files_[0].tensors()) c.where_[name] = 0;
  return c;
}

const SafetensorsFile* Checkpoint::fileOf(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : &files_[it->second];
}

Result<const TensorInfo*> Checkpoint::expect(const std::string& name, const std::vector<int64_t>& shape) const {
  const SafetensorsFile* f = fileOf(name);
  if (!f) return notFound(dir_ + ": missing tensor " + name + " (expected shape " + shapeToString(shape) + ")");
  const TensorInfo* info = f->find(name);
  if (info->shape != shape)
    return invalidArgument(f->path() + ": tensor " + name + " has shape " + shapeToString(info->shape) +
                           " but the config implies " + shapeToString(shape));
  return info;
}

Status Checkpoint::readF32(const std::string& name, const std::vector<int64_t>& shape, float* dst) const {
  PD_ASSIGN_OR_RETURN(const TensorInfo* info, expect(name, shape));
  if (info->dtype != TensorDtype::kF8E4M3) return fileOf(name)->readF32(name, dst);
  PD_ASSIGN_OR_RETURN(const Fp8BlockScales scales, blockScales(name, shape));
  // The codes in chunks through a small buffer, dequantized straight into dst.
  constexpr size_t kChunk = size_t(1) << 20;
  std::vector<uint8_t> codes(std::min(kChunk, size_t(info->numel())));
  const size_t n = size_t(info->numel());
  for (size_t done = 0; done < n; done += kChunk) {
    const size_t m = std::min(kChunk, n - done);
    PD_RETURN_IF_ERROR(readBytes(name, done, m, codes.data()));
    fp8DequantRun(codes.data(), m, int64_t(done), scales, dst + done);
  }
  return Status::ok();
}

Result<Fp8BlockScales> Checkpoint::blockScales(const std::string& name, const std::vector<int64_t>& shape) const {
  PD_ASSIGN_OR_RETURN(const TensorInfo* info, expect(name, shape));
  if (info->dtype != TensorDtype::kF8E4M3)
    return invalidArgument(fileOf(name)->path() + ": tensor " + name + " is " + tensorDtypeName(info->dtype) +
                           ", not F8_E4M3: it has no block scales");
  if (!quant_.fp8)
    return failedPrecondition(fileOf(name)->path() + ": tensor " + name +
                              " is F8_E4M3 but config.json has no FP8 quantization_config (its block size "
                              "and scales are unknown)");
  if (shape.size() != 2)
    return unimplemented(fileOf(name)->path() + ": tensor " + name + " is F8_E4M3 with shape " + shapeToString(shape) +
                         " (block-scaled FP8 is read for 2-D weights only)");
  Fp8BlockScales s;
  s.rows = shape[0];
  s.cols = shape[1];
  s.blockRows = quant_.blockRows;
  s.blockCols = quant_.blockCols;
  const std::vector<int64_t> scaleShape = fp8ScaleShape(s.rows, s.cols, quant_);
  s.scaleInv.resize(size_t(scaleShape[0] * scaleShape[1]));
  const std::string scaleName = name + "_scale_inv";
  if (!has(scaleName))
    return notFound(dir_ + ": F8_E4M3 tensor " + name + " has no " + scaleName + " (expected shape " +
                    shapeToString(scaleShape) + ")");
  PD_ASSIGN_OR_RETURN(const TensorInfo* si, expect(scaleName, scaleShape));
  if (si->dtype == TensorDtype::kF8E4M3)
    return invalidArgument(fileOf(scaleName)->path() + ": block scales " + scaleName +
                           " are F8_E4M3 (expected F32, BF16 or F16)");
  PD_RETURN_IF_ERROR(fileOf(scaleName)->readF32(scaleName, s.scaleInv.data()));
  return s;
}

Status Checkpoint::readBytes(const std::string& name, uint64_t byteOffset, size_t len, void* dst) const {
  const SafetensorsFile* f = fileOf(name);
  if (!f) return notFound(dir_ + ": missing tensor " + name);
  return f->readBytes(name, byteOffset, len, dst);
}

Result<std::string> Checkpoint::weightsFingerprint() const {
  Sha256 h;
  std::vector<char> buf(kFingerprintSample);
  // One sample of len bytes at off (within the tensor), hashed with its position so that a
  // sample cannot stand in for another.
  auto sample = [&](const std::string& name, uint64_t off, size_t len) -> Status {
    PD_RETURN_IF_ERROR(readBytes(name, off, len, buf.data()));
    h.update("@" + std::to_string(off) + ":" + std::to_string(len) + ";");
    h.update(buf.data(), len);
    return Status::ok();
  };
  for (const auto& [name, file] : where_) {  // std::map: name order
    const TensorInfo& t = *files_[file].find(name);
    const uint64_t bytes = t.end - t.begin;
    h.update(name + "|" + tensorDtypeName(t.dtype) + "|" + shapeToString(t.shape) + "|");
    if (bytes <= 3 * kFingerprintSample) {
      for (uint64_t off = 0; off < bytes; off += kFingerprintSample)
        PD_RETURN_IF_ERROR(sample(name, off, size_t(std::min<uint64_t>(kFingerprintSample, bytes - off))));
      continue;
    }
    for (uint64_t off : {uint64_t(0), bytes / 2 - kFingerprintSample / 2, bytes - kFingerprintSample})
      PD_RETURN_IF_ERROR(sample(name, off, kFingerprintSample));
  }
  return h.hex().substr(0, 16);
}

}  // namespace pd::engine
