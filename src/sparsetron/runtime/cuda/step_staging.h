// A whole step's inputs and loss sums on the device: what the full-iteration graph and the CUDA
// pipeline read each micro-batch's inputs from and write its loss sums to, so the step runs
// without a host copy between micro-batches. Under dynamic CP a step's micro-batches go through
// the slots in rounds, and a device index says which slot the next micro-batch reads (one
// captured micro-batch serves every slot). The engine and `sparsetron plan` plan it alike.
#pragma once

#include <cstdint>

#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/cuda/glm5_model.h"

namespace sparsetron {

struct StepStaging {
    int64_t slots = 0;  // micro-batches a step may hold
    MemoryPlan::Slot inputs = -1, sums = -1;
    MemoryPlan::Slot index = -1;  // one int32: the slot of the next micro-batch (dynamic CP)
};
// `slots` micro-batches' input blocks and loss sums of `model` in `plan` (Activations): a
// micro-batch's sums once per stage the model holds (CudaPipeline's layout).
StepStaging plan_step_staging(const cuda::CudaGlm5Model& model, MemoryPlan& plan, int64_t slots);

}  // namespace sparsetron
