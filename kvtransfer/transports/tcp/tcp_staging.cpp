// TcpTransport, staging of kCuda memory (I/O thread; docs/kvtransfer.md "GPU memory"): the
// sender copies device chunks into pinned bounce buffers ahead of the socket, the receiver
// reads into bounce buffers and copies to the device before it acks.
#include "kvtransfer/transports/tcp/tcp_impl.h"

namespace pd::kvt {

void TcpTransport::Impl::pumpStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
  Job& j = s->jobs.front();
  auto t = j.t;
  j.started = true;
  if (!s->stage) {
    s->stage = std::make_unique<StagingRing>(copier_, options_.stageChunkBytes, size_t(options_.stageBuffers),
                                             options_.peerTimeout);
    s->stageFrames.assign(s->stage->slots(), {});
    s->stageHead = 0;
    s->stageCount = 0;
  }
  StagingRing& ring = *s->stage;
  const size_t nSlots = ring.slots();
  while (s->stageCount < nSlots && j.next < j.segs.size()) {
    const size_t slot = (s->stageHead + s->stageCount) % nSlots;
    auto buf = ring.buffer(slot);
    if (!buf.ok()) {
      failStaged(p, s, t, buf.status().withContext("tcp transport: staging buffer"));
      return;
    }
    auto& frames = s->stageFrames[slot];
    frames.clear();
    s->stagePieces.clear();
    size_t off = 0;
    int device = j.segs[j.next].device;
    while (j.next < j.segs.size() && off < ring.slotBytes() && frames.size() < kMaxStagePieces) {
      const Seg& seg = j.segs[j.next];
      if (seg.device != device && !frames.empty()) break;  // one copy batch per device
      const size_t n = std::min(seg.len - j.nextOff, ring.slotBytes() - off);
      char* dst = *buf + off;
      s->stagePieces.push_back({dst, reinterpret_cast<const void*>(seg.local + j.nextOff), n});
      frames.push_back({reinterpret_cast<uintptr_t>(dst), seg.token, seg.remote + j.nextOff, n, -1});
      off += n;
      j.nextOff += n;
      if (j.nextOff == seg.len) {
        j.next++;
        j.nextOff = 0;
      }
    }
    Status st = ring.launch(slot, CopyDirection::kToHost, std::max(device, 0), s->stagePieces, t->id);
    if (!st.isOk()) {
      failStaged(p, s, t, st.withContext("tcp transport: copying GPU memory out"));
      return;
    }
    s->stageCount++;
  }
  if (s->stageCount == 0) {  // defensive: a staged job always has data
    failStaged(p, s, t, internalError("tcp transport: staged job without data"));
    return;
  }
  const size_t head = s->stageHead;
  std::vector<uint64_t> failed;
  Status q = ring.query(head, &failed);
  if (q.inProgress()) {
    if (steadyNow() - ring.launchedAt(head) > options_.peerTimeout) {
      failStaged(p, s, t,
                 deadlineExceeded("tcp transport: a device-to-host copy of transfer " + std::to_string(t->id) +
                                  " did not finish within " + std::to_string(options_.peerTimeout.count()) + " ms"));
      return;
    }
    armStageTimer(p, s);
    return;
  }
  if (!q.isOk()) {
    failStaged(p, s, t, q.withContext("tcp transport: copying GPU memory out for transfer " + std::to_string(t->id)));
    return;
  }
  s->bufs.clear();
  size_t nh = 0;
  for (const Seg& f : s->stageFrames[head]) appendData(*s, t->id, f, nh);
  if (j.next == j.segs.size() && s->stageCount == 1) appendEnd(*s, t, nh);
  startStagedWrite(p, s, t);
}

void TcpTransport::Impl::startStagedWrite(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                                          std::shared_ptr<IoTransfer> t) {
  s->writing = true;
  s->writingFor = t;
  t->writesInFlight++;
  const uint64_t gen = s->stageGen;
  asio::async_write(s->sock, s->bufs, TransferAllInOne{asio::buffer_size(s->bufs)},
                    [this, p, s, t, gen](boost::system::error_code ec, size_t) {
                      if (gen == s->stageGen && s->stageCount > 0) {  // the chunk's slot is free again
                        s->stageHead = (s->stageHead + 1) % s->stage->slots();
                        s->stageCount--;
                      }
                      onWritten(p, s, t, ec);
                    });
}

void TcpTransport::Impl::armStageTimer(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s) {
  if (s->stageTimerArmed) return;
  s->stageTimerArmed = true;
  s->stageTimer.expires_after(kStagePoll);
  s->stageTimer.async_wait([this, p, s](boost::system::error_code ec) {
    s->stageTimerArmed = false;
    if (ec || stopping_) return;
    pump(p, s);
  });
}

void TcpTransport::Impl::failStaged(const std::shared_ptr<OutPeer>& p, const std::shared_ptr<OutStream>& s,
                                    const std::shared_ptr<IoTransfer>& t, Status st) {
  PD_LOG(kWarn, "kvt.tcp") << "peer '" << p->name << "': transfer " << t->id << " failed: " << st.message();
  complete(*p, t, std::move(st));
  pump(p, s);
}

void TcpTransport::Impl::resetStage(OutStream& s) {
  if (!s.stage) return;
  s.stage.reset();
  s.stageHead = 0;
  s.stageCount = 0;
  s.stageGen++;
}

void TcpTransport::Impl::quiesceStagedCopies(const std::shared_ptr<IoTransfer>& t) {
  for (auto& p : ioPeers_) {
    for (auto& s : p->streams) {
      if (!s->stage || s->jobs.empty() || s->jobs.front().t != t) continue;
      std::vector<uint64_t> ignored;
      Status st = s->stage->waitAll(steadyNow() + options_.peerTimeout, &ignored);
      if (st.code() == StatusCode::kDeadlineExceeded) {
        PD_LOG(kError, "kvt.tcp") << "cancel of transfer " << t->id << ": " << st.message();
      }
    }
  }
}

void TcpTransport::Impl::stagedRead(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr,
                                    uint64_t left) {
  if (left == 0) {
    readHeader(c);
    return;
  }
  auto dst = reserveStage(c, 1);
  if (!dst) return;
  const size_t n = std::min<uint64_t>(left, c->stage->slotBytes() - c->stageOff);
  asio::async_read(c->sock, asio::buffer(*dst, n),
                   [this, c, tid, device, addr, left, n, dst = *dst](boost::system::error_code ec, size_t) {
                     if (ec) {
                       dropIn(c, ec.message(), false);
                       return;
                     }
                     launchStaged(c, tid, device, addr, dst, n);
                     if (c->refused.count(tid)) {
                       c->discardLeft = left - n;
                       discardPayload(c);
                       return;
                     }
                     stagedRead(c, tid, device, addr + n, left - n);
                   });
}

std::optional<char*> TcpTransport::Impl::reserveStage(const std::shared_ptr<InConn>& c, size_t need) {
  if (!c->stage) {
    c->stage = std::make_unique<StagingRing>(copier_, options_.stageChunkBytes, size_t(options_.stageBuffers),
                                             options_.peerTimeout);
    c->stageSlot = 0;
    c->stageOff = 0;
  }
  StagingRing& ring = *c->stage;
  if (ring.slotBytes() - c->stageOff < need) {
    c->stageSlot = (c->stageSlot + 1) % ring.slots();
    c->stageOff = 0;
    std::vector<uint64_t> failed;
    Status st = ring.wait(c->stageSlot, steadyNow() + options_.peerTimeout, &failed);
    if (!noteStageErrors(c, st, failed)) return std::nullopt;
  }
  auto buf = ring.buffer(c->stageSlot);
  if (!buf.ok()) {
    dropIn(c, "staging buffer: " + buf.status().message(), true);
    return std::nullopt;
  }
  return *buf + c->stageOff;
}

void TcpTransport::Impl::launchStaged(const std::shared_ptr<InConn>& c, uint64_t tid, int device, uint64_t addr,
                                      char* src, size_t n) {
  CopyPiece piece{reinterpret_cast<void*>(addr), src, n};
  Status st = c->stage->launch(c->stageSlot, CopyDirection::kToDevice, device, {&piece, 1}, tid);
  c->stageOff += n;
  if (!st.isOk()) {
    PD_LOG(kWarn, "kvt.tcp") << "transfer " << tid << " from '" << c->peerName << "': " << st.message();
    c->refused.emplace(tid, "copying into GPU memory failed: " + st.message());
  }
}

bool TcpTransport::Impl::drainStage(const std::shared_ptr<InConn>& c) {
  std::vector<uint64_t> failed;
  Status st = c->stage->waitAll(steadyNow() + options_.peerTimeout, &failed);
  return noteStageErrors(c, st, failed);
}

bool TcpTransport::Impl::noteStageErrors(const std::shared_ptr<InConn>& c, const Status& st,
                                         const std::vector<uint64_t>& failed) {
  if (st.code() == StatusCode::kDeadlineExceeded) {
    dropIn(c, "a host-to-device copy did not finish within " + std::to_string(options_.peerTimeout.count()) + " ms",
           true);
    return false;
  }
  for (uint64_t tid : failed) {
    PD_LOG(kWarn, "kvt.tcp") << "transfer " << tid << " from '" << c->peerName << "': " << st.message();
    c->refused.emplace(tid, "copying into GPU memory failed: " + st.message());
  }
  return true;
}

}  // namespace pd::kvt
