// The distributed optimizer's shard (optim/owner_assignment.h) as the CUDA model plans its
// masters (cuda::MasterPlacement): the same for the engine and for `plan`.
#pragma once

#include <vector>

#include "sparsetron/config/run_config.h"
#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/optim/owner_assignment.h"

namespace sparsetron {

static_assert(cuda::MasterPlacement::kSplitRows == kRowSplit);

inline cuda::MasterPlacement master_placement(const OptimizerShard& shard, const RunConfig& run) {
    return {.owner = shard.sharded() ? shard.owner : std::vector<int>{},
            .rank = shard.rank,
            .ranks = shard.ranks,
            .fp8_gather = run.fp8_param_gather,
            .host_fraction = run.optimizer_cpu_offload ? run.optimizer_offload_fraction : 0.0,
            .bf16_gradients = run.grad_reduce_in_bf16};
}

}  // namespace sparsetron
