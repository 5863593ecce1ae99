#include "sparsetron/runtime/cuda/step_staging.h"

namespace sparsetron {

StepStaging plan_step_staging(const cuda::CudaGlm5Model& model, MemoryPlan& plan, int64_t slots) {
    StepStaging s;
    s.slots = slots;
    s.inputs = plan.add(MemClass::Activations, "graph.input_slots", DType::I32,
                        {slots, model.input_words()});
    // A micro-batch's sums per chunk the rank holds (interleaved pipeline stages).
    s.sums = plan.add(MemClass::Activations, "graph.loss_sums", DType::F64,
                      {slots * int64_t(model.stages().size()), model.n_sums()});
    s.index = plan.add(MemClass::Activations, "graph.slot_index", DType::I32, {1});
    return s;
}

}  // namespace sparsetron
