#include "engine/weight_stream.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>

#include "engine/checkpoint.h"
#include "engine/fp8_blocks.h"
#include "engine/tensor_parallel.h"

namespace pd::engine {

HostWeightCopier::~HostWeightCopier() {
  for (void* p : device_) std::free(p);
}

Result<void*> HostWeightCopier::allocStaging(size_t bytes) {
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  if (!p) return resourceExhausted("host weight copier: staging of " + std::to_string(bytes) + " bytes");
  stagingBytes_ += bytes;
  return p;
}

void HostWeightCopier::freeStaging(void* p) { std::free(p); }

Result<void*> HostWeightCopier::allocDevice(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 256, std::max<size_t>(bytes, 16)) != 0)
    return resourceExhausted("host weight copier: " + std::to_string(bytes) + " bytes");
  device_.push_back(p);
  deviceBytes_ += bytes;
  return p;
}

Status HostWeightCopier::copyAsync(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  bytesCopied_ += bytes;
  return Status::ok();
}

namespace {

// Rows [rows) x columns [cols) of a checkpoint tensor viewed as [shape[0]][rest].
struct Piece {
  std::string name;
  std::vector<int64_t> shape;
  RowRange rows, cols;
};

// Converts n values from one dtype to another (n may be 0; from == to is a copy).
void convert(const void* src, TensorDtype from, void* dst, TensorDtype to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * tensorDtypeBytes(from));
    return;
  }
  auto* s16 = static_cast<const uint16_t*>(src);
  auto* s32 = static_cast<const float*>(src);
  auto load = [&](size_t i) {
    return from == TensorDtype::kF32 ? s32[i] : from == TensorDtype::kBF16 ? bf16ToF32(s16[i]) : f16ToF32(s16[i]);
  };
  if (to == TensorDtype::kF32) {
    auto* d = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = load(i);
  } else if (to == TensorDtype::kBF16) {
    auto* d = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = f32ToBf16(load(i));
  } else {
    auto* d = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = f32ToF16(load(i));
  }
}

// Where a chunk's elements sit in their tensor [rows][rowCols]: runs of runLen elements, the
// first at flat index `first`, each next one a row further. Only F8_E4M3 conversion needs it
// (each element's block scale).
struct Runs {
  const Fp8BlockScales* scales;
  int64_t first;
  size_t runLen;
  size_t rowCols;
};

// n F8_E4M3 codes dequantized with their block scales and stored in `to` (f32, bf16 or f16;
// the narrower ones rounded once, from the f32 product).
void convertFp8(const uint8_t* codes, void* dst, TensorDtype to, size_t n, const Runs& runs) {
  constexpr size_t kTmp = 1024;
  float tmp[kTmp];
  for (size_t done = 0; done < n;) {
    const size_t run = done / runs.runLen, off = done % runs.runLen;
    const size_t m = std::min({n - done, runs.runLen - off, kTmp});
    const int64_t flat = runs.first + int64_t(run * runs.rowCols + off);
    float* out = to == TensorDtype::kF32 ? static_cast<float*>(dst) + done : tmp;
    fp8DequantRun(codes + done, m, flat, *runs.scales, out);
    if (to == TensorDtype::kBF16)
      for (size_t k = 0; k < m; ++k) static_cast<uint16_t*>(dst)[done + k] = f32ToBf16(tmp[k]);
    else if (to == TensorDtype::kF16)
      for (size_t k = 0; k < m; ++k) static_cast<uint16_t*>(dst)[done + k] = f32ToF16(tmp[k]);
    done += m;
  }
}

class Streamer {
 public:
  Streamer(const Checkpoint& ckpt, DeviceWeightCopier& copier, WeightLoadStats& stats)
      : ckpt_(ckpt), copier_(copier), stats_(stats) {}
  ~Streamer() {
    if (staging_) {
      (void)copier_.waitCopies();  // nothing may still read the buffer we free
      copier_.freeStaging(staging_);
    }
  }

  Status init(size_t stagingBytes) {
    half_ = stagingBytes / 2 / 64 * 64;
    PD_ASSIGN_OR_RETURN(staging_, copier_.allocStaging(2 * half_));
    stats_.stagingBytes = 2 * half_;
    return Status::ok();
  }

  // One device image: the pieces one after the other, in dtype `to` -- or, with keepFp8 and
  // every piece F8_E4M3, as codes plus row-expanded scales.
  Result<DeviceTensor> load(const std::vector<Piece>& pieces, TensorDtype to, bool keepFp8 = false) {
    if (keepFp8 && !pieces.empty()) {
      bool allFp8 = true;
      for (const Piece& p : pieces) {
        PD_ASSIGN_OR_RETURN(const TensorInfo* info, ckpt_.expect(p.name, p.shape));
        allFp8 = allFp8 && info->dtype == TensorDtype::kF8E4M3;
      }
      if (allFp8) return loadFp8(pieces);
    }
    DeviceTensor t;
    t.dtype = to;
    std::vector<const TensorInfo*> infos;
    for (const Piece& p : pieces) {
      PD_ASSIGN_OR_RETURN(const TensorInfo* info, ckpt_.expect(p.name, p.shape));
      infos.push_back(info);
      t.bytes += size_t(p.rows.count) * size_t(p.cols.count) * tensorDtypeBytes(to);
    }
    PD_ASSIGN_OR_RETURN(t.data, copier_.allocDevice(t.bytes));
    size_t at = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      Fp8BlockScales scales;
      if (infos[i]->dtype == TensorDtype::kF8E4M3) {
        // The whole tensor's scales (one f32 per block), whatever slice this rank reads.
        PD_ASSIGN_OR_RETURN(scales, ckpt_.blockScales(pieces[i].name, pieces[i].shape));
        PD_ASSIGN_OR_RETURN(
            const TensorInfo* si,
            ckpt_.expect(pieces[i].name + "_scale_inv", fp8ScaleShape(scales.rows, scales.cols, ckpt_.quantization())));
        stats_.fileBytesRead += si->end - si->begin;
      }
      PD_RETURN_IF_ERROR(streamPiece(pieces[i], infos[i]->dtype, to, scales, static_cast<char*>(t.data), &at));
    }
    return t;
  }

  Status finish() { return copier_.waitCopies(); }

 private:
  // The codes of every piece as stored, then the row-expanded scales of all their rows. The
  // pieces of one fused matrix share their columns (fusedRows), hence one scale layout.
  Result<DeviceTensor> loadFp8(const std::vector<Piece>& pieces) {
    DeviceTensor t;
    t.dtype = TensorDtype::kF8E4M3;
    const RowRange cols = pieces.front().cols;
    const int bc = ckpt_.quantization().blockCols;
    t.scaleColOffset = cols.begin % bc;
    const size_t scaleCols = size_t(fp8RowScaleCols(t.scaleColOffset, cols.count, bc));
    size_t rows = 0;
    for (const Piece& p : pieces) {
      if (p.cols.begin != cols.begin || p.cols.count != cols.count)
        return internalError("weight stream: fused FP8 pieces with different columns (" + p.name + ")");
      rows += size_t(p.rows.count);
    }
    t.bytes = rows * size_t(cols.count);
    t.scaleBytes = rows * scaleCols * sizeof(float);
    PD_ASSIGN_OR_RETURN(t.data, copier_.allocDevice(t.bytes));
    PD_ASSIGN_OR_RETURN(t.scales, copier_.allocDevice(t.scaleBytes));
    std::vector<float> scales(rows * scaleCols);
    size_t at = 0, row = 0;
    const Fp8BlockScales none;
    for (const Piece& p : pieces) {
      PD_ASSIGN_OR_RETURN(const Fp8BlockScales s, ckpt_.blockScales(p.name, p.shape));
      PD_ASSIGN_OR_RETURN(const TensorInfo* si,
                          ckpt_.expect(p.name + "_scale_inv", fp8ScaleShape(s.rows, s.cols, ckpt_.quantization())));
      stats_.fileBytesRead += si->end - si->begin;
      fp8ExpandRowScales(s, p.rows.begin, p.rows.count, p.cols.begin, p.cols.count, &scales[row * scaleCols]);
      row += size_t(p.rows.count);
      PD_RETURN_IF_ERROR(
          streamPiece(p, TensorDtype::kF8E4M3, TensorDtype::kF8E4M3, none, static_cast<char*>(t.data), &at));
    }
    // The scales through the staging halves, as the codes went.
    const char* src = reinterpret_cast<const char*>(scales.data());
    for (size_t done = 0; done < t.scaleBytes;) {
      const size_t m = std::min(half_, t.scaleBytes - done);
      char* buf = nextHalf();
      PD_RETURN_IF_ERROR(copier_.waitCopies());
      std::memcpy(buf, src + done, m);
      PD_RETURN_IF_ERROR(copier_.copyAsync(static_cast<char*>(t.scales) + done, buf, m));
      stats_.deviceBytes += m;
      ++stats_.copies;
      done += m;
    }
    return t;
  }

  // Streams one piece to dst + *at, advancing *at by the bytes it wrote. `scales`: an F8_E4M3
  // piece's block scales (empty otherwise).
  Status streamPiece(const Piece& p, TensorDtype from, TensorDtype to, const Fp8BlockScales& scales, char* dst,
                     size_t* at) {
    const size_t sb = tensorDtypeBytes(from), db = tensorDtypeBytes(to);
    const bool conv = from != to;
    const size_t perElem = sb + (conv ? db : 0);  // staging bytes one element needs
    const size_t room = half_ - kAlign;           // the converted run starts aligned (send)
    const size_t rowCols = size_t(p.shape.size() > 1 ? p.shape[1] : 1);
    if (size_t(p.cols.count) == rowCols) {
      // Whole rows: one contiguous byte range of the file, cut into chunks.
      const size_t begin = size_t(p.rows.begin) * rowCols, n = size_t(p.rows.count) * rowCols;
      const size_t chunk = std::max<size_t>(1, room / perElem);
      for (size_t done = 0; done < n; done += chunk) {
        const size_t m = std::min(chunk, n - done);
        char* raw = nextHalf();
        PD_RETURN_IF_ERROR(ckpt_.readBytes(p.name, (begin + done) * sb, m * sb, raw));
        PD_RETURN_IF_ERROR(send(raw, from, to, m, dst + *at, Runs{&scales, int64_t(begin + done), m, rowCols}));
        *at += m * db;
      }
      return Status::ok();
    }
    // A column slice: each row's run of columns is one read; as many rows per chunk as fit.
    const size_t rowElems = size_t(p.cols.count);
    if (rowElems * perElem > room)
      return invalidArgument("weight stream: tensor " + p.name + ": a row slice of " +
                             std::to_string(rowElems * perElem) + " staging bytes exceeds half of the " +
                             std::to_string(2 * half_) + "-byte staging buffer");
    const size_t rowsPerChunk = room / (rowElems * perElem);
    for (size_t r = 0; r < size_t(p.rows.count); r += rowsPerChunk) {
      const size_t m = std::min(rowsPerChunk, size_t(p.rows.count) - r);
      char* raw = nextHalf();
      for (size_t i = 0; i < m; ++i) {
        const size_t row = size_t(p.rows.begin) + r + i;
        PD_RETURN_IF_ERROR(ckpt_.readBytes(p.name, (row * rowCols + size_t(p.cols.begin)) * sb, rowElems * sb,
                                           raw + i * rowElems * sb));
      }
      const int64_t first = int64_t((size_t(p.rows.begin) + r) * rowCols + size_t(p.cols.begin));
      PD_RETURN_IF_ERROR(send(raw, from, to, m * rowElems, dst + *at, Runs{&scales, first, rowElems, rowCols}));
      *at += m * rowElems * db;
    }
    return Status::ok();
  }

  // The half to fill next. The copy out of it (two sends ago) finished at the last send's wait.
  char* nextHalf() {
    cur_ ^= 1;
    return static_cast<char*>(staging_) + cur_ * half_;
  }

  // n elements read into raw (in `from`): converted behind them when needed, then copied.
  Status send(char* raw, TensorDtype from, TensorDtype to, size_t n, char* dst, const Runs& runs) {
    stats_.fileBytesRead += n * tensorDtypeBytes(from);
    const char* out = raw;
    if (from != to) {
      // Behind the raw run, aligned: an odd count of 16-bit values would misalign f32 stores.
      char* conv = raw + (n * tensorDtypeBytes(from) + kAlign - 1) / kAlign * kAlign;
      if (from == TensorDtype::kF8E4M3)
        convertFp8(reinterpret_cast<const uint8_t*>(raw), conv, to, n, runs);
      else
        convert(raw, from, conv, to, n);
      out = conv;
    }
    // The other half's copy must be done before the next nextHalf() refills it.
    PD_RETURN_IF_ERROR(copier_.waitCopies());
    PD_RETURN_IF_ERROR(copier_.copyAsync(dst, out, n * tensorDtypeBytes(to)));
    stats_.deviceBytes += n * tensorDtypeBytes(to);
    ++stats_.copies;
    return Status::ok();
  }

  static constexpr size_t kAlign = 64;
  const Checkpoint& ckpt_;
  DeviceWeightCopier& copier_;
  WeightLoadStats& stats_;
  void* staging_ = nullptr;
  size_t half_ = 0;
  int cur_ = 1;
};

Piece whole(std::string name, std::vector<int64_t> shape) {
  const int cols = int(shape.size() > 1 ? shape[1] : 1);
  return Piece{std::move(name), shape, {0, int(shape[0])}, {0, cols}};
}

// Rows `r` of the fused matrix whose parts are `names` of `partRows` rows each, in order: the
// pieces of the parts they fall into (a range never straddles two parts: the plan's ranges
// lie inside one projection).
std::vector<Piece> fusedRows(const std::vector<std::string>& names, const std::vector<int64_t>& partRows, int64_t cols,
                             std::span<const RowRange> ranges) {
  std::vector<Piece> out;
  for (const RowRange& r : ranges) {
    int64_t base = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      if (r.begin < base + partRows[i]) {
        std::vector<int64_t> shape =
            cols > 0 ? std::vector<int64_t>{partRows[i], cols} : std::vector<int64_t>{partRows[i]};
        out.push_back(Piece{names[i], shape, {int(r.begin - base), r.count}, {0, int(cols > 0 ? cols : 1)}});
        break;
      }
      base += partRows[i];
    }
  }
  return out;
}

}  // namespace

Result<DeviceModel> streamWeightsToDevice(const std::string& dir, const ModelConfig& c, const WeightStreamOptions& o,
                                          DeviceWeightCopier& copier, WeightLoadStats* statsOut) {
  const auto t0 = std::chrono::steady_clock::now();
  if (o.matrixDtype == TensorDtype::kF8E4M3)
    return unimplemented(
        "weight stream: F8_E4M3 device matrices (the kernels take f32, bf16 or f16; an FP8 "
        "checkpoint is dequantized while streaming)");
  if (o.stagingBytes < (size_t(64) << 10))
    return invalidArgument("weight stream: stagingBytes " + std::to_string(o.stagingBytes) +
                           " is below the 64 KiB minimum");
  PD_ASSIGN_OR_RETURN(const TensorParallelPlan plan, planTensorParallel(c, o.tensorParallelSize));
  if (o.rank < 0 || o.rank >= plan.size)
    return invalidArgument("weight stream: rank " + std::to_string(o.rank) + " outside tensor_parallel_size " +
                           std::to_string(plan.size));
  if (c.isMoe() && plan.size > 1)
    return unimplemented("weight stream: tensor_parallel_size " + std::to_string(plan.size) + " with " +
                         architectureName(c.architecture) +
                         "'s mixture of experts (expert parallelism is not implemented)");
  PD_ASSIGN_OR_RETURN(const Checkpoint ckpt, Checkpoint::open(dir, c.quantization));
  WeightLoadStats stats;
  DeviceModel m;
  {
    Streamer s(ckpt, copier, stats);
    const bool k8 = o.keepFp8;
    PD_RETURN_IF_ERROR(s.init(o.stagingBytes));
    const TensorDtype md = o.matrixDtype, f32 = TensorDtype::kF32;
    const int64_t h = c.hiddenSize, q = c.qDim(), kv = c.kvDim(), ffn = c.intermediateSize;
    const int r = o.rank;
    PD_ASSIGN_OR_RETURN(m.embed, s.load({whole("model.embed_tokens.weight", {c.vocabSize, h})}, md));
    if (r == 0) {
      PD_ASSIGN_OR_RETURN(m.finalNorm, s.load({whole("model.norm.weight", {h})}, f32));
      if (!c.tieWordEmbeddings) {
        PD_ASSIGN_OR_RETURN(m.lmHead, s.load({whole("lm_head.weight", {c.vocabSize, h})}, md));
      }
    }
    const auto qkvRows = plan.qkvRows(r);
    const auto guRows = plan.gateUpRows(r);
    m.layers.resize(size_t(c.numLayers));
    for (int l = 0; l < c.numLayers; ++l) {
      DeviceLayer& d = m.layers[size_t(l)];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      PD_ASSIGN_OR_RETURN(d.inputNorm, s.load({whole(p + "input_layernorm.weight", {h})}, f32));
      PD_ASSIGN_OR_RETURN(d.postNorm, s.load({whole(p + "post_attention_layernorm.weight", {h})}, f32));
      const std::vector<std::string> qkvNames{p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                              p + "self_attn.v_proj.weight"};
      PD_ASSIGN_OR_RETURN(d.qkv, s.load(fusedRows(qkvNames, {q, kv, kv}, h, qkvRows), md, k8));
      if (c.qkvBias) {
        const std::vector<std::string> biasNames{p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                                 p + "self_attn.v_proj.bias"};
        PD_ASSIGN_OR_RETURN(d.qkvBias, s.load(fusedRows(biasNames, {q, kv, kv}, 0, qkvRows), f32));
      }
      Piece oSlice = whole(p + "self_attn.o_proj.weight", {h, q});
      oSlice.cols = plan.oColumns(r);
      PD_ASSIGN_OR_RETURN(d.o, s.load({oSlice}, md, k8));
      if (c.oBias && r == 0) {
        PD_ASSIGN_OR_RETURN(d.oBias, s.load({whole(p + "self_attn.o_proj.bias", {h})}, f32));
      }
      if (c.qkNorm) {
        PD_ASSIGN_OR_RETURN(d.qNorm, s.load({whole(p + "self_attn.q_norm.weight", {c.headDim})}, f32));
        PD_ASSIGN_OR_RETURN(d.kNorm, s.load({whole(p + "self_attn.k_norm.weight", {c.headDim})}, f32));
      }
      if (c.isMoeLayer(l)) {
        // The names model_weights.cpp reads: Mixtral block_sparse_moe.{gate, experts.E.w1 (gate),
        // w3 (up), w2 (down)}; Qwen3-MoE and DeepseekV3 mlp.{gate, experts.E.gate_proj, up_proj,
        // down_proj}; DeepseekV3 also mlp.gate.e_score_correction_bias and mlp.shared_experts.
        const bool mixtral = c.architecture == Architecture::kMixtral;
        const bool deepseek = c.architecture == Architecture::kDeepseekV3;
        const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
        const int64_t ne = c.moe.numExperts, ef = c.moe.expertFfn;
        PD_ASSIGN_OR_RETURN(d.router, s.load({whole(moe + "gate.weight", {ne, h})}, f32));
        if (deepseek) {
          d.routerBias.resize(size_t(ne));
          PD_RETURN_IF_ERROR(ckpt.readF32(moe + "gate.e_score_correction_bias", {ne}, d.routerBias.data()));
        }
        d.experts.resize(size_t(ne));
        for (int64_t e = 0; e < ne; ++e) {
          const std::string ep = moe + "experts." + std::to_string(e) + ".";
          PD_ASSIGN_OR_RETURN(d.experts[size_t(e)].gateUp,
                              s.load({whole(ep + (mixtral ? "w1.weight" : "gate_proj.weight"), {ef, h}),
                                      whole(ep + (mixtral ? "w3.weight" : "up_proj.weight"), {ef, h})},
                                     md));
          PD_ASSIGN_OR_RETURN(d.experts[size_t(e)].down,
                              s.load({whole(ep + (mixtral ? "w2.weight" : "down_proj.weight"), {h, ef})}, md));
        }
        if (deepseek && c.moe.numSharedExperts > 0) {
          const int64_t sf = c.moe.sharedFfn();
          PD_ASSIGN_OR_RETURN(d.gateUp, s.load({whole(p + "mlp.shared_experts.gate_proj.weight", {sf, h}),
                                                whole(p + "mlp.shared_experts.up_proj.weight", {sf, h})},
                                               md));
          PD_ASSIGN_OR_RETURN(d.down, s.load({whole(p + "mlp.shared_experts.down_proj.weight", {h, sf})}, md));
        }
        continue;
      }
      const std::vector<std::string> guNames{p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"};
      PD_ASSIGN_OR_RETURN(d.gateUp, s.load(fusedRows(guNames, {ffn, ffn}, h, guRows), md, k8));
      Piece downSlice = whole(p + "mlp.down_proj.weight", {h, ffn});
      downSlice.cols = plan.downColumns(r);
      PD_ASSIGN_OR_RETURN(d.down, s.load({downSlice}, md, k8));
    }
    PD_RETURN_IF_ERROR(s.finish());
  }
  m.deviceBytes = stats.deviceBytes;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (statsOut) *statsOut = stats;
  return m;
}

}  // namespace pd::engine
