// A ports file: how a process tells whoever started it which ports it bound (--ports-file on
// pdserve-router and the workers). Its parent passes port 0 (the OS picks one when the
// listener binds) and reads the file, instead of picking a "free" port itself and handing it
// over: a port the parent found free can be taken by any other socket before the child binds
// it, and under parallel tests it was (EADDRINUSE at start-up).
//
// Format: one "name port" line per listener ("http 40123", "control 40125", "metrics 40127").
// The file is written once every listener is bound, to a temporary name and renamed, so a
// reader sees either no file or the whole of it.
//
// Threads: no shared state; any thread.
#pragma once

#include <map>
#include <string>

#include "common/base/status.h"

namespace pd {

using PortMap = std::map<std::string, int>;

// Writes `ports` to `path` atomically (path + ".tmp", then rename). kUnavailable names the
// file when it cannot be written.
Status writePortsFile(const std::string& path, const PortMap& ports);

// kNotFound while the file does not exist; kInvalidArgument (naming the file and the line)
// when a line is not "name port" with a port in 1..65535.
Result<PortMap> readPortsFile(const std::string& path);

}  // namespace pd
