// TcpTransport: kvt::Transport over plain TCP (Boost.Asio), the path that works everywhere.
//
// Wire: the sender streams frames of a 40-byte header followed by the payload; a data header
// names the receiver's exposure token, the target address and the length, and the payload is
// gathered straight out of registered memory (one writev per batch, no staging copy). The
// receiver checks every data header against the regions it registered AND exposed through
// packRemoteKey() and reads the payload directly into place; a write outside them is refused
// (its bytes are discarded, the transfer fails on the sender with the receiver's reason).
// Write grants (receiverFenced, transport.h): grantWrite() makes a fresh random 64-bit token
// bound to exactly the granted ranges; a write carrying it must lie inside one of them, and
// once revokeWrite() returned the token is refused (a frame of it that was landing has its
// connection closed first). With options.requireWriteGrant a region key's token no longer
// authorises writes. Refusals are counted through options.onWriteRejected.
// A transfer completes when the receiver acknowledges that all of its data landed (on every
// stream).
//
// GPU memory (kCuda) is staged (docs/kvtransfer.md "GPU memory"): with a DeviceCopier (a CUDA
// device at run time, or options.deviceCopier) the sender copies kCuda segments chunk by chunk
// into pinned bounce buffers and writes each chunk while the next ones copy; the receiver
// reads payloads for kCuda regions into bounce buffers and copies them to the device, and
// acks only after every copy finished. Host-only transfers never touch the copier.
// Without a copier, registering kCuda memory is kFailedPrecondition with the reason.
//
// Threads: one internal I/O thread runs Asio; the Transport methods are called from the
// owner's thread only (transport.h), and progress()/poll() are where the I/O thread's
// completions become visible. loadPeer() returns at once and connects in the background:
// transfers posted meanwhile wait for the connection, and fail with the peer when it is
// refused or not up within options.connectTimeout; cancel() waits (briefly, bounded) until the I/O thread no longer
// reads the transfer's local memory. Striped streams share the one I/O thread.
//
// Peer death: a connection error, or no progress on pending work for options.peerTimeout,
// fails every pending transfer to that peer with kUnavailable; the peer stays dead (later
// posts fail at once) until it is unloaded and loaded again.
#pragma once

#include <memory>

#include "kvtransfer/transport.h"
#include "kvtransfer/transport_factory.h"

namespace pd::kvt {

class TcpTransport final : public Transport {
 public:
  // Binds options.listenHost:listenPort and starts the I/O thread; kUnavailable when the
  // address cannot be bound.
  static Result<std::unique_ptr<Transport>> create(const TransportOptions& options);
  ~TcpTransport() override;

  TransportCaps caps() const override;
  Result<MemHandle> registerMemory(const MemDesc& desc) override;
  Status deregisterMemory(MemHandle handle) override;
  Result<std::string> packRemoteKey(MemHandle handle) override;
  Result<std::string> localConnInfo() override;
  Result<PeerId> loadPeer(const PeerInfo& peer) override;
  Status unloadPeer(PeerId peer) override;
  bool peerAlive(PeerId peer) const override;
  Result<TransferId> post(const DescList& local, const DescList& remote, PeerId peer,
                          const std::string& grant) override;
  Result<std::string> grantWrite(const DescList& ranges) override;
  Status revokeWrite(const std::string& grant) override;
  Status poll(TransferId id) override;
  Status cancel(TransferId id) override;
  bool progress() override;

  // Test hook (FaultTransport's "kill the connection"): closes every socket to `peer` as if
  // the network dropped it; pending transfers fail with kUnavailable.
  void dropConnections(PeerId peer);

  class Impl;

 private:
  explicit TcpTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd::kvt
