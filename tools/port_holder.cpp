#include "tools/port_holder.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace pd::tools {
namespace {

// Inodes of the sockets listening on `port` in one /proc/net/tcp{,6} table. A line:
// "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode",
// local_address "HEXADDR:HEXPORT", st 0A = LISTEN.
void listeningInodes(const std::string& table, int port, std::set<std::string>* inodes) {
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    if (!(f >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode)) continue;
    const auto colon = local.rfind(':');
    if (state != "0A" || colon == std::string::npos) continue;
    if (std::strtol(local.c_str() + colon + 1, nullptr, 16) == port) inodes->insert(inode);
  }
}

// basename of argv[0] from /proc/<pid>/cmdline; "" when the process is gone.
std::string programOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string argv0;
  std::getline(in, argv0, '\0');
  return argv0.substr(argv0.rfind('/') + 1);
}

pid_t parentOf(pid_t pid) {
  // /proc/<pid>/stat: "pid (comm) state ppid ...", where comm may hold spaces and parentheses.
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 1));
  std::string state;
  pid_t ppid = 0;
  rest >> state >> ppid;
  return ppid;
}

bool bindable(int family, int port) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // no such address family here: nothing to hold it
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (family == AF_INET6) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(uint16_t(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  const int e = errno;
  ::close(fd);
  return rc == 0 || e != EADDRINUSE;
}

}  // namespace

std::optional<PortHolder> findPortHolder(int port) {
  std::set<std::string> inodes;
  listeningInodes("/proc/net/tcp", port, &inodes);
  listeningInodes("/proc/net/tcp6", port, &inodes);
  if (inodes.empty()) return std::nullopt;
  DIR* proc = ::opendir("/proc");
  if (!proc) return std::nullopt;
  std::optional<PortHolder> found;
  while (dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    const std::string fdDir = "/proc/" + std::string(e->d_name) + "/fd";
    DIR* fds = ::opendir(fdDir.c_str());
    if (!fds) continue;  // gone, or another user's
    while (dirent* f = ::readdir(fds)) {
      char link[64];
      const ssize_t n = ::readlinkat(::dirfd(fds), f->d_name, link, sizeof link - 1);
      if (n <= 0) continue;
      const std::string target(link, size_t(n));
      if (target.rfind("socket:[", 0) != 0 || !inodes.count(target.substr(8, target.size() - 9))) continue;
      PortHolder h;
      h.pid = pid_t(pid);
      h.program = programOf(h.pid);
      h.parent = parentOf(h.pid);
      if (h.parent > 1) h.parentProgram = programOf(h.parent);
      found = h;
      break;
    }
    ::closedir(fds);
    if (found) break;
  }
  ::closedir(proc);
  return found;
}

Status checkPortFree(int port, const std::string& what) {
  if (port <= 0 || (bindable(AF_INET, port) && bindable(AF_INET6, port))) return Status::ok();
  const std::string head = "port " + std::to_string(port) + " (" + what + ")";
  const auto h = findPortHolder(port);
  if (!h) return unavailable(head + " is in use by a process this user cannot see; free it or choose another port");
  const std::string pid = std::to_string(h->pid);
  if (h->program.rfind("pdserve-", 0) == 0) {
    // One of ours: either a cluster still running, or a process of one whose supervisor died.
    if (h->parentProgram == "pdserve") {
      return unavailable(head + " is held by pid " + pid + " (" + h->program + ") of the pdserve up running as pid " +
                         std::to_string(h->parent) + ": stop that one (Ctrl-C, or kill " + std::to_string(h->parent) +
                         ") or choose another port");
    }
    return unavailable(head + " is held by pid " + pid + " (" + h->program +
                       ", not under a running pdserve up): stop it with kill " + pid);
  }
  return unavailable(head + " is held by pid " + pid + " (" + (h->program.empty() ? "?" : h->program) +
                     "): stop it or choose another port");
}

}  // namespace pd::tools
