// Writes the records of tests/faults/fault_report.h when each test case ends.
#define CATCH_CONFIG_EXTERNAL_INTERFACES
#include "tests/faults/fault_report.h"

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

namespace pd::test {
namespace {

std::vector<FaultRecord>& pending() {
  static std::vector<FaultRecord> records;
  return records;
}

std::string slug(const std::string& text) {
  std::string out;
  for (char ch : text) {
    const bool keep = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
    if (keep)
      out += ch;
    else if (!out.empty() && out.back() != '-')
      out += '-';
  }
  return out.substr(0, 120);
}

class FaultRecordWriter : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    const std::string dir = std::string(PD_BINARY_DIR) + "/fault-records";
    std::filesystem::create_directories(dir);
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    for (const FaultRecord& r : pending()) {
      nlohmann::json j{{"fault", r.fault},
                       {"test", std::string(program_invocation_short_name) + ": " + stats.testInfo.name},
                       {"asserted", r.asserted},
                       {"detected", r.detected},
                       {"measured", r.measured},
                       {"passed", stats.totals.assertions.failed == 0},
                       {"time", now}};
      std::ofstream(dir + "/" + slug(r.fault + " " + stats.testInfo.name) + ".json") << j.dump(2) << "\n";
    }
    pending().clear();
  }
};

}  // namespace

void recordFault(FaultRecord record) { pending().push_back(std::move(record)); }

CATCH_REGISTER_LISTENER(FaultRecordWriter)

}  // namespace pd::test
