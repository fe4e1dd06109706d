// Device-independent verbs logic; the formats and the rules are in verbs_codec.h.
#include "kvtransfer/transports/verbs_codec.h"

#include <algorithm>
#include <cstring>

#include "kvtransfer/kvt.pb.h"
#include "kvtransfer/transports/blob_codec.h"

namespace pd::kvt::verbs {
namespace {
constexpr uint32_t kKeyMagic = 0x4b425256;   // "VRBK"
constexpr uint32_t kConnMagic = 0x43425256;  // "VRBC"
// 1 was the hand-written binary layout; 2 is kvt.proto's VerbsRemoteKey / VerbsConnInfo.
constexpr uint32_t kVersion = 2;
constexpr uint64_t kMaxSgeBytes = 1ull << 31;

}  // namespace

std::string encodeKey(const PackedKey& key) {
  proto::VerbsRemoteKey m;
  m.set_magic(kKeyMagic);
  m.set_version(kVersion);
  m.set_addr(key.addr);
  m.set_len(key.len);
  m.set_rkey(key.rkey);
  return m.SerializeAsString();
}

Result<PackedKey> decodeKey(const std::string& blob) {
  PD_ASSIGN_OR_RETURN(
      auto m, parseMagicBlob<proto::VerbsRemoteKey>(blob, kKeyMagic, kVersion, "verbs: remote key", "a verbs blob"));
  if (!m.has_addr() || !m.has_len() || !m.has_rkey())
    return dataLoss("verbs: remote key blob lacks its address, length or rkey (truncated? " +
                    std::to_string(blob.size()) + " bytes)");
  PackedKey k{m.addr(), m.len(), m.rkey()};
  if (k.len == 0 || k.addr + k.len < k.addr) return invalidArgument("verbs: remote key has an empty or wrapping range");
  return k;
}

std::string encodeConnInfo(const ConnInfo& c) {
  proto::VerbsConnInfo m;
  m.set_magic(kConnMagic);
  m.set_version(kVersion);
  if (c.peerQpn) m.set_peer_qpn(*c.peerQpn);
  m.set_name(c.name);
  m.set_lid(c.lid);
  m.set_gid(std::string(reinterpret_cast<const char*>(c.gid.data()), c.gid.size()));
  m.set_gid_index(c.gidIndex);
  m.set_port(c.port);
  m.set_mtu(c.mtu);
  m.set_qpn(c.qpn);
  m.set_psn(c.psn);
  return m.SerializeAsString();
}

Result<ConnInfo> decodeConnInfo(const std::string& blob) {
  PD_ASSIGN_OR_RETURN(auto m, parseMagicBlob<proto::VerbsConnInfo>(blob, kConnMagic, kVersion, "verbs: connection info",
                                                                   "a verbs blob"));
  if (!m.has_name() || !m.has_lid() || !m.has_gid() || !m.has_gid_index() || !m.has_port() || !m.has_mtu() ||
      !m.has_qpn() || !m.has_psn())
    return dataLoss("verbs: connection info lacks some of its fields (truncated? " + std::to_string(blob.size()) +
                    " bytes)");
  if (m.gid().size() != 16)
    return invalidArgument("verbs: connection info has a GID of " + std::to_string(m.gid().size()) +
                           " bytes (16 expected)");
  if (m.lid() > 0xffff || m.gid_index() > 0xff || m.port() > 0xff)
    return invalidArgument("verbs: connection info has a LID, GID index or port number out of range");
  if (m.qpn() > 0xffffff || m.psn() > 0xffffff || (m.has_peer_qpn() && m.peer_qpn() > 0xffffff))
    return invalidArgument("verbs: connection info has a QP number or PSN wider than 24 bits");
  if (m.mtu() < 1 || m.mtu() > 5)
    return invalidArgument("verbs: connection info has MTU code " + std::to_string(m.mtu()) +
                           " (allowed 1..5 = 256..4096 bytes)");
  ConnInfo c;
  c.name = m.name();
  c.lid = static_cast<uint16_t>(m.lid());
  std::memcpy(c.gid.data(), m.gid().data(), 16);
  c.gidIndex = static_cast<uint8_t>(m.gid_index());
  c.port = static_cast<uint8_t>(m.port());
  c.mtu = static_cast<uint8_t>(m.mtu());
  c.qpn = m.qpn();
  c.psn = m.psn();
  if (m.has_peer_qpn()) c.peerQpn = m.peer_qpn();
  return c;
}

Result<std::optional<uint32_t>> PendingQps::choose(const ConnInfo& remote) const {
  if (!remote.peerQpn) {
    if (order_.empty()) return std::optional<uint32_t>();
    return std::optional<uint32_t>(order_.front());
  }
  if (std::find(order_.begin(), order_.end(), *remote.peerQpn) == order_.end())
    return failedPrecondition("verbs: peer '" + remote.name + "' answers QP " + std::to_string(*remote.peerQpn) +
                              ", which is not a QP offered here and still unconnected (" +
                              std::to_string(order_.size()) + " pending)");
  return std::optional<uint32_t>(*remote.peerQpn);
}

void PendingQps::take(uint32_t qpn) { order_.erase(std::remove(order_.begin(), order_.end(), qpn), order_.end()); }

Result<std::vector<WritePlan>> planWrites(const std::vector<SegmentPair>& pairs, const BatchLimits& limits) {
  if (limits.maxSge == 0 || limits.maxMsgBytes == 0)
    return invalidArgument("verbs: work request limits must be > 0 (maxSge " + std::to_string(limits.maxSge) +
                           ", maxMsgBytes " + std::to_string(limits.maxMsgBytes) + ")");
  const uint64_t maxMsg = std::min(limits.maxMsgBytes, kMaxSgeBytes);
  std::vector<WritePlan> out;
  for (const SegmentPair& p : pairs) {
    uint64_t done = 0;
    while (done < p.len) {
      const uint64_t localAddr = p.localAddr + done;
      const uint64_t remoteAddr = p.remoteAddr + done;
      WritePlan* w = out.empty() ? nullptr : &out.back();
      const bool joins = w && w->rkey == p.rkey && w->remoteAddr + w->bytes == remoteAddr && w->bytes < maxMsg;
      if (!joins) {
        out.push_back(WritePlan{remoteAddr, p.rkey, 0, {}});
        w = &out.back();
      }
      const uint64_t piece = std::min(p.len - done, maxMsg - w->bytes);
      Sge* last = w->sges.empty() ? nullptr : &w->sges.back();
      if (last && last->lkey == p.lkey && last->addr + last->len == localAddr) {
        last->len += static_cast<uint32_t>(piece);  // <= maxMsg <= 2^31 in total
      } else if (w->sges.size() < limits.maxSge) {
        w->sges.push_back(Sge{localAddr, static_cast<uint32_t>(piece), p.lkey});
      } else {
        // This WRITE has no SGE left: start a new one at the same remote address.
        out.push_back(WritePlan{remoteAddr, p.rkey, 0, {Sge{localAddr, 0, p.lkey}}});
        w = &out.back();
        const uint64_t fresh = std::min(p.len - done, maxMsg);
        w->sges.back().len = static_cast<uint32_t>(fresh);
        w->bytes = fresh;
        done += fresh;
        continue;
      }
      w->bytes += piece;
      done += piece;
    }
  }
  return out;
}

SendWindow::SendWindow(uint32_t depth, uint32_t signalEvery)
    : depth_(std::max<uint32_t>(depth, 2)),
      every_(std::clamp<uint32_t>(signalEvery, 1, std::max<uint32_t>(depth, 2) / 2)) {}

bool SendWindow::onPost(uint64_t transfer, size_t index, size_t total) {
  ++used_;
  ++sinceSignal_;
  const bool last = index + 1 == total;
  if (!last && !shouldSignal(index, total, every_) && sinceSignal_ < every_) return false;
  fifo_.push_back(Entry{transfer, sinceSignal_, last});
  sinceSignal_ = 0;
  return true;
}

std::optional<SendWindow::Completed> SendWindow::onCompletion() {
  if (fifo_.empty()) return std::nullopt;
  Entry e = fifo_.front();
  fifo_.pop_front();
  used_ -= std::min(used_, e.wrs);
  return Completed{e.transfer, e.last};
}

}  // namespace pd::kvt::verbs
