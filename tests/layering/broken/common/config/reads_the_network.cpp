// A fixture for layering_includes_catches_breaks: inside the foundation, config may not use net.
#include "common/net/framed.h"
