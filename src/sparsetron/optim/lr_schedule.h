// Learning-rate schedules (SPEC §7): linear warm-up, then cosine / linear / WSD decay to min_lr,
// or constant.
#pragma once

#include <cstdint>

#include "sparsetron/config/run_config.h"

namespace sparsetron {

// LR for optimizer step `step` (1-based: the first update uses step 1).
double learning_rate(const RunConfig& r, int64_t step);

}  // namespace sparsetron
