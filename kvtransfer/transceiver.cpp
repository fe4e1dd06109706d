#include "kvtransfer/transceiver.h"

#include "common/base/log.h"
#include "kvtransfer/kvt.pb.h"

namespace pd::kvt {

namespace {
constexpr size_t kMaxEarly = 4096;

std::string missingLayers(const std::vector<bool>& have) {
  std::string out;
  size_t n = have.size();
  for (size_t i = 0; i < n;) {
    if (have[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j + 1 < n && !have[j + 1]) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(i) + (j > i ? "-" + std::to_string(j) : "");
    i = j + 1;
  }
  return out;
}
}  // namespace

const char* kvEventKindName(KvEventKind kind) {
  switch (kind) {
    case KvEventKind::kSent: return "sent";
    case KvEventKind::kSendFailed: return "send_failed";
    case KvEventKind::kReceived: return "received";
    case KvEventKind::kReceiveFailed: return "receive_failed";
  }
  return "unknown";
}

KvTransceiver::KvTransceiver(TransferAgent& agent, const Clock& clock) : agent_(agent), clock_(clock) {}

Result<Segments> KvTransceiver::buildSegments(const KvSource& src, const KvTarget& dst, int layerBegin,
                                              int layerEnd) {
  const auto& sl = src.layout;
  const auto& dl = dst.layout;
  if (sl.blockBytes() != dl.blockBytes() || sl.numLayers != dl.numLayers || sl.blockSize != dl.blockSize ||
      sl.dtype != dl.dtype) {
    return invalidArgument("kv transfer: layouts disagree: source " + sl.fingerprint() + ", target " +
                           dl.fingerprint());
  }
  if (layerBegin < 0 || layerEnd > sl.numLayers || layerBegin >= layerEnd) {
    return invalidArgument("kv transfer: layer range [" + std::to_string(layerBegin) + ", " +
                           std::to_string(layerEnd) + ") is empty or outside [0, " +
                           std::to_string(sl.numLayers) + ")");
  }
  if (src.blockIds.size() != dst.blockIds.size()) {
    return invalidArgument("kv transfer: " + std::to_string(src.blockIds.size()) + " source blocks but " +
                           std::to_string(dst.blockIds.size()) + " target blocks");
  }
  for (size_t i = 0; i < src.blockIds.size(); ++i) {
    if (src.blockIds[i] < 0 || src.blockIds[i] >= sl.numBlocks) {
      return invalidArgument("kv transfer: source block id " + std::to_string(src.blockIds[i]) +
                             " outside [0, " + std::to_string(sl.numBlocks) + ")");
    }
    if (dst.blockIds[i] < 0 || dst.blockIds[i] >= dl.numBlocks) {
      return invalidArgument("kv transfer: target block id " + std::to_string(dst.blockIds[i]) +
                             " outside [0, " + std::to_string(dl.numBlocks) + ")");
    }
  }
  Segments out;
  const size_t bb = sl.blockBytes();
  const size_t n = src.blockIds.size();
  for (int layer = layerBegin; layer < layerEnd; ++layer) {
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && src.blockIds[j] == src.blockIds[j - 1] + 1 && dst.blockIds[j] == dst.blockIds[j - 1] + 1) ++j;
      const size_t len = (j - i) * bb;
      MemDesc l;
      l.addr = src.base + sl.blockOffset(layer, src.blockIds[i]);
      l.len = len;
      l.kind = src.kind;
      l.device = src.device;
      MemDesc r;
      r.addr = dst.base + dl.blockOffset(layer, dst.blockIds[i]);
      r.len = len;
      r.kind = dst.kind;
      r.device = dst.device;
      out.local.push_back(l);
      out.remote.push_back(r);
      i = j;
    }
  }
  return out;
}

Status KvTransceiver::send(RequestId request, const KvSource& source, const KvTarget& target, int layerBegin,
                           int layerEnd) {
  PD_ASSIGN_OR_RETURN(Segments segs, buildSegments(source, target, layerBegin, layerEnd));
  auto& st = sends_[request];
  if (st.numLayers == 0) {
    st.numLayers = source.layout.numLayers;
    st.done.assign(size_t(st.numLayers), false);
  }
  proto::KvNotify note;
  note.set_request_id(request);
  note.set_layer_begin(layerBegin);
  note.set_layer_end(layerEnd);
  note.set_num_layers(source.layout.numLayers);
  auto id = agent_.post(segs.local, segs.remote, target.peer, note.SerializeAsString());
  if (!id.ok()) {
    if (st.inFlight.empty()) sends_.erase(request);
    return id.status().withContext("request " + std::to_string(request) + " layers [" +
                                   std::to_string(layerBegin) + ", " + std::to_string(layerEnd) + ")");
  }
  st.inFlight.push_back({*id, {layerBegin, layerEnd}});
  return Status::ok();
}

Status KvTransceiver::cancelSend(RequestId request) {
  auto it = sends_.find(request);
  if (it == sends_.end()) return notFound("kv transfer: no send in flight for request " + std::to_string(request));
  for (auto& [id, layers] : it->second.inFlight) {
    if (agent_.cancel(id).isOk()) (void)agent_.poll(id);  // consume the kCancelled outcome
  }
  sends_.erase(it);
  return Status::ok();
}

Status KvTransceiver::expect(RequestId request, int numLayers, Deadline deadline) {
  if (numLayers <= 0) return invalidArgument("kv transfer: expect() needs numLayers > 0");
  if (expects_.count(request)) {
    return Status(StatusCode::kAlreadyExists, "kv transfer: request " + std::to_string(request) + " is already expected");
  }
  ExpectState es;
  es.arrived.assign(size_t(numLayers), false);
  es.deadline = deadline;
  expects_[request] = std::move(es);
  auto early = early_.find(request);
  if (early != early_.end()) {
    for (auto [a, b] : early->second) {
      for (int l = std::max(a, 0); l < std::min(b, numLayers); ++l) expects_[request].arrived[size_t(l)] = true;
    }
    early_.erase(early);
  }
  return Status::ok();
}

Status KvTransceiver::cancelExpect(RequestId request) {
  if (!expects_.erase(request)) return notFound("kv transfer: request " + std::to_string(request) + " is not expected");
  return Status::ok();
}

void KvTransceiver::onNotification(const Notification& n, std::vector<KvEvent>& events) {
  proto::KvNotify note;
  if (!note.ParseFromString(n.payload) || note.layer_begin() < 0 || note.layer_end() <= note.layer_begin()) {
    PD_LOG(kWarn, "kvt") << "ignoring a malformed KV notification from '" << n.peerName << "'";
    return;
  }
  auto it = expects_.find(note.request_id());
  if (it == expects_.end()) {
    if (early_.size() >= kMaxEarly) early_.erase(early_.begin());
    early_[note.request_id()].push_back({note.layer_begin(), note.layer_end()});
    return;
  }
  auto& es = it->second;
  if (note.num_layers() != int(es.arrived.size()) || note.layer_end() > int(es.arrived.size())) {
    events.push_back({it->first, KvEventKind::kReceiveFailed,
                      invalidArgument("kv transfer: request " + std::to_string(it->first) + " from '" + n.peerName +
                                      "' has " + std::to_string(note.num_layers()) + " layers, expected " +
                                      std::to_string(es.arrived.size()))});
    expects_.erase(it);
    return;
  }
  for (int l = note.layer_begin(); l < note.layer_end(); ++l) es.arrived[size_t(l)] = true;
  if (std::all_of(es.arrived.begin(), es.arrived.end(), [](bool b) { return b; })) {
    events.push_back({it->first, KvEventKind::kReceived, Status::ok()});
    expects_.erase(it);
  }
}

std::vector<KvEvent> KvTransceiver::poll() {
  std::vector<KvEvent> events;
  agent_.progress();
  for (auto it = sends_.begin(); it != sends_.end();) {
    auto& st = it->second;
    Status failure;
    for (size_t i = 0; i < st.inFlight.size();) {
      Status s = agent_.poll(st.inFlight[i].first);
      if (s.inProgress()) {
        ++i;
        continue;
      }
      auto [a, b] = st.inFlight[i].second;
      st.inFlight.erase(st.inFlight.begin() + long(i));
      if (s.isOk()) {
        for (int l = a; l < b; ++l) st.done[size_t(l)] = true;
      } else if (failure.isOk()) {
        failure = s.withContext("request " + std::to_string(it->first) + " layers [" + std::to_string(a) + ", " +
                                std::to_string(b) + ")");
      }
    }
    if (!failure.isOk()) {
      for (auto& [id, layers] : st.inFlight) {
        if (agent_.cancel(id).isOk()) (void)agent_.poll(id);
      }
      events.push_back({it->first, KvEventKind::kSendFailed, failure});
      it = sends_.erase(it);
    } else if (st.inFlight.empty() && std::all_of(st.done.begin(), st.done.end(), [](bool b) { return b; })) {
      events.push_back({it->first, KvEventKind::kSent, Status::ok()});
      it = sends_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& n : agent_.takeNotifications()) onNotification(n, events);
  for (auto it = expects_.begin(); it != expects_.end();) {
    if (it->second.deadline.expired(clock_)) {
      const auto& have = it->second.arrived;
      size_t got = size_t(std::count(have.begin(), have.end(), true));
      events.push_back({it->first, KvEventKind::kReceiveFailed,
                        deadlineExceeded("kv transfer: request " + std::to_string(it->first) + ": " +
                                         std::to_string(got) + " of " + std::to_string(have.size()) +
                                         " layers arrived before the deadline (missing " + missingLayers(have) + ")")});
      it = expects_.erase(it);
    } else {
      ++it;
    }
  }
  return events;
}

}  // namespace pd::kvt
