// TcpTransport, peer death (I/O thread): the watchdog that fails a peer without progress for
// options.peerTimeout, and failPeer, which every connection error ends in.
#include "kvtransfer/transports/tcp/tcp_impl.h"

namespace pd::kvt {

void TcpTransport::Impl::closePeerSockets(OutPeer& p) {
  if (p.connectTimer) p.connectTimer->cancel();
  for (auto& s : p.streams) {
    boost::system::error_code ec;
    s->sock.shutdown(tcp::socket::shutdown_both, ec);
    s->sock.close(ec);
  }
}

void TcpTransport::Impl::failPeer(const std::shared_ptr<OutPeer>& p, const std::string& reason, StatusCode code) {
  if (p->dead.exchange(true)) return;
  {
    std::lock_guard lock(p->reasonMu);
    p->deathReason = reason;
  }
  if (code == StatusCode::kUnavailable && !p->active.empty()) {
    PD_LOG(kWarn, "kvt.tcp") << "peer '" << p->name << "' at " << p->endpoint << ": " << reason << "; failing "
                             << p->active.size() << " pending transfer(s)";
  } else {
    PD_LOG(kDebug, "kvt.tcp") << "peer '" << p->name << "' at " << p->endpoint << ": " << reason;
  }
  closePeerSockets(*p);
  auto active = std::move(p->active);
  p->active.clear();
  for (auto& [id, t] : active) {
    complete(*p, t, Status(code, "tcp transport: peer '" + p->name + "' at " + p->endpoint + ": " + reason));
  }
  for (auto& s : p->streams) {
    s->jobs.clear();
    s->awaitingAck.clear();
    resetStage(*s);
  }
}

void TcpTransport::Impl::armWatchdog() {
  auto period =
      std::max(std::chrono::milliseconds(10), std::min(std::chrono::milliseconds(200), options_.peerTimeout / 4));
  watchdog_.expires_after(period);
  watchdog_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_) return;
    auto now = steadyNow();
    for (auto& p : ioPeers_) {
      if (p->dead.load() || p->active.empty()) continue;
      if (now - p->lastProgress > options_.peerTimeout) {
        failPeer(p, "no progress for " + std::to_string(options_.peerTimeout.count()) +
                        " ms (peer hung or network stalled)");
      }
    }
    armWatchdog();
  });
}

}  // namespace pd::kvt
