#include "common/base/ports_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace pd {

Status writePortsFile(const std::string& path, const PortMap& ports) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& [name, port] : ports) out << name << ' ' << port << '\n';
    out.flush();
    if (!out) return unavailable("cannot write the ports file " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return unavailable("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  }
  return Status::ok();
}

Result<PortMap> readPortsFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return notFound("no ports file " + path + " (yet)");
  PortMap ports;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    std::istringstream fields(line);
    std::string name, rest;
    long port = 0;
    if (!(fields >> name >> port) || (fields >> rest) || port < 1 || port > 65535) {
      return invalidArgument(path + ":" + std::to_string(n) + ": expected 'name port', got '" + line + "'");
    }
    ports[name] = int(port);
  }
  return ports;
}

}  // namespace pd
