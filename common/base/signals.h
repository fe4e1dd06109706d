// Termination signals for pdserve's long-running programs.
#pragma once

#include <signal.h>

namespace pd {

// Blocks SIGINT and SIGTERM in the calling thread and returns the set, for sigwait() or
// sigtimedwait(). Call it first in main(), before any thread starts, so every thread inherits
// the mask and only the waiting thread ever sees the signals.
sigset_t blockTerminationSignals();

}  // namespace pd
