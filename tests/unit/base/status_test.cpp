#include "common/base/status.h"

#include <catch2/catch.hpp>

using namespace pd;

namespace {
Result<int> parsePositive(int v) {
  if (v <= 0) return invalidArgument("value " + std::to_string(v) + " is not positive");
  return v;
}
Result<int> doubled(int v) {
  PD_ASSIGN_OR_RETURN(int x, parsePositive(v));
  return 2 * x;
}
Status check(int v) {
  PD_RETURN_IF_ERROR(parsePositive(v).status());
  return Status::ok();
}
}  // namespace

TEST_CASE("Status carries code and message") {
  Status s = notFound("model.safetensors: no such file");
  CHECK_FALSE(s.isOk());
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.toString() == "NOT_FOUND: model.safetensors: no such file");
  CHECK(s.withContext("loading model").message() == "loading model: model.safetensors: no such file");
  CHECK(Status::ok().toString() == "OK");
  CHECK(Status(StatusCode::kInProgress, "").inProgress());
}

TEST_CASE("Result propagates values and errors") {
  auto good = doubled(21);
  REQUIRE(good.ok());
  CHECK(*good == 42);
  auto bad = doubled(-3);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message() == "value -3 is not positive");
  CHECK(check(1).isOk());
  CHECK(check(0).code() == StatusCode::kInvalidArgument);
}
