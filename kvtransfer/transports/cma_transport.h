// CmaTransport ("cma"): kvt::Transport between two processes on the SAME node, over Linux
// cross-memory attach (process_vm_writev straight from this process's registered memory into
// the peer's exposed region: one copy, done by the kernel, no socket, no bounce buffer).
// Why this and not UCX's shared-memory lanes: docs/kvtransfer.md ("same node").
//
// Connection (kvt.proto CmaConnInfo): boot id, pid-namespace inode, pid, a random instance id,
// the address of a word holding that id, and the name of an abstract Unix socket (the control
// channel). loadPeer() accepts a peer only after it proved it is reachable by CMA: same boot id
// (same kernel), same pid namespace (the pid means the same process here), and
// process_vm_readv of the probe word in that pid returns the instance id (this very process,
// and the kernel lets us access its memory). Anything else (another node, another container,
// another user, ptrace restrictions, another network namespace for the socket) is kUnavailable
// with the reason, so the agent moves on to the next transport.
//
// A transfer: post() checks the segments (SegmentMatcher: local inside a registration, remote
// inside a key this peer packed) and queues; `copyThreads` worker threads write it in batches
// of at most `sliceBytes` and 1,024 segments per process_vm_writev. When every batch landed, the
// I/O thread sends END{transfer, exposure tokens used} on the control channel; the receiver's
// I/O thread checks the tokens are still exposed and answers ACK. poll() reports ok on the
// ACK: the bytes were in place before END was sent.
//
// Trust boundary: a process that may process_vm_writev into another may also ptrace it, so the
// receiver cannot refuse a write; the kernel's ptrace access check (same user, not
// non-dumpable, Yama) is the boundary. Inside it, the sender only writes inside regions the
// receiver packed a key for (checked at post), and the receiver reports a transfer into a
// withdrawn exposure (deregistered since) as kInvalidArgument at END; bytes already landed.
// Callers must not deregister a region that peers may still write (KV fencing, #12).
//
// Peer failure, the stated bound:
//   - death (SIGKILL, crash): the peer's pidfd becomes readable and its control socket hangs
//     up, seen by the I/O thread at once (a poll wakeup); a copy into it fails with ESRCH.
//     Every pending transfer fails with kUnavailable within milliseconds; later posts fail.
//   - a stall (SIGSTOP, a hung receiver): CMA writes into a stopped process still succeed, but
//     its I/O thread does not answer; a transfer whose END is not acknowledged within
//     `peerTimeout` fails with kUnavailable naming the process state. Bound: peerTimeout after
//     the data was written (+ one poll tick, 50 ms). The peer stays loaded: once it runs
//     again, new transfers go through.
//
// cancel(): before END went out it stops the transfer and returns once no copy thread is in
// one of its batches (bounded by one batch: ~1 ms for 4 MiB); bytes of batches already written
// stay. After END went out: kFailedPrecondition, poll() reports the real outcome.
//
// Threads: as transport.h; the owner thread only queues, checks and reads outcomes under one
// mutex. Inside: `copyThreads` copy threads and one I/O thread (control sockets, pidfds,
// acknowledgement deadlines). GPU memory: not supported (registerMemory refuses kCuda).
#pragma once

#include <memory>

#include "kvtransfer/transport.h"
#include "kvtransfer/transport_factory.h"

namespace pd::kvt {

struct CmaOptions {
  std::string localName = "pdserve";
  std::chrono::milliseconds peerTimeout{5000};  // END -> ACK deadline (a stalled peer)
  int copyThreads = 2;                          // process_vm_writev in parallel
  size_t sliceBytes = 4 << 20;                  // per process_vm_writev call
};

// kUnavailable when this kernel has no process_vm_writev (ENOSYS) or the node facts cannot be
// read (/proc); the message says which.
Result<std::unique_ptr<Transport>> makeCmaTransport(const CmaOptions& options);

// Reads the CmaOptions knobs of TransportOptions::extra ("cma.threads", "cma.slice_bytes").
CmaOptions cmaOptionsFrom(const TransportOptions& options);

}  // namespace pd::kvt
