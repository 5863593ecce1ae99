// A build without CUDA links this in place of runtime/cuda/: the CUDA engine and its plan throw
// "built without CUDA".
#include "sparsetron/core/error.h"
#include "sparsetron/runtime/cuda_plan.h"
#include "sparsetron/runtime/step_engine.h"

namespace sparsetron {

MemoryPlan cuda_memory_plan(const Recipe&, const ParamStore&, int64_t, int64_t,
                            const std::vector<PipelineStage>&, int) {
    built_without_cuda("plan --device cuda");
}
std::string cuda_plan_shortfall(const Recipe&, const ParamStore&, int64_t, int64_t, size_t, size_t,
                                const std::vector<PipelineStage>&, int) {
    built_without_cuda("cuda_plan_shortfall");
}
std::string format_cuda_plan(const Recipe&, const ParamStore&, int64_t, int64_t, size_t*, int,
                             const std::vector<PipelineStage>&, int) {
    built_without_cuda("plan --device cuda");
}
cuda::ExchangeShape exchange_shape(const ModelConfig&, int64_t) {
    built_without_cuda("exchange_shape");
}
std::unique_ptr<StepEngine> make_cuda_engine(const Recipe&, TrainingPlan&, const Communicators&) {
    built_without_cuda("--device cuda");
}

}  // namespace sparsetron
