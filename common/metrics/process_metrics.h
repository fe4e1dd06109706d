// The process_* metric families that the standard Prometheus client libraries export
// (client_golang's process collector), read from /proc/self on Linux, so that dashboards and
// alerts written for any Prometheus-instrumented process work on pdserve's too:
//   process_cpu_seconds_total       counter, user + system CPU time
//   process_resident_memory_bytes   gauge
//   process_virtual_memory_bytes    gauge
//   process_open_fds, process_max_fds  gauges (the soft RLIMIT_NOFILE)
//   process_start_time_seconds      gauge, Unix time the process started
// Internal to pd_metrics: Registry::enableProcessMetrics() appends them at serialize().
// Threads: any; each call reads /proc afresh. Errors: a value that cannot be read (no /proc)
// leaves its family out rather than exporting a wrong 0.
#pragma once

#include <prometheus/metric_family.h>

#include <vector>

namespace pd::metrics {

std::vector<prometheus::MetricFamily> processFamilies();

}  // namespace pd::metrics
