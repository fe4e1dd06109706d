#include "tools/plan/planner.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <thread>

namespace pd::plan {

int fittingTensorParallel(const ModelShape& model, const Device& device, const SimOptions& sim, int64_t longestTokens) {
  for (int tp : {1, 2, 4, 8}) {
    const CostModel cost(model, device, tp);
    if (cost.kvBlocks(sim.blockSize, sim.memoryUtilization, sim.kvCacheBytes) * sim.blockSize >= longestTokens)
      return tp;
  }
  return 0;
}

namespace {

std::string fmtS(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g s", s);
  return b;
}

// The rate search's bounds, as multiples of the trace's mean rate. High: a layout ends its
// doubling at its first failing rate, which shed requests bring (each counts as a miss), so
// the bound only stops a search that can never fail; a short trace on many GPUs needs more
// than 64x (8 H100s passed 64x of the Azure conversation trace's 3.17 req/s).
constexpr double kMaxRateScale = 1024, kMinRateScale = 1.0 / 64;

// Why `c` loses to `best`: its highest rate, and what its replay of the trace missed.
std::string verdictAgainst(const Candidate& c, const Candidate& best, const Slo& slo) {
  char b[160];
  std::snprintf(b, sizeof b, "%.2f < %.2f req/s", c.maxRate, best.maxRate);
  std::string why = b;
  if (c.maxRate == best.maxRate) why = "ties the best; ranked by attainment at the trace's rate";
  const SimSummary& s = c.summary;
  if (s.shed > 0) why += "; at the trace's rate " + std::to_string(s.shed) + " shed";
  if (s.finished + s.shed < s.requests)
    why += "; at the trace's rate " + std::to_string(s.requests - s.finished - s.shed) + " unfinished";
  if (s.ttftP99 > slo.ttftS) why += "; at the trace's rate TTFT p99 " + fmtS(s.ttftP99) + " > " + fmtS(slo.ttftS);
  if (s.itlP99 > slo.itlS) why += "; at the trace's rate ITL p99 " + fmtS(s.itlP99) + " > " + fmtS(slo.itlS);
  return why;
}

double meanRate(const std::vector<SimRequest>& requests) {
  if (requests.size() < 2) return 1;
  const double span = requests.back().arrivalS - requests.front().arrivalS;
  return span > 0 ? double(requests.size() - 1) / span : 1;
}

// One layout: its replay of the trace, then the rate search (see the header).
Result<Candidate> evaluate(const CostModel& cost, const PlanOptions& options, const Layout& layout,
                           const std::vector<SimRequest>& trace, double traceRate, const RequestSource& source) {
  SimOptions so = options.sim;
  so.layout = layout;
  auto simulateAt = [&](const std::vector<SimRequest>& rs) -> Result<SimSummary> {
    auto r = simulate(cost, so, rs);
    if (!r.ok()) return r.status();
    return r->summary;
  };
  Candidate c;
  auto run = [&](double scale) -> Result<SimSummary> {
    auto rs = source(scale * traceRate);
    if (!rs.ok()) return rs.status();
    auto summary = simulateAt(*rs);
    if (summary.ok()) c.curve.push_back(RatePoint{scale * traceRate, *summary});
    return summary;
  };
  c.layout = layout;
  auto replay = simulateAt(trace);
  if (!replay.ok()) return replay.status();
  c.summary = *replay;
  // Bracket the highest passing multiplier, then bisect between pass and fail.
  double pass = 0, fail = 0;
  SimSummary passed;
  auto base = run(1);
  if (!base.ok()) return base.status();
  if (base->attainment >= options.attainment) {
    pass = 1, passed = *base;
    for (double m = 2; m <= kMaxRateScale; m *= 2) {
      auto r = run(m);
      if (!r.ok()) return r.status();
      if (r->attainment < options.attainment) {
        fail = m;
        break;
      }
      pass = m, passed = *r;
    }
  } else {
    fail = 1;
    for (double m = 0.5; m >= kMinRateScale; m /= 2) {
      auto r = run(m);
      if (!r.ok()) return r.status();
      if (r->attainment >= options.attainment) {
        pass = m, passed = *r;
        break;
      }
      fail = m;
    }
  }
  for (int k = 0; k < options.bisections && pass > 0 && fail > 0; ++k) {
    const double m = std::sqrt(pass * fail);
    auto r = run(m);
    if (!r.ok()) return r.status();
    if (r->attainment >= options.attainment)
      pass = m, passed = *r;
    else
      fail = m;
  }
  std::sort(c.curve.begin(), c.curve.end(), [](const RatePoint& a, const RatePoint& b) { return a.rate < b.rate; });
  c.maxRateScale = pass;
  c.maxRate = pass * traceRate;
  c.atMaxRate = passed;
  return c;
}

}  // namespace

Result<std::vector<Candidate>> searchLayouts(const ModelShape& model, const Device& device, const PlanOptions& options,
                                             const RequestSource& source, const Progress& progress) {
  auto trace = source(0);
  if (!trace.ok()) return trace.status();
  const std::vector<SimRequest>& requests = *trace;
  const double traceRate = meanRate(requests);
  int64_t longest = 1;
  for (const auto& r : requests) longest = std::max<int64_t>(longest, int64_t(r.prompt.size()) + r.outputTokens);
  const int tp = fittingTensorParallel(model, device, options.sim, longest);
  if (tp == 0) {
    return failedPrecondition("plan: " + model.name + " with a " + std::to_string(longest) +
                              "-token request fits no worker of up to 8 " + device.name + " devices");
  }
  const int workers = options.devices / tp;
  if (workers < 1) {
    return invalidArgument("--gpus " + std::to_string(options.devices) + ": one worker of " + model.name + " needs " +
                           std::to_string(tp) + " " + device.name + " devices");
  }
  std::vector<Layout> layouts;
  layouts.push_back(Layout{0, workers, tp, options.sim.layout.shortPromptTokens});
  for (int p = 1; p < workers; ++p)
    for (int64_t threshold : options.thresholds) layouts.push_back(Layout{p, workers - p, tp, threshold});

  const CostModel cost(model, device, tp);
  // Layouts are independent: each is evaluated on a thread of its own (simulate() shares
  // nothing between calls) into its own slot, so the result does not depend on the threads.
  std::vector<Candidate> out(layouts.size());
  std::vector<Status> errors(layouts.size());
  std::atomic<size_t> next{0};
  int done = 0;
  std::mutex progressMutex;
  auto evaluateNext = [&] {
    for (size_t i = next++; i < layouts.size(); i = next++) {
      auto c = evaluate(cost, options, layouts[i], requests, traceRate, source);
      if (c.ok())
        out[i] = std::move(*c);
      else
        errors[i] = c.status();
      if (progress) {
        std::lock_guard<std::mutex> lock(progressMutex);
        progress(done++, int(layouts.size()), layouts[i]);
      }
    }
  };
  const unsigned threads =
      std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), unsigned(layouts.size())));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(evaluateNext);
  evaluateNext();
  for (auto& t : pool) t.join();
  for (const Status& e : errors)
    if (!e.isOk()) return e;

  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    if (a.maxRate != b.maxRate) return a.maxRate > b.maxRate;
    return a.summary.attainment > b.summary.attainment;
  });
  out.front().verdict = "best";
  for (size_t i = 1; i < out.size(); ++i) out[i].verdict = verdictAgainst(out[i], out.front(), options.sim.slo);
  return out;
}

}  // namespace pd::plan
