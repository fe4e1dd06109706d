#include "common/metrics/metrics.h"

#include <prometheus/check_names.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "common/metrics/process_metrics.h"

namespace pd::metrics {

void Counter::inc(double by) {
  if (c_ != nullptr && by >= 0) c_->Increment(by);
}
double Counter::value() const { return c_ != nullptr ? c_->Value() : 0.0; }

void Gauge::set(double v) {
  if (g_ != nullptr) g_->Set(v);
}
void Gauge::inc(double by) {
  if (g_ != nullptr) g_->Increment(by);
}
void Gauge::dec(double by) {
  if (g_ != nullptr) g_->Decrement(by);
}
double Gauge::value() const { return g_ != nullptr ? g_->Value() : 0.0; }

void Histogram::observe(double v) {
  if (h_ != nullptr) h_->Observe(v);
}

// Families are cached by name so that per-request lookups (a label value per route decision)
// skip prometheus-cpp's builder and registry scan; the family itself locks its metric map.
struct Registry::Families {
  std::mutex mutex;
  std::unordered_map<std::string, prometheus::Family<prometheus::Counter>*> counters;
  std::unordered_map<std::string, prometheus::Family<prometheus::Gauge>*> gauges;
  std::unordered_map<std::string, prometheus::Family<prometheus::Histogram>*> histograms;
};

Registry::Registry(Labels constantLabels)
    : constantLabels_(std::move(constantLabels)),
      registry_(std::make_shared<prometheus::Registry>()),
      families_(std::make_unique<Families>()) {}

Registry::~Registry() = default;

namespace {

template <typename T, typename Builder>
prometheus::Family<T>* familyFor(std::mutex& mutex, std::unordered_map<std::string, prometheus::Family<T>*>& map,
                                 Builder builder, const std::string& name, const std::string& help,
                                 const Labels& constantLabels, prometheus::Registry& registry) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = map.find(name);
  if (it != map.end()) return it->second;
  // Throws std::invalid_argument on a bad name or a name taken by another type.
  auto& family = builder.Name(name).Help(help).Labels(constantLabels).Register(registry);
  map.emplace(name, &family);
  return &family;
}

}  // namespace

Counter Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  auto* f = familyFor(families_->mutex, families_->counters, prometheus::BuildCounter(), name, help, constantLabels_,
                      *registry_);
  return Counter(&f->Add(labels));
}

Gauge Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  auto* f =
      familyFor(families_->mutex, families_->gauges, prometheus::BuildGauge(), name, help, constantLabels_, *registry_);
  return Gauge(&f->Add(labels));
}

Histogram Registry::histogram(const std::string& name, const std::string& help, const std::vector<double>& buckets,
                              const Labels& labels) {
  auto* f = familyFor(families_->mutex, families_->histograms, prometheus::BuildHistogram(), name, help,
                      constantLabels_, *registry_);
  return Histogram(&f->Add(labels, buckets));
}

void Registry::enableProcessMetrics() {
  std::lock_guard<std::mutex> lock(families_->mutex);
  processMetrics_ = true;
}

void Registry::setAliases(std::vector<Alias> aliases, Labels extraLabels) {
  for (const auto& a : aliases) {
    if (!prometheus::CheckMetricName(a.to) || a.to == a.from)
      throw std::invalid_argument("metric alias '" + a.to + "' of '" + a.from + "' is not a valid new name");
  }
  for (const auto& [name, value] : extraLabels) {
    if (!prometheus::CheckLabelName(name))
      throw std::invalid_argument("metric alias label '" + name + "' is not a valid label name");
  }
  std::lock_guard<std::mutex> lock(families_->mutex);
  aliases_ = std::move(aliases);
  aliasLabels_ = std::move(extraLabels);
}

std::string Registry::serialize() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<Alias> aliases;
  Labels extra;
  bool process = false;
  {
    std::lock_guard<std::mutex> lock(families_->mutex);
    aliases = aliases_;
    extra = aliasLabels_;
    process = processMetrics_;
  }
  const size_t own = families.size();
  for (const auto& a : aliases) {
    for (size_t i = 0; i < own; ++i) {
      if (families[i].name != a.from) continue;
      prometheus::MetricFamily copy = families[i];
      copy.name = a.to;
      copy.help += " (alias of " + a.from + ")";
      for (auto& m : copy.metric)
        for (const auto& [name, value] : extra) m.label.push_back({name, value});
      families.push_back(std::move(copy));
    }
  }
  if (process) {
    for (auto& f : processFamilies()) {
      for (auto& m : f.metric)
        for (const auto& [name, value] : constantLabels_) m.label.push_back({name, value});
      families.push_back(std::move(f));
    }
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace pd::metrics
