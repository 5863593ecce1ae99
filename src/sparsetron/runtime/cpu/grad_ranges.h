// The gradient arena as contiguous ranges for the data-parallel reduction: dense gradients are
// summed over every rank, the routed experts' (sharded over EP) over the expert-data-parallel
// group only, so neighbouring parameters of one kind form one range (the alignment gaps between
// them are zero and reduce harmlessly).
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"

namespace sparsetron {

struct GradRange {
    float* begin = nullptr;
    int64_t count = 0;  // floats
    bool routed_expert = false;
};

// In arena order; covers every trainable parameter's gradient exactly once.
std::vector<GradRange> gradient_ranges(const ParamStore& store, const MemoryPlan& plan);

}  // namespace sparsetron
