#include "worker/status_endpoint.h"

namespace pd::worker {

StatusEndpoint::StatusEndpoint(net::IoPool& io, metrics::Registry& registry,
                               std::function<std::optional<std::string>()> unhealthy)
    : io_(io), registry_(registry), unhealthy_(std::move(unhealthy)) {}

Status StatusEndpoint::start(const std::string& host, int port) {
  net::HttpServerOptions opts;
  opts.host = host;
  opts.port = static_cast<uint16_t>(port);
  server_ = std::make_unique<net::HttpServer>(
      io_.context(), opts, [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
        if (req.path() == "/health") {
          const auto why = unhealthy_();
          r->sendFull(why ? 503 : 200, {{"content-type", "text/plain"}}, why ? *why + "\n" : "ok\n");
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
