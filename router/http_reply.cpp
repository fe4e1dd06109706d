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
  ApiError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      e.status = 400;
      break;
    case StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_exceeded";
      e.code = "admission_refused";
      break;
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
      e.status = 503;
      e.type = "service_unavailable";
      break;
    default:
      e.status = 500;
      e.type = "internal_error";
  }
  return e;
}

}  // namespace pd::router
