// pdserve up: a local cluster (router + prefill + decode workers) on this machine, supervised
// until Ctrl-C. The README's serve command runs it.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/base/log.h"
#include "common/base/signals.h"
#include "tools/commands.h"
#include "tools/local_actuator.h"
#include "tools/local_cluster.h"

namespace pd::tools {
namespace {

std::string selfDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

struct UpArgs {
  LocalClusterOptions o;
  bool autoscale = true;
  std::string targetsPath;  // --prometheus-targets; empty: <run dir>/prometheus-targets.json
};

// Prometheus file_sd (https://prometheus.io/docs/guide/file-sd/): one target group per
// process, the router and each live worker, so a scrape config that lists this file follows
// the cluster as it scales. The label pdserve_process says which ("router" or the worker id);
// it is not one of the series' own labels (role, worker, component), so none is overwritten.
std::string fileSdTargets(LocalCluster& cluster) {
  nlohmann::json groups = nlohmann::json::array();
  groups.push_back(
      {{"targets", {"127.0.0.1:" + std::to_string(cluster.httpPort())}}, {"labels", {{"pdserve_process", "router"}}}});
  for (Pool pool : {Pool::kPrefill, Pool::kDecode})
    for (const std::string& id : cluster.liveWorkers(pool))
      groups.push_back({{"targets", {"127.0.0.1:" + std::to_string(cluster.metricsPort(id))}},
                        {"labels", {{"pdserve_process", id}}}});
  return groups.dump(2) + "\n";
}

// Written to a temporary file and renamed over the old one: Prometheus reloads file_sd files
// when they change and must never read half of one.
bool writeTargets(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out.flush()) return false;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

int runUp(UpArgs& args) {
  const sigset_t signals = blockTerminationSignals();

  LocalClusterOptions& o = args.o;
  o.binDir = selfDir();
  const bool autoscale = args.autoscale;
  auto cluster = LocalCluster::start(o);
  if (!cluster.ok()) {
    std::fprintf(stderr, "pdserve up: %s\n", cluster.status().message().c_str());
    return 1;
  }
  LocalActuator actuator(*cluster.value(), autoscale);
  const int port = cluster.value()->httpPort();
  const auto& cfg = cluster.value()->config();
  std::string model =
      cfg.model.name.empty() ? std::filesystem::path(cfg.model.path).filename().string() : cfg.model.name;
  std::printf(
      "\npdserve is up: http://127.0.0.1:%d/v1  (model '%s', %d prefill + %d decode workers)\n"
      "try:\n  curl -s http://127.0.0.1:%d/v1/completions -H 'Content-Type: application/json' \\\n"
      "    -d '{\"model\": \"%s\", \"prompt\": \"Hello\", \"max_tokens\": 16}'\n"
      "metrics: http://127.0.0.1:%d/metrics    autoscaling: %s    stop: Ctrl-C\n\n",
      port, model.c_str(), o.prefillReplicas >= 0 ? o.prefillReplicas : cfg.pools.prefill.replicas,
      o.decodeReplicas >= 0 ? o.decodeReplicas : cfg.pools.decode.replicas, port, model.c_str(), port,
      actuator.describe().c_str());
  // Renamed keys given by their old path (logged at load too, but scrolled past by now).
  for (const std::string& w : cfg.warnings) {
    std::printf("config: %s (docs/config.md, \"Renamed keys\")\n", w.c_str());
  }
  // Each worker's own /metrics (its steps, KV pool, transfers), for an SRE or a benchmark.
  for (Pool pool : {Pool::kPrefill, Pool::kDecode})
    for (const std::string& id : cluster.value()->liveWorkers(pool))
      std::printf("worker metrics: %s http://127.0.0.1:%d/metrics\n", id.c_str(), cluster.value()->metricsPort(id));
  // Every process's /metrics as a file_sd targets file, rewritten when the workers change.
  const std::string targetsPath =
      args.targetsPath.empty() ? cluster.value()->runDir() + "/prometheus-targets.json" : args.targetsPath;
  std::string targets = fileSdTargets(*cluster.value());
  if (!writeTargets(targetsPath, targets)) {
    std::fprintf(stderr, "pdserve up: cannot write %s\n", targetsPath.c_str());
    cluster.value()->stop();
    return 1;
  }
  std::printf(
      "prometheus targets (file_sd, kept current): %s\n"
      "  scrape_configs: [{job_name: pdserve, file_sd_configs: [{files: ['%s']}]}]\n",
      targetsPath.c_str(), targetsPath.c_str());
  std::fflush(stdout);
  timespec tick{0, 200 * 1000 * 1000};
  // The actuator polls at the router's tick, at most once a second: its recommendation
  // changes no faster.
  const auto pollEvery = std::chrono::milliseconds(std::min<int64_t>(1000, cfg.router.autoscaler.tickMs));
  auto nextPoll = std::chrono::steady_clock::now();
  while (true) {
    int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig > 0) {
      std::fprintf(stderr, "pdserve up: stopping the cluster\n");
      cluster.value()->stop();
      return 0;
    }
    while (auto dead = cluster.value()->processes().waitAny(std::chrono::milliseconds(0))) {
      if (cluster.value()->expectedExit(*dead)) {
        std::printf("pdserve up: %s stopped (drained, %s)\n", dead->name.c_str(), dead->description.c_str());
        std::fflush(stdout);
        continue;
      }
      std::fprintf(stderr, "pdserve up: %s %s; stopping the cluster\n", dead->name.c_str(), dead->description.c_str());
      cluster.value()->stop();
      return 1;
    }
    if (std::chrono::steady_clock::now() >= nextPoll) {
      actuator.poll();
      nextPoll = std::chrono::steady_clock::now() + pollEvery;
      if (std::string now = fileSdTargets(*cluster.value()); now != targets && writeTargets(targetsPath, now))
        targets = std::move(now);
    }
  }
}

}  // namespace

void addUpCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd = pdserve.add_subcommand("up", "start a local cluster (router + workers) and supervise it");
  cmd->footer(
      "Starts a router, N prefill "
      "and M decode workers (the config's pools), makes the configured model on first use, "
      "waits until all are healthy, prints the URL, and stops them all on Ctrl-C. A worker that "
      "dies stops the cluster. A pool whose max_replicas exceeds its min_replicas is scaled "
      "within those bounds to the router's pdserve_desired_replicas (workers are drained before "
      "they stop); --no-autoscale (or router.autoscaler.local_actuator: false) keeps the sizes "
      "fixed.");
  auto args = std::make_shared<UpArgs>();
  LocalClusterOptions& o = args->o;
  cmd->add_option("--config", o.configPath, "the cluster YAML")->capture_default_str();
  cmd->add_option("--port", o.httpPort, "the router's HTTP port");
  cmd->add_option("--control-port", o.controlPort, "the router's control port (0: a free one)");
  cmd->add_option("--prefill", o.prefillReplicas, "prefill workers (default: the config's)");
  cmd->add_option("--decode", o.decodeReplicas, "decode workers (default: the config's)");
  cmd->add_option("--prometheus-targets", args->targetsPath,
                  "where to write a Prometheus file_sd targets file listing the router's and every worker's "
                  "/metrics, kept current as the pools scale (default: prometheus-targets.json in the run "
                  "directory, removed at exit)");
  cmd->add_flag_callback(
      "--no-autoscale", [args] { args->autoscale = false; }, "keep the pool sizes fixed");
  cmd->callback([args, &run] { run = [args] { return runUp(*args); }; });
}

}  // namespace pd::tools
