// Learning-rate schedules (SPEC §7) as Megatron's OptimizerParamScheduler computes them: linear
// warm-up from lr_warmup_init, then linear / cosine / WSD / inverse-square-root decay to min_lr
// at lr_decay_iters (min_lr after it), or constant.
#pragma once

#include <cstdint>

#include "sparsetron/config/run_config.h"

namespace sparsetron {

// The rate of optimizer update `update` (1-based: 1 + the updates applied before it). Megatron
// steps its scheduler after each update that was not skipped, so update k runs at the
// scheduler's rate for k - 1 steps done; its log line shows the rate after the step (the next
// update's).
double learning_rate(const RunConfig& r, int64_t update);

}  // namespace sparsetron
