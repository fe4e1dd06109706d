// How the router answers over HTTP: JSON bodies, OpenAI error objects, and the mapping from a
// worker's Status to the HTTP status and error type the client sees. Shared by the service's
// endpoint handlers and the request streams.
//
// Threads: any; the functions only format and hand bytes to an HttpResponder (whose methods
// are thread-safe and never block).
#pragma once

#include <memory>

#include <nlohmann/json.hpp>

#include "common/base/status.h"
#include "common/net/http_server.h"
#include "router/openai_api.h"

namespace pd::router {

// `headers` gain content-type: application/json.
void sendJson(const std::shared_ptr<net::HttpResponder>& r, int status, const nlohmann::json& j,
              net::HttpHeaders headers = {});
// The error object with its status; 429 and 503 carry retry-after (e.retryAfterS, else 1).
void sendError(const std::shared_ptr<net::HttpResponder>& r, const ApiError& e);
// A worker error as the HTTP status and OpenAI error object the client sees.
ApiError apiErrorFor(const Status& s);

}  // namespace pd::router
