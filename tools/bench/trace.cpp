#include "tools/bench/trace.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pd::bench {
namespace {

std::string trim(std::string s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool parseInt(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

bool parseDouble(const std::string& s, double* out) {
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size() && std::isfinite(*out);
}

// Days since 1970-01-01 of a proleptic Gregorian date (the civil-from-days inverse).
int64_t daysFromCivil(int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const unsigned yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<int64_t>(doe) - 719468;
}

std::string where(const std::string& name, size_t line) { return name + ":" + std::to_string(line) + ": "; }

Status finish(Trace* t) {
  if (t->rows.empty()) return invalidArgument(t->path + ": the trace has no rows");
  return Status::ok();
}

}  // namespace

std::vector<std::string> splitCsv(const std::string& line) {
  // No quoted fields: a quote would be a format we do not know, and the callers' number
  // checks then reject the row with its line number.
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == ',') {
      out.push_back(trim(cur));
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(trim(cur));
  return out;
}

bool parseDateTimeSeconds(const std::string& text, double* out) {
  // YYYY-MM-DD hh:mm:ss[.frac]
  if (text.size() < 19 || text[4] != '-' || text[7] != '-' || (text[10] != ' ' && text[10] != 'T') || text[13] != ':' ||
      text[16] != ':')
    return false;
  int64_t y, mo, d, h, mi, s;
  if (!parseInt(text.substr(0, 4), &y) || !parseInt(text.substr(5, 2), &mo) || !parseInt(text.substr(8, 2), &d) ||
      !parseInt(text.substr(11, 2), &h) || !parseInt(text.substr(14, 2), &mi) || !parseInt(text.substr(17, 2), &s))
    return false;
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60) return false;
  double frac = 0;
  if (text.size() > 19) {
    if (text[19] != '.') return false;
    std::string digits = text.substr(20);
    if (digits.empty() || digits.size() > 12) return false;
    for (char c : digits)
      if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    frac = std::stod("0." + digits);
  }
  *out = static_cast<double>(daysFromCivil(y, static_cast<unsigned>(mo), static_cast<unsigned>(d))) * 86400.0 +
         static_cast<double>(h * 3600 + mi * 60 + s) + frac;
  return true;
}

Result<Trace> parseTraceCsv(std::istream& in, const std::string& name) {
  Trace t;
  t.path = name;
  std::string line;
  size_t lineNo = 0;
  int tsCol = -1, promptCol = -1, outputCol = -1;
  bool haveHeader = false;
  bool timeIsDatetime = false;
  double firstTs = 0, prevTs = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    auto cols = splitCsv(line);
    if (!haveHeader) {
      static const char* kIgnored[] = {"Model", "Total tokens", "Log Type", "Session ID", "Elapsed time"};
      for (size_t i = 0; i < cols.size(); ++i) {
        const std::string& c = cols[i];
        if (c == "TIMESTAMP" || c == "Timestamp") {
          tsCol = static_cast<int>(i);
        } else if (c == "ContextTokens") {
          promptCol = static_cast<int>(i);
        } else if (c == "GeneratedTokens") {
          outputCol = static_cast<int>(i);
        } else if (c == "Request tokens") {
          promptCol = static_cast<int>(i);
          t.format = TraceFormat::kBurstGptCsv;
        } else if (c == "Response tokens") {
          outputCol = static_cast<int>(i);
          t.format = TraceFormat::kBurstGptCsv;
        } else if (std::find_if(std::begin(kIgnored), std::end(kIgnored), [&](const char* k) { return c == k; }) ==
                   std::end(kIgnored)) {
          return invalidArgument(where(name, lineNo) + "unknown column '" + c +
                                 "' (known: TIMESTAMP, ContextTokens, GeneratedTokens for Azure; "
                                 "Timestamp, Request tokens, Response tokens, Model, Total tokens, "
                                 "Log Type, Session ID, Elapsed time for BurstGPT)");
        }
      }
      if (tsCol < 0 || promptCol < 0 || outputCol < 0)
        return invalidArgument(where(name, lineNo) +
                               "the header needs a timestamp, a prompt-length and an output-length "
                               "column (e.g. TIMESTAMP,ContextTokens,GeneratedTokens); got '" +
                               line + "'");
      haveHeader = true;
      continue;
    }
    const size_t need = static_cast<size_t>(std::max({tsCol, promptCol, outputCol})) + 1;
    if (cols.size() < need)
      return invalidArgument(where(name, lineNo) + "expected at least " + std::to_string(need) + " columns, got " +
                             std::to_string(cols.size()) + ": '" + line + "'");
    double ts = 0;
    const std::string& tsText = cols[static_cast<size_t>(tsCol)];
    if (t.rows.empty()) timeIsDatetime = tsText.find('-') != std::string::npos;
    bool tsOk = timeIsDatetime ? parseDateTimeSeconds(tsText, &ts) : parseDouble(tsText, &ts);
    if (!tsOk)
      return invalidArgument(where(name, lineNo) + "timestamp '" + tsText + "' is not " +
                             (timeIsDatetime ? "a 'YYYY-MM-DD hh:mm:ss.fffffff' datetime" : "a number of seconds"));
    TraceRow row;
    if (!parseInt(cols[static_cast<size_t>(promptCol)], &row.promptTokens) || row.promptTokens < 0)
      return invalidArgument(where(name, lineNo) + "prompt length '" + cols[static_cast<size_t>(promptCol)] +
                             "' is not a non-negative integer");
    if (!parseInt(cols[static_cast<size_t>(outputCol)], &row.outputTokens) || row.outputTokens < 0)
      return invalidArgument(where(name, lineNo) + "output length '" + cols[static_cast<size_t>(outputCol)] +
                             "' is not a non-negative integer");
    if (t.rows.empty()) {
      firstTs = ts;
    } else if (ts < prevTs) {
      return invalidArgument(where(name, lineNo) + "timestamp goes backwards (the trace must be sorted by time)");
    }
    prevTs = ts;
    row.arrivalS = ts - firstTs;
    t.rows.push_back(std::move(row));
  }
  if (!haveHeader) return invalidArgument(name + ": empty file (no CSV header)");
  PD_RETURN_IF_ERROR(finish(&t));
  return t;
}

Result<Trace> parseMooncakeJsonl(std::istream& in, const std::string& name) {
  Trace t;
  t.path = name;
  t.format = TraceFormat::kMooncakeJsonl;
  t.blockTokens = 512;
  std::string line;
  size_t lineNo = 0;
  double firstMs = 0, prevMs = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return invalidArgument(where(name, lineNo) + "not a JSON object: '" + line.substr(0, 120) + "'");
    TraceRow row;
    double ms = 0;
    bool haveTs = false, haveIn = false, haveOut = false;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      const auto& v = it.value();
      if (k == "timestamp") {
        if (!v.is_number()) return invalidArgument(where(name, lineNo) + "timestamp is not a number");
        ms = v.get<double>();
        haveTs = true;
      } else if (k == "input_length") {
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
          return invalidArgument(where(name, lineNo) + "input_length is not a non-negative integer");
        row.promptTokens = v.get<int64_t>();
        haveIn = true;
      } else if (k == "output_length") {
        if (!v.is_number_integer() || v.get<int64_t>() < 0)
          return invalidArgument(where(name, lineNo) + "output_length is not a non-negative integer");
        row.outputTokens = v.get<int64_t>();
        haveOut = true;
      } else if (k == "hash_ids") {
        if (!v.is_array()) return invalidArgument(where(name, lineNo) + "hash_ids is not an array");
        row.hashIds.reserve(v.size());
        for (const auto& h : v) {
          if (!h.is_number_integer()) return invalidArgument(where(name, lineNo) + "hash_ids holds a non-integer");
          row.hashIds.push_back(h.get<int64_t>());
        }
      } else {
        return invalidArgument(where(name, lineNo) + "unknown key '" + k +
                               "' (known: timestamp, input_length, output_length, hash_ids)");
      }
    }
    if (!haveTs || !haveIn || !haveOut)
      return invalidArgument(where(name, lineNo) + "missing " +
                             std::string(!haveTs   ? "timestamp"
                                         : !haveIn ? "input_length"
                                                   : "output_length"));
    if (!row.hashIds.empty()) {
      const int64_t want = (row.promptTokens + t.blockTokens - 1) / t.blockTokens;
      if (static_cast<int64_t>(row.hashIds.size()) != want)
        return invalidArgument(where(name, lineNo) + "hash_ids has " + std::to_string(row.hashIds.size()) +
                               " blocks but input_length " + std::to_string(row.promptTokens) + " needs " +
                               std::to_string(want) + " blocks of 512 tokens");
    }
    if (t.rows.empty()) {
      firstMs = ms;
    } else if (ms < prevMs) {
      return invalidArgument(where(name, lineNo) + "timestamp goes backwards (the trace must be sorted by time)");
    }
    prevMs = ms;
    row.arrivalS = (ms - firstMs) / 1000.0;
    t.rows.push_back(std::move(row));
  }
  PD_RETURN_IF_ERROR(finish(&t));
  return t;
}

Result<Trace> loadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return notFound(path + ": cannot open the trace file");
  std::string first;
  char c;
  while (in.get(c)) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      first.push_back(c);
      break;
    }
  }
  in.clear();
  in.seekg(0);
  if (first == "{") return parseMooncakeJsonl(in, path);
  return parseTraceCsv(in, path);
}

}  // namespace pd::bench
