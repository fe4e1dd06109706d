// `pdserve tokenize`: encode text (or render and encode a chat) with a model's tokenizer and
// print the ids and their pieces.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

void usage() {
  std::fprintf(stderr,
               "usage: pdserve tokenize --model DIR (--text TEXT | --chat FILE.json) [options]\n"
               "  --model DIR          a Hugging Face model directory (tokenizer.json,\n"
               "                       tokenizer_config.json)\n"
               "  --text TEXT          text to encode\n"
               "  --chat FILE.json     a JSON array of {role, content} messages, or an object\n"
               "                       {\"messages\": [...], ...extra template variables}\n"
               "  --no-generation-prompt  with --chat: do not end with the assistant prompt\n"
               "  --no-special         do not add BOS/EOS (the chat prompt never adds them twice)\n"
               "  --json               print {\"prompt\", \"ids\", \"pieces\"} as JSON\n");
}

}  // namespace

int runTokenize(int argc, char** argv) {
  std::string model, text, chatFile;
  bool haveText = false, generationPrompt = true, addSpecial = true, asJson = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "pdserve tokenize: %s needs a value\n", a.c_str());
        return false;
      }
      out = argv[++i];
      return true;
    };
    if (a == "--model") {
      if (!value(model)) return 2;
    } else if (a == "--text") {
      if (!value(text)) return 2;
      haveText = true;
    } else if (a == "--chat") {
      if (!value(chatFile)) return 2;
    } else if (a == "--no-generation-prompt") {
      generationPrompt = false;
    } else if (a == "--no-special") {
      addSpecial = false;
    } else if (a == "--json") {
      asJson = true;
    } else if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "pdserve tokenize: unknown option '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (model.empty() || haveText == !chatFile.empty()) {
    std::fprintf(stderr, "pdserve tokenize: give --model and exactly one of --text or --chat\n");
    usage();
    return 2;
  }
  auto tok = tok::Tokenizer::loadDir(model);
  if (!tok.ok()) {
    std::fprintf(stderr, "pdserve tokenize: %s\n", tok.status().toString().c_str());
    return 1;
  }
  if (!chatFile.empty()) {
    std::ifstream in(chatFile);
    if (!in) {
      std::fprintf(stderr, "pdserve tokenize: %s: cannot open\n", chatFile.c_str());
      return 1;
    }
    nlohmann::ordered_json doc;
    try {
      doc = nlohmann::ordered_json::parse(in);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pdserve tokenize: %s is not valid JSON: %s\n", chatFile.c_str(), e.what());
      return 1;
    }
    tok::ChatOptions opts;
    opts.addGenerationPrompt = generationPrompt;
    nlohmann::ordered_json messages = doc;
    if (doc.is_object()) {
      messages = doc.value("messages", nlohmann::ordered_json::array());
      for (auto it = doc.begin(); it != doc.end(); ++it)
        if (it.key() != "messages") opts.extra[it.key()] = it.value();
    }
    auto tpl = tok::ChatTemplate::forTokenizer(**tok);
    if (!tpl.ok()) {
      std::fprintf(stderr, "pdserve tokenize: %s\n", tpl.status().toString().c_str());
      return 1;
    }
    if (tpl->isDefault())
      std::fprintf(stderr, "pdserve tokenize: model has no chat_template; using the ChatML default\n");
    auto prompt = tpl->render(messages, opts);
    if (!prompt.ok()) {
      std::fprintf(stderr, "pdserve tokenize: %s\n", prompt.status().toString().c_str());
      return 1;
    }
    text = *prompt;
    addSpecial = false;  // templates write BOS themselves (as transformers' apply_chat_template)
  }
  auto ids = (*tok)->encode(text, addSpecial);
  if (!ids.ok()) {
    std::fprintf(stderr, "pdserve tokenize: %s\n", ids.status().toString().c_str());
    return 1;
  }
  if (asJson) {
    nlohmann::ordered_json out;
    out["prompt"] = text;
    out["ids"] = *ids;
    nlohmann::ordered_json pieces = nlohmann::ordered_json::array();
    for (auto id : *ids) pieces.push_back((*tok)->idToToken(id));
    out["pieces"] = pieces;
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    return 0;
  }
  if (!chatFile.empty()) std::printf("prompt: %s\n", nlohmann::json(text).dump().c_str());
  std::printf("%zu tokens\n", ids->size());
  for (auto id : *ids) {
    std::printf(
        "%8d  %s\n", id,
        nlohmann::json((*tok)->idToToken(id)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  return 0;
}

}  // namespace pd::tools
