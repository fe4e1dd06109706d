// pdserve: one binary, one subcommand per job (docs/design.md §2, tools/).
#include <cstdio>
#include <cstring>
#include <iterator>

#include "tools/commands.h"

namespace pd::tools {
namespace {

const Command kCommands[] = {
    {"version", "print the version", runVersion},
    {"make-model", "write a small random-weight HF model directory", runMakeModel},
    {"generate", "run the engine in-process on token ids (greedy)", runGenerate},
    {"up", "start a local cluster (router + workers) and supervise it", runUp},
    {"tokenize", "encode text or a chat with a model's tokenizer", runTokenize},
    {"bench", "load-test an OpenAI-compatible server (TTFT, ITL, goodput)", runBench},
    {"plan", "size prefill/decode pools for a trace and SLOs on a named GPU (simulated)", runPlan},
};

void printUsage() {
  std::fprintf(stderr, "usage: pdserve <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(stderr, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(stderr, "\n'pdserve <command> --help' describes a command.\n");
}

}  // namespace

int runVersion(int, char**) {
  std::printf("pdserve %s\n", PD_VERSION);
  return 0;
}

}  // namespace pd::tools

int main(int argc, char** argv) {
  using namespace pd::tools;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    printUsage();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands) {
    if (!std::strcmp(argv[1], c.name)) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "pdserve: unknown command '%s'\n", argv[1]);
  printUsage();
  return 2;
}
