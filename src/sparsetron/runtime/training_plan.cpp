#include "sparsetron/runtime/training_plan.h"

#include <algorithm>

#include "sparsetron/core/error.h"
#include "sparsetron/model/param_table.h"

namespace sparsetron {

std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe, Device device,
                                                 const PipelineStage& stage) {
    return make_training_plan(recipe, device, std::vector<PipelineStage>{stage});
}

std::unique_ptr<TrainingPlan> make_training_plan(const Recipe& recipe, Device device,
                                                 const std::vector<PipelineStage>& stages) {
    auto tp = std::make_unique<TrainingPlan>();
    const RunConfig& r = recipe.run;
    tp->model = recipe.model;
    const int64_t slots = r.tokens_per_microbatch();
    if (r.dsa_dense_warmup) {  // SPEC §3.2: attention over every key, the dense indexer loss
        tp->model.dsa_indexer_topk = std::max(tp->model.dsa_indexer_topk, slots);
        tp->model.dsa_indexer_use_sparse_loss = false;
    }
    tp->model.expert_parallel_ranks = r.expert_model_parallel_size;
    tp->max_documents = r.max_documents_per_microbatch > 0 ? r.max_documents_per_microbatch
                                                           : default_max_documents(slots);
    tp->chunk_rows = r.loss_chunk_rows > 0 ? r.loss_chunk_rows : std::min<int64_t>(slots, 1024);
    // Context parallelism: a rank computes its chunks of every document and attends over every
    // row of the micro-batch (parallel/context/cp_row_plan.h).
    tp->rows = cp_row_plan(r, slots, tp->max_documents);
    tp->model.context_parallel_ranks = tp->rows.max_group;
    if (r.dynamic_context_parallel)
        tp->group_slots = tp->rows.slots, tp->group_max_documents = tp->rows.max_documents;
    tp->chunk_rows = std::min(tp->chunk_rows, tp->rows.rows);
    tp->params = make_param_table(tp->model, tp->plan, DType::F32, stages);
    if (device == Device::CPU)
        for (const PipelineStage& stage : stages)
            tp->cpu_models.push_back(std::make_unique<Glm5Model<float>>(
                tp->model, *tp->params, tp->plan, tp->rows.rows, tp->rows.max_documents,
                tp->chunk_rows, tp->rows.key_rows, stage));
    for (const auto& m : tp->cpu_models) m->set_fp8_blockwise(r.fp8_blockwise());
    tp->optimizer = std::make_unique<Optimizer>(*tp->params, tp->plan, tp->model, recipe.run);
    return tp;
}

void check_fp8_recipe(const RunConfig& r, Device device, bool fp8_output_proj) {
    // Never run bf16 silently under an FP8 recipe.
    if (r.fp8_recipe == "mxfp8")
        throw Error(
            "fp8_recipe: mxfp8 is not implemented: its block scaling (32-element UE8M0 scales) "
            "needs Blackwell, and Hopper's cuBLASLt has no MXFP8 GEMM. On Hopper add the overlay "
            "recipes/overlays/h200.yaml (fp8_recipe: blockwise, 1x128 activation / 128x128 "
            "weight scales): --recipe <recipe>,recipes/overlays/h200.yaml; or --set "
            "fp8_recipe= to train in bf16");
    ST_CHECK(r.fp8_recipe.empty() || r.fp8_blockwise(), "fp8_recipe: ", r.fp8_recipe,
             " is not implemented (blockwise is; drop the key to train in bf16)");
    ST_CHECK(!fp8_output_proj || device == Device::CUDA,
             "fp8_output_proj (the head's GEMMs in FP8) runs on CUDA only; the CPU model's head "
             "stays fp32: use --device cuda or drop the key");
    ST_CHECK(r.fp8_recipe.empty() || r.fp8_format == "e4m3", "fp8_format: ", r.fp8_format,
             " is not implemented (blockwise uses e4m3 for every operand)");
}

}  // namespace sparsetron
