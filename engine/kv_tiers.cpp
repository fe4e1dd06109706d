#include "engine/kv_tiers.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <system_error>

#include "common/base/hash.h"
#include "common/base/log.h"

namespace pd::engine {
namespace fs = std::filesystem;

uint64_t kvChecksum(std::span<const uint8_t> bytes, uint64_t seed) {
  uint64_t lane[4] = {mix64(seed ^ 1), mix64(seed ^ 2), mix64(seed ^ 3), mix64(seed ^ 4)};
  size_t i = 0;
  for (; i + 32 <= bytes.size(); i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, bytes.data() + i + 8 * size_t(k), 8);
      lane[k] = (lane[k] ^ w) * 0x9E3779B97F4A7C15ULL;
      lane[k] ^= lane[k] >> 29;
    }
  }
  uint64_t h = mix64(lane[0] ^ mix64(lane[1] ^ mix64(lane[2] ^ mix64(lane[3] ^ bytes.size()))));
  for (; i < bytes.size(); ++i) h = mix64(h ^ bytes[i]);
  return h;
}

// ---- Host tier ----------------------------------------------------------------------------

Result<std::unique_ptr<KvHostTier>> KvHostTier::create(int64_t bytes, size_t strideBytes) {
  if (strideBytes == 0 || bytes < int64_t(strideBytes) * 2) {
    return invalidArgument("kv host tier: " + std::to_string(bytes) + " bytes hold fewer than 2 blocks of " +
                           std::to_string(strideBytes) + " bytes");
  }
  const int n = int(std::min<int64_t>(bytes / int64_t(strideBytes), int64_t(1) << 30));
  const size_t mapped = size_t(n) * strideBytes;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return resourceExhausted("kv host tier: cannot map " + std::to_string(mapped) + " bytes: " + std::strerror(errno));
  }
  return std::unique_ptr<KvHostTier>(new KvHostTier(static_cast<uint8_t*>(p), mapped, strideBytes, n));
}

KvHostTier::KvHostTier(uint8_t* base, size_t mapped, size_t stride, int n)
    : base_(base), mapped_(mapped), stride_(stride), slots_(size_t(n)) {
  free_.reserve(size_t(n));
  for (int s = n - 1; s >= 0; --s) free_.push_back(s);
}

KvHostTier::~KvHostTier() { munmap(base_, mapped_); }

bool KvHostTier::matches(uint64_t hash, std::span<const TokenId> tokens) const {
  auto it = byHash_.find(hash);
  if (it == byHash_.end()) return false;
  const auto& t = slots_[size_t(it->second)].tokens;
  return std::equal(tokens.begin(), tokens.end(), t.begin(), t.end());
}

void KvHostTier::touch(uint64_t hash) {
  auto it = byHash_.find(hash);
  if (it == byHash_.end()) return;
  Slot& s = slots_[size_t(it->second)];
  lru_.splice(lru_.end(), lru_, s.lruPos);
}

const uint8_t* KvHostTier::data(uint64_t hash) const {
  auto it = byHash_.find(hash);
  return it == byHash_.end() ? nullptr : base_ + size_t(it->second) * stride_;
}

uint8_t* KvHostTier::insert(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens,
                            std::optional<Evicted>* evicted) {
  int s;
  if (!free_.empty()) {
    s = free_.back();
    free_.pop_back();
  } else {
    s = lru_.front();
    lru_.pop_front();
    Slot& old = slots_[size_t(s)];
    byHash_.erase(old.hash);
    if (evicted != nullptr) *evicted = Evicted{old.hash, old.parentHash, std::move(old.tokens)};
  }
  Slot& slot = slots_[size_t(s)];
  slot.used = true;
  slot.hash = hash;
  slot.parentHash = parentHash;
  slot.tokens.assign(tokens.begin(), tokens.end());
  slot.lruPos = lru_.insert(lru_.end(), s);
  byHash_.emplace(hash, s);
  return base_ + size_t(s) * stride_;
}

Status KvHostTier::checkInvariants() const {
  auto fail = [](const std::string& what) { return internalError("kv host tier invariant violated: " + what); };
  std::vector<uint8_t> seen(slots_.size(), 0);
  for (int s : free_) {
    if (s < 0 || size_t(s) >= slots_.size()) return fail("free slot " + std::to_string(s) + " out of range");
    if (seen[size_t(s)]++) return fail("slot " + std::to_string(s) + " listed twice");
  }
  for (int s : lru_) {
    if (s < 0 || size_t(s) >= slots_.size()) return fail("used slot " + std::to_string(s) + " out of range");
    if (seen[size_t(s)]++) return fail("slot " + std::to_string(s) + " listed twice");
    auto it = byHash_.find(slots_[size_t(s)].hash);
    if (it == byHash_.end() || it->second != s) return fail("slot " + std::to_string(s) + " is not indexed");
    if (*slots_[size_t(s)].lruPos != s) return fail("slot " + std::to_string(s) + " has a stale LRU position");
  }
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (!seen[s]) return fail("slot " + std::to_string(s) + " is neither free nor used");
  }
  if (byHash_.size() != lru_.size()) return fail("index and LRU sizes differ");
  return Status::ok();
}

// ---- Disk tier ----------------------------------------------------------------------------
//
// File: "PDKVBLK1", u32 identity length, u32 tokens, u64 hash, u64 parent hash, u64 KV bytes,
// u64 checksum (of the whole file with this field zeroed), identity, tokens (int32), KV.
namespace {

constexpr char kMagic[8] = {'P', 'D', 'K', 'V', 'B', 'L', 'K', '1'};
constexpr size_t kFixedHeader = 48;
constexpr size_t kChecksumAt = 40;
constexpr uint32_t kMaxIdentity = 4096;

template <typename T>
void put(std::string* s, size_t at, T v) {
  std::memcpy(s->data() + at, &v, sizeof v);
}
template <typename T>
T get(const std::string& s, size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool readFile(const fs::path& p, size_t maxBytes, std::string* out, size_t* fileSize) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  if (f == nullptr) return false;
  std::error_code ec;
  *fileSize = size_t(fs::file_size(p, ec));
  if (ec) {
    std::fclose(f);
    return false;
  }
  out->resize(std::min(*fileSize, maxBytes));
  const size_t got = out->empty() ? 0 : std::fread(out->data(), 1, out->size(), f);
  std::fclose(f);
  out->resize(got);
  return true;
}

}  // namespace

std::string KvDiskTier::encodeFile(const std::string& identity, uint64_t hash, uint64_t parentHash,
                                   std::span<const TokenId> tokens, std::span<const uint8_t> kv) {
  std::string s(kFixedHeader + identity.size() + tokens.size_bytes() + kv.size(), '\0');
  std::memcpy(s.data(), kMagic, 8);
  put<uint32_t>(&s, 8, uint32_t(identity.size()));
  put<uint32_t>(&s, 12, uint32_t(tokens.size()));
  put<uint64_t>(&s, 16, hash);
  put<uint64_t>(&s, 24, parentHash);
  put<uint64_t>(&s, 32, uint64_t(kv.size()));
  size_t at = kFixedHeader;
  std::memcpy(s.data() + at, identity.data(), identity.size());
  at += identity.size();
  if (!tokens.empty()) std::memcpy(s.data() + at, tokens.data(), tokens.size_bytes());
  at += tokens.size_bytes();
  if (!kv.empty()) std::memcpy(s.data() + at, kv.data(), kv.size());
  put<uint64_t>(&s, kChecksumAt, kvChecksum(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size())));
  return s;
}

int64_t KvDiskTier::fileBytes(int numTokens) const {
  return int64_t(kFixedHeader + identity_.size() + size_t(numTokens) * sizeof(TokenId) + stride_);
}

fs::path KvDiskTier::fileFor(uint64_t hash) const { return dir_ / (hex16(hash) + ".kvb"); }

std::optional<KvDiskTier::FileDrop> KvDiskTier::check(std::string& c, bool full, Entry* out, uint64_t* hash) const {
  if (c.size() < kFixedHeader) return FileDrop::kTruncated;
  if (std::memcmp(c.data(), kMagic, 8) != 0) return FileDrop::kCorrupt;
  const uint32_t idLen = get<uint32_t>(c, 8);
  const uint32_t n = get<uint32_t>(c, 12);
  if (idLen > kMaxIdentity || n > (1u << 20)) return FileDrop::kCorrupt;
  if (c.size() < kFixedHeader + idLen) return FileDrop::kTruncated;
  if (std::string_view(c.data() + kFixedHeader, idLen) != identity_) return FileDrop::kForeign;
  if (int(n) != blockSize_ || get<uint64_t>(c, 32) != stride_) return FileDrop::kCorrupt;
  const size_t tokAt = kFixedHeader + idLen;
  if (c.size() < tokAt + n * sizeof(TokenId)) return FileDrop::kTruncated;
  out->parentHash = get<uint64_t>(c, 24);
  out->tokens.resize(n);
  std::memcpy(out->tokens.data(), c.data() + tokAt, n * sizeof(TokenId));
  *hash = get<uint64_t>(c, 16);
  // The name must be what the tokens and parent hash to: a flipped bit in the header would
  // otherwise file valid KV under another prompt's name.
  if (hashBlockTokens(out->parentHash, out->tokens) != *hash) return FileDrop::kCorrupt;
  out->bytes = fileBytes(int(n));
  if (full) {
    if (c.size() < size_t(out->bytes)) return FileDrop::kTruncated;
    if (c.size() > size_t(out->bytes)) return FileDrop::kCorrupt;
    // The checksum covers the file with its own field zeroed: zeroed in place, then put back.
    const uint64_t stored = get<uint64_t>(c, kChecksumAt);
    put<uint64_t>(&c, kChecksumAt, 0);
    const uint64_t computed = kvChecksum(std::span(reinterpret_cast<const uint8_t*>(c.data()), c.size()));
    put<uint64_t>(&c, kChecksumAt, stored);
    if (computed != stored) return FileDrop::kCorrupt;
  }
  return std::nullopt;
}

Result<std::unique_ptr<KvDiskTier>> KvDiskTier::open(const std::string& path, std::string identity, int64_t maxBytes,
                                                     int64_t queueBytes, size_t strideBytes, int blockSize) {
  if (path.empty() || identity.empty() || maxBytes <= 0 || strideBytes == 0 || blockSize <= 0) {
    return invalidArgument("kv disk tier: needs a directory, a model identity and a positive size (got '" + path +
                           "', " + std::to_string(maxBytes) + " bytes)");
  }
  std::unique_ptr<KvDiskTier> d(new KvDiskTier());
  d->identity_ = std::move(identity);
  d->maxBytes_ = maxBytes;
  d->queueBytes_ = std::max<int64_t>(queueBytes, 0);
  d->stride_ = strideBytes;
  d->blockSize_ = blockSize;
  // One subdirectory per identity: workers of different models may share the directory
  // without ever reading (or deleting) each other's files.
  const std::string key = hex16(kvChecksum(
      std::span(reinterpret_cast<const uint8_t*>(d->identity_.data()), d->identity_.size()), 0x6b76646973ULL));
  d->dir_ = fs::path(path) / key;
  std::error_code ec;
  fs::create_directories(d->dir_, ec);
  if (ec) return unavailable("kv disk tier: cannot create " + d->dir_.string() + ": " + ec.message());
  // Index what a previous run left: header and size only (the checksum is verified when a
  // block is loaded), oldest first by modification time.
  struct Found {
    fs::file_time_type mtime;
    uint64_t hash;
    Entry e;
  };
  std::vector<Found> found;
  const size_t headerMax = kFixedHeader + kMaxIdentity + size_t(blockSize) * sizeof(TokenId);
  for (fs::directory_iterator it(d->dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path p = it->path();
    if (p.extension() == ".tmp") {  // a write interrupted by a crash
      fs::remove(p, ec);
      continue;
    }
    if (p.extension() != ".kvb" || !it->is_regular_file()) continue;
    std::string head;
    size_t size = 0;
    Entry e;
    uint64_t hash = 0;
    std::optional<FileDrop> bad;
    if (!readFile(p, headerMax, &head, &size)) {
      bad = FileDrop::kCorrupt;
    } else {
      bad = d->check(head, false, &e, &hash);
      if (!bad && p.filename() != hex16(hash) + ".kvb") bad = FileDrop::kCorrupt;
      if (!bad && size < size_t(e.bytes)) bad = FileDrop::kTruncated;
      if (!bad && size > size_t(e.bytes)) bad = FileDrop::kCorrupt;
    }
    if (bad) {
      ++d->filesDropped_[int(*bad)];
      PD_LOG(kWarn, "kv_tiers") << "dropping " << p.string() << ": "
                                << (*bad == FileDrop::kForeign     ? "made for another model identity"
                                    : *bad == FileDrop::kTruncated ? "truncated"
                                                                   : "corrupt");
      std::error_code rm;
      fs::remove(p, rm);
      continue;
    }
    found.push_back({it->last_write_time(ec), hash, std::move(e)});
  }
  if (ec) return unavailable("kv disk tier: cannot read " + d->dir_.string() + ": " + ec.message());
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  for (Found& f : found) {
    d->committedBytes_ += f.e.bytes;
    f.e.lruPos = d->lru_.insert(d->lru_.end(), f.hash);
    d->index_.emplace(f.hash, std::move(f.e));
    ++d->filesLoaded_;
  }
  while (d->committedBytes_ > d->maxBytes_ && !d->lru_.empty()) d->evictOldest(nullptr);
  d->writer_ = std::thread([p = d.get()] { p->writerMain(); });
  return d;
}

KvDiskTier::~KvDiskTier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

bool KvDiskTier::matches(uint64_t hash, std::span<const TokenId> tokens) const {
  auto it = index_.find(hash);
  return it != index_.end() &&
         std::equal(tokens.begin(), tokens.end(), it->second.tokens.begin(), it->second.tokens.end());
}

void KvDiskTier::forget(uint64_t hash, std::vector<Change>* changes) {
  auto it = index_.find(hash);
  if (it == index_.end()) return;
  if (changes != nullptr) changes->push_back({false, hash, it->second.parentHash, {}});
  committedBytes_ -= it->second.bytes;
  lru_.erase(it->second.lruPos);
  index_.erase(it);
}

void KvDiskTier::evictOldest(std::vector<Change>* changes) {
  const uint64_t h = lru_.front();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Op{false, h, fileFor(h), {}});
  }
  cv_.notify_one();
  forget(h, changes);
  ++evictions_;
}

bool KvDiskTier::enqueue(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens,
                         std::span<const uint8_t> kv, std::vector<Change>* changes) {
  if (knows(hash)) return false;
  const int64_t size = fileBytes(int(tokens.size()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queuedBytes_ + size > queueBytes_) {
      ++writesDropped_[int(WriteDrop::kQueueFull)];
      return false;
    }
  }
  while (committedBytes_ + pendingBytes_ + size > maxBytes_ && !lru_.empty()) evictOldest(changes);
  if (committedBytes_ + pendingBytes_ + size > maxBytes_) {  // all of it is queued writes
    ++writesDropped_[int(WriteDrop::kDiskFull)];
    return false;
  }
  Entry e;
  e.parentHash = parentHash;
  e.tokens.assign(tokens.begin(), tokens.end());
  e.bytes = size;
  pending_.emplace(hash, std::move(e));
  pendingBytes_ += size;
  Op op{true, hash, fileFor(hash), encodeFile(identity_, hash, parentHash, tokens, kv)};  // outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    queuedBytes_ += size;
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
  return true;
}

void KvDiskTier::writerMain() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, everything done
    Op op = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    Done d{op.hash, true, false, {}};
    std::error_code ec;
    if (!op.write) {
      fs::remove(op.path, ec);
    } else {
      // Write aside and rename: a reader (a restarted worker) sees a whole file or none; a
      // crash leaves a .tmp that open() deletes.
      fs::path tmp = op.path;
      tmp += ".tmp";
      std::FILE* f = std::fopen(tmp.c_str(), "wb");
      bool ok = f != nullptr && std::fwrite(op.contents.data(), 1, op.contents.size(), f) == op.contents.size();
      int err = ok ? 0 : errno;
      if (f != nullptr && std::fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
      }
      if (ok && std::rename(tmp.c_str(), op.path.c_str()) != 0) {
        ok = false;
        err = errno;
      }
      if (!ok) {
        fs::remove(tmp, ec);
        d.ok = false;
        d.noSpace = err == ENOSPC || err == EDQUOT;
        d.error = std::strerror(err);
      }
    }
    lock.lock();
    busy_ = false;
    if (op.write) {
      queuedBytes_ -= int64_t(op.contents.size());
      done_.push_back(std::move(d));
    }
    if (queue_.empty()) idleCv_.notify_all();
  }
}

void KvDiskTier::poll(std::vector<Change>* changes) {
  std::vector<Done> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(done_);
  }
  for (Done& d : done) {
    auto it = pending_.find(d.hash);
    if (it == pending_.end()) continue;
    Entry e = std::move(it->second);
    pending_.erase(it);
    pendingBytes_ -= e.bytes;
    if (!d.ok) {
      ++writesDropped_[int(d.noSpace ? WriteDrop::kDiskFull : WriteDrop::kError)];
      PD_LOG(kWarn, "kv_tiers") << "cannot write " << fileFor(d.hash).string() << ": " << d.error;
      continue;
    }
    ++writes_;
    committedBytes_ += e.bytes;
    e.lruPos = lru_.insert(lru_.end(), d.hash);
    if (changes != nullptr) changes->push_back({true, d.hash, e.parentHash, e.tokens});
    index_.emplace(d.hash, std::move(e));
  }
}

bool KvDiskTier::load(uint64_t hash, std::span<uint8_t> dst, std::vector<Change>* changes) {
  auto it = index_.find(hash);
  if (it == index_.end()) return false;
  const fs::path p = fileFor(hash);
  std::string contents;
  size_t size = 0;
  Entry e;
  uint64_t got = 0;
  std::optional<FileDrop> bad;
  if (!readFile(p, size_t(it->second.bytes) + 1, &contents, &size)) {
    bad = FileDrop::kTruncated;  // gone (deleted from outside): nothing to load
  } else {
    bad = check(contents, true, &e, &got);
    if (!bad && (got != hash || e.parentHash != it->second.parentHash || e.tokens != it->second.tokens)) {
      bad = FileDrop::kCorrupt;
    }
    if (!bad && dst.size() != stride_) bad = FileDrop::kCorrupt;
  }
  if (bad) {
    ++filesDropped_[int(*bad)];
    PD_LOG(kWarn, "kv_tiers") << "dropping " << p.string() << " instead of loading it: "
                              << (*bad == FileDrop::kForeign     ? "made for another model identity"
                                  : *bad == FileDrop::kTruncated ? "truncated or missing"
                                                                 : "corrupt (checksum or header)");
    std::error_code ec;
    fs::remove(p, ec);
    forget(hash, changes);
    return false;
  }
  std::memcpy(dst.data(), contents.data() + contents.size() - stride_, stride_);
  lru_.splice(lru_.end(), lru_, it->second.lruPos);
  return true;
}

bool KvDiskTier::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return idleCv_.wait_for(lock, timeout, [&] { return queue_.empty() && !busy_; });
}

Status KvDiskTier::checkInvariants() const {
  auto fail = [](const std::string& what) { return internalError("kv disk tier invariant violated: " + what); };
  if (lru_.size() != index_.size()) return fail("LRU and index sizes differ");
  int64_t bytes = 0;
  for (const auto& [h, e] : index_) {
    if (*e.lruPos != h) return fail("block " + hex16(h) + " has a stale LRU position");
    if (pending_.count(h)) return fail("block " + hex16(h) + " is both written and queued");
    bytes += e.bytes;
  }
  if (bytes != committedBytes_)
    return fail("byte count " + std::to_string(committedBytes_) + " != " + std::to_string(bytes));
  int64_t pending = 0;
  for (const auto& [h, e] : pending_) pending += e.bytes;
  if (pending != pendingBytes_) return fail("queued byte count is stale");
  if (committedBytes_ + pendingBytes_ > maxBytes_) return fail("over the byte bound");
  return Status::ok();
}

// ---- The store ----------------------------------------------------------------------------

Result<std::unique_ptr<KvTierStore>> KvTierStore::create(KvCacheManager& kv, const KvTierOptions& options,
                                                         const std::string& identity) {
  if (options.hostBytes <= 0 && options.diskBytes <= 0) {
    return invalidArgument("kv tiers: both the host and the disk tier are off (0 bytes)");
  }
  if (kv.data() == nullptr || kv.region().kind != MemKind::kHost) {
    return failedPrecondition("kv tiers: the KV region is " + toString(kv.region()) +
                              "; a host copier copies host regions only (the cuda backend's tiers are made with "
                              "its block copier, engine/cuda_kv_copier.h)");
  }
  return create(kv, options, identity, std::make_unique<HostKvBlockCopier>(kv));
}

Result<std::unique_ptr<KvTierStore>> KvTierStore::create(KvCacheManager& kv, const KvTierOptions& options,
                                                         const std::string& identity,
                                                         std::unique_ptr<KvBlockCopier> copier) {
  if (options.hostBytes <= 0 && options.diskBytes <= 0) {
    return invalidArgument("kv tiers: both the host and the disk tier are off (0 bytes)");
  }
  if (!copier) return invalidArgument("kv tiers: no block copier");
  const size_t stride = copier->strideBytes();
  if (stride == 0 || stride % kv.blockStrideBytes() != 0) {
    return invalidArgument("kv tiers: the copier's block of " + std::to_string(stride) +
                           " bytes is not whole blocks of the region's " + std::to_string(kv.blockStrideBytes()));
  }
  if (options.demoteAheadBlocks < 0) {
    return invalidArgument("kv tiers: demoteAheadBlocks " + std::to_string(options.demoteAheadBlocks) + " is negative");
  }
  std::unique_ptr<KvTierStore> s(new KvTierStore(kv));
  s->copier_ = std::move(copier);
  s->scratch_.resize(stride);
  s->demoteAhead_ = options.demoteAheadBlocks > 0 ? options.demoteAheadBlocks : std::max(1, kv.numTotalBlocks() / 32);
  if (options.hostBytes > 0) {
    PD_ASSIGN_OR_RETURN(s->host_, KvHostTier::create(options.hostBytes, stride));
  }
  if (options.diskBytes > 0) {
    PD_ASSIGN_OR_RETURN(s->disk_, KvDiskTier::open(options.diskPath, identity, options.diskBytes,
                                                   options.diskWriteQueueBytes, stride, kv.blockSize()));
  }
  kv.setLowerTiers(s.get());
  return s;
}

KvTierStore::~KvTierStore() {
  // Every copy reads a block of the region: none may outlive the store (the region is freed
  // after it), and every held block goes back to the manager.
  if (copier_ && copier_->asynchronous()) takeCompletedCopies(true, false);
  releaseDeferred();
  kv_.setLowerTiers(nullptr);
}

void KvTierStore::record(const std::vector<KvDiskTier::Change>& changes) {
  for (const auto& c : changes) {
    kv_.recordEvent({c.stored ? KvBlockEvent::Kind::kStored : KvBlockEvent::Kind::kRemoved, c.hash, c.parentHash,
                     c.tokens, KvTier::kDisk});
  }
}

void KvTierStore::writeToDisk(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens,
                              std::span<const uint8_t> kv) {
  std::vector<KvDiskTier::Change> changes;
  disk_->enqueue(hash, parentHash, tokens, kv, &changes);
  record(changes);
}

void KvTierStore::onNamed(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) {
  if (!disk_ || disk_->knows(hash)) return;
  if (copier_->asynchronous()) {
    for (const InFlight& f : inFlight_) {
      if (!f.demotion && f.hash == hash) return;  // already on its way to disk
    }
    if (copier_->freeSlots() == 0) return;  // skipped: the eviction is its last chance
    auto slot = copier_->startCopyOut(b);
    if (!slot.ok()) {
      PD_LOG(kWarn, "kv_tiers") << "write-through of block " << hex16(hash)
                                << " not started: " << slot.status().toString();
      return;
    }
    inFlight_.push_back({*slot, b, false, hash, parentHash, std::vector<TokenId>(tokens.begin(), tokens.end())});
    return;
  }
  if (Status st = copier_->copyOut(b, scratch_.data()); !st.isOk()) {
    PD_LOG(kWarn, "kv_tiers") << "write-through of block " << hex16(hash) << " dropped: " << st.toString();
    return;
  }
  writeToDisk(hash, parentHash, tokens, scratch_);
}

void KvTierStore::demoteToHost(uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens,
                               const uint8_t* bytes) {
  if (host_->contains(hash)) {  // promoted from here earlier: the copy is still good
    host_->touch(hash);
    return;
  }
  std::optional<KvHostTier::Evicted> evicted;
  uint8_t* slot = host_->insert(hash, parentHash, tokens, &evicted);
  if (evicted && disk_ && !disk_->knows(evicted->hash)) {
    // The slot's old bytes are still there: nothing was copied into it yet.
    writeToDisk(evicted->hash, evicted->parentHash, evicted->tokens,
                std::span<const uint8_t>(slot, host_->strideBytes()));
  }
  std::memcpy(slot, bytes, host_->strideBytes());
  ++demotionsToHost_;
  if (evicted) {
    ++hostEvictions_;
    kv_.recordEvent({KvBlockEvent::Kind::kRemoved, evicted->hash, evicted->parentHash, {}, KvTier::kHost});
  }
  kv_.recordEvent({KvBlockEvent::Kind::kStored, hash, parentHash, std::vector<TokenId>(tokens.begin(), tokens.end()),
                   KvTier::kHost});
}

void KvTierStore::onEvict(BlockId b, uint64_t hash, uint64_t parentHash, std::span<const TokenId> tokens) {
  const bool async = copier_->asynchronous();
  bool waited = false;
  if (async && !inFlight_.empty()) {
    // b is reused as soon as this returns: no copy still reading it (a write-through) may be
    // in flight. Held blocks go back to the manager at the next poll (we are inside it now).
    waited = true;
    takeCompletedCopies(true, true);
  }
  const bool needCopy = host_ ? !host_->contains(hash) : (disk_ && !disk_->knows(hash));
  if (!needCopy) {
    if (host_) host_->touch(hash);  // promoted from here earlier: the copy is still good
    waitedEvictions_ += waited ? 1 : 0;
    return;
  }
  if (host_ && !async) {
    // A host region: copied straight into the host slot (a memcpy cannot fail).
    std::optional<KvHostTier::Evicted> evicted;
    uint8_t* slot = host_->insert(hash, parentHash, tokens, &evicted);
    if (evicted && disk_ && !disk_->knows(evicted->hash)) {
      // The slot's old bytes are still there: nothing was copied into it yet.
      writeToDisk(evicted->hash, evicted->parentHash, evicted->tokens,
                  std::span<const uint8_t>(slot, host_->strideBytes()));
    }
    (void)copier_->copyOut(b, slot);
    ++demotionsToHost_;
    if (evicted) {
      ++hostEvictions_;
      kv_.recordEvent({KvBlockEvent::Kind::kRemoved, evicted->hash, evicted->parentHash, {}, KvTier::kHost});
    }
    kv_.recordEvent({KvBlockEvent::Kind::kStored, hash, parentHash, std::vector<TokenId>(tokens.begin(), tokens.end()),
                     KvTier::kHost});
    return;
  }
  // A device region whose demotion ahead did not keep up (the loop waits for this copy), or
  // no host tier: the write-through may have been dropped (queue full, no staging slot) and
  // the eviction is its last chance.
  waitedEvictions_ += async ? 1 : 0;
  if (Status st = copier_->copyOut(b, scratch_.data()); !st.isOk()) {
    PD_LOG(kWarn, "kv_tiers") << "demotion of block " << hex16(hash) << " dropped: " << st.toString();
    return;
  }
  if (host_) {
    demoteToHost(hash, parentHash, tokens, scratch_.data());
  } else {
    writeToDisk(hash, parentHash, tokens, scratch_);
  }
}

void KvTierStore::takeCompletedCopies(bool wait, bool deferRelease) {
  std::vector<KvBlockCopier::Done> done;
  copier_->completed(wait, &done);
  for (const KvBlockCopier::Done& d : done) {
    auto it = std::find_if(inFlight_.begin(), inFlight_.end(), [&](const InFlight& f) { return f.slot == d.slot; });
    if (it == inFlight_.end()) {
      PD_LOG(kError, "kv_tiers") << "the copier reported slot " << d.slot << ", which has no copy in flight";
      continue;
    }
    InFlight f = std::move(*it);
    inFlight_.erase(it);
    if (!d.status.isOk()) {
      PD_LOG(kWarn, "kv_tiers") << (f.demotion ? "demotion" : "write-through") << " of block " << hex16(f.hash)
                                << " dropped: " << d.status.toString();
    } else {
      const uint8_t* bytes = copier_->slotData(d.slot);
      if (f.demotion && host_) demoteToHost(f.hash, f.parentHash, f.tokens, bytes);
      if (!f.demotion && disk_ && !disk_->knows(f.hash)) {
        writeToDisk(f.hash, f.parentHash, f.tokens, std::span<const uint8_t>(bytes, copier_->strideBytes()));
      }
    }
    copier_->releaseSlot(d.slot);
    if (f.demotion) {
      if (deferRelease) {
        releaseDeferred_.push_back(f.block);
      } else {
        kv_.releaseHeld(f.block);
      }
    }
  }
}

void KvTierStore::releaseDeferred() {
  for (BlockId b : releaseDeferred_) kv_.releaseHeld(b);
  releaseDeferred_.clear();
}

void KvTierStore::demoteAhead() {
  if (!host_ || !copier_->asynchronous()) return;
  // Held blocks count: each becomes a free uncached block once its copy completed.
  while (kv_.numFreeBlocks() - kv_.numCachedFreeBlocks() + kv_.numHeldBlocks() < demoteAhead_ &&
         kv_.numCachedFreeBlocks() > 0 && copier_->freeSlots() > 0) {
    std::optional<KvCacheManager::HeldBlock> h = kv_.evictAndHold();
    if (!h) return;
    if (host_->contains(h->hash)) {  // promoted from here earlier: nothing to copy
      host_->touch(h->hash);
      kv_.releaseHeld(h->block);
      continue;
    }
    auto slot = copier_->startCopyOut(h->block);
    if (!slot.ok()) {
      PD_LOG(kWarn, "kv_tiers") << "demotion of block " << hex16(h->hash)
                                << " not started: " << slot.status().toString();
      kv_.releaseHeld(h->block);
      return;
    }
    inFlight_.push_back({*slot, h->block, true, h->hash, h->parentHash, std::move(h->tokens)});
  }
}

void KvTierStore::finishCopies() {
  if (!copier_->asynchronous()) return;
  takeCompletedCopies(true, false);
  releaseDeferred();
}

int KvTierStore::promote(std::span<const TokenId> tokens, int maxTokens, int maxNewBlocks) {
  KvCacheManager::PromoteSource src;
  src.has = [this](uint64_t h, std::span<const TokenId> toks) -> std::optional<KvTier> {
    // A block demoted ahead whose copy is still in flight: wait for the copies (microseconds)
    // rather than recompute it. Inside the manager's promote(): held blocks are released at
    // the next poll.
    if (host_ &&
        std::any_of(inFlight_.begin(), inFlight_.end(), [&](const InFlight& f) { return f.demotion && f.hash == h; })) {
      takeCompletedCopies(true, true);
    }
    if (host_ && host_->matches(h, toks)) {
      host_->touch(h);  // most recently used: a demotion during this promotion keeps it
      return KvTier::kHost;
    }
    if (disk_ && disk_->matches(h, toks)) return KvTier::kDisk;
    return std::nullopt;
  };
  // Synchronous copies in: the block is named when fill returns, so a step or a KV transfer
  // may read it right after promote(); and the source (a host slot a demotion may reuse, the
  // one scratch block) changes after the call.
  src.fill = [this](uint64_t h, KvTier from, BlockId dst) {
    if (from == KvTier::kHost && host_ && host_->contains(h)) {
      Status st = copier_->copyIn(host_->data(h), dst);
      if (!st.isOk()) PD_LOG(kWarn, "kv_tiers") << "promotion of block " << hex16(h) << " failed: " << st.toString();
      return st.isOk();
    }
    if (!disk_) return false;
    std::vector<KvDiskTier::Change> changes;
    const bool ok = disk_->load(h, scratch_, &changes);
    record(changes);
    if (!ok) return false;
    Status st = copier_->copyIn(scratch_.data(), dst);
    if (!st.isOk()) PD_LOG(kWarn, "kv_tiers") << "promotion of block " << hex16(h) << " failed: " << st.toString();
    return st.isOk();
  };
  return kv_.promote(tokens, maxTokens, maxNewBlocks, src);
}

void KvTierStore::poll() {
  if (copier_->asynchronous()) {
    takeCompletedCopies(false, false);
    releaseDeferred();
    demoteAhead();
  }
  if (!disk_) return;
  std::vector<KvDiskTier::Change> changes;
  disk_->poll(&changes);
  record(changes);
}

void KvTierStore::appendSnapshot(std::vector<KvBlockEvent>* out) const {
  if (host_) {
    host_->forEach([&](uint64_t h, uint64_t parent, const std::vector<TokenId>& toks) {
      out->push_back({KvBlockEvent::Kind::kStored, h, parent, toks, KvTier::kHost});
    });
  }
  if (disk_) {
    disk_->forEach([&](uint64_t h, uint64_t parent, const std::vector<TokenId>& toks) {
      out->push_back({KvBlockEvent::Kind::kStored, h, parent, toks, KvTier::kDisk});
    });
  }
}

KvTierStats KvTierStore::stats() const {
  KvTierStats s;
  if (host_) {
    s.hostBlocks = host_->size();
    s.hostCapacityBlocks = host_->capacity();
  }
  s.demotionsToHost = demotionsToHost_;
  s.hostEvictions = hostEvictions_;
  s.copiesInFlight = int64_t(inFlight_.size());
  s.waitedEvictions = waitedEvictions_;
  s.blockBytes = int64_t(copier_->strideBytes());
  if (disk_) {
    s.diskBlocks = disk_->size();
    s.diskBytes = disk_->bytes();
    s.diskWrites = disk_->writes();
    s.diskEvictions = disk_->evictions();
    s.diskFilesLoaded = disk_->filesLoaded();
    for (int i = 0; i < 3; ++i) {
      s.diskWritesDropped[i] = disk_->writesDropped(KvDiskTier::WriteDrop(i));
      s.diskFilesDropped[i] = disk_->filesDropped(KvDiskTier::FileDrop(i));
    }
  }
  return s;
}

Status KvTierStore::checkInvariants() const {
  if (host_) PD_RETURN_IF_ERROR(host_->checkInvariants());
  if (disk_) PD_RETURN_IF_ERROR(disk_->checkInvariants());
  auto fail = [](const std::string& what) { return internalError("kv tier store invariant violated: " + what); };
  int demotions = 0;
  std::vector<int> slots;
  for (const InFlight& f : inFlight_) {
    slots.push_back(f.slot);
    if (!f.demotion) continue;
    ++demotions;
    if (!kv_.isHeld(f.block)) return fail("block " + std::to_string(f.block) + " is demoted but not held");
  }
  for (BlockId b : releaseDeferred_) {
    if (!kv_.isHeld(b)) return fail("block " + std::to_string(b) + " awaits release but is not held");
  }
  if (demotions + int(releaseDeferred_.size()) != kv_.numHeldBlocks()) {
    return fail(std::to_string(kv_.numHeldBlocks()) + " blocks are held for " + std::to_string(demotions) +
                " demotions in flight and " + std::to_string(releaseDeferred_.size()) + " awaiting release");
  }
  std::sort(slots.begin(), slots.end());
  if (std::adjacent_find(slots.begin(), slots.end()) != slots.end()) return fail("two copies share a staging slot");
  if (copier_->freeSlots() + int(inFlight_.size()) != copier_->numSlots()) {
    return fail(std::to_string(inFlight_.size()) + " copies in flight and " + std::to_string(copier_->freeSlots()) +
                " free slots do not add up to " + std::to_string(copier_->numSlots()));
  }
  return kv_.checkInvariants();
}

}  // namespace pd::engine
