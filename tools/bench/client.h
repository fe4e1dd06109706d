// The load generator's network side: an asynchronous HTTP/1.1 client (Boost.Asio +
// Boost.Beast, C++20 coroutines) that sends a workload's requests on schedule to an
// OpenAI-compatible server and records what each stream looked like from the client.
//
// Threads: runLoad() runs one io_context on the calling thread and returns when every sent
// request has finished or timed out; nothing else runs concurrently, and the callbacks in
// RunOptions are called on that thread. One thread holds 1,000+ concurrent streams: a stream
// costs a coroutine frame and a socket (runLoad raises RLIMIT_NOFILE towards its hard limit).
// Errors: per-request failures are recorded (status, body, reason) and never thrown; runLoad
// fails only when the URL cannot be resolved. Every network wait has a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/base/status.h"
#include "tools/bench/stats.h"
#include "tools/bench/workload.h"

namespace pd::bench {

struct ServerTarget {
  std::string host;
  std::string port = "80";
  std::string basePath;     // "" or a prefix such as "/openai" (a trailing /v1 is dropped)
  std::string url() const;  // "http://host:port/prefix"
};
// Accepts "http://host[:port][/prefix][/v1]" or "host:port". https is refused with a message.
Result<ServerTarget> parseServerUrl(std::string_view url);

struct ClientOptions {
  ServerTarget server;
  Endpoint endpoint = Endpoint::kCompletions;
  std::string apiKey;  // sent as "Authorization: Bearer <key>" when not empty
  double connectTimeoutS = 10;
  double idleTimeoutS = 120;     // longest silence between two reads of one stream
  double requestTimeoutS = 900;  // whole-request bound
};

struct ProgressInfo {
  bool warmup = false;
  double elapsedS = 0;
  int64_t total = 0, sent = 0, finished = 0, failed = 0, inFlight = 0;
};

struct RunOptions {
  int64_t maxConcurrency = 0;                                  // 0: no cap
  double durationS = 0;                                        // > 0: send nothing new after this many seconds
  std::function<std::string(const PlannedRequest&)> makeBody;  // required unless turnPromptIds is set
  // Multi-turn replay (multiturn.h): when set, a request's prompt ids come from here (given
  // its previous turn's record, or null when it has none) and its body from makeBodyIds; a
  // request with a previous turn (PlannedRequest::parent) is sent only once that turn has
  // finished (its eligibleS says when). The records keep the prompt and generated ids.
  std::function<std::vector<int32_t>(const PlannedRequest&, const RequestRecord* previous)> turnPromptIds;
  std::function<std::string(const PlannedRequest&, const std::vector<int32_t>&)> makeBodyIds;
  std::function<void(const ProgressInfo&)> onProgress;  // optional
  double progressIntervalS = 0.2;
  // Stop sending when the first responses are all refusals (4xx other than 408/429): a wrong
  // model name or a bad option would otherwise fail every request in the plan.
  bool abortOnRefusal = true;
  // SIGINT/SIGTERM stop the run: nothing new is sent, streams in flight are cancelled (recorded
  // as "cancelled: interrupted"), and runLoad returns what was measured. For the CLI; tests
  // leave it off.
  bool handleSignals = false;
};

struct RunOutput {
  std::vector<RequestRecord> warmups;
  std::vector<RequestRecord> records;  // the measured requests that were sent, in plan order
  double durationS = 0;                // measured phase: first send -> last request finished
  std::string abortReason;             // non-empty when the run stopped early
  // When the measured phase began (its time 0), on the steady clock: the metrics timeline
  // (scraper.h) is aligned to it.
  std::chrono::steady_clock::time_point measuredStart{};
};

Result<RunOutput> runLoad(const ClientOptions& client, const Workload& workload, const RunOptions& opts);

// GET {base}/v1/models. ok() with httpStatus and the model ids (empty when the body is not
// an OpenAI model list); an error only when no HTTP response arrived.
struct ModelList {
  int httpStatus = 0;
  std::vector<std::string> ids;
  std::string body;
};
Result<ModelList> fetchModels(const ClientOptions& client, double timeoutS);

// One GET of `path` on `server` (Connection: close), bounded by timeoutS from connect to the
// last byte; bodies over 64 MiB are an error. A bearer token is sent when not empty. Safe
// from any thread (each call has its own io_context). Errors: no HTTP response.
struct HttpText {
  int httpStatus = 0;
  std::string body;
};
Result<HttpText> httpGetText(const ServerTarget& server, const std::string& path, double timeoutS,
                             const std::string& bearer = "");

}  // namespace pd::bench
