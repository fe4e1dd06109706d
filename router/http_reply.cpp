#include "router/http_reply.h"

namespace pd::router {

using nlohmann::json;

void sendJson(const std::shared_ptr<net::HttpResponder>& r, int status, const json& j, net::HttpHeaders headers) {
  headers["content-type"] = "application/json";
  r->sendFull(status, std::move(headers), j.dump(-1, ' ', false, json::error_handler_t::replace));
}

void sendError(const std::shared_ptr<net::HttpResponder>& r, const ApiError& e) {
  net::HttpHeaders h;
  if (e.status == 429 || e.status == 503) h["retry-after"] = std::to_string(e.retryAfterS.value_or(1));
  sendJson(r, e.status, e.toJson(), std::move(h));
}

ApiError apiErrorFor(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return ApiError::invalidRequest(s.message());
    case StatusCode::kResourceExhausted:
      return ApiError::rateLimited(s.message(), "admission_refused");
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
      return ApiError::unavailable(s.message());
    default:
      return ApiError::internal(s.message());
  }
}

}  // namespace pd::router
