// `pdserve plan --html`: one self-contained HTML page (inline SVG, no external resources)
// with the SLO-attainment curve against request rate for the best layouts -- every rate the
// search simulated (planner.h, Candidate::curve), DistServe's way of comparing placements --
// the p99 TTFT and ITL at those rates, and the ranking table the terminal prints.
//
// Contract: plain functions, safe from any thread; writePlanHtml returns a Status naming the
// path when it cannot write.
#pragma once

#include <string>
#include <vector>

#include "common/base/status.h"
#include "tools/plan/planner.h"

namespace pd::plan {

struct PlanReportInfo {
  std::string commandLine;
  std::string trace;  // the workload's description
  std::string model;
  std::string device;  // with the cost model's note (calibrated or not)
  Slo slo;
  double attainment = 0.9;  // the target, a fraction
  int curves = 5;           // layouts drawn, best first
};

std::string planHtml(const PlanReportInfo& info, const std::vector<Candidate>& ranked);
Status writePlanHtml(const std::string& path, const PlanReportInfo& info, const std::vector<Candidate>& ranked);

}  // namespace pd::plan
