// A group of child processes that live and die together: what `pdserve up` supervises.
//
// Each child's stdout and stderr are forwarded line by line to our stderr with a
// "[name] " prefix, so a cluster's logs read as one stream. stopAll() sends SIGTERM, waits up
// to its deadline, then SIGKILLs what is left; the destructor calls it, so no child outlives
// the group.
// The children also die with the supervisor: each gets SIGTERM (PR_SET_PDEATHSIG) when the
// process that spawned it ends in any way, SIGKILL and crashes included, so no router or worker
// is left holding the cluster's ports (docs/serving.md, "Processes and threads").
// Threads: not thread-safe; one owner thread calls every method, and it must live as long as
// the children (the kernel sends the death signal when the thread that forked exits). Output
// forwarding runs on an internal thread per child.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/base/status.h"

namespace pd::tools {

struct ChildExit {
  std::string name;
  pid_t pid = 0;
  std::string description;  // "exited with status 1", "killed by signal 9 (Killed)"
};

class ProcessGroup {
 public:
  ProcessGroup() = default;
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Starts argv[0] (a path) with the given arguments, in a process group of its own, stdin
  // /dev/null, no signal blocked. Errors name the program (and why exec failed).
  Result<pid_t> spawn(const std::string& name, const std::vector<std::string>& argv);

  // Waits up to `timeout` for any child to exit; returns it, or nullopt on timeout.
  std::optional<ChildExit> waitAny(std::chrono::milliseconds timeout);

  // SIGTERM to every running child, up to `grace` for them to exit, then SIGKILL.
  void stopAll(std::chrono::milliseconds grace = std::chrono::seconds(5));

  size_t running() const;
  // Sends `sig` to the named running child's process group. SIGSTOP returns once every thread
  // of the child is stopped (at most 2 s): kill() only queues the stop, and until one of its
  // threads is scheduled to take it, the others run on -- on a loaded machine for long enough
  // to answer a message the caller sends next.
  Status signal(const std::string& name, int sig);
  // The named running child's pid (kNotFound when there is none), e.g. to read its /proc.
  Result<pid_t> pidOf(const std::string& name) const;

 private:
  struct Child {
    std::string name;
    pid_t pid = 0;
    bool running = true;
    std::thread forwarder;
  };
  std::optional<ChildExit> reapOne(bool block);

  std::vector<Child> children_;
};

}  // namespace pd::tools
