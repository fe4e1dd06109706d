// TcpTransport, sender side (I/O thread): connects a peer's streams, turns each stream's jobs
// into gathered writes of frames straight out of registered memory, and reads the acks back.
#include "kvtransfer/transports/tcp/tcp_impl.h"

namespace pd::kvt {

// Connects and greets every stream; transfers posted meanwhile wait on the streams (pump()
// writes nothing before `connected`). A refused or failed connection, or none within
// connectTimeout, fails the peer and with it every transfer waiting for it.
void TcpTransport::Impl::connectStreams(std::shared_ptr<OutPeer> p, tcp::endpoint ep, uint64_t remoteInstance) {
  p->connectTimer = std::make_unique<asio::steady_timer>(io_);
  p->connectTimer->expires_after(options_.connectTimeout);
  p->connectTimer->async_wait([this, p](boost::system::error_code ec) {
    if (ec || p->connected) return;
    failPeer(p, "connect timed out after " + std::to_string(options_.connectTimeout.count()) + " ms");
  });
  auto remaining = std::make_shared<int>(int(p->streams.size()));
  for (const auto& s : p->streams) {
    s->sock.async_connect(ep, [this, p, s, remaining, remoteInstance](boost::system::error_code ec) {
      if (p->dead.load() || stopping_) return;
      if (ec) return failPeer(p, "cannot connect: " + ec.message());
      boost::system::error_code ig;
      s->sock.set_option(tcp::no_delay(true), ig);
      // The receiver speaks first: its challenge, answered in our hello.
      asio::async_read(
          s->sock, asio::buffer(&s->challengeHdr, sizeof(WireHeader)),
          [this, p, s, remaining, remoteInstance](boost::system::error_code rec, size_t) {
            if (p->dead.load() || stopping_) return;
            if (rec) return failPeer(p, "no challenge from the receiver: " + rec.message());
            const WireHeader& ch = s->challengeHdr;
            if (ch.magic != kMagic || ch.version != kWireVersion || FrameType(ch.type) != FrameType::kChallenge ||
                (ch.len != 0 && ch.len != auth::kNonceBytes)) {
              return failPeer(p, "the receiver's first frame is not a challenge (another wire version?)");
            }
            if (ch.len == 0 && authenticated()) {
              // Never write to a receiver that cannot check who writes: fail closed.
              return failPeer(p, "authentication failed: the receiver has no cluster secret and this side has one",
                              StatusCode::kFailedPrecondition);
            }
            if (ch.len != 0 && !authenticated()) {
              // Say hello without a proof, so the receiver logs and counts the refusal, then fail.
              s->challenge.clear();
              return sendHello(p, s, remoteInstance, remaining, /*thenFail=*/true);
            }
            s->challenge.assign(ch.len, '\0');
            if (ch.len == 0) return sendHello(p, s, remoteInstance, remaining, false);
            asio::async_read(s->sock, asio::buffer(s->challenge),
                             [this, p, s, remaining, remoteInstance](boost::system::error_code nec, size_t) {
                               if (p->dead.load() || stopping_) return;
                               if (nec) return failPeer(p, "challenge not read: " + nec.message());
                               sendHello(p, s, remoteInstance, remaining, false);
                             });
          });
    });
  }
}

void TcpTransport::Impl::sendHello(std::shared_ptr<OutPeer> p, std::shared_ptr<OutStream> s, uint64_t remoteInstance,
                                   std::shared_ptr<int> remaining, bool thenFail) {
  // Hello: who we are (for the receiver's logs), whom we meant to reach, and, with a
  // cluster secret, the proof over the receiver's challenge.
  auto hello = std::make_shared<std::string>(sizeof(WireHeader), '\0');
  WireHeader h;
  h.type = uint8_t(FrameType::kHello);
  h.token = remoteInstance;
  h.addr = uint64_t(s->index);
  std::string proof;
  if (authenticated()) {
    proof = kvHelloProof(*options_.clusterSecret, s->challenge, remoteInstance, uint64_t(s->index), options_.localName);
    h.flags = kFlagHasProof;
  }
  h.len = options_.localName.size() + proof.size();
  std::memcpy(hello->data(), &h, sizeof h);
  hello->append(options_.localName);
  hello->append(proof);
  asio::async_write(
      s->sock, asio::buffer(*hello), [this, p, s, hello, remaining, thenFail](boost::system::error_code wec, size_t) {
        if (p->dead.load() || stopping_) return;
        if (thenFail) {
          return failPeer(p, "authentication failed: the receiver requires the cluster secret and this side has none",
                          StatusCode::kFailedPrecondition);
        }
        if (wec) return failPeer(p, "hello failed: " + wec.message());
        readAck(p, s);
        if (--*remaining > 0) return;
        p->connected = true;
        p->connectTimer->cancel();
        p->lastProgress = steadyNow();
        ioPeers_.push_back(p);
        PD_LOG(kDebug, "kvt.tcp") << "peer '" << p->name << "' at " << p->endpoint << " connected with "
                                  << p->streams.size() << " stream(s)";
        for (auto& stream : p->streams) pump(p, stream);
      });
}

void TcpTransport::Impl::startTransfer(std::shared_ptr<OutPeer> p, std::shared_ptr<IoTransfer> t,
                                       std::vector<std::vector<Seg>> perStream, bool staged) {
  if (p->dead.load()) {
    std::lock_guard lock(p->reasonMu);
    complete(*p, t, unavailable("tcp transport: peer '" + p->name + "' is dead: " + p->deathReason));
    return;
  }
  if (t->cancelled.load()) return;
  if (p->active.empty()) p->lastProgress = steadyNow();
  p->active[t->id] = t;
  int used = 0;
  for (auto& segs : perStream) used += segs.empty() ? 0 : 1;
  const bool single = used <= 1;
  bool placedEmpty = false;
  for (size_t i = 0; i < perStream.size(); ++i) {
    if (perStream[i].empty()) {
      if (used != 0 || placedEmpty) continue;
      placedEmpty = true;
    }
    Job j;
    j.t = t;
    j.segs = std::move(perStream[i]);
    j.final = single;
    j.staged = staged && !j.segs.empty();
    t->pendingEnds++;
    p->streams[i]->jobs.push_back(std::move(j));
    pump(p, p->streams[i]);
  }
}

void TcpTransport::Impl::pump(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
  if (s->writing || p->dead.load() || !p->connected) return;
  while (!s->jobs.empty()) {
    Job& j = s->jobs.front();
    auto t = j.t;
    if (t->cancelled.load() || t->done) {
      bool started = j.started;
      if (j.staged) resetStage(*s);
      s->jobs.pop_front();
      if (started) {
        // Let the receiver drop any refusal state for it; the ack it would have sent never comes.
        s->hdrs[0] = WireHeader{};
        s->hdrs[0].type = uint8_t(FrameType::kAbort);
        s->hdrs[0].transferId = t->id;
        s->bufs.assign(1, asio::buffer(&s->hdrs[0], sizeof(WireHeader)));
        startWrite(p, s, nullptr);
        return;
      }
      continue;
    }
    if (j.staged) {
      pumpStaged(p, s);
      return;
    }
    j.started = true;
    // kvtransfer/bench/tcp_like.cpp planStream() cuts batches exactly like this loop (the
    // transport's like-for-like ceiling): a change here belongs there too.
    s->bufs.clear();
    size_t nh = 0;
    size_t bytes = 0;
    auto addData = [&](const Seg& seg) {
      appendData(*s, t->id, seg, nh);
      bytes += seg.len;
    };
    // Leave room for the End frame.
    while (j.next < j.segs.size() && s->bufs.size() + 4 <= kMaxBatchBuffers && bytes < kMaxBatchBytes) {
      if (j.segs[j.next].len >= kSmallPayload) {
        addData(j.segs[j.next++]);
        continue;
      }
      if (s->bufs.size() + 5 > kMaxBatchBuffers) break;  // no room for a non-empty group
      // A run of small payloads becomes one group frame: the receiver reads it with one
      // syscall instead of one per segment (the send side still gathers from registered
      // memory, no copy).
      WireHeader& g = s->hdrs[nh++];
      g = WireHeader{};
      g.type = uint8_t(FrameType::kGroup);
      g.transferId = t->id;
      s->bufs.push_back(asio::buffer(&g, sizeof g));
      const size_t before = bytes;
      size_t inner = 0;
      while (j.next < j.segs.size() && j.segs[j.next].len < kSmallPayload && s->bufs.size() + 4 <= kMaxBatchBuffers &&
             bytes < kMaxBatchBytes) {
        addData(j.segs[j.next++]);
        ++inner;
      }
      g.len = (bytes - before) + inner * sizeof(WireHeader);
    }
    bool endNow = j.next == j.segs.size() && s->bufs.size() + 2 <= kMaxBatchBuffers;
    if (endNow) appendEnd(*s, t, nh);
    startWrite(p, s, t);
    return;
  }
}

void TcpTransport::Impl::startWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                                    std::shared_ptr<IoTransfer> t) {
  s->writing = true;
  s->writingFor = t;
  if (t) t->writesInFlight++;
  asio::async_write(s->sock, s->bufs, TransferAllInOne{asio::buffer_size(s->bufs)},
                    [this, p, s, t](boost::system::error_code ec, size_t) { onWritten(p, s, t, ec); });
}

void TcpTransport::Impl::onWritten(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                                   const std::shared_ptr<IoTransfer>& t, boost::system::error_code ec) {
  s->writing = false;
  s->writingFor.reset();
  if (t) {
    t->writesInFlight--;
    if (t->writesInFlight == 0) resolveQuiesce(*t);
  }
  if (ec) {
    if (!p->dead.load() && ec != asio::error::operation_aborted) failPeer(p, "write failed: " + ec.message());
    return;
  }
  p->lastProgress = steadyNow();
  pump(p, s);
}

void TcpTransport::Impl::appendData(OutStream& s, uint64_t transferId, const Seg& seg, size_t& nh) {
  WireHeader& h = s.hdrs[nh++];
  h = WireHeader{};
  h.type = uint8_t(FrameType::kData);
  h.transferId = transferId;
  h.token = seg.token;
  h.addr = seg.remote;
  h.len = seg.len;
  s.bufs.push_back(asio::buffer(&h, sizeof h));
  s.bufs.push_back(asio::buffer(reinterpret_cast<const void*>(seg.local), seg.len));
}

void TcpTransport::Impl::appendEnd(OutStream& s, const std::shared_ptr<IoTransfer>& t, size_t& nh) {
  const Job& j = s.jobs.front();
  WireHeader& h = s.hdrs[nh++];
  h = WireHeader{};
  h.type = uint8_t(FrameType::kEnd);
  h.transferId = t->id;
  s.bufs.push_back(asio::buffer(&h, sizeof h));
  s.awaitingAck.push_back(t);
  if (j.final) t->finalSent = true;
  s.jobs.pop_front();
}

void TcpTransport::Impl::readAck(std::shared_ptr<OutPeer> p, std::shared_ptr<OutStream> s) {
  asio::async_read(
      s->sock, asio::buffer(&s->ackHdr, sizeof(WireHeader)), [this, p, s](boost::system::error_code ec, size_t) {
        if (ec) {
          // Aborted = we closed the socket ourselves (failPeer, unload, shutdown).
          if (!p->dead.load() && ec != asio::error::operation_aborted) {
            failPeer(
                p, ec == asio::error::eof ? std::string("connection closed by peer") : "read failed: " + ec.message());
          }
          return;
        }
        const WireHeader& h = s->ackHdr;
        if (h.magic != kMagic || h.type != uint8_t(FrameType::kAck) || h.len > kMaxAckMessage) {
          failPeer(p, "protocol error: unexpected frame from the receiver");
          return;
        }
        s->ackMsg.resize(h.len);
        if (h.len == 0) {
          onAck(p, s);
          return;
        }
        asio::async_read(s->sock, asio::buffer(s->ackMsg), [this, p, s](boost::system::error_code ec2, size_t) {
          if (ec2) {
            if (!p->dead.load()) failPeer(p, "read failed: " + ec2.message());
            return;
          }
          onAck(p, s);
        });
      });
}

void TcpTransport::Impl::onAck(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
  const WireHeader h = s->ackHdr;
  if (s->awaitingAck.empty() || s->awaitingAck.front()->id != h.transferId) {
    failPeer(p, "protocol error: ack for transfer " + std::to_string(h.transferId) + " out of order");
    return;
  }
  auto t = s->awaitingAck.front();
  s->awaitingAck.pop_front();
  p->lastProgress = steadyNow();
  if (!t->done) {
    if ((h.flags & kFlagRefused) && t->status.isOk()) {
      t->status = invalidArgument("tcp transport: peer '" + p->name + "' refused transfer " + std::to_string(t->id) +
                                  ": " + s->ackMsg);
    }
    if (--t->pendingEnds == 0) complete(*p, t, t->status);
  }
  readAck(p, s);
}

void TcpTransport::Impl::complete(OutPeer& p, const std::shared_ptr<IoTransfer>& t, Status st) {
  if (t->done) return;
  t->done = true;
  p.active.erase(t->id);
  {
    std::lock_guard lock(completedMu_);
    completed_.push_back({t->id, std::move(st)});
  }
  if (t->writesInFlight == 0) resolveQuiesce(*t);
}

void TcpTransport::Impl::cancelOnIo(const std::shared_ptr<IoTransfer>& t,
                                    const std::shared_ptr<std::promise<bool>>& prom) {
  // Past the point of no return: its outcome is known or all of its data is out.
  if (t->done || t->finalSent) {
    prom->set_value(false);
    return;
  }
  t->cancelled = true;
  if (copier_) quiesceStagedCopies(t);
  // Forget it for the peer's liveness accounting; acks still in flight are matched and dropped.
  for (auto& p : ioPeers_) p->active.erase(t->id);
  t->done = true;
  if (t->writesInFlight == 0) {
    prom->set_value(true);
  } else {
    t->quiesceWaiters.push_back(std::move(*prom));
  }
}

void TcpTransport::Impl::resolveQuiesce(IoTransfer& t) {
  for (auto& w : t.quiesceWaiters) w.set_value(true);
  t.quiesceWaiters.clear();
}

}  // namespace pd::kvt
