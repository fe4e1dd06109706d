#include "tools/local_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "common/base/cluster_auth.h"
#include "common/base/log.h"
#include "common/base/ports_file.h"
#include "engine/model_maker.h"
#include "tools/port_holder.h"

namespace pd::tools {

using namespace std::chrono;

Result<int> freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return internalError(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    return internalError(std::string("bind: ") + std::strerror(errno));
  }
  ::close(fd);
  return int(ntohs(addr.sin_port));
}

double poolGauge(const std::string& metrics, const std::string& name, const std::string& pool) {
  const std::string key = name + "{pool=\"" + pool + "\"} ";
  for (size_t at = metrics.find(key); at != std::string::npos; at = metrics.find(key, at + 1)) {
    if (at == 0 || metrics[at - 1] == '\n') return std::atof(metrics.c_str() + at + key.size());
  }
  return -1;
}

namespace {

std::string dechunk(const std::string& body) {
  std::string out;
  size_t at = 0;
  while (at < body.size()) {
    size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) break;
    size_t n = std::strtoul(body.c_str() + at, nullptr, 16);
    if (n == 0) break;
    out.append(body, eol + 2, n);
    at = eol + 2 + n + 2;
  }
  return out;
}

}  // namespace

Result<HttpReply> httpRequest(int port, const std::string& method, const std::string& path, const std::string& body,
                              milliseconds timeout, const std::vector<std::string>& extraHeaders) {
  const auto deadline = steady_clock::now() + timeout;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  if (fd < 0) return internalError(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  auto waitFor = [&](short events) {
    int left = int(duration_cast<milliseconds>(deadline - steady_clock::now()).count());
    pollfd p{fd, events, 0};
    return left > 0 && ::poll(&p, 1, left) == 1;
  };
  std::string request = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& h : extraHeaders) request += h + "\r\n";
  if (!body.empty() || method == "POST") {
    request += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  request += "\r\n" + body;
  std::string reply;
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 || errno == EINPROGRESS;
  size_t sent = 0;
  while (ok && sent < request.size() && waitFor(POLLOUT)) {
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0)
      ok = false;
    else
      sent += size_t(n);
  }
  while (ok && waitFor(POLLIN)) {
    char buf[16384];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    reply.append(buf, size_t(n));
  }
  ::close(fd);
  if (reply.compare(0, 5, "HTTP/") != 0) {
    return unavailable("127.0.0.1:" + std::to_string(port) + path + ": no HTTP answer");
  }
  HttpReply r;
  r.status = std::atoi(reply.c_str() + reply.find(' ') + 1);
  auto bodyAt = reply.find("\r\n\r\n");
  r.headers = reply.substr(0, bodyAt);
  for (auto& c : r.headers) c = char(std::tolower(static_cast<unsigned char>(c)));
  r.body = bodyAt == std::string::npos ? std::string() : reply.substr(bodyAt + 4);
  if (r.headers.find("transfer-encoding: chunked") != std::string::npos) r.body = dechunk(r.body);
  return r;
}

namespace {

// A child's ports file (common/base/ports_file.h) in the run directory.
std::string portsFileOf(const std::string& runDir, const std::string& process) {
  return runDir + "/" + process + ".ports";
}

// A fresh cluster secret (32 random bytes, hex) in runDir/cluster.secret, 0600, and a copy of
// the config naming it in runDir/cluster.yaml. Returns the copy's path.
Result<std::string> writeAuthenticatedConfig(const std::string& configPath, const std::string& runDir) {
  const std::string secretPath = runDir + "/cluster.secret";
  PD_ASSIGN_OR_RETURN(std::string raw, auth::randomNonce());
  std::string hex;
  static const char* kDigits = "0123456789abcdef";
  for (unsigned char ch : raw) {
    hex += kDigits[ch >> 4];
    hex += kDigits[ch & 15];
  }
  int fd = ::open(secretPath.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return unavailable("cannot create " + secretPath + ": " + std::strerror(errno));
  hex += "\n";
  const bool written = ::write(fd, hex.data(), hex.size()) == ssize_t(hex.size());
  ::close(fd);
  if (!written) return unavailable("cannot write " + secretPath);
  YAML::Node root;
  try {
    root = YAML::LoadFile(configPath);
    if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
    root["cluster"]["secret_file"] = secretPath;
  } catch (const YAML::Exception& e) {
    return invalidArgument(configPath + ": " + e.what());
  }
  YAML::Emitter out;
  out << root;
  const std::string path = runDir + "/cluster.yaml";
  std::ofstream f(path, std::ios::trunc);
  f << "# Generated by pdserve up from " << configPath << ": the same cluster, with a fresh secret.\n"
    << out.c_str() << "\n";
  if (!f) return unavailable("cannot write " + path);
  return path;
}

}  // namespace

Result<std::unique_ptr<LocalCluster>> LocalCluster::start(const LocalClusterOptions& o) {
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  PD_ASSIGN_OR_RETURN(c->config_, config::loadClusterConfig(o.configPath));
  c->configPath_ = o.configPath;
  c->runDir_ = o.runDir;
  if (c->runDir_.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/pdserve-up-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr)
      return unavailable("cannot make a run directory: " + std::string(std::strerror(errno)));
    c->runDir_ = tmpl;
    c->ownsRunDir_ = true;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(c->runDir_, ec);
    if (ec) return unavailable("cannot make run directory " + c->runDir_ + ": " + ec.message());
  }
  if (o.generateSecret && !c->config_.cluster.authenticated()) {
    std::error_code ec;
    std::filesystem::remove(c->runDir_ + "/cluster.secret", ec);
    PD_ASSIGN_OR_RETURN(c->configPath_, writeAuthenticatedConfig(o.configPath, c->runDir_));
    PD_ASSIGN_OR_RETURN(c->config_, config::loadClusterConfig(c->configPath_));
    PD_LOG(kInfo, "up") << "internal planes authenticated with a fresh secret in " << c->runDir_ << "/cluster.secret";
  }
  auto& cfg = c->config_;
  if (!std::filesystem::exists(cfg.model.path + "/config.json")) {
    engine::MakeModelOptions m;
    m.preset = std::string(config::toString(cfg.model.preset));
    PD_LOG(kInfo, "up") << "making the default '" << m.preset << "' model in " << cfg.model.path
                        << " (seeded random weights: its text is noise)";
    PD_RETURN_IF_ERROR(engine::makeModel(m, cfg.model.path));
  }
  int prefillN = o.prefillReplicas >= 0 ? o.prefillReplicas : cfg.pools.prefill.replicas;
  int decodeN = o.decodeReplicas >= 0 ? o.decodeReplicas : cfg.pools.decode.replicas;
  const int httpPort = o.httpPort >= 0 ? o.httpPort : cfg.router.port;
  const int controlPort = o.controlPort >= 0 ? o.controlPort : cfg.router.controlPort;
  const auto deadline = steady_clock::now() + o.startTimeout;
  // A fixed port still held (most often by the router of a cluster whose pdserve up died) is
  // named with its holder now, not as the router's bind error in its log.
  PD_RETURN_IF_ERROR(checkPortFree(httpPort, "router.http.port"));
  PD_RETURN_IF_ERROR(checkPortFree(controlPort, "router.workers.control_port"));
  // The router binds its ports (0: OS-chosen) and says which in its ports file; the workers
  // are started once it did, with the control port it bound.
  const std::string routerPorts = portsFileOf(c->runDir_, "router");
  std::error_code ec;
  std::filesystem::remove(routerPorts, ec);
  PD_RETURN_IF_ERROR(c->group_
                         .spawn("router", {(std::filesystem::path(o.binDir) / "pdserve-router").string(), "--config",
                                           c->configPath_, "--port", std::to_string(httpPort), "--control-port",
                                           std::to_string(controlPort), "--ports-file", routerPorts})
                         .status());
  PD_ASSIGN_OR_RETURN(PortMap ports, c->waitForPorts("router", deadline));
  c->httpPort_ = ports["http"];
  c->controlPort_ = ports["control"];
  c->binDir_ = o.binDir;
  for (int i = 0; i < prefillN; ++i) PD_RETURN_IF_ERROR(c->startWorker(Pool::kPrefill).status());
  for (int i = 0; i < decodeN; ++i) PD_RETURN_IF_ERROR(c->startWorker(Pool::kDecode).status());
  // What /metrics wants (router.http.metrics_auth): nothing, an API key (the first one given in
  // plain text; a sha256: entry cannot be sent), or the token of metrics_bearer_file.
  std::vector<std::string> metricsAuth;
  if (cfg.router.metricsAuth == config::MetricsAuth::kApiKey) {
    for (const auto& k : cfg.router.apiKeys) {
      if (k.rfind("sha256:", 0) != 0) {
        metricsAuth.push_back("Authorization: Bearer " + k);
        break;
      }
    }
    if (metricsAuth.empty()) {
      return failedPrecondition(
          "router.http.metrics_auth is api_key and every router.http.api_keys entry is a sha256: hash: "
          "the cluster's readiness cannot be read from /metrics");
    }
  } else if (cfg.router.metricsAuth == config::MetricsAuth::kBearerFile) {
    std::ifstream in(cfg.router.metricsBearerFile);
    std::string token;
    in >> token;
    metricsAuth.push_back("Authorization: Bearer " + token);
  }
  c->metricsAuth_ = metricsAuth;
  while (steady_clock::now() < deadline) {
    if (auto dead = c->group_.waitAny(milliseconds(200))) {
      return unavailable(dead->name + " " + dead->description + " during start-up (see its [" + dead->name +
                         "] log lines)");
    }
    auto health = httpGet(c->httpPort_, "/health", seconds(2));
    if (!health.ok() || health->status != 200) continue;
    auto metrics = c->routerMetrics(seconds(2));
    const bool portsKnown = std::all_of(c->workers_.begin(), c->workers_.end(),
                                        [&](const auto& w) { return c->metricsPort(w.first) != 0; });
    if (metrics.ok() && portsKnown && poolGauge(*metrics, "pdserve_pool_workers", "prefill") >= prefillN &&
        poolGauge(*metrics, "pdserve_pool_workers", "decode") >= decodeN) {
      return c;
    }
  }
  return deadlineExceeded("the cluster was not healthy within " + std::to_string(o.startTimeout.count()) + " s");
}

LocalCluster::~LocalCluster() {
  stop();
  if (ownsRunDir_) {
    std::error_code ec;
    std::filesystem::remove_all(runDir_, ec);
  }
}

Result<PortMap> LocalCluster::waitForPorts(const std::string& process, steady_clock::time_point deadline) {
  const std::string path = portsFileOf(runDir_, process);
  for (;;) {
    auto ports = readPortsFile(path);
    if (ports.status().code() != StatusCode::kNotFound) return ports;
    if (auto dead = group_.waitAny(milliseconds(20))) {
      return unavailable(dead->name + " " + dead->description + " during start-up (see its [" + dead->name +
                         "] log lines)");
    }
    if (steady_clock::now() >= deadline) return deadlineExceeded(process + " wrote no " + path + " in time");
  }
}

int LocalCluster::metricsPort(const std::string& worker) const {
  auto it = metricsPorts_.find(worker);
  if (it != metricsPorts_.end()) return it->second;
  if (!workers_.count(worker)) return 0;
  auto ports = readPortsFile(portsFileOf(runDir_, worker));
  if (!ports.ok() || !ports->count("metrics")) return 0;
  return metricsPorts_[worker] = ports->at("metrics");
}

void LocalCluster::stop() {
  group_.stopAll();
  workers_.clear();
}

Result<std::string> LocalCluster::startWorker(Pool pool) {
  const auto& cfg = config_;
  // With role moves every worker is a pdserve-worker that may become a prefill worker, so
  // all of them take their slot (and port, with prefill's base_port) from one space.
  const bool flex = cfg.router.autoscaler.roleMoves;
  const int basePort = pool == Pool::kPrefill || flex ? cfg.pools.prefill.basePort : cfg.pools.decode.basePort;
  std::set<int> slots;
  for (const auto& [id, w] : workers_)
    if (w.pool == pool || flex) slots.insert(w.slot);
  int slot = 0;
  while (slots.count(slot)) ++slot;
  const std::string id = flex ? "worker-" + std::to_string(nextId_[0])
                              : std::string(poolName(pool)) + "-" + std::to_string(nextId_[int(pool)]);
  const std::string program = flex ? "pdserve-worker" : pool == Pool::kPrefill ? "pdserve-prefill" : "pdserve-decode";
  const std::string portsFile = portsFileOf(runDir_, id);
  std::error_code ec;
  std::filesystem::remove(portsFile, ec);
  std::vector<std::string> argv{(std::filesystem::path(binDir_) / program).string(),
                                "--config",
                                configPath_,
                                "--id",
                                id,
                                "--router",
                                "127.0.0.1:" + std::to_string(controlPort_),
                                "--metrics-port",
                                "0",
                                "--ports-file",
                                portsFile};
  if (flex) argv.insert(argv.end(), {"--role", poolName(pool)});
  // pools.prefill.base_port: a prefill worker's control port is base_port + its slot (0:
  // OS-chosen); decode workers take no inbound connections from other workers.
  if ((pool == Pool::kPrefill || flex) && basePort != 0) {
    PD_RETURN_IF_ERROR(checkPortFree(basePort + slot, "pools.prefill.base_port + slot " + std::to_string(slot)));
    argv.insert(argv.end(), {"--port", std::to_string(basePort + slot)});
  }
  PD_RETURN_IF_ERROR(group_.spawn(id, argv).status());
  ++nextId_[flex ? 0 : int(pool)];
  workers_[id] = Worker{pool, slot, ++started_, false, {}};
  return id;
}

Status LocalCluster::switchRole(const std::string& id, Pool to) {
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.draining) return notFound("no live worker named '" + id + "'");
  if (!config_.router.autoscaler.roleMoves) {
    return failedPrecondition("worker '" + id + "' cannot switch roles: router.autoscaler.role_moves is off");
  }
  if (it->second.pool == to) return Status::ok();
  PD_RETURN_IF_ERROR(group_.signal(id, SIGUSR1));
  it->second.pool = to;
  metricsPorts_.erase(id);  // the new role binds its own (the worker rewrites its ports file)
  return Status::ok();
}

Status LocalCluster::drainWorker(const std::string& id) {
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.draining) return notFound("no live worker named '" + id + "'");
  PD_RETURN_IF_ERROR(group_.signal(id, SIGTERM));
  it->second.draining = true;
  it->second.killAt = steady_clock::now() + drainDeadline();
  return Status::ok();
}

std::chrono::milliseconds LocalCluster::drainDeadline() const {
  return milliseconds(config_.engine.drainTimeoutMs) + seconds(5);
}

std::vector<std::string> LocalCluster::liveWorkers(Pool pool) const {
  std::vector<std::pair<uint64_t, std::string>> byAge;
  for (const auto& [id, w] : workers_)
    if (w.pool == pool && !w.draining) byAge.emplace_back(w.started, id);
  std::sort(byAge.begin(), byAge.end());
  std::vector<std::string> out;
  for (auto& [n, id] : byAge) out.push_back(std::move(id));
  return out;
}

std::vector<std::string> LocalCluster::drainingWorkers(Pool pool) const {
  std::vector<std::string> out;
  for (const auto& [id, w] : workers_)
    if (w.pool == pool && w.draining) out.push_back(id);
  return out;
}

std::vector<std::string> LocalCluster::killOverdueDrains() {
  std::vector<std::string> killed;
  const auto now = steady_clock::now();
  for (auto& [id, w] : workers_) {
    if (w.draining && now >= w.killAt && group_.signal(id, SIGKILL).isOk()) {
      killed.push_back(id);
      w.killAt = now + seconds(3600);  // once
    }
  }
  return killed;
}

bool LocalCluster::expectedExit(const ChildExit& exit) {
  auto it = workers_.find(exit.name);
  if (it == workers_.end() || !it->second.draining) {
    if (it != workers_.end()) workers_.erase(it);
    return false;
  }
  workers_.erase(it);
  metricsPorts_.erase(exit.name);
  return true;
}

Result<std::string> LocalCluster::routerMetrics(milliseconds timeout) const {
  PD_ASSIGN_OR_RETURN(HttpReply r, httpRequest(httpPort_, "GET", "/metrics", "", timeout, metricsAuth_));
  if (r.status != 200) return unavailable("the router's /metrics answered " + std::to_string(r.status));
  return r.body;
}

Status LocalCluster::kill(const std::string& name) { return group_.signal(name, SIGKILL); }

}  // namespace pd::tools
