#include "engine/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

namespace pd::engine {

size_t tensorDtypeBytes(TensorDtype d) {
  switch (d) {
    case TensorDtype::kF32:
      return 4;
    case TensorDtype::kF16:
    case TensorDtype::kBF16:
      return 2;
    case TensorDtype::kF8E4M3:
      return 1;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shapeToString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

float bf16ToF32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16ToF32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t absBits = bits & 0x7fffffffu;
  if (absBits > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (absBits >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: inf
  int exp = int(absBits >> 23) - 127 + 15;
  uint32_t mant = absBits & 0x7fffffu;
  if (exp <= 0) {  // subnormal (or zero) in f16
    if (exp < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - exp;  // 24-bit mantissa down to the subnormal's 10 bits
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = (uint32_t(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exp: fine
  return uint16_t(sign | half);
}

namespace {
// Every e4m3 code's value, built once from the format's definition: exponent field 0 is
// subnormal (m / 8 * 2^-6), else (1 + m / 8) * 2^(e - 7); S.1111.111 is NaN.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      float a = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
      if (e == 15 && m == 7) a = std::numeric_limits<float>::quiet_NaN();
      v[c] = (c & 0x80) ? -a : a;
    }
  }
};
const E4m3Table kE4m3;
}  // namespace

float e4m3ToF32(uint8_t v) { return kE4m3.v[v]; }

uint8_t f32ToE4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return uint8_t(sign | 0x7f);
  const double a = std::fabs(double(f));
  if (a >= 448.0) return uint8_t(sign | 0x7e);  // saturate (incl. infinity)
  // Scaling by powers of two is exact and nearbyint rounds half to even (the default mode).
  if (a < std::ldexp(1.0, -6)) {
    // Subnormal range: units of 2^-9; a rounded count of 8 is the smallest normal, code 0x08.
    return uint8_t(sign | uint8_t(std::nearbyint(std::ldexp(a, 9))));
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);                           // a = f * 2^e2, f in [0.5, 1)
  int e = e2 - 1;                                     // a in [2^e, 2^(e+1))
  int n = int(std::nearbyint(std::ldexp(a, 3 - e)));  // 8..16: the significand in eighths
  if (n == 16) {
    n = 8;
    ++e;
  }
  return uint8_t(sign | ((e + 7) << 3) | (n - 8));  // < 448 here, so never the NaN code
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}
SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    o.fd_ = -1;
    dataStart_ = o.dataStart_;
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

namespace {

Status preadAll(int fd, void* dst, size_t len, uint64_t offset, const std::string& path) {
  auto* p = static_cast<uint8_t*>(dst);
  while (len > 0) {
    const ssize_t n = ::pread(fd, p, len, off_t(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return dataLoss(path + ": read failed: " + std::strerror(errno));
    }
    if (n == 0) return dataLoss(path + ": unexpected end of file");
    p += n;
    len -= size_t(n);
    offset += uint64_t(n);
  }
  return Status::ok();
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) return notFound(path + ": cannot open: " + std::strerror(errno));
  const off_t fileSize = ::lseek(f.fd_, 0, SEEK_END);
  if (fileSize < 8) return dataLoss(path + ": too short for a safetensors file");
  uint8_t lenBytes[8];
  PD_RETURN_IF_ERROR(preadAll(f.fd_, lenBytes, 8, 0, path));
  uint64_t headerLen = 0;
  for (int i = 7; i >= 0; --i) headerLen = (headerLen << 8) | lenBytes[i];
  if (headerLen > uint64_t(fileSize) - 8 || headerLen > (uint64_t(100) << 20))
    return dataLoss(path + ": header length " + std::to_string(headerLen) + " exceeds the file");
  std::string header(headerLen, '\0');
  PD_RETURN_IF_ERROR(preadAll(f.fd_, header.data(), headerLen, 8, path));
  f.dataStart_ = 8 + headerLen;
  const uint64_t dataSize = uint64_t(fileSize) - f.dataStart_;

  try {
    const auto j = nlohmann::json::parse(header);
    if (!j.is_object()) return dataLoss(path + ": header is not a JSON object");
    for (const auto& [name, t] : j.items()) {
      if (name == "__metadata__") {
        if (t.is_object())
          for (const auto& [k, v] : t.items()) f.metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
        continue;
      }
      TensorInfo info;
      const std::string dt = t.at("dtype").get<std::string>();
      const std::optional<TensorDtype> dtype = enumFromName(kTensorDtypeNames, dt);
      if (!dtype)
        return unimplemented(path + ": tensor " + name + " has dtype " + dt +
                             " (supported: " + enumNameList(kTensorDtypeNames) + ")");
      info.dtype = *dtype;
      info.shape = t.at("shape").get<std::vector<int64_t>>();
      const auto offs = t.at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > dataSize)
        return dataLoss(path + ": tensor " + name + " has data_offsets outside the file");
      info.begin = offs[0];
      info.end = offs[1];
      if (info.end - info.begin != uint64_t(info.numel()) * tensorDtypeBytes(info.dtype))
        return dataLoss(path + ": tensor " + name + " shape " + shapeToString(info.shape) + " " + dt +
                        " does not match its " + std::to_string(info.end - info.begin) + " bytes");
      f.tensors_[name] = std::move(info);
    }
  } catch (const std::exception& e) {
    return dataLoss(path + ": malformed header: " + e.what());
  }
  return f;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status SafetensorsFile::readF32(const std::string& name, float* dst) const {
  const TensorInfo* t = find(name);
  if (!t) return notFound(path_ + ": no tensor named " + name);
  if (t->dtype == TensorDtype::kF8E4M3)
    return failedPrecondition(path_ + ": tensor " + name +
                              " is F8_E4M3: its values need their block scales (read it through Checkpoint "
                              "with the config's quantization_config)");
  const uint64_t bytes = t->end - t->begin;
  if (t->dtype == TensorDtype::kF32) return preadAll(fd_, dst, bytes, dataStart_ + t->begin, path_);
  // Half-precision: read in chunks into a staging buffer, widen into dst.
  constexpr size_t kChunk = size_t(1) << 20;  // elements
  std::unique_ptr<uint16_t[]> stage(new uint16_t[kChunk]);
  const size_t n = size_t(t->numel());
  for (size_t done = 0; done < n; done += kChunk) {
    const size_t m = std::min(kChunk, n - done);
    PD_RETURN_IF_ERROR(preadAll(fd_, stage.get(), m * 2, dataStart_ + t->begin + done * 2, path_));
    if (t->dtype == TensorDtype::kBF16)
      for (size_t i = 0; i < m; ++i) dst[done + i] = bf16ToF32(stage[i]);
    else
      for (size_t i = 0; i < m; ++i) dst[done + i] = f16ToF32(stage[i]);
  }
  return Status::ok();
}

Status SafetensorsFile::readBytes(const std::string& name, uint64_t byteOffset, size_t len, void* dst) const {
  const TensorInfo* t = find(name);
  if (!t) return notFound(path_ + ": no tensor named " + name);
  const uint64_t bytes = t->end - t->begin;
  if (byteOffset > bytes || len > bytes - byteOffset)
    return outOfRange(path_ + ": tensor " + name + ": bytes [" + std::to_string(byteOffset) + ", " +
                      std::to_string(byteOffset + len) + ") outside its " + std::to_string(bytes));
  return preadAll(fd_, dst, len, dataStart_ + t->begin + byteOffset, path_);
}

Status writeSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (uint64_t(numel) * tensorDtypeBytes(t.dtype) != t.bytes.size())
      return invalidArgument("writeSafetensors: tensor " + t.name + " shape " + shapeToString(t.shape) +
                             " does not match " + std::to_string(t.bytes.size()) + " bytes");
    header[t.name] = {
        {"dtype", tensorDtypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return notFound(path + ": cannot create: " + std::strerror(errno));
  uint8_t lenBytes[8];
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) lenBytes[i] = uint8_t(len >> (8 * i));
  out.write(reinterpret_cast<const char*>(lenBytes), 8);
  out.write(h.data(), std::streamsize(h.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  out.close();
  if (!out) return dataLoss(path + ": write failed");
  return Status::ok();
}

}  // namespace pd::engine
