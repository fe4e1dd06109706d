#include "tools/bench/sse.h"

#include <limits>

#include <nlohmann/json.hpp>

namespace pd::bench {

void SseDecoder::endLine(std::vector<SseEvent>* out) {
  if (line_.empty()) {
    if (haveData_) {
      out->push_back(std::move(cur_));
      cur_ = SseEvent{};
      haveData_ = false;
    }
    return;
  }
  if (line_[0] != ':') {
    const size_t colon = line_.find(':');
    std::string_view field(line_.data(), colon == std::string::npos ? line_.size() : colon);
    std::string_view value;
    if (colon != std::string::npos) {
      value = std::string_view(line_).substr(colon + 1);
      if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
    }
    if (field == "data") {
      if (haveData_) cur_.data.push_back('\n');
      cur_.data.append(value);
      haveData_ = true;
    } else if (field == "event") {
      cur_.event.assign(value);
    }
  }
  line_.clear();
}

void SseDecoder::feed(std::string_view bytes, std::vector<SseEvent>* out) {
  for (char c : bytes) {
    if (c == '\n') {
      if (lastCr_) {
        lastCr_ = false;  // the \n of a \r\n pair: the line already ended
        continue;
      }
      endLine(out);
    } else if (c == '\r') {
      lastCr_ = true;
      endLine(out);
    } else {
      lastCr_ = false;
      line_.push_back(c);
    }
  }
}

void StreamAccounting::fail(std::string why) {
  if (error_.empty()) error_ = std::move(why);
}

void StreamAccounting::onEvent(const SseEvent& ev, double tMs) {
  if (done_) return;  // anything after [DONE] is ignored, as the OpenAI SDK does
  if (ev.data == "[DONE]") {
    done_ = true;
    doneMs_ = tMs;
    return;
  }
  nlohmann::json j = nlohmann::json::parse(ev.data, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    fail("malformed chunk: " + ev.data.substr(0, 200));
    return;
  }
  if (ev.event == "error" || j.contains("error")) {
    const auto& e = j.contains("error") ? j["error"] : j;
    std::string msg = e.is_object() && e.contains("message") && e["message"].is_string()
                          ? e["message"].get<std::string>()
                          : ev.data.substr(0, 300);
    fail("stream error: " + msg);
    return;
  }
  int64_t k = -1;
  if (j.contains("usage") && j["usage"].is_object()) {
    const auto& u = j["usage"];
    if (u.contains("pdserve_timing") && u["pdserve_timing"].is_object()) {
      split_.clear();
      for (const auto& [key, v] : u["pdserve_timing"].items()) {
        if (key == "route" && v.is_string()) splitRoute_ = v.get<std::string>();
        if (key.size() > 3 && key.compare(key.size() - 3, 3, "_ms") == 0 && v.is_number())
          split_[key.substr(0, key.size() - 3)] = v.get<double>();
      }
    }
    if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer())
      usagePrompt_ = u["prompt_tokens"].get<int64_t>();
    if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
      const auto& d = u["prompt_tokens_details"];
      if (d.contains("cached_tokens") && d["cached_tokens"].is_number_integer())
        usageCached_ = d["cached_tokens"].get<int64_t>();
    }
    if (u.contains("completion_tokens") && u["completion_tokens"].is_number_integer()) {
      usageCompletion_ = u["completion_tokens"].get<int64_t>();
      const bool hasChoices = j.contains("choices") && j["choices"].is_array() && !j["choices"].empty();
      if (hasChoices) {  // continuous usage: the growth is this chunk's token count
        k = std::max<int64_t>(0, usageCompletion_ - cumulativeSeen_);
        cumulativeSeen_ = std::max(cumulativeSeen_, usageCompletion_);
      }
    }
  }
  if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
    const auto& c = j["choices"][0];
    if (c.contains("finish_reason") && c["finish_reason"].is_string())
      finishReason_ = c["finish_reason"].get<std::string>();
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      for (const auto& id : c["token_ids"])
        if (id.is_number_integer()) tokenIds_.push_back(id.get<int32_t>());
      if (k < 0) k = static_cast<int64_t>(c["token_ids"].size());
    }
    if (k < 0 && c.contains("logprobs") && c["logprobs"].is_object()) {
      const auto& lp = c["logprobs"];
      if (!chat_ && lp.contains("tokens") && lp["tokens"].is_array()) k = static_cast<int64_t>(lp["tokens"].size());
      if (chat_ && lp.contains("content") && lp["content"].is_array()) k = static_cast<int64_t>(lp["content"].size());
    }
    if (k < 0) {
      bool nonEmpty = false;
      if (chat_) {
        if (c.contains("delta") && c["delta"].is_object()) {
          const auto& d = c["delta"];
          for (const char* key : {"content", "reasoning_content", "reasoning"})
            if (d.contains(key) && d[key].is_string() && !d[key].get_ref<const std::string&>().empty()) nonEmpty = true;
          if (d.contains("tool_calls") && d["tool_calls"].is_array() && !d["tool_calls"].empty()) nonEmpty = true;
        }
      } else if (c.contains("text") && c["text"].is_string()) {
        nonEmpty = !c["text"].get_ref<const std::string&>().empty();
      }
      k = nonEmpty ? 1 : 0;
    }
  }
  if (k <= 0) return;
  if (tokens_ == 0) {
    ttftMs_ = tMs;
  } else {
    itls_.push_back(tMs - lastMs_);
  }
  for (int64_t i = 1; i < k; ++i) itls_.push_back(0.0);
  lastMs_ = tMs;
  tokens_ += k;
}

}  // namespace pd::bench
