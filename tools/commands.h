// The `pdserve` CLI's subcommands. Each lives in its own file (tools/cmd_<name>.cpp) and is
// listed in tools/main.cpp's table. A command gets argv after its name and returns the
// process exit code: 0 ok, 1 runtime failure, 2 usage error (with a message on stderr).
#pragma once

namespace pd::tools {

using CommandFn = int (*)(int argc, char** argv);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
};

int runVersion(int argc, char** argv);
int runMakeModel(int argc, char** argv);
int runGenerate(int argc, char** argv);
int runTokenize(int argc, char** argv);
int runBench(int argc, char** argv);
int runBenchMixed(int argc, char** argv);  // `pdserve bench mixed`
int runUp(int argc, char** argv);
int runPlan(int argc, char** argv);

}  // namespace pd::tools
