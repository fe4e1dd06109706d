#include "tools/bench/workload.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tools/bench/multiturn.h"

namespace pd::bench {
namespace {

// splitmix64: a tiny, well-mixed generator whose output is the same on every platform
// (std:: distributions are not), so a seed names one workload everywhere.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    const double u1 = 1.0 - uniform01(), u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
  double exponential(double rate) { return -std::log(1.0 - uniform01()) / rate; }
};

uint64_t mix(uint64_t a, uint64_t b) {
  Rng r(a ^ (b * 0xD1B54A32D192ED03ull));
  return r.next();
}

int64_t drawLength(const LengthSpec& s, Rng& rng) {
  double v = s.a;
  switch (s.kind) {
    case LengthSpec::Kind::kFixed:
      v = s.a;
      break;
    case LengthSpec::Kind::kUniform:
      v = s.a + std::floor(rng.uniform01() * (s.b - s.a + 1));
      break;
    case LengthSpec::Kind::kLognormal: {
      const double mu = std::log(s.a) - s.b * s.b / 2;  // so that E[X] = a
      v = std::exp(mu + s.b * rng.normal());
      break;
    }
  }
  return std::max<int64_t>(1, std::llround(v));
}

bool parseNum(std::string_view t, double* out) {
  std::string s(t);
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return !s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size() && std::isfinite(*out);
}

}  // namespace

std::string LengthSpec::describe() const {
  std::ostringstream o;
  switch (kind) {
    case Kind::kFixed:
      o << a;
      break;
    case Kind::kUniform:
      o << "uniform[" << a << "," << b << "]";
      break;
    case Kind::kLognormal:
      o << "lognormal(mean " << a << ", sigma " << b << ")";
      break;
  }
  return o.str();
}

Result<LengthSpec> parseLengthSpec(std::string_view text, std::string_view option) {
  const std::string opt(option);
  std::vector<std::string_view> parts;
  size_t pos = 0;
  while (true) {
    const size_t c = text.find(':', pos);
    parts.push_back(text.substr(pos, c == std::string_view::npos ? std::string_view::npos : c - pos));
    if (c == std::string_view::npos) break;
    pos = c + 1;
  }
  auto bad = [&](const std::string& why) {
    return invalidArgument(opt + ": '" + std::string(text) + "': " + why +
                           " (forms: N, fixed:N, uniform:MIN:MAX, lognormal:MEAN:SIGMA)");
  };
  LengthSpec s;
  double a = 0, b = 0;
  if (parts.size() == 1 || (parts.size() == 2 && parts[0] == "fixed")) {
    if (!parseNum(parts.back(), &a) || a < 1) return bad("the length must be a number >= 1");
    s.kind = LengthSpec::Kind::kFixed;
    s.a = std::round(a);
    return s;
  }
  if (parts.size() != 3) return bad("wrong number of fields");
  if (!parseNum(parts[1], &a) || !parseNum(parts[2], &b)) return bad("the fields must be numbers");
  if (parts[0] == "uniform") {
    if (a < 1 || b < a) return bad("uniform needs 1 <= MIN <= MAX");
    s.kind = LengthSpec::Kind::kUniform;
    s.a = std::round(a);
    s.b = std::round(b);
  } else if (parts[0] == "lognormal") {
    if (a < 1 || b < 0 || b > 4) return bad("lognormal needs MEAN >= 1 and 0 <= SIGMA <= 4");
    s.kind = LengthSpec::Kind::kLognormal;
    s.a = a;
    s.b = b;
  } else {
    return bad("unknown distribution '" + std::string(parts[0]) + "'");
  }
  return s;
}

std::string PhaseSpec::describe() const {
  std::ostringstream o;
  o << "prompt " << promptLen.describe() << ", output " << outputLen.describe() << ", " << rate << "/s for "
    << durationS << " s";
  return o.str();
}

Result<PhaseSpec> parsePhaseSpec(std::string_view text, int number, const PhaseSpec& defaults) {
  const std::string opt = "--phase " + std::to_string(number);
  static const char kFields[] = " (fields: prompt-len, output-len, rate, duration)";
  PhaseSpec p = defaults;
  bool haveDuration = false;
  std::vector<std::string> seen;
  if (text.empty()) return invalidArgument(opt + ": empty; give e.g. prompt-len=uniform:16:128,rate=3,duration=30");
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string_view item =
        text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    pos = comma == std::string_view::npos ? text.size() + 1 : comma + 1;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return invalidArgument(opt + ": '" + std::string(item) + "' is not FIELD=VALUE" + kFields);
    const std::string key(item.substr(0, eq));
    const std::string_view value = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      return invalidArgument(opt + ": field '" + key + "' given twice");
    seen.push_back(key);
    if (key == "prompt-len" || key == "output-len") {
      auto l = parseLengthSpec(value, opt + " " + key);
      if (!l.ok()) return l.status();
      (key == "prompt-len" ? p.promptLen : p.outputLen) = *l;
    } else if (key == "rate" || key == "duration") {
      double v = 0;
      if (!parseNum(value, &v) || !(v > 0))
        return invalidArgument(opt + ": " + key + " '" + std::string(value) + "' is not a number > 0");
      if (key == "rate")
        p.rate = v;
      else
        p.durationS = v, haveDuration = true;
    } else {
      return invalidArgument(opt + ": unknown field '" + key + "'" + kFields);
    }
  }
  if (!haveDuration) return invalidArgument(opt + ": duration is missing (duration=SECONDS)");
  if (!(p.rate > 0)) return invalidArgument(opt + ": rate is missing (rate=R, or --rate for every phase)");
  return p;
}

const char* endpointPath(Endpoint e) { return e == Endpoint::kChat ? "/v1/chat/completions" : "/v1/completions"; }

namespace {

// A phased workload: Poisson arrivals within each phase's window, phases back to back.
Result<Workload> buildPhased(const WorkloadOptions& o) {
  if (!o.tracePath.empty()) return invalidArgument("--phase is for synthetic lengths; it cannot be used with --trace");
  if (o.durationS > 0) return invalidArgument("--phase sets the run's length (the phases' durations); drop --duration");
  if (o.numRequests > 0) return invalidArgument("--phase plans requests by time; drop --num-requests");
  if (o.closedLoop) return invalidArgument("--phase needs open-loop arrivals (each phase has a rate)");
  Workload w;
  w.arrival = ArrivalMode::kPoisson;
  Rng lenRng(mix(o.seed, 0x1e9));
  Rng arrRng(mix(o.seed, 0xa11));
  auto lengths = [&](PlannedRequest& r, const PhaseSpec& p) {
    r.promptTokens = drawLength(p.promptLen, lenRng);
    r.outputTokens = drawLength(p.outputLen, lenRng);
    if (o.maxPromptTokens > 0) r.promptTokens = std::min(r.promptTokens, o.maxPromptTokens);
    if (o.maxOutputTokens > 0) r.outputTokens = std::min(r.outputTokens, o.maxOutputTokens);
  };
  for (int64_t i = 0; i < o.warmup; ++i) {  // warm-ups look like the first phase
    PlannedRequest r;
    r.index = i;
    r.warmup = true;
    r.phase = 0;
    lengths(r, o.phases.front());
    w.warmups.push_back(std::move(r));
  }
  lenRng = Rng(mix(o.seed, 0x1e9));
  double start = 0;
  int64_t index = 0;
  for (size_t k = 0; k < o.phases.size(); ++k) {
    const PhaseSpec& p = o.phases[k];
    if (!(p.rate > 0) || !(p.durationS > 0))
      return invalidArgument("--phase " + std::to_string(k + 1) + ": rate and duration must be > 0");
    const double end = start + p.durationS;
    // The first arrival of a phase is one gap after its start (memoryless: as if the phase's
    // process had been running), so a phase boundary is not a burst.
    for (double t = start + arrRng.exponential(p.rate); t < end; t += arrRng.exponential(p.rate)) {
      PlannedRequest r;
      r.index = index++;
      r.scheduledS = t;
      r.phase = static_cast<int>(k);
      lengths(r, p);
      w.requests.push_back(std::move(r));
    }
    w.phases.push_back({start, end, p});
    start = end;
  }
  if (w.requests.empty()) return invalidArgument("--phase: the phases plan no request (raise a rate or a duration)");
  std::ostringstream d;
  d << w.phases.size() << " phases: ";
  for (size_t k = 0; k < w.phases.size(); ++k) d << (k ? "; " : "") << (k + 1) << ") " << w.phases[k].spec.describe();
  if (o.maxPromptTokens > 0) d << "; prompt <= " << o.maxPromptTokens;
  if (o.maxOutputTokens > 0) d << "; output <= " << o.maxOutputTokens;
  d << "; arrivals poisson; " << w.requests.size() << " requests";
  if (o.warmup > 0) d << " + " << o.warmup << " warm-up";
  w.describe = d.str();
  return w;
}

}  // namespace

Result<Workload> buildWorkload(const WorkloadOptions& o) {
  if (o.numRequests < 0) return invalidArgument("--num-requests must be >= 0");
  if (o.durationS < 0) return invalidArgument("--duration must be >= 0");
  if (!(o.timeScale > 0)) return invalidArgument("--time-scale must be > 0");
  if (o.rate < 0) return invalidArgument("--rate must be >= 0");
  if (o.warmup < 0) return invalidArgument("--warmup must be >= 0");
  if (o.sampleConversations < 1) return invalidArgument("--sample-conversations must be >= 1");
  if (o.maxPromptTokens < 0 || o.maxOutputTokens < 0) return invalidArgument("--max-*-tokens must be >= 0");
  if (!o.phases.empty()) return buildPhased(o);
  Workload w;
  Trace trace;
  const bool haveTrace = !o.tracePath.empty();
  if (haveTrace) {
    PD_ASSIGN_OR_RETURN(trace, loadTrace(o.tracePath));
    w.traceFormat = traceFormatName(trace.format);
    if (o.sampleConversations > 1) {
      if (trace.blockTokens <= 0)
        return invalidArgument("--sample-conversations needs a trace with prefix blocks (Mooncake JSONL hash_ids)");
      std::vector<TraceRow> kept;
      for (size_t i = 0; i < trace.rows.size(); ++i) {
        const TraceRow& row = trace.rows[i];
        const int64_t key = row.hashIds.size() > 1 ? row.hashIds[1] : static_cast<int64_t>(i);
        if (key % o.sampleConversations == 0) kept.push_back(row);
      }
      if (kept.empty()) return invalidArgument("--sample-conversations: no row is kept");
      trace.rows = std::move(kept);
    }
  }
  if (o.rate > 0)
    w.arrival = ArrivalMode::kPoisson;
  else if (haveTrace && !o.closedLoop)
    w.arrival = ArrivalMode::kTrace;
  else
    w.arrival = ArrivalMode::kImmediate;

  int64_t n = o.numRequests;
  if (n == 0) {
    if (o.durationS > 0 && w.arrival == ArrivalMode::kPoisson)
      n = static_cast<int64_t>(std::ceil(o.rate * o.durationS * 3 + 100));  // trimmed by time below
    else if (o.durationS > 0 && w.arrival == ArrivalMode::kImmediate)
      n = kMaxDurationOnlyRequests;
    else if (haveTrace)
      n = static_cast<int64_t>(trace.rows.size());
    else
      return invalidArgument("give --num-requests or --duration (or a trace to replay)");
  }
  if (w.arrival == ArrivalMode::kTrace) n = std::min<int64_t>(n, static_cast<int64_t>(trace.rows.size()));

  // Lengths: trace rows are scaled (prefix blocks scale with them) so the longest selected
  // prompt fits maxPromptTokens; synthetic lengths are only capped.
  double scale = 1.0;
  if (haveTrace) {
    if (o.lengthScale > 0) {
      scale = o.lengthScale;
    } else if (o.maxPromptTokens > 0) {
      int64_t longest = 1;
      for (int64_t i = 0; i < std::min<int64_t>(n, static_cast<int64_t>(trace.rows.size())); ++i)
        longest = std::max(longest, trace.rows[static_cast<size_t>(i)].promptTokens);
      scale = std::min(1.0, static_cast<double>(o.maxPromptTokens) / static_cast<double>(longest));
    }
  }
  w.lengthScale = scale;
  const int64_t blockTokens =
      haveTrace && trace.blockTokens > 0 ? std::max<int64_t>(1, std::llround(trace.blockTokens * scale)) : 0;

  Rng lenRng(mix(o.seed, 0x1e9));
  Rng arrRng(mix(o.seed, 0xa11));
  auto makeRequest = [&](int64_t i) {
    PlannedRequest r;
    r.index = i;
    if (haveTrace) {
      const TraceRow& row = trace.rows[static_cast<size_t>(i) % trace.rows.size()];
      r.promptTokens = std::max<int64_t>(1, std::llround(static_cast<double>(row.promptTokens) * scale));
      r.outputTokens = std::max<int64_t>(1, row.outputTokens);
      if (blockTokens > 0) {
        r.hashIds = row.hashIds;
        r.blockTokens = blockTokens;
      }
      // A wrapped-around replay must not share prefixes it did not share in the trace.
      if (i >= static_cast<int64_t>(trace.rows.size())) r.hashIds.clear();
    } else {
      r.promptTokens = drawLength(o.promptLen, lenRng);
      r.outputTokens = drawLength(o.outputLen, lenRng);
    }
    if (o.maxPromptTokens > 0) r.promptTokens = std::min(r.promptTokens, o.maxPromptTokens);
    if (o.maxOutputTokens > 0) r.outputTokens = std::min(r.outputTokens, o.maxOutputTokens);
    return r;
  };

  for (int64_t i = 0; i < o.warmup; ++i) {
    PlannedRequest r = makeRequest(i);
    r.hashIds.clear();  // warm-ups must not pre-warm the measured prompts' prefix cache
    r.warmup = true;
    w.warmups.push_back(std::move(r));
  }
  // Measured requests draw lengths after the warm-ups; rewind so the measured set does not
  // depend on --warmup.
  lenRng = Rng(mix(o.seed, 0x1e9));
  double t = 0;
  const double t0 = haveTrace ? trace.rows.front().arrivalS : 0;
  std::vector<double> traceTimes;
  if (w.arrival == ArrivalMode::kTrace) {
    traceTimes.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) traceTimes.push_back(trace.rows[static_cast<size_t>(i)].arrivalS - t0);
    if (o.spreadTicks) {
      double lastGap = 0;
      for (size_t b = 0; b < traceTimes.size();) {
        size_t e = b + 1;
        while (e < traceTimes.size() && traceTimes[e] == traceTimes[b]) ++e;
        // The gap to the next distinct time: from the trace itself, past the selected rows too.
        double next = -1;
        if (e < traceTimes.size())
          next = traceTimes[e];
        else if (e < trace.rows.size())
          next = trace.rows[e].arrivalS - t0;
        const double gap = next > traceTimes[b] ? next - traceTimes[b] : lastGap;
        for (size_t k = b; k < e; ++k) traceTimes[k] += gap * static_cast<double>(k - b) / static_cast<double>(e - b);
        lastGap = gap;
        b = e;
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    PlannedRequest r = makeRequest(i);
    switch (w.arrival) {
      case ArrivalMode::kTrace:
        r.scheduledS = traceTimes[static_cast<size_t>(i)] * o.timeScale;
        break;
      case ArrivalMode::kPoisson:
        if (i > 0) t += arrRng.exponential(o.rate);
        r.scheduledS = t;
        break;
      case ArrivalMode::kImmediate:
        r.scheduledS = 0;
        break;
    }
    if (o.durationS > 0 && w.arrival != ArrivalMode::kImmediate && r.scheduledS >= o.durationS) break;
    w.requests.push_back(std::move(r));
  }
  if (w.requests.empty()) return invalidArgument("the workload is empty (check --num-requests / --duration)");
  if (o.multiTurn) {
    if (!haveTrace || trace.blockTokens <= 0)
      return invalidArgument("--multi-turn needs a trace with prefix blocks (Mooncake JSONL hash_ids)");
    if (static_cast<int64_t>(w.requests.size()) > static_cast<int64_t>(trace.rows.size()))
      return invalidArgument("--multi-turn replays each trace row once: ask for at most " +
                             std::to_string(trace.rows.size()) + " requests");
    if (o.turnMinTokens < 1) return invalidArgument("--turn-min-tokens must be >= 1");
    w.chainedTurns = linkTurns(w.requests, trace.rows, trace.blockTokens, scale, o.turnMinTokens);
    // A next turn's planned length: the previous turn's prompt and answer and its new message.
    for (PlannedRequest& r : w.requests) {
      if (r.parent < 0) continue;
      const PlannedRequest& p = w.requests[static_cast<size_t>(r.parent)];
      r.promptTokens = p.promptTokens + p.outputTokens + r.newTokens;
    }
  }

  std::ostringstream d;
  if (haveTrace) {
    d << "trace " << o.tracePath << " (" << w.traceFormat << ")";
    if (o.sampleConversations > 1) d << ", 1 conversation in " << o.sampleConversations;
    if (scale != 1.0) d << ", prompt lengths x" << scale;
    if (blockTokens > 0) d << ", prefix blocks of " << blockTokens << " tokens";
  } else {
    d << "prompt " << o.promptLen.describe() << ", output " << o.outputLen.describe();
  }
  if (o.maxPromptTokens > 0) d << ", prompt <= " << o.maxPromptTokens;
  if (o.maxOutputTokens > 0) d << ", output <= " << o.maxOutputTokens;
  d << "; arrivals " << arrivalModeName(w.arrival);
  if (w.arrival == ArrivalMode::kTrace && o.timeScale != 1.0) d << " x" << o.timeScale;
  if (w.arrival == ArrivalMode::kTrace && o.spreadTicks) d << " (ticks spread)";
  if (w.arrival == ArrivalMode::kPoisson) d << " " << o.rate << "/s";
  d << "; " << w.requests.size() << " requests";
  if (o.multiTurn) d << " (multi-turn: " << w.chainedTurns << " next turns)";
  if (o.warmup > 0) d << " + " << o.warmup << " warm-up";
  w.describe = d.str();
  return w;
}

std::vector<int32_t> promptTokenIds(const PlannedRequest& r, const TokenIdRange& range, uint64_t seed) {
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(r.promptTokens));
  const uint64_t span = static_cast<uint64_t>(std::max<int64_t>(1, range.maxId - range.minId));
  auto put = [&](Rng& rng, int64_t count) {
    for (int64_t k = 0; k < count; ++k)
      ids.push_back(static_cast<int32_t>(range.minId + static_cast<int64_t>(rng.next() % span)));
  };
  int64_t left = r.promptTokens;
  if (r.blockTokens > 0) {
    for (int64_t h : r.hashIds) {
      if (left <= 0) break;
      // Block content depends only on (seed, hash id): shared ids give identical blocks.
      Rng block(mix(seed, 0xB10C0000ull ^ static_cast<uint64_t>(h)));
      const int64_t take = std::min(left, r.blockTokens);
      put(block, take);
      left -= take;
    }
  }
  if (left > 0) {
    Rng own(mix(mix(seed, r.warmup ? 0x3a11ull : 0x5eedull), static_cast<uint64_t>(r.index)));
    put(own, left);
  }
  return ids;
}

std::string ByteTextPrompter::textFor(const std::vector<int32_t>& ids) const {
  // Letters with a space about every sixth character: plain ASCII a byte-level tokenizer
  // reads byte by byte; the mapping is a function of the id, so shared blocks stay shared.
  static const char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz     ";
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids) s.push_back(kAlphabet[static_cast<uint32_t>(id) % (sizeof(kAlphabet) - 1)]);
  return s;
}

std::string buildRequestBody(const PlannedRequest& r, const BodyOptions& o) {
  return buildRequestBodyIds(r, promptTokenIds(r, o.ids, o.seed), o);
}

std::string buildRequestBodyIds(const PlannedRequest& r, const std::vector<int32_t>& ids, const BodyOptions& o) {
  nlohmann::json j = nlohmann::json::object();
  if (!o.model.empty()) j["model"] = o.model;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  if (o.continuousUsage) j["stream_options"]["continuous_usage_stats"] = true;
  j["max_tokens"] = r.outputTokens;
  if (o.ignoreEos) j["ignore_eos"] = true;
  if (o.returnTokenIds) j["return_token_ids"] = true;
  if (o.temperature >= 0) j["temperature"] = o.temperature;
  if (o.endpoint == Endpoint::kChat) {
    j["max_completion_tokens"] = r.outputTokens;
    static const ByteTextPrompter kDefault;
    const TextPrompter& p = o.prompter ? *o.prompter : kDefault;
    j["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", p.textFor(ids)}}});
  }
  if (!o.extraJson.empty()) {
    nlohmann::json extra = nlohmann::json::parse(o.extraJson, nullptr, false);
    if (extra.is_object()) j.update(extra);
  }
  std::string body = j.dump();
  if (o.endpoint == Endpoint::kCompletions) {
    // The id array is written by hand: long prompts are the bulk of the bytes, and this runs
    // on the generator's only thread.
    std::string arr = "\"prompt\":[";
    arr.reserve(ids.size() * 7 + 16);
    char buf[16];
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) arr.push_back(',');
      auto res = std::to_chars(buf, buf + sizeof buf, ids[i]);
      arr.append(buf, res.ptr);
    }
    arr += "],";
    body.insert(1, arr);
  }
  return body;
}

}  // namespace pd::bench
