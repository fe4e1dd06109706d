// `pdserve tokenize`: encode text (or render and encode a chat) with a model's tokenizer and
// print the ids and their pieces.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "tools/commands.h"

namespace pd::tools {
namespace {

struct TokenizeArgs {
  std::string model, text, chatFile;
  bool haveText = false, noGenerationPrompt = false, noSpecial = false, asJson = false;
};

int runTokenize(const TokenizeArgs& args) {
  const std::string& model = args.model;
  const std::string& chatFile = args.chatFile;
  std::string text = args.text;
  const bool generationPrompt = !args.noGenerationPrompt, asJson = args.asJson;
  bool addSpecial = !args.noSpecial;
  if (model.empty() || args.haveText == !chatFile.empty()) {
    std::fprintf(stderr,
                 "pdserve tokenize: give --model and exactly one of --text or --chat "
                 "(see pdserve tokenize --help)\n");
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

}  // namespace

void addTokenizeCommand(CLI::App& pdserve, CommandRun& run) {
  CLI::App* cmd =
      pdserve.add_subcommand("tokenize", "encode text or a chat with a model's tokenizer; prints the ids and pieces");
  auto args = std::make_shared<TokenizeArgs>();
  cmd->add_option("--model", args->model, "a Hugging Face model directory (tokenizer.json, tokenizer_config.json)");
  cmd->add_option_function<std::string>(
      "--text",
      [args](const std::string& v) {
        args->text = v;
        args->haveText = true;
      },
      "text to encode");
  cmd->add_option("--chat", args->chatFile,
                  "FILE.json: a JSON array of {role, content} messages, or an object "
                  "{\"messages\": [...], ...extra template variables}");
  cmd->add_flag("--no-generation-prompt", args->noGenerationPrompt,
                "with --chat: do not end with the assistant prompt");
  cmd->add_flag("--no-special", args->noSpecial, "do not add BOS/EOS (the chat prompt never adds them twice)");
  cmd->add_flag("--json", args->asJson, "print {\"prompt\", \"ids\", \"pieces\"} as JSON");
  cmd->callback([args, &run] { run = [args] { return runTokenize(*args); }; });
}

}  // namespace pd::tools
