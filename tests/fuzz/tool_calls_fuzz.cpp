// The tool-call parsers (router/tool_calls.h) on model output, which can be anything. Input:
// byte 0 picks the syntax and the chunking, the rest is the answer's text. Every call must
// return; a call's arguments are always a JSON object's text; streamed in pieces, the answer
// comes out as the same content and the same calls as parsed whole.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "router/tool_calls.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pd::router;
  if (size < 1) return 0;
  const ToolCallFormat formats[] = {ToolCallFormat::kHermes, ToolCallFormat::kLlama3Json, ToolCallFormat::kMistral};
  const ToolCallFormat f = formats[data[0] % 3];
  const size_t piece = 1 + (data[0] >> 2) % 17;  // the stream's chunk size
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  ParsedToolOutput whole = parseToolCalls(f, text);
  for (const auto& c : whole.calls) {
    PD_FUZZ_CHECK(!c.name.empty(), "a call has a name");
    auto args = nlohmann::json::parse(c.arguments, nullptr, false);
    PD_FUZZ_CHECK(args.is_object(), "arguments are a JSON object");
    PD_FUZZ_CHECK(c.id.starts_with("call_"), "ids are call_...");
  }
  if (whole.calls.empty()) PD_FUZZ_CHECK(whole.content == text, "no call: the whole text is content");

  ToolCallStreamer s(f);
  std::string content;
  for (size_t at = 0; at < text.size(); at += piece) content += s.push(text.substr(at, piece)).content;
  auto end = s.finish();
  content += end.content;
  size_t heads = 0;
  for (const auto& d : end.calls) heads += d.id ? 1 : 0;
  PD_FUZZ_CHECK(heads == end.calls.size() / 2, "each call: a head delta and an arguments delta");
  if (!s.sawCalls()) PD_FUZZ_CHECK(content == text, "no call: the stream's content is the text");
  return 0;
}
