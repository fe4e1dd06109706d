// The fault suite's records (docs/reliability.md): each fault case (tests/e2e, tests/conformance) says what it
// injected, what it asserts, how the fault is detected and what it measured, and the suite writes the table of
// docs/reliability.md from those records (tests/faults/fault_table.py).
//
// recordFault() keeps the record for the running test case; when the case ends, a Catch2
// listener (fault_report.cpp) writes it to $PD_BINARY_DIR/fault-records/<slug>.json with the
// case's name and whether every assertion of it passed. A case that fails before it records
// leaves no record, and the table says so. Test code only; the test's thread.
#pragma once

#include <string>

namespace pd::test {

struct FaultRecord {
  std::string fault;     // the fault injected, as the table names it ("decode worker killed mid-stream")
  std::string asserted;  // what the case checks, in a line
  std::string detected;  // how the cluster learns of the fault, with the bound that sets it
  std::string measured;  // what this run measured ("" when nothing)
};

void recordFault(FaultRecord record);

}  // namespace pd::test
