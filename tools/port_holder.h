// Who holds a TCP port on this host, for a start-up error that names the process instead of a
// bare "address in use": `pdserve up` checks its fixed ports before it starts anything, and a
// port left held by the router or a worker of an earlier cluster is named with its pid and
// the command that stops it (docs/serving.md, "Processes and threads").
//
// The holder is found the way ss -p does: the listening socket's inode in /proc/net/tcp and
// /proc/net/tcp6, then the /proc/<pid>/fd link to "socket:[inode]". Processes of another
// user (without root) or another network namespace are not visible; then the error says
// only that the port is in use.
//
// Threads: no shared state; any thread.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "common/base/status.h"

namespace pd::tools {

struct PortHolder {
  pid_t pid = 0;
  std::string program;  // basename of argv[0], e.g. "pdserve-router"
  pid_t parent = 0;
  std::string parentProgram;  // "" when the parent is gone or unreadable
};

// The process with a socket listening on `port` (any address, IPv4 or IPv6), if visible.
std::optional<PortHolder> findPortHolder(int port);

// OK when a listener could bind `port` on every address now (a probe socket with SO_REUSEADDR,
// as our listeners set, closed at once). Otherwise kUnavailable: "port 8000 (what) is held by
// pid 1234 (pdserve-router, not under a running pdserve up): stop it with kill 1234", or
// without the holder when it cannot be seen. `what` names the setting, e.g. "router.http.port".
Status checkPortFree(int port, const std::string& what);

}  // namespace pd::tools
