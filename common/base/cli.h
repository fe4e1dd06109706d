// The one way pdserve's programs, subcommands and benchmarks read their command lines: CLI11
// (header-only, Debian libcli11-dev), with the conventions every program shares.
//
//   CLI::App app{"What the program does.", "pdserve-router"};
//   pd::cli::configure(app);
//   app.add_option("--config", configPath, "cluster YAML")->capture_default_str();
//   if (int rc = pd::cli::parse(app, argc, argv); rc >= 0) return rc;
//
// --help (-h) prints the generated help on stdout and exits 0; an unknown flag, a missing or
// bad value or a missing required flag prints "<program>: <what>" naming the flag on stderr
// and exits 2. A flag given twice keeps its last value, as the hand-written parsers did.
#pragma once

#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

namespace pd::cli {

// The exit code of a usage error (and of a config file the program cannot read).
inline constexpr int kUsageExit = 2;

// pdserve's conventions on `app` (call before adding options; subcommands added afterwards
// inherit them).
inline void configure(CLI::App& app) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_help_flag("-h,--help", "Print this help message and exit");
}

// What a ParseError means for the process: prints the help (exit 0) or "<name>: <what>" and
// a --help hint on stderr (exit 2). `app` is the top-level app (its help prints the selected
// subcommand's).
inline int exitCode(CLI::App& app, const CLI::ParseError& e) {
  if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
    app.exit(e);  // --help: the help of the (sub)command on stdout
    return 0;
  }
  std::string name = app.get_name();
  for (const CLI::App* sub = &app; !sub->get_subcommands().empty();) {
    sub = sub->get_subcommands().front();
    name += " " + sub->get_name();
  }
  std::fprintf(stderr, "%s: %s (see %s --help)\n", name.c_str(), e.what(), name.c_str());
  return kUsageExit;
}

// Parses argv (argv[0] the program) into `app`. Returns -1 when the program goes on, else the
// exit code to return (see exitCode).
inline int parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return exitCode(app, e);
  }
  return -1;
}

// `message` less a leading "<flag>: ": for a check() that reports a parser's error, which
// names the flag itself (CLI11 puts the flag in front of a check's message).
inline std::string withoutFlag(const std::string& message, const std::string& flag) {
  const std::string prefix = flag + ": ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

// A TCP port flag: an integer in [0, 65535]; errors name the flag.
inline CLI::Option* addPort(CLI::App& app, const std::string& name, int& port, const std::string& description) {
  return app.add_option(name, port, description)->check(CLI::Range(0, 65535));
}

}  // namespace pd::cli
