#include "tools/process_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

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

// The child between fork() and exec(): async-signal-safe calls only. Its own process group
// (a terminal's Ctrl-C reaches only the supervisor, which decides the order in which children
// stop), SIGTERM when the supervisor dies (PR_SET_PDEATHSIG: even a SIGKILLed or crashed
// `pdserve up` leaves no orphan holding its ports; the signal follows the thread that forked,
// hence the one-owner-thread contract in process_group.h), output to `out`. An exec failure's
// errno goes back through `err`.
[[noreturn]] void execChild(char* const* args, int out, int err, pid_t supervisor) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  // The supervisor may have died before prctl took effect: then no signal will come.
  if (::getppid() != supervisor) ::_exit(127);
  const int in = ::open("/dev/null", O_RDONLY);
  if (in >= 0) ::dup2(in, STDIN_FILENO);
  ::dup2(out, STDOUT_FILENO);
  ::dup2(out, STDERR_FILENO);
  // Signals blocked by the supervisor (sigtimedwait) would stay blocked across exec.
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(args[0], args, environ);
  const int e = errno;
  (void)!::write(err, &e, sizeof e);
  ::_exit(127);
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
  // Everything the child needs is made before fork(): between fork and exec a child of a
  // multi-threaded process may only make async-signal-safe calls.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t supervisor = ::getpid();
  int errPipe[2];  // exec's failure, reported back: CLOEXEC, so a successful exec closes it
  if (::pipe2(errPipe, O_CLOEXEC) != 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return internalError("spawn " + name + ": pipe: " + std::strerror(errno));
  }
  const pid_t pid = ::fork();
  if (pid == 0) execChild(args.data(), fds[1], errPipe[1], supervisor);
  const int forkErrno = errno;
  ::close(fds[1]);
  ::close(errPipe[1]);
  int childErrno = 0;
  ssize_t n = 0;
  if (pid > 0) {
    do n = ::read(errPipe[0], &childErrno, sizeof childErrno);
    while (n < 0 && errno == EINTR);
  }
  ::close(errPipe[0]);
  if (pid < 0 || n == ssize_t(sizeof childErrno)) {
    ::close(fds[0]);
    if (pid > 0) ::waitpid(pid, nullptr, 0);
    return unavailable("spawn " + name + ": " + argv[0] + ": " + std::strerror(pid < 0 ? forkErrno : childErrno));
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

namespace {

// Whether every thread of `pid` is stopped (state T in /proc/<pid>/task/<tid>/stat).
bool allThreadsStopped(pid_t pid) {
  std::error_code ec;
  std::filesystem::directory_iterator tasks("/proc/" + std::to_string(pid) + "/task", ec);
  if (ec) return true;  // gone: nothing runs
  for (const auto& task : tasks) {
    std::ifstream in(task.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(") ");
    if (paren == std::string::npos || paren + 2 >= stat.size()) continue;  // exited meanwhile
    const char state = stat[paren + 2];
    if (state != 'T' && state != 't' && state != 'Z' && state != 'X') return false;
  }
  return true;
}

}  // namespace

Status ProcessGroup::signal(const std::string& name, int sig) {
  for (auto& c : children_) {
    if (c.name == name && c.running) {
      ::kill(-c.pid, sig);
      if (sig == SIGSTOP) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        while (!allThreadsStopped(c.pid) && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
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
