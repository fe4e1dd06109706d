// TcpTransport, receiver side (I/O thread): accepts connections, checks every frame against
// what this transport exposed, reads payloads into place and writes acks.
#include "kvtransfer/transports/tcp/tcp_impl.h"

namespace pd::kvt {

void TcpTransport::Impl::doAccept() {
  auto c = std::make_shared<InConn>(io_);
  acceptor_.async_accept(c->sock, [this, c](boost::system::error_code ec) {
    if (stopping_) {
      closeIn(*c);
      return;
    }
    if (ec) {
      if (ec != asio::error::operation_aborted) {
        PD_LOG(kWarn, "kvt.tcp") << "accept failed: " << ec.message();
        doAccept();
      }
      return;
    }
    boost::system::error_code ig;
    c->sock.set_option(tcp::no_delay(true), ig);
    auto rep = c->sock.remote_endpoint(ig);
    c->remote = rep.address().to_string() + ":" + std::to_string(rep.port());
    inConns_.push_back(c);
    // The receiver speaks first: its challenge (a fresh nonce with a cluster secret, an empty
    // one without), so a writer proves the secret on this connection, and a mixed pair sees
    // the mismatch at once. No hello (and proof) within handshakeTimeout: closed.
    WireHeader ch;
    ch.type = uint8_t(FrameType::kChallenge);
    if (authenticated()) {
      auto nonce = auth::randomNonce();
      if (!nonce.ok()) {
        dropIn(c, nonce.status().message(), true);
        doAccept();
        return;
      }
      c->nonce = std::move(nonce).value();
    }
    ch.len = c->nonce.size();
    auto frame = std::make_shared<std::string>(reinterpret_cast<const char*>(&ch), sizeof ch);
    frame->append(c->nonce);
    asio::async_write(c->sock, asio::buffer(*frame), [this, c, frame](boost::system::error_code wec, size_t) {
      if (wec) dropIn(c, "challenge not written: " + wec.message(), false);
    });
    c->helloTimer.expires_after(options_.handshakeTimeout);
    c->helloTimer.async_wait([this, c](boost::system::error_code tec) {
      if (tec || c->helloDone || c->closed) return;
      dropIn(c, "no hello within " + std::to_string(options_.handshakeTimeout.count()) + " ms", true, "timeout");
    });
    readHeader(c);
    doAccept();
  });
}

void TcpTransport::Impl::closeIn(InConn& c) {
  if (c.closed) return;
  c.closed = true;
  c.helloTimer.cancel();
  boost::system::error_code ec;
  c.sock.shutdown(tcp::socket::shutdown_both, ec);
  c.sock.close(ec);
}

void TcpTransport::Impl::dropIn(const std::shared_ptr<InConn>& c, const std::string& why, bool warn,
                                const char* handshakeReason) {
  if (c->closed) return;
  if (!c->helloDone && options_.onHandshakeFailure) {
    options_.onHandshakeFailure(handshakeReason ? handshakeReason : warn ? "protocol" : "closed");
  }
  if (warn && !c->helloDone) {
    helloWarnings_.warn(c->remote, "kvt.tcp", "closing connection from ? (" + c->remote + "): " + why);
  } else if (warn) {
    PD_LOG(kWarn, "kvt.tcp") << "closing connection from " << (c->peerName.empty() ? "?" : c->peerName) << " ("
                             << c->remote << "): " << why;
  } else {
    PD_LOG(kDebug, "kvt.tcp") << "connection from " << c->peerName << " (" << c->remote << ") ended: " << why;
  }
  closeIn(*c);
  inConns_.erase(std::remove(inConns_.begin(), inConns_.end(), c), inConns_.end());
}

void TcpTransport::Impl::onHelloText(const std::shared_ptr<InConn>& c, bool hasProof, uint64_t stream) {
  std::string name = c->text;
  std::string proof;
  if (hasProof) {
    proof = name.substr(name.size() - auth::kProofBytes);
    name.resize(name.size() - auth::kProofBytes);
  }
  std::string why;
  if (authenticated() && !hasProof) {
    why = "the writer sent no cluster credential (no cluster.secret_file on its side?)";
  } else if (!authenticated() && hasProof) {
    why = "the writer requires cluster authentication and this side has no cluster.secret_file";
  } else if (authenticated() && !auth::constantTimeEqual(
                                    kvHelloProof(*options_.clusterSecret, c->nonce, instance_, stream, name), proof)) {
    why = "the writer's proof is wrong (another cluster secret, or replayed)";
  }
  if (!why.empty()) {
    helloWarnings_.warn(c->remote, "kvt.tcp",
                        "authentication failed on kv_tcp connection from '" + name + "' (" + c->remote + "): " + why);
    if (options_.onAuthFailure) options_.onAuthFailure(why);
    dropIn(c, "authentication failed: " + why, false, "auth");
    return;
  }
  c->peerName = std::move(name);
  c->helloDone = true;
  c->helloTimer.cancel();
  readHeader(c);
}

void TcpTransport::Impl::readHeader(std::shared_ptr<InConn> c) {
  asio::async_read(c->sock, asio::buffer(&c->hdr, sizeof(WireHeader)), [this, c](boost::system::error_code ec, size_t) {
    if (ec) {
      dropIn(c, ec.message(), false);
      return;
    }
    onHeader(c);
  });
}

void TcpTransport::Impl::onHeader(const std::shared_ptr<InConn>& c) {
  c->landingGrant = 0;  // the previous frame's payload, if any, is in place
  const WireHeader& h = c->hdr;
  if (h.magic != kMagic || h.version != kWireVersion) {
    dropIn(c, "protocol error: bad magic or wire version", true);
    return;
  }
  auto type = FrameType(h.type);
  if (!c->helloDone && type != FrameType::kHello) {
    dropIn(c, "protocol error: data before hello", true);
    return;
  }
  switch (type) {
    case FrameType::kHello: {
      const bool hasProof = h.flags & kFlagHasProof;
      if (c->helloDone || h.len > kMaxNameLen + (hasProof ? auth::kProofBytes : 0) ||
          (hasProof && h.len < auth::kProofBytes)) {
        dropIn(c, "protocol error: bad hello", true);
        return;
      }
      if (h.token != instance_) {
        dropIn(c, "hello names another transport instance (stale connection info?)", true);
        return;
      }
      const uint64_t stream = h.addr;
      readText(c, h.len, [this, c, hasProof, stream] { onHelloText(c, hasProof, stream); });
      return;
    }
    case FrameType::kData: {
      uint64_t tid = h.transferId;
      if (c->refused.count(tid) == 0) {
        int device = -1;
        const char* reason = "";
        std::string why = validateWrite(h.token, h.addr, h.len, &device, &reason);
        if (why.empty()) c->landingGrant = h.token;
        if (why.empty() && device >= 0) {
          stagedRead(c, tid, device, h.addr, h.len);
          return;
        }
        if (why.empty()) {
          // A data frame is always followed by another frame (data, end or abort), so the
          // payload and the next header come in one read: half the syscalls for small
          // segments, and the payload still lands straight in place.
          std::array<asio::mutable_buffer, 2> bufs = {asio::buffer(reinterpret_cast<void*>(h.addr), h.len),
                                                      asio::buffer(&c->hdr, sizeof(WireHeader))};
          asio::async_read(c->sock, bufs, TransferAllInOne{asio::buffer_size(bufs)},
                           [this, c](boost::system::error_code ec, size_t) {
                             if (ec) {
                               dropIn(c, ec.message(), false);
                               return;
                             }
                             onHeader(c);
                           });
          return;
        }
        refuse(c, tid, why, reason);
      }
      c->discardLeft = h.len;
      discardPayload(c);
      return;
    }
    case FrameType::kEnd: {
      if (h.len != 0) {
        dropIn(c, "protocol error: an End frame with a payload", true);
        return;
      }
      const uint64_t tid = h.transferId;
      // Staged data must be in device memory before the ack.
      if (c->stage && !drainStage(c)) return;
      auto it = c->refused.find(tid);
      if (it != c->refused.end()) {
        sendAck(c, tid, true, it->second);
        c->refused.erase(it);
      } else {
        sendAck(c, tid, false, "");
      }
      readHeader(c);
      return;
    }
    case FrameType::kAbort:
      c->refused.erase(h.transferId);
      readHeader(c);
      return;
    case FrameType::kGroup: {
      if (h.len < sizeof(WireHeader) || h.len > kMaxGroupBytes) {
        dropIn(c, "protocol error: bad group frame length", true);
        return;
      }
      c->group.resize(h.len);
      // Like a data frame, a group is always followed by another frame: read both at once.
      std::array<asio::mutable_buffer, 2> bufs = {asio::buffer(c->group), asio::buffer(&c->hdr, sizeof(WireHeader))};
      asio::async_read(c->sock, bufs, TransferAllInOne{asio::buffer_size(bufs)},
                       [this, c](boost::system::error_code ec, size_t) {
                         if (ec) {
                           dropIn(c, ec.message(), false);
                           return;
                         }
                         if (!scatterGroup(c)) return;
                         onHeader(c);
                       });
      return;
    }
    default:
      dropIn(c, "protocol error: unknown frame type " + std::to_string(h.type), true);
      return;
  }
}

bool TcpTransport::Impl::scatterGroup(const std::shared_ptr<InConn>& c) {
  const char* p = c->group.data();
  const char* end = p + c->group.size();
  while (p < end) {
    WireHeader h;
    if (size_t(end - p) < sizeof h) {
      dropIn(c, "protocol error: truncated header in a group frame", true);
      return false;
    }
    std::memcpy(&h, p, sizeof h);
    p += sizeof h;
    if (h.magic != kMagic || h.type != uint8_t(FrameType::kData) || h.len > size_t(end - p)) {
      dropIn(c, "protocol error: bad frame inside a group frame", true);
      return false;
    }
    if (c->refused.count(h.transferId) == 0) {
      int device = -1;
      const char* reason = "";
      std::string why = validateWrite(h.token, h.addr, h.len, &device, &reason);
      if (why.empty() && device >= 0) {
        auto dst = reserveStage(c, h.len);
        if (!dst) return false;
        std::memcpy(*dst, p, h.len);
        launchStaged(c, h.transferId, device, h.addr, *dst, h.len);
      } else if (why.empty()) {
        std::memcpy(reinterpret_cast<void*>(h.addr), p, h.len);
      } else {
        refuse(c, h.transferId, why, reason);
      }
    }
    p += h.len;
  }
  return true;
}

std::string TcpTransport::Impl::validateWrite(uint64_t token, uint64_t addr, uint64_t len, int* device,
                                              const char** reason) {
  std::shared_lock lock(exposuresMu_);
  if (auto g = grants_.find(token); g != grants_.end()) {
    const MemDesc* d = g->second.find(addr, len);
    if (!d) {
      *reason = "outside_grant";
      return "write of " + std::to_string(len) + " bytes at " + hex(addr) +
             " is outside the memory its write grant covers";
    }
    *device = d->kind == MemKind::kCuda ? d->device : -1;
    return {};
  }
  auto it = exposures_.find(token);
  if (it == exposures_.end()) {
    *reason = "unknown_grant";
    return "write of " + std::to_string(len) + " bytes at " + hex(addr) +
           " names an unknown or withdrawn exposure token or a revoked write grant (a stale or forged write)";
  }
  if (options_.requireWriteGrant) {
    *reason = "grant_required";
    return "write of " + std::to_string(len) + " bytes at " + hex(addr) +
           " carries a region key but no write grant, and this receiver requires one";
  }
  const MemDesc& d = it->second;
  if (!KeyRange{d.addr, d.len}.covers(addr, len)) {
    *reason = "outside_region";
    return "write of " + std::to_string(len) + " bytes at " + hex(addr) + " is outside the exposed region " +
           toString(d);
  }
  *device = d.kind == MemKind::kCuda ? d.device : -1;
  return {};
}

void TcpTransport::Impl::refuse(const std::shared_ptr<InConn>& c, uint64_t tid, const std::string& why,
                                const char* reason) {
  PD_LOG(kWarn, "kvt.tcp") << "refusing transfer " << tid << " from '" << c->peerName << "' (" << c->remote
                           << "): " << why;
  c->refused[tid] = why;
  if (options_.onWriteRejected) options_.onWriteRejected(reason);
}

template <typename Fn>
void TcpTransport::Impl::readText(const std::shared_ptr<InConn>& c, uint64_t len, Fn&& then) {
  c->text.resize(len);
  if (len == 0) {
    then();
    return;
  }
  asio::async_read(c->sock, asio::buffer(c->text),
                   [this, c, then = std::forward<Fn>(then)](boost::system::error_code ec, size_t) {
                     if (ec) {
                       dropIn(c, ec.message(), false);
                       return;
                     }
                     then();
                   });
}

void TcpTransport::Impl::discardPayload(std::shared_ptr<InConn> c) {
  if (c->discardLeft == 0) {
    readHeader(c);
    return;
  }
  if (c->discard.empty()) c->discard.resize(1 << 20);
  size_t n = std::min<uint64_t>(c->discardLeft, c->discard.size());
  asio::async_read(c->sock, asio::buffer(c->discard.data(), n), [this, c, n](boost::system::error_code ec, size_t) {
    if (ec) {
      dropIn(c, ec.message(), false);
      return;
    }
    c->discardLeft -= n;
    discardPayload(c);
  });
}

void TcpTransport::Impl::sendAck(const std::shared_ptr<InConn>& c, uint64_t tid, bool refused, const std::string& msg) {
  WireHeader h;
  h.type = uint8_t(FrameType::kAck);
  h.flags = refused ? kFlagRefused : 0;
  h.transferId = tid;
  std::string m = msg.substr(0, kMaxAckMessage);
  h.len = m.size();
  std::string frame(sizeof h, '\0');
  std::memcpy(frame.data(), &h, sizeof h);
  frame += m;
  c->outq.push_back(std::move(frame));
  flushAcks(c);
}

void TcpTransport::Impl::flushAcks(const std::shared_ptr<InConn>& c) {
  if (c->writing || c->outq.empty() || c->closed) return;
  c->writing = true;
  asio::async_write(c->sock, asio::buffer(c->outq.front()), [this, c](boost::system::error_code ec, size_t) {
    c->writing = false;
    if (ec) {
      dropIn(c, ec.message(), false);
      return;
    }
    c->outq.pop_front();
    flushAcks(c);
  });
}

}  // namespace pd::kvt
