#include "tests/unit/bench/fake_openai_server.h"

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

namespace pd::bench::testing {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::awaitable;
using asio::ip::tcp;
using nlohmann::json;

struct FakeOpenAiServer::Impl {
  asio::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  std::thread thread;
  std::atomic<int64_t> served{0};
  std::atomic<int64_t> accepted{0};
  std::atomic<int64_t> open{0};
  std::atomic<int64_t> peak{0};

  awaitable<void> accept() {
    while (true) {
      beast::error_code ec;
      tcp::socket s = co_await acceptor.async_accept(asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return;
      ++accepted;
      asio::co_spawn(ioc, session(std::move(s)), asio::detached);
    }
  }

  awaitable<void> sendJson(tcp::socket& s, http::status st, const std::string& body, bool keepAlive,
                           beast::error_code& ec) {
    http::response<http::string_body> res{st, 11};
    res.set(http::field::content_type, "application/json");
    res.keep_alive(keepAlive);
    res.body() = body;
    res.prepare_payload();
    co_await http::async_write(s, res, asio::redirect_error(asio::use_awaitable, ec));
  }

  awaitable<void> session(tcp::socket s) {
    beast::flat_buffer buf;
    beast::error_code ec;
    while (true) {
      http::request<http::string_body> req;
      co_await http::async_read(s, buf, req, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) break;
      ++served;
      const bool keep = req.keep_alive();
      if (req.method() == http::verb::get && req.target() == "/v1/models") {
        co_await sendJson(
            s, http::status::ok,
            std::string(
                R"({"object":"list","data":[{"id":"test-model","object":"model","created":0,"owned_by":"test"}]})"),
            keep, ec);
        if (ec || !keep) break;
        continue;
      }
      const bool chat = req.target() == "/v1/chat/completions";
      json body = json::parse(req.body(), nullptr, false);
      if (req.method() != http::verb::post || (!chat && req.target() != "/v1/completions") || body.is_discarded()) {
        co_await sendJson(
            s, http::status::bad_request,
            std::string(
                R"({"error":{"message":"bad request","type":"invalid_request_error","param":null,"code":null}})"),
            keep, ec);
        if (ec || !keep) break;
        continue;
      }
      const std::string model = body.value("model", "");
      if (model == "busy") {
        co_await sendJson(
            s, http::status::service_unavailable,
            std::string(
                R"({"error":{"message":"all workers are busy","type":"service_unavailable","param":null,"code":"overloaded"}})"),
            keep, ec);
        if (ec || !keep) break;
        continue;
      }
      if (model != "test-model") {
        co_await sendJson(
            s, http::status::not_found,
            R"({"error":{"message":"The model `)" + model +
                R"(` does not exist.","type":"invalid_request_error","param":"model","code":"model_not_found"}})",
            keep, ec);
        if (ec || !keep) break;
        continue;
      }
      co_await stream(s, body, chat, ec);
      if (ec || !keep) break;
    }
    s.shutdown(tcp::socket::shutdown_both, ec);
  }

  awaitable<void> stream(tcp::socket& s, const json& body, bool chat, beast::error_code& ec) {
    const int64_t open_ = ++open;
    for (int64_t p = peak.load(); open_ > p && !peak.compare_exchange_weak(p, open_);) {
    }
    const int64_t maxTokens = body.value("max_tokens", 16);
    const double ttftMs = body.value("test_ttft_ms", 20.0);
    const double itlMs = body.value("test_itl_ms", 5.0);
    const int64_t perChunk = std::max<int64_t>(1, body.value("test_chunk", 1));
    const int64_t failAfter = body.value("test_fail_after", -1);
    const int64_t promptTokens =
        body.contains("prompt") && body["prompt"].is_array() ? static_cast<int64_t>(body["prompt"].size()) : 3;
    http::response<http::empty_body> res{http::status::ok, 11};
    res.set(http::field::content_type, "text/event-stream");
    res.chunked(true);
    http::response_serializer<http::empty_body> sr{res};
    co_await http::async_write_header(s, sr, asio::redirect_error(asio::use_awaitable, ec));
    asio::steady_timer timer(ioc);
    auto send = [&](const std::string& data) -> awaitable<void> {
      const std::string ev = "data: " + data + "\n\n";
      co_await asio::async_write(s, http::make_chunk(asio::buffer(ev)), asio::redirect_error(asio::use_awaitable, ec));
    };
    auto sleepMs = [&](double ms) -> awaitable<void> {
      timer.expires_after(std::chrono::microseconds(static_cast<int64_t>(ms * 1000)));
      beast::error_code tec;
      co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, tec));
    };
    if (chat && !ec)
      co_await send(std::string(
          R"({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})"));
    int64_t sent = 0;
    bool first = true;
    while (!ec && sent < maxTokens) {
      co_await sleepMs(first ? ttftMs : itlMs);
      first = false;
      if (failAfter >= 0 && sent >= failAfter) {
        co_await send(std::string(
            R"({"error":{"message":"scripted failure","type":"InternalServerError","param":null,"code":500}})"));
        break;
      }
      const int64_t k = std::min(perChunk, maxTokens - sent);
      json ids = json::array();
      std::string text;
      for (int64_t i = 0; i < k; ++i) {
        ids.push_back(100 + sent + i);
        text += "t";
      }
      sent += k;
      json chunk;
      if (chat) {
        chunk = {
            {"id", "c1"},
            {"object", "chat.completion.chunk"},
            {"choices", json::array({{{"index", 0}, {"delta", {{"content", text}}}, {"finish_reason", nullptr}}})}};
      } else {
        chunk = {{"id", "c1"},
                 {"object", "text_completion"},
                 {"choices", json::array({{{"index", 0}, {"text", text}, {"finish_reason", nullptr}}})}};
      }
      if (perChunk > 1) chunk["choices"][0]["token_ids"] = ids;
      co_await send(chunk.dump());
    }
    if (!ec && sent == maxTokens) {
      co_await send(
          std::string(R"({"id":"c1","choices":[{"index":0,"text":"","delta":{},"finish_reason":"length"}]})"));
      // Built outside the co_await: GCC 12 rejects array temporaries in an awaited expression.
      const std::string usage =
          json{{"id", "c1"},
               {"choices", json::array()},
               {"usage",
                {{"prompt_tokens", promptTokens}, {"completion_tokens", sent}, {"total_tokens", promptTokens + sent}}}}
              .dump();
      co_await send(usage);
    }
    if (!ec) co_await send(std::string("[DONE]"));
    if (!ec) co_await asio::async_write(s, http::make_chunk_last(), asio::redirect_error(asio::use_awaitable, ec));
    --open;
  }
};

FakeOpenAiServer::FakeOpenAiServer() : impl_(std::make_unique<Impl>()) {
  tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), 0);
  impl_->acceptor.open(ep.protocol());
  impl_->acceptor.set_option(asio::socket_base::reuse_address(true));
  impl_->acceptor.bind(ep);
  impl_->acceptor.listen(4096);
  asio::co_spawn(impl_->ioc, impl_->accept(), asio::detached);
  impl_->thread = std::thread([this] { impl_->ioc.run(); });
}

FakeOpenAiServer::~FakeOpenAiServer() {
  impl_->ioc.stop();
  impl_->thread.join();
}

uint16_t FakeOpenAiServer::port() const { return impl_->acceptor.local_endpoint().port(); }
int64_t FakeOpenAiServer::requestsServed() const { return impl_->served.load(); }
int64_t FakeOpenAiServer::peakOpenStreams() const { return impl_->peak.load(); }

}  // namespace pd::bench::testing

namespace pd::bench::testing {
int64_t FakeOpenAiServer::connectionsAccepted() const { return impl_->accepted.load(); }
}  // namespace pd::bench::testing
