// The `pdserve` CLI's subcommands. Each lives in its own file (tools/cmd_<name>.cpp) and is
// listed in tools/main.cpp: add<Name>Command(pdserve, run) defines its CLI11 subcommand and
// options, and when the command line selects it, sets `run` to what runs it. A run returns
// the process exit code: 0 ok, 1 runtime failure, 2 usage error (with a message on stderr).
#pragma once

#include <functional>
#include <map>
#include <string>

#include "common/base/cli.h"

namespace pd::tools {

using CommandRun = std::function<int()>;
using AddCommandFn = void (*)(CLI::App& parent, CommandRun& run);

void addVersionCommand(CLI::App& pdserve, CommandRun& run);
void addMakeModelCommand(CLI::App& pdserve, CommandRun& run);
void addGenerateCommand(CLI::App& pdserve, CommandRun& run);
void addTokenizeCommand(CLI::App& pdserve, CommandRun& run);
void addBenchCommand(CLI::App& pdserve, CommandRun& run);
void addBenchMixedCommand(CLI::App& bench, CommandRun& run);  // `pdserve bench mixed`
void addUpCommand(CLI::App& pdserve, CommandRun& run);
void addPlanCommand(CLI::App& pdserve, CommandRun& run);

// The command line as given, "pdserve plan --trace ..." (reports record it).
const std::string& commandLine();

// Options whose text goes into values[name] unparsed (the command parses and checks it,
// naming the flag), as `pdserve bench` and `pdserve plan` keep theirs; a flag stores "".
inline void addTextOption(CLI::App& cmd, std::map<std::string, std::string>& values, const std::string& name,
                          const std::string& description) {
  cmd.add_option_function<std::string>(
      name, [&values, name](const std::string& v) { values[name] = v; }, description);
}
inline void addTextFlag(CLI::App& cmd, std::map<std::string, std::string>& values, const std::string& name,
                        const std::string& description) {
  cmd.add_flag_callback(
      name, [&values, name] { values[name] = ""; }, description);
}

}  // namespace pd::tools
