#include "worker/router_links.h"

#include <netdb.h>
#include <sys/socket.h>

#include <cstring>

#include "common/base/log.h"

namespace pd::worker {

RouterLinks::RouterLinks(net::IoPool& io, LoopInbox& inbox, std::vector<RouterTarget> targets,
                         net::ConnectionOptions options, Handlers handlers, std::chrono::milliseconds reresolve)
    : io_(io),
      inbox_(inbox),
      targets_(std::move(targets)),
      options_(std::move(options)),
      handlers_(std::move(handlers)),
      reresolve_(reresolve) {}

RouterLinks::~RouterLinks() { stop(); }

std::map<std::string, bool> RouterLinks::resolveAll(std::vector<std::string>* failed) const {
  std::map<std::string, bool> out;
  for (const RouterTarget& t : targets_) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(t.host.c_str(), std::to_string(t.port).c_str(), &hints, &res);
    if (rc != 0) {
      failed->push_back(t.host + ": " + ::gai_strerror(rc));
      continue;
    }
    for (addrinfo* a = res; a; a = a->ai_next) {
      char host[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) continue;
      out[std::string(host) + ":" + std::to_string(t.port)] = true;
    }
    ::freeaddrinfo(res);
  }
  return out;
}

// Starts a link for every new address and stops those whose name no longer lists them.
void RouterLinks::sync() {
  std::vector<std::string> failed;
  const auto addresses = resolveAll(&failed);
  for (const auto& why : failed) PD_LOG(kWarn, "worker") << "router " << why << " (keeping its current links)";
  std::vector<std::shared_ptr<RouterLink>> started, stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [address, unused] : addresses) {
      if (links_.count(address)) continue;
      const auto colon = address.rfind(':');
      const RouterId id = nextId_++;
      auto link = std::make_shared<RouterLink>(
          io_, inbox_, address.substr(0, colon), std::atoi(address.c_str() + colon + 1), options_,
          RouterLink::Handlers{[this, id](proto::Envelope&& env) { handlers_.onMessage(id, std::move(env)); },
                               [this, id](bool up, const Status& why) { handlers_.onState(id, up, why); }});
      links_[address] = Link{id, link};
      started.push_back(link);
    }
    if (failed.empty()) {
      for (auto it = links_.begin(); it != links_.end();) {
        if (addresses.count(it->first)) {
          ++it;
          continue;
        }
        PD_LOG(kInfo, "worker") << "router " << it->first << " is no longer listed; leaving it";
        stopped.push_back(it->second.link);
        it = links_.erase(it);
      }
    }
  }
  for (auto& l : started) l->start();
  for (auto& l : stopped) l->stop();  // outside the lock: it joins the link's thread
}

void RouterLinks::start() {
  sync();
  resolver_ = std::thread([this] { resolverLoop(); });
}

void RouterLinks::resolverLoop() {
  while (!stopping_) {
    {
      std::unique_lock<std::mutex> lock(waitMu_);
      cv_.wait_for(lock, reresolve_, [this] { return stopping_.load(); });
    }
    if (!stopping_) sync();
  }
}

void RouterLinks::stop() {
  {
    std::lock_guard<std::mutex> lock(waitMu_);
    if (stopping_.exchange(true)) return;
  }
  cv_.notify_all();
  if (resolver_.joinable()) resolver_.join();
  std::map<std::string, Link> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links.swap(links_);
  }
  for (auto& [address, l] : links) l.link->stop();
}

Status RouterLinks::send(RouterId router, proto::Envelope env) {
  std::shared_ptr<RouterLink> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [address, l] : links_)
      if (l.id == router) link = l.link;
  }
  if (!link) return unavailable("router link " + std::to_string(router) + " is gone");
  return link->send(std::move(env));
}

void RouterLinks::broadcast(const proto::Envelope& env, bool kvEventsOnly) {
  std::vector<std::shared_ptr<RouterLink>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [address, l] : links_)
      if (l.link->isUp() && (!kvEventsOnly || l.link->peerTakesKvEvents())) links.push_back(l.link);
  }
  for (auto& l : links) (void)l->send(env);
}

bool RouterLinks::takesKvEvents(RouterId router) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [address, l] : links_)
    if (l.id == router) return l.link->peerTakesKvEvents();
  return false;
}

std::string RouterLinks::refusal() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [address, l] : links_)
    if (std::string why = l.link->refusal(); !why.empty()) return "router " + address + ": " + why;
  return "";
}

bool RouterLinks::anyUp() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [address, l] : links_)
    if (l.link->isUp()) return true;
  return false;
}

}  // namespace pd::worker
