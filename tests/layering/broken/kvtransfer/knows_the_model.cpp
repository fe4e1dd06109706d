// A fixture for layering_includes_catches_breaks: kvtransfer may not know model types.
#include "engine/kv_layout.h"
