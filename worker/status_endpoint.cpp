#include "worker/status_endpoint.h"

namespace pd::worker {

StatusEndpoint::StatusEndpoint(net::IoPool& io, metrics::Registry& registry,
                               std::function<bool()> healthy)
    : io_(io), registry_(registry), healthy_(std::move(healthy)) {}

Status StatusEndpoint::start(const std::string& host, int port) {
  net::HttpServerOptions opts;
  opts.host = host;
  opts.port = static_cast<uint16_t>(port);
  server_ = std::make_unique<net::HttpServer>(
      io_.context(), opts, [this](net::HttpRequest req, std::shared_ptr<net::HttpResponder> r) {
        if (req.path() == "/health") {
          bool ok = healthy_();
          r->sendFull(ok ? 200 : 503, {{"content-type", "text/plain"}}, ok ? "ok\n" : "not ready\n");
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
