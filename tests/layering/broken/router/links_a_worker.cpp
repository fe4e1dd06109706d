// A fixture for layering_includes_catches_breaks: the router never sees the engine.
#include "worker/worker_loop.h"
