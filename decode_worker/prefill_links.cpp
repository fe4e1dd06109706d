#include "decode_worker/prefill_links.h"

#include <algorithm>

#include "common/base/log.h"
#include "worker/proto_convert.h"

namespace pd::decode {

using namespace std::chrono;

namespace {
constexpr const char* kTag = "decode";
}  // namespace

PrefillLinks::PrefillLinks(worker::WorkerLoop& loop, Callbacks callbacks)
    : loop_(loop), callbacks_(std::move(callbacks)) {}

const PrefillLinks::Link* PrefillLinks::find(const std::string& address) const {
  auto it = links_.find(address);
  return it == links_.end() ? nullptr : &it->second;
}

bool PrefillLinks::ready(const std::string& address) const {
  const Link* l = find(address);
  return l && l->conn && l->kvReady;
}

bool PrefillLinks::connected(const std::string& address) const {
  const Link* l = find(address);
  return l && l->conn;
}

bool PrefillLinks::handshaking(const std::string& address) const {
  const Link* l = find(address);
  return l && l->conn && !l->kvReady;
}

kvt::AgentPeer PrefillLinks::kvPeer(const std::string& address) const {
  const Link* l = find(address);
  return l && l->kvReady ? l->kvPeer : 0;
}

net::ConnectionPtr PrefillLinks::connection(const std::string& address) const {
  const Link* l = find(address);
  return l ? l->conn : nullptr;
}

const worker::KvTargetLayout* PrefillLinks::replyLayout(const std::string& address) const {
  const Link* l = find(address);
  return l && l->conn && l->kvReady && l->replyLayout ? &*l->replyLayout : nullptr;
}

SteadyTime PrefillLinks::lastHeard(const std::string& address) const {
  const Link* l = find(address);
  return l ? l->lastHeard : SteadyTime{};
}

Status PrefillLinks::send(const std::string& address, proto::Envelope env) {
  auto it = links_.find(address);
  if (it == links_.end() || !it->second.conn) {
    return unavailable("no connection to prefill worker " + address);
  }
  return it->second.conn->send(std::move(env));
}

void PrefillLinks::dial(const std::string& address) {
  Link& link = links_[address];
  if (link.conn || link.connecting) return;
  link.connecting = true;
  const auto colon = address.rfind(':');
  net::ConnectionOptions opts = loop_.leasedControlOptions("prefill_link");
  opts.hello.set_role(proto::ROLE_DECODE);
  opts.hello.set_worker_id(loop_.flags().workerId);
  opts.hello.set_model_fingerprint(loop_.bundle().fingerprint);
  net::ConnectionCallbacks cb;
  cb.onMessage = [this, address](const net::ConnectionPtr& c, proto::Envelope&& env) {
    auto shared = std::make_shared<proto::Envelope>(std::move(env));
    loop_.post([this, address, c, shared] { onMessage(address, c, std::move(*shared)); });
  };
  cb.onClose = [this, address](const net::ConnectionPtr& c, const Status& why) {
    loop_.post([this, address, c, why] { onClosed(address, c, why); });
  };
  const milliseconds timeout(std::min<int64_t>(3000, loop_.config().kvTransfer.timeoutMs));
  net::FramedClient::connectAsync(
      loop_.io(), address.substr(0, colon), std::atoi(address.c_str() + colon + 1), opts, cb, timeout,
      [this, address](Result<net::ConnectionPtr> r) {
        loop_.post([this, address, r = std::move(r)]() mutable { onConnected(address, std::move(r)); });
      });
}

void PrefillLinks::redial(const std::string& address) {
  Link& link = links_[address];
  const auto now = steadyNow();
  if (link.conn || link.connecting || now < link.redialAt) return;
  link.redialDelay = link.redialDelay == milliseconds(0) ? kFirstRedial : std::min(2 * link.redialDelay, kMaxRedial);
  link.redialAt = now + link.redialDelay;
  PD_LOG(kDebug, kTag) << "prefill worker " << address << ": reconnecting";
  dial(address);
}

void PrefillLinks::onConnected(const std::string& address, Result<net::ConnectionPtr> r) {
  Link& link = links_[address];
  link.connecting = false;
  if (!r.ok()) {
    PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << r.status().toString();
    return callbacks_.onDown(address, r.status());
  }
  const std::string& fingerprint = loop_.bundle().fingerprint;
  const std::string& theirs = r.value()->peerHello().model_fingerprint();
  if (theirs != fingerprint) {
    Status why =
        failedPrecondition("prefill worker " + address + " serves '" + theirs + "', not '" + fingerprint + "'");
    r.value()->close(why);
    return callbacks_.onDown(address, why);
  }
  link.conn = r.value();
  link.kvReady = false;
  link.lastHeard = steadyNow();
  // The offer: fresh kvtransfer endpoints for this prefill worker alone (verbs makes one QP
  // per offer; RC cannot share it between peers), and where our KV blocks live.
  auto offer = loop_.agent().localMetadata();
  if (!offer.ok()) {
    return drop(address, offer.status().withContext("KV offer to prefill worker " + address));
  }
  proto::Envelope env;
  env.set_request_id(0);
  env.mutable_kv_connect()->set_metadata(std::move(offer).value());
  worker::KvTargetLayout layout;
  layout.numBlocks = loop_.engine().kv().numTotalBlocks();
  layout.regions = loop_.bundle().kvRegions;
  worker::toProto(layout, env.mutable_kv_connect());
  const int64_t timeoutMs = loop_.config().kvTransfer.timeoutMs;
  link.kvTimer = loop_.at(steadyNow() + milliseconds(timeoutMs), [this, address, timeoutMs] {
    auto it = links_.find(address);
    if (it == links_.end()) return;
    it->second.kvTimer = 0;
    if (it->second.conn && !it->second.kvReady) {
      drop(address, deadlineExceeded("prefill worker " + address + " did not answer KvConnect within " +
                                     std::to_string(timeoutMs) + " ms"));
    }
  });
  if (Status s = link.conn->send(std::move(env)); !s.isOk()) drop(address, s);
}

void PrefillLinks::onMessage(const std::string& address, const net::ConnectionPtr& c, proto::Envelope&& env) {
  auto it = links_.find(address);
  const bool current = it != links_.end() && it->second.conn == c;
  // Progress is not an answer: a worker that dies mid-prefill after reporting progress is
  // still recomputed as a silent one (RemotePrefills::recomputeStall reads lastHeard).
  if (current && env.body_case() != proto::Envelope::kPrefillProgress) it->second.lastHeard = steadyNow();
  if (env.request_id() == 0) {
    if (current) onKvConnectReply(address, std::move(env));
    return;
  }
  // Request messages of a link already dropped still count (a Cancel acknowledgement); the
  // owner ignores answers for requests it no longer has on that address.
  callbacks_.onMessage(address, std::move(env));
}

// The prefill worker's reply (or its refusal). Loading it connects our side of the lanes.
void PrefillLinks::onKvConnectReply(const std::string& address, proto::Envelope&& env) {
  Link& link = links_.at(address);
  if (env.body_case() == proto::Envelope::kError) {
    return drop(address, net::fromProtoError(env.error()));
  }
  if (env.body_case() != proto::Envelope::kKvConnect || link.kvReady) {
    PD_LOG(kWarn, kTag) << "ignoring '" << net::bodyName(env) << "' from prefill worker " << address;
    return;
  }
  auto loaded = loop_.agent().loadPeer(env.kv_connect().metadata());
  if (!loaded.ok()) {
    return drop(address, loaded.status().withContext("loading prefill worker " + address + "'s KV reply"));
  }
  link.kvReady = true;
  link.kvPeer = *loaded;
  link.replyLayout.reset();
  if (env.kv_connect().num_blocks() > 0) {
    // Its pool, for the pulls it may ask over this link; a malformed one only turns them off.
    if (auto layout = worker::fromProto(env.kv_connect()); layout.ok()) {
      link.replyLayout = std::move(layout).value();
    } else {
      PD_LOG(kWarn, kTag) << "prefill worker " << address << ": KvConnect reply's pool: " << layout.status().toString();
    }
  }
  link.redialDelay = milliseconds(0);
  loop_.cancelTimer(link.kvTimer);
  PD_LOG(kInfo, kTag) << "prefill worker " << address << ": KV over " << loop_.agent().peerTransport(*loaded).value();
  callbacks_.onReady(address);
}

void PrefillLinks::drop(const std::string& address, const Status& why) {
  auto it = links_.find(address);
  if (it == links_.end()) return;
  PD_LOG(kWarn, kTag) << "prefill worker " << address << ": " << why.toString();
  it->second.kvReady = false;
  loop_.cancelTimer(it->second.kvTimer);
  if (auto c = std::move(it->second.conn)) {
    it->second.conn.reset();
    c->close(why);  // onClosed ignores it: it is no longer the link's connection
  }
  callbacks_.onDown(address, why);
}

void PrefillLinks::onClosed(const std::string& address, const net::ConnectionPtr& c, const Status& why) {
  auto it = links_.find(address);
  if (it == links_.end() || it->second.conn != c) return;
  it->second.conn.reset();
  it->second.kvReady = false;
  loop_.cancelTimer(it->second.kvTimer);
  callbacks_.onDown(address, unavailable("prefill worker " + address + " disconnected: " + why.message()));
}

void PrefillLinks::shutdown(const Status& why) {
  for (auto& [address, link] : links_) {
    loop_.cancelTimer(link.kvTimer);
    if (link.conn) link.conn->close(why);
  }
  links_.clear();
}

}  // namespace pd::decode
