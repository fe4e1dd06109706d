#include "tools/port_holder.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include <catch2/catch.hpp>

using namespace pd::tools;

TEST_CASE("a held port is named with its holder's pid and program; a free one passes") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);

  auto holder = findPortHolder(port);
  REQUIRE(holder.has_value());
  CHECK(holder->pid == ::getpid());
  CHECK(holder->program == "test_tools");
  const pd::Status s = checkPortFree(port, "router.http.port");
  CHECK(s.message() == "port " + std::to_string(port) + " (router.http.port) is held by pid " +
                           std::to_string(::getpid()) + " (test_tools): stop it or choose another port");
  ::close(fd);
  CHECK(checkPortFree(port, "router.http.port").isOk());
  CHECK(checkPortFree(0, "an OS-chosen port").isOk());
}
