#include "common/engine/model_weights.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/engine/safetensors.h"

namespace pd::engine {

WeightBuffer::WeightBuffer(size_t count) : count_(count) {
  if (count == 0) return;
  const size_t bytes = count * sizeof(float);
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded) != 0) throw std::bad_alloc();
  // Transparent huge pages cut TLB misses when decode streams every weight once per token.
  if (align == kHuge) ::madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, rounded);
  data_ = static_cast<float*>(p);
}
WeightBuffer::~WeightBuffer() { std::free(data_); }
WeightBuffer::WeightBuffer(WeightBuffer&& o) noexcept { *this = std::move(o); }
WeightBuffer& WeightBuffer::operator=(WeightBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    count_ = o.count_;
    o.data_ = nullptr;
    o.count_ = 0;
  }
  return *this;
}

size_t ModelWeights::totalBytes() const {
  size_t n = embed.size() + finalNorm.size() + lmHead.size();
  for (const auto& l : layers)
    n += l.inputNorm.size() + l.qkv.size() + l.qkvBias.size() + l.o.size() + l.oBias.size() +
         l.postNorm.size() + l.gateUp.size() + l.down.size();
  return n * sizeof(float);
}

namespace {

bool fileExists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// All shards of a checkpoint, and which shard holds each tensor.
class TensorSource {
 public:
  Status open(const std::string& dir) {
    dir_ = dir;
    const std::string index = dir + "/model.safetensors.index.json";
    if (fileExists(index)) {
      std::ifstream in(index);
      std::stringstream ss;
      ss << in.rdbuf();
      std::map<std::string, std::string> weightMap;
      try {
        const auto j = nlohmann::json::parse(ss.str());
        for (const auto& [name, file] : j.at("weight_map").items())
          weightMap[name] = file.get<std::string>();
      } catch (const std::exception& e) {
        return invalidArgument(index + ": malformed index: " + e.what());
      }
      std::set<std::string> shardNames;
      for (const auto& [name, file] : weightMap) shardNames.insert(file);
      for (const auto& file : shardNames) {
        if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
          return invalidArgument(index + ": shard name \"" + file + "\" must be a plain file name");
        PD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(dir + "/" + file));
        files_.push_back(std::move(f));
      }
      for (size_t i = 0; i < files_.size(); ++i)
        for (const auto& [name, info] : files_[i].tensors()) where_[name] = i;
      for (const auto& [name, file] : weightMap)
        if (!where_.count(name))
          return notFound(index + ": tensor " + name + " is listed for " + file + " but not in it");
      return Status::ok();
    }
    const std::string single = dir + "/model.safetensors";
    if (!fileExists(single))
      return notFound(dir + ": no model.safetensors and no model.safetensors.index.json");
    PD_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(single));
    files_.push_back(std::move(f));
    for (const auto& [name, info] : files_[0].tensors()) where_[name] = 0;
    return Status::ok();
  }

  bool has(const std::string& name) const { return where_.count(name) != 0; }

  // Checks presence and shape, then reads the tensor as f32 into dst.
  Status read(const std::string& name, const std::vector<int64_t>& shape, float* dst) const {
    auto it = where_.find(name);
    if (it == where_.end())
      return notFound(dir_ + ": missing tensor " + name + " (expected shape " + shapeToString(shape) + ")");
    const SafetensorsFile& f = files_[it->second];
    const TensorInfo* info = f.find(name);
    if (info->shape != shape)
      return invalidArgument(f.path() + ": tensor " + name + " has shape " +
                             shapeToString(info->shape) + " but the config implies " +
                             shapeToString(shape));
    return f.readF32(name, dst);
  }

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;
};

}  // namespace

Result<std::shared_ptr<const ModelWeights>> loadModelWeights(const std::string& dir,
                                                             const ModelConfig& c) {
  TensorSource src;
  PD_RETURN_IF_ERROR(src.open(dir));

  auto m = std::make_shared<ModelWeights>();
  m->config = c;
  m->dir = dir;
  const int64_t h = c.hiddenSize, q = c.qDim(), kv = c.kvDim(), ffn = c.intermediateSize;
  const int64_t qkvRows = q + 2 * kv;

  m->embed = WeightBuffer(size_t(c.vocabSize) * h);
  PD_RETURN_IF_ERROR(src.read("model.embed_tokens.weight", {c.vocabSize, h}, m->embed.data()));
  m->finalNorm = WeightBuffer(h);
  PD_RETURN_IF_ERROR(src.read("model.norm.weight", {h}, m->finalNorm.data()));
  if (!c.tieWordEmbeddings) {
    m->lmHead = WeightBuffer(size_t(c.vocabSize) * h);
    PD_RETURN_IF_ERROR(src.read("lm_head.weight", {c.vocabSize, h}, m->lmHead.data()));
  }

  m->layers.resize(c.numLayers);
  for (int l = 0; l < c.numLayers; ++l) {
    LayerWeights& w = m->layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    w.inputNorm = WeightBuffer(h);
    PD_RETURN_IF_ERROR(src.read(p + "input_layernorm.weight", {h}, w.inputNorm.data()));
    w.postNorm = WeightBuffer(h);
    PD_RETURN_IF_ERROR(src.read(p + "post_attention_layernorm.weight", {h}, w.postNorm.data()));

    w.qkv = WeightBuffer(size_t(qkvRows * h));
    PD_RETURN_IF_ERROR(src.read(p + "self_attn.q_proj.weight", {q, h}, w.qkv.data()));
    PD_RETURN_IF_ERROR(src.read(p + "self_attn.k_proj.weight", {kv, h}, w.qkv.data() + q * h));
    PD_RETURN_IF_ERROR(src.read(p + "self_attn.v_proj.weight", {kv, h}, w.qkv.data() + (q + kv) * h));
    if (c.qkvBias) {
      w.qkvBias = WeightBuffer(size_t(qkvRows));
      PD_RETURN_IF_ERROR(src.read(p + "self_attn.q_proj.bias", {q}, w.qkvBias.data()));
      PD_RETURN_IF_ERROR(src.read(p + "self_attn.k_proj.bias", {kv}, w.qkvBias.data() + q));
      PD_RETURN_IF_ERROR(src.read(p + "self_attn.v_proj.bias", {kv}, w.qkvBias.data() + q + kv));
    }
    w.o = WeightBuffer(size_t(h * q));
    PD_RETURN_IF_ERROR(src.read(p + "self_attn.o_proj.weight", {h, q}, w.o.data()));
    if (c.oBias) {
      w.oBias = WeightBuffer(size_t(h));
      PD_RETURN_IF_ERROR(src.read(p + "self_attn.o_proj.bias", {h}, w.oBias.data()));
    }
    w.gateUp = WeightBuffer(size_t(2 * ffn * h));
    PD_RETURN_IF_ERROR(src.read(p + "mlp.gate_proj.weight", {ffn, h}, w.gateUp.data()));
    PD_RETURN_IF_ERROR(src.read(p + "mlp.up_proj.weight", {ffn, h}, w.gateUp.data() + ffn * h));
    w.down = WeightBuffer(size_t(h * ffn));
    PD_RETURN_IF_ERROR(src.read(p + "mlp.down_proj.weight", {h, ffn}, w.down.data()));
  }
  return std::shared_ptr<const ModelWeights>(std::move(m));
}

Result<std::shared_ptr<const ModelWeights>> loadModel(const std::string& dir) {
  PD_ASSIGN_OR_RETURN(ModelConfig c, loadModelConfig(dir));
  return loadModelWeights(dir, c);
}

}  // namespace pd::engine
