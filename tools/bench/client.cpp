// The only translation unit of pd_bench that includes Boost.Beast (compile time: DESIGN §9).
#include "tools/bench/client.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <memory>
#include <unordered_set>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "tools/bench/sse.h"

namespace pd::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::awaitable;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

std::string ServerTarget::url() const { return "http://" + host + ":" + port + basePath; }

Result<ServerTarget> parseServerUrl(std::string_view url) {
  std::string u(url);
  if (u.rfind("https://", 0) == 0)
    return invalidArgument("--url: https is not supported by the generator; use plain http (" + u + ")");
  if (u.rfind("http://", 0) == 0) u = u.substr(7);
  ServerTarget t;
  const size_t slash = u.find('/');
  std::string hostPort = u.substr(0, slash);
  t.basePath = slash == std::string::npos ? "" : u.substr(slash);
  while (!t.basePath.empty() && t.basePath.back() == '/') t.basePath.pop_back();
  if (t.basePath.size() >= 3 && t.basePath.compare(t.basePath.size() - 3, 3, "/v1") == 0)
    t.basePath.resize(t.basePath.size() - 3);
  if (hostPort.empty()) return invalidArgument("--url: no host in '" + std::string(url) + "'");
  const size_t colon = hostPort.rfind(':');
  if (colon != std::string::npos && hostPort.find(']') == std::string::npos) {
    t.host = hostPort.substr(0, colon);
    t.port = hostPort.substr(colon + 1);
    if (t.port.empty() || t.port.size() > 5 || t.port.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(t.port) < 1 || std::stoi(t.port) > 65535)
      return invalidArgument("--url: port '" + t.port + "' is not a number in [1, 65535]");
  } else {
    t.host = hostPort;
  }
  if (t.host.empty()) return invalidArgument("--url: no host in '" + std::string(url) + "'");
  return t;
}

namespace {

std::chrono::milliseconds ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, s) * 1000.0));
}

double msBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void raiseFdLimit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t want = std::min<rlim_t>(rl.rlim_max, 65536);
  if (rl.rlim_cur < want) {
    rl.rlim_cur = want;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

bool isRefusal(int status) { return status >= 400 && status < 500 && status != 408 && status != 429; }

class Runner {
 public:
  Runner(const ClientOptions& c, const RunOptions& o, tcp::resolver::results_type eps)
      : c_(c),
        o_(o),
        endpoints_(std::move(eps)),
        slotTimer_(ioc_),
        progressTimer_(ioc_),
        dispatchTimer_(ioc_),
        signals_(ioc_) {
    target_ = c_.server.basePath + endpointPath(c_.endpoint);
  }

  RunOutput run(const Workload& w) {
    asio::co_spawn(ioc_, main(w), asio::detached);
    ioc_.run();
    return std::move(out_);
  }

 private:
  awaitable<void> main(const Workload& w) {
    asio::co_spawn(ioc_, progressLoop(), asio::detached);
    if (o_.handleSignals) {
      signals_.add(SIGINT);
      signals_.add(SIGTERM);
      signals_.async_wait([this](const beast::error_code& ec, int) {
        if (ec) return;
        interrupted_ = true;
        if (abort_.empty()) abort_ = "interrupted by a signal";
        dispatchTimer_.cancel();
        for (auto* st : active_) st->cancel();
      });
    }
    if (!w.warmups.empty()) {
      warmup_ = true;
      co_await phase(w.warmups, &out_.warmups, /*useSchedule=*/false);
      warmup_ = false;
    }
    if (abort_.empty()) co_await phase(w.requests, &out_.records, /*useSchedule=*/true);
    out_.measuredStart = t0_;
    out_.durationS = std::chrono::duration<double>(Clock::now() - t0_).count();
    out_.abortReason = abort_;
    if (o_.onProgress) {  // the final state, so a progress bar ends at its true count
      ProgressInfo pi;
      pi.elapsedS = out_.durationS;
      pi.total = total_;
      pi.sent = sent_;
      pi.finished = doneCount_;
      pi.failed = failedCount_;
      o_.onProgress(pi);
    }
    finished_ = true;
    progressTimer_.cancel();
    beast::error_code sec;
    signals_.cancel(sec);
    for (auto& s : idle_) {
      beast::error_code ec;
      s->socket().shutdown(tcp::socket::shutdown_both, ec);
    }
    idle_.clear();
  }

  // Sends `plan` (on its schedule or back to back), then waits for every sent request.
  awaitable<void> phase(const std::vector<PlannedRequest>& plan, std::vector<RequestRecord>* recs, bool useSchedule) {
    recs->assign(plan.size(), RequestRecord{});
    plan_ = &plan;
    recs_ = recs;
    done_.assign(plan.size(), 0);
    t0_ = Clock::now();
    total_ = static_cast<int64_t>(plan.size());
    sent_ = doneCount_ = failedCount_ = 0;
    size_t i = 0;
    asio::steady_timer& timer = dispatchTimer_;
    for (; i < plan.size() && abort_.empty(); ++i) {
      const PlannedRequest& p = plan[i];
      const auto due = t0_ + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(useSchedule ? p.scheduledS : 0.0));
      if (useSchedule && o_.durationS > 0 && Clock::now() - t0_ >= std::chrono::duration<double>(o_.durationS)) break;
      if (Clock::now() < due) {
        timer.expires_at(due);
        beast::error_code ec;
        co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      }
      auto eligible = due;
      if (o_.maxConcurrency > 0 && inFlight_ >= o_.maxConcurrency) {
        while (inFlight_ >= o_.maxConcurrency) co_await waitSlot();
        eligible = std::max(due, lastSlotFreed_);
      }
      if (!abort_.empty()) break;
      RequestRecord& r = (*recs)[i];
      r.index = p.index;
      r.scheduledS = std::chrono::duration<double>(due - t0_).count();
      r.eligibleS = std::chrono::duration<double>(eligible - t0_).count();
      ++inFlight_;
      ++sent_;
      asio::co_spawn(ioc_, request(&p, &r), asio::detached);
    }
    recs->resize(i);
    while (inFlight_ > 0) co_await waitSlot();
  }

  awaitable<void> waitSlot() {
    slotTimer_.expires_at(Clock::time_point::max());
    beast::error_code ec;
    co_await slotTimer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }

  awaitable<void> progressLoop() {
    while (!finished_) {
      if (o_.onProgress) {
        ProgressInfo pi;
        pi.warmup = warmup_;
        pi.elapsedS = std::chrono::duration<double>(Clock::now() - t0_).count();
        pi.total = total_;
        pi.sent = sent_;
        pi.finished = doneCount_;
        pi.failed = failedCount_;
        pi.inFlight = inFlight_;
        o_.onProgress(pi);
      }
      progressTimer_.expires_after(ms(o_.progressIntervalS));
      beast::error_code ec;
      co_await progressTimer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
  }

  void onRequestDone(RequestRecord* r) {
    --inFlight_;
    ++doneCount_;
    if (!r->ok) ++failedCount_;
    if (r->ok) anySuccess_ = true;
    if (o_.abortOnRefusal && !r->ok && !anySuccess_ && isRefusal(r->httpStatus) && abort_.empty())
      abort_ = "the server refused the first request(s): " + r->error;
    lastSlotFreed_ = Clock::now();
    slotTimer_.cancel();
  }

  std::unique_ptr<beast::tcp_stream> takeIdle() {
    if (idle_.empty()) return nullptr;
    auto s = std::move(idle_.back());
    idle_.pop_back();
    return s;
  }

  awaitable<void> request(const PlannedRequest* p, RequestRecord* r) {
    const size_t pos = static_cast<size_t>(p - plan_->data());
    std::string body;
    if (o_.turnPromptIds) {
      const RequestRecord* previous = nullptr;
      if (p->parent >= 0 && static_cast<size_t>(p->parent) < pos) {
        // The next turn of a conversation: its prompt holds the previous answer.
        asio::steady_timer wait(ioc_);
        while (!done_[static_cast<size_t>(p->parent)] && !interrupted_) {
          wait.expires_after(std::chrono::milliseconds(5));
          beast::error_code ec;
          co_await wait.async_wait(asio::redirect_error(asio::use_awaitable, ec));
        }
        previous = &(*recs_)[static_cast<size_t>(p->parent)];
        r->eligibleS = std::max(r->eligibleS, std::chrono::duration<double>(Clock::now() - t0_).count());
      }
      r->promptIds = o_.turnPromptIds(*p, previous);
      body = o_.makeBodyIds(*p, r->promptIds);
    } else {
      body = o_.makeBody(*p);
    }
    r->plannedPromptTokens = r->promptTokens = p->promptTokens;
    r->plannedOutputTokens = p->outputTokens;
    const auto start = Clock::now();
    r->startS = std::chrono::duration<double>(start - t0_).count();
    const auto deadline = start + ms(c_.requestTimeoutS);
    auto opTimeout = [&]() {
      const auto left = deadline - Clock::now();
      const auto idle = std::chrono::duration_cast<Clock::duration>(ms(c_.idleTimeoutS));
      return std::max(Clock::duration::zero(), std::min(left, idle));
    };

    http::request<http::string_body> req{http::verb::post, target_, 11};
    req.set(http::field::host, c_.server.host);
    req.set(http::field::user_agent, "pdserve-bench");
    req.set(http::field::content_type, "application/json");
    req.set(http::field::accept, "text/event-stream");
    if (!c_.apiKey.empty()) req.set(http::field::authorization, "Bearer " + c_.apiKey);
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();

    StreamAccounting acct(c_.endpoint == Endpoint::kChat);
    std::string errBody;
    std::string failure;
    int status = 0;
    bool bodyComplete = false;
    bool keepAlive = false;
    std::unique_ptr<beast::tcp_stream> s;
    for (int attempt = 0; attempt < 2; ++attempt) {
      beast::error_code ec;
      if (s) active_.erase(s.get());
      s = attempt == 0 ? takeIdle() : nullptr;  // a retry never takes another idle socket: it may be stale too
      const bool reused = s != nullptr;
      if (!s) s = std::make_unique<beast::tcp_stream>(ioc_);
      active_.insert(s.get());
      if (interrupted_) {
        failure = "cancelled: interrupted";
        break;
      }
      if (!reused) {
        s->expires_after(std::min(opTimeout(), std::chrono::duration_cast<Clock::duration>(ms(c_.connectTimeoutS))));
        co_await s->async_connect(endpoints_, asio::redirect_error(asio::use_awaitable, ec));
        if (ec) {
          failure = "connect: " + c_.server.url() + ": " + ec.message();
          break;
        }
        s->socket().set_option(tcp::no_delay(true), ec);
      }
      s->expires_after(opTimeout());
      co_await http::async_write(*s, req, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        if (reused && attempt == 0) continue;  // a kept-alive socket the server had closed
        failure = "write: " + ec.message();
        break;
      }
      beast::flat_buffer buf;
      http::response_parser<http::buffer_body> parser;
      parser.body_limit(std::numeric_limits<std::uint64_t>::max());
      s->expires_after(opTimeout());
      co_await http::async_read_header(*s, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) {
        if (reused && attempt == 0 &&
            (ec == http::error::end_of_stream || ec == asio::error::connection_reset || ec == asio::error::eof))
          continue;
        failure = ec == beast::error::timeout ? "timeout: no response header" : "read: " + ec.message();
        break;
      }
      status = static_cast<int>(parser.get().result_int());
      SseDecoder decoder;
      std::vector<SseEvent> events;
      char chunk[16384];
      while (!parser.is_done()) {
        parser.get().body().data = chunk;
        parser.get().body().size = sizeof chunk;
        s->expires_after(opTimeout());
        co_await http::async_read_some(*s, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
        if (ec == http::error::need_buffer) ec = {};
        const size_t n = sizeof chunk - parser.get().body().size;
        const double tMs = msBetween(start, Clock::now());
        if (n > 0) {
          if (status == 200) {
            events.clear();
            decoder.feed(std::string_view(chunk, n), &events);
            for (const auto& ev : events) acct.onEvent(ev, tMs);
            if (acct.failed()) break;
          } else if (errBody.size() < 4096) {
            errBody.append(chunk, std::min(n, 4096 - errBody.size()));
          }
        }
        if (ec) {
          if (ec == beast::error::timeout)
            failure = Clock::now() >= deadline
                          ? "timeout: the request exceeded " + std::to_string(c_.requestTimeoutS) + " s"
                          : "timeout: the stream was silent for " + std::to_string(c_.idleTimeoutS) + " s";
          else
            failure = "read: " + ec.message();
          break;
        }
      }
      bodyComplete = parser.is_done();
      keepAlive = bodyComplete && parser.keep_alive();
      break;
    }
    if (s) active_.erase(s.get());
    if (interrupted_ && !failure.empty()) failure = "cancelled: interrupted";
    const auto end = Clock::now();
    r->httpStatus = status;
    r->chunkTokens = acct.chunkTokens();
    r->ttftMs = acct.ttftMs();
    r->e2eMs = acct.done() ? acct.doneMs() : msBetween(start, end);
    r->finishReason = acct.finishReason();
    r->outputTokens = acct.usageCompletionTokens() >= 0 ? acct.usageCompletionTokens() : acct.chunkTokens();
    if (acct.usagePromptTokens() >= 0) r->promptTokens = acct.usagePromptTokens();
    r->itlsMs = acct.takeItls();
    r->ttftSplitMs = acct.ttftSplitMs();
    r->ttftSplitRoute = acct.ttftSplitRoute();
    r->cachedTokens = acct.usageCachedTokens();
    if (o_.turnPromptIds) r->generatedIds = acct.takeTokenIds();
    r->endS = std::chrono::duration<double>(end - t0_).count();
    if (!failure.empty()) {
      r->error = failure;
    } else if (status != 200) {
      r->error = "HTTP " + std::to_string(status) + ": " + errBody;
    } else if (acct.failed()) {
      r->error = acct.error();
    } else if (acct.chunkTokens() == 0) {
      r->error = "no tokens: the stream ended without a token-bearing chunk";
    } else {
      r->ok = true;
    }
    if (s && keepAlive && r->ok && acct.done()) {
      idle_.push_back(std::move(s));
    } else if (s) {
      beast::error_code ec;
      s->socket().shutdown(tcp::socket::shutdown_both, ec);
      s->close();
    }
    if (pos < done_.size()) done_[pos] = 1;
    onRequestDone(r);
  }

  const ClientOptions& c_;
  const RunOptions& o_;
  asio::io_context ioc_{1};
  tcp::resolver::results_type endpoints_;
  std::string target_;
  asio::steady_timer slotTimer_;
  asio::steady_timer progressTimer_;
  asio::steady_timer dispatchTimer_;
  asio::signal_set signals_;
  std::unordered_set<beast::tcp_stream*> active_;  // streams with a request on them
  bool interrupted_ = false;
  std::vector<std::unique_ptr<beast::tcp_stream>> idle_;
  Clock::time_point t0_ = Clock::now();
  Clock::time_point lastSlotFreed_ = Clock::now();
  int64_t inFlight_ = 0, sent_ = 0, doneCount_ = 0, failedCount_ = 0, total_ = 0;
  bool warmup_ = false;
  bool finished_ = false;
  bool anySuccess_ = false;
  std::string abort_;
  RunOutput out_;
  // The phase being sent: its plan, its records, and which of them have finished (a next
  // turn waits on its previous one).
  const std::vector<PlannedRequest>* plan_ = nullptr;
  std::vector<RequestRecord>* recs_ = nullptr;
  std::vector<char> done_;
};

Result<tcp::resolver::results_type> resolve(const ServerTarget& t) {
  asio::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::error_code ec;
  auto eps = resolver.resolve(t.host, t.port, ec);
  if (ec) return unavailable("cannot resolve " + t.host + ":" + t.port + ": " + ec.message());
  return eps;
}

}  // namespace

Result<RunOutput> runLoad(const ClientOptions& client, const Workload& workload, const RunOptions& opts) {
  if (!opts.makeBody && !(opts.turnPromptIds && opts.makeBodyIds))
    return invalidArgument("runLoad: RunOptions.makeBody (or turnPromptIds and makeBodyIds) is required");
  PD_ASSIGN_OR_RETURN(auto eps, resolve(client.server));
  raiseFdLimit();
  Runner runner(client, opts, std::move(eps));
  return runner.run(workload);
}

Result<ModelList> fetchModels(const ClientOptions& client, double timeoutS) {
  PD_ASSIGN_OR_RETURN(HttpText t,
                      httpGetText(client.server, client.server.basePath + "/v1/models", timeoutS, client.apiKey));
  ModelList ml;
  ml.httpStatus = t.httpStatus;
  ml.body = std::move(t.body);
  nlohmann::json j = nlohmann::json::parse(ml.body, nullptr, false);
  if (!j.is_discarded() && j.is_object() && j.contains("data") && j["data"].is_array())
    for (const auto& m : j["data"])
      if (m.is_object() && m.contains("id") && m["id"].is_string()) ml.ids.push_back(m["id"].get<std::string>());
  return ml;
}

Result<HttpText> httpGetText(const ServerTarget& server, const std::string& path, double timeoutS,
                             const std::string& bearer) {
  PD_ASSIGN_OR_RETURN(auto eps, resolve(server));
  asio::io_context ioc;
  Result<HttpText> result = unavailable("GET " + path + ": no response");
  auto task = [&]() -> awaitable<void> {
    beast::tcp_stream s(ioc);
    beast::error_code ec;
    s.expires_after(ms(timeoutS));
    co_await s.async_connect(eps, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      result = unavailable("cannot connect to " + server.host + ":" + server.port + ": " + ec.message());
      co_return;
    }
    http::request<http::empty_body> req{http::verb::get, path, 11};
    req.set(http::field::host, server.host);
    req.set(http::field::user_agent, "pdserve-bench");
    req.set(http::field::connection, "close");
    if (!bearer.empty()) req.set(http::field::authorization, "Bearer " + bearer);
    co_await http::async_write(s, req, asio::redirect_error(asio::use_awaitable, ec));
    beast::flat_buffer buf;
    http::response_parser<http::string_body> parser;
    parser.body_limit(64 << 20);
    if (!ec) co_await http::async_read(s, buf, parser, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      result = unavailable(ec == beast::error::timeout
                               ? "timeout after " + std::to_string(static_cast<int64_t>(timeoutS * 1000)) + " ms"
                               : "GET " + path + ": " + ec.message());
      co_return;
    }
    HttpText t;
    t.httpStatus = static_cast<int>(parser.get().result_int());
    t.body = std::move(parser.get().body());
    result = std::move(t);
    s.socket().shutdown(tcp::socket::shutdown_both, ec);
  };
  asio::co_spawn(ioc, task(), asio::detached);
  ioc.run();
  return result;
}

}  // namespace pd::bench
