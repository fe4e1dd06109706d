// A small facade over prometheus-cpp (core): a Registry that makes counters, gauges and
// histograms, and renders the Prometheus text exposition format for a /metrics handler.
//
//   pd::metrics::Registry reg(pd::metrics::Labels{{"role", "decode"}});  // constant labels
//   pd::metrics::Counter done = reg.counter("pdserve_x_total", "help", {{"reason", "stop"}});
//   done.inc();
//   std::string body = reg.serialize();    // "text/plain; version=0.0.4"
//
// Threads: every method of Registry and of the handles may be called from any thread at any
// time (prometheus-cpp locks per family; a handle's update is one atomic add or a short lock).
// Handles are cheap pointer-sized values, valid as long as the Registry that made them.
// Errors: a name or label name that is not a valid Prometheus name, or a name reused with
// another metric type or other label names, is a programming error: it throws
// std::invalid_argument, so make families at start-up (label *values* are free at any time).
//
// The pdserve metric sets (names from docs/design.md §6) are in pdserve_metrics.h.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace pd::metrics {

using Labels = std::map<std::string, std::string>;

class Counter {
 public:
  Counter() = default;
  void inc(double by = 1.0);  // by >= 0; negative increments are ignored (counters only grow)
  double value() const;
  explicit operator bool() const { return c_ != nullptr; }

 private:
  friend class Registry;
  explicit Counter(prometheus::Counter* c) : c_(c) {}
  prometheus::Counter* c_ = nullptr;
};

class Gauge {
 public:
  Gauge() = default;
  void set(double v);
  void inc(double by = 1.0);
  void dec(double by = 1.0);
  double value() const;
  explicit operator bool() const { return g_ != nullptr; }

 private:
  friend class Registry;
  explicit Gauge(prometheus::Gauge* g) : g_(g) {}
  prometheus::Gauge* g_ = nullptr;
};

class Histogram {
 public:
  Histogram() = default;
  void observe(double v);
  explicit operator bool() const { return h_ != nullptr; }

 private:
  friend class Registry;
  explicit Histogram(prometheus::Histogram* h) : h_(h) {}
  prometheus::Histogram* h_ = nullptr;
};

class Registry {
 public:
  // constantLabels are added to every metric of this registry (e.g. role, worker id).
  explicit Registry(Labels constantLabels = {});
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Returns the metric with this name and labels, creating the family and the metric on
  // first use. Counters' names end in _total by convention (the caller writes it).
  Counter counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  // buckets: strictly increasing upper bounds (+Inf is implicit). A later call for an existing
  // (name, labels) returns the existing histogram and ignores buckets.
  Histogram histogram(const std::string& name, const std::string& help, const std::vector<double>& buckets,
                      const Labels& labels = {});

  // Each family named `from` is also written as `to`, every series with `extraLabels` added:
  // the same values under a second name, made when serialize() runs, so the two can never
  // disagree (vLLM-compatible names, pdserve_metrics.h). Replaces earlier aliases; call it at
  // start-up. `to` must be a valid metric name (':' is allowed, as in "vllm:...") and differ
  // from every family's own name: std::invalid_argument otherwise.
  struct Alias {
    std::string from, to;
  };
  void setAliases(std::vector<Alias> aliases, Labels extraLabels);

  // Also writes the process_* families of the standard Prometheus client libraries, read from
  // /proc/self when serialize() runs: process_cpu_seconds_total, process_resident_memory_bytes,
  // process_virtual_memory_bytes, process_open_fds, process_max_fds and
  // process_start_time_seconds (with the registry's constant labels). Call it once per process,
  // on the registry its /metrics serves (exportProcessInfo in pdserve_metrics.h does).
  void enableProcessMetrics();

  // The text exposition format (version 0.0.4) of every metric (families grouped by type, in
  // the order they were made), then the aliases, then the process_* families if enabled.
  std::string serialize() const;

  // The underlying registry, e.g. for a prometheus::Exposer.
  std::shared_ptr<prometheus::Registry> native() const { return registry_; }

 private:
  struct Families;  // name -> family, per type (behind a mutex)
  Labels constantLabels_;
  std::vector<Alias> aliases_;  // guarded by families_->mutex
  Labels aliasLabels_;
  bool processMetrics_ = false;  // guarded by families_->mutex
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> families_;
};

// The content type of serialize()'s output.
inline constexpr std::string_view kTextContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace pd::metrics
