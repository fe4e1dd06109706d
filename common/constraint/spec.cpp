#include "common/constraint/spec.h"
