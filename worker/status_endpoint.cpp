#include "worker/status_endpoint.h"

#include <nlohmann/json.hpp>

namespace pd::worker {

StatusEndpoint::StatusEndpoint(net::IoPool& io, metrics::Registry& registry,
                               std::function<std::optional<Unhealthy>()> unhealthy)
    : io_(io), registry_(registry), unhealthy_(std::move(unhealthy)) {}

Status StatusEndpoint::start(const std::string& host, int port) {
  net::HttpServerOptions opts;
  opts.host = host;
  opts.port = static_cast<uint16_t>(port);
  server_ = std::make_unique<net::HttpServer>(
      io_.context(), opts, [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
        if (req.path() == "/health") {
          const auto why = unhealthy_();
          if (!why) return r->sendFull(200, {{"content-type", "text/plain"}}, "ok\n");
          const nlohmann::json body = {{"status", why->status}, {"reason", why->reason}};
          r->sendFull(503, {{"content-type", "application/json"}}, body.dump() + "\n");
        } else if (req.path() == "/metrics") {
          r->sendFull(200, {{"content-type", "text/plain; version=0.0.4"}}, registry_.serialize());
        } else {
          r->sendFull(404, {{"content-type", "text/plain"}}, "not found\n");
        }
      });
  return server_->start();
}

int StatusEndpoint::port() const { return server_ ? server_->port() : 0; }

}  // namespace pd::worker
