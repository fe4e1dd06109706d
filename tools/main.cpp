// pdserve: one binary, one subcommand per job (docs/design.md §2, tools/).
#include <cstdio>
#include <string>

#include "tools/commands.h"

namespace pd::tools {
namespace {

std::string gCommandLine = "pdserve";

const AddCommandFn kCommands[] = {
    addVersionCommand,  addMakeModelCommand, addGenerateCommand, addUpCommand,
    addTokenizeCommand, addBenchCommand,     addPlanCommand,
};

}  // namespace

const std::string& commandLine() { return gCommandLine; }

void addVersionCommand(CLI::App& pdserve, CommandRun& run) {
  pdserve.add_subcommand("version", "print the version")->callback([&run] {
    run = [] {
      std::printf("pdserve %s\n", PD_VERSION);
      return 0;
    };
  });
}

}  // namespace pd::tools

int main(int argc, char** argv) {
  using namespace pd::tools;
  for (char** arg = argv + 1; arg < argv + argc; ++arg) gCommandLine += std::string(" ") + *arg;
  CLI::App app{
      "pdserve: one binary, one subcommand per job; 'pdserve <command> --help' "
      "describes a command.",
      "pdserve"};
  pd::cli::configure(app);
  app.require_subcommand(1);
  CommandRun run;
  for (AddCommandFn add : kCommands) add(app, run);
  if (argc < 2) {
    std::fputs(app.help().c_str(), stderr);
    return pd::cli::kUsageExit;
  }
  const std::string first = argv[1];
  const CLI::App& commands = app;
  auto named = [&first](const CLI::App* c) { return c->get_name() == first; };
  if (first[0] != '-' && commands.get_subcommands(named).empty()) {
    std::fprintf(stderr, "pdserve: unknown command '%s' (see pdserve --help)\n", first.c_str());
    return pd::cli::kUsageExit;
  }
  if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
  return run ? run() : pd::cli::kUsageExit;
}
