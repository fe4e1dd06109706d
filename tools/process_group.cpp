#include "tools/process_group.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

extern char** environ;

namespace pd::tools {
namespace {

// Copies lines from `fd` to stderr with a prefix until EOF.
void forwardLines(int fd, std::string prefix) {
  std::string pending;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = pending.find('\n', start)) != std::string::npos) {
      std::string line = prefix + pending.substr(start, nl - start + 1);
      std::fwrite(line.data(), 1, line.size(), stderr);
      start = nl + 1;
    }
    pending.erase(0, start);
  }
  if (!pending.empty()) {
    std::string line = prefix + pending + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
  ::close(fd);
}

std::string describeStatus(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "stopped (status " + std::to_string(status) + ")";
}

}  // namespace

ProcessGroup::~ProcessGroup() { stopAll(); }

Result<pid_t> ProcessGroup::spawn(const std::string& name, const std::vector<std::string>& argv) {
  if (argv.empty()) return invalidArgument("spawn " + name + ": empty command");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return internalError("spawn " + name + ": pipe: " + std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  // Children get their own process group so a terminal's Ctrl-C reaches only us, and we
  // decide the order in which they stop.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);

  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, argv[0].c_str(), &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return unavailable("spawn " + name + ": " + argv[0] + ": " + std::strerror(rc));
  }
  Child child;
  child.name = name;
  child.pid = pid;
  child.forwarder = std::thread(forwardLines, fds[0], "[" + name + "] ");
  children_.push_back(std::move(child));
  return pid;
}

std::optional<ChildExit> ProcessGroup::reapOne(bool block) {
  int status = 0;
  for (auto& c : children_) {
    if (!c.running) continue;
    pid_t r = ::waitpid(c.pid, &status, block ? 0 : WNOHANG);
    if (r == c.pid) {
      c.running = false;
      if (c.forwarder.joinable()) c.forwarder.join();
      return ChildExit{c.name, c.pid, describeStatus(status)};
    }
  }
  return std::nullopt;
}

std::optional<ChildExit> ProcessGroup::waitAny(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto e = reapOne(false)) return e;
    if (running() == 0 || std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void ProcessGroup::stopAll(std::chrono::milliseconds grace) {
  for (auto& c : children_)
    if (c.running) ::kill(-c.pid, SIGTERM);  // the child's whole process group
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (running() > 0 && std::chrono::steady_clock::now() < deadline) {
    if (!reapOne(false)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& c : children_)
    if (c.running) ::kill(-c.pid, SIGKILL);
  while (running() > 0) reapOne(true);
  children_.clear();
}

Status ProcessGroup::signal(const std::string& name, int sig) {
  for (auto& c : children_) {
    if (c.name == name && c.running) {
      ::kill(-c.pid, sig);
      return Status::ok();
    }
  }
  return notFound("no running process named '" + name + "'");
}

Result<pid_t> ProcessGroup::pidOf(const std::string& name) const {
  for (const auto& c : children_)
    if (c.name == name && c.running) return c.pid;
  return notFound("no running process named '" + name + "'");
}

size_t ProcessGroup::running() const {
  size_t n = 0;
  for (const auto& c : children_) n += c.running ? 1 : 0;
  return n;
}

}  // namespace pd::tools
