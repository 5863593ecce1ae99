#include "sparsetron/runtime/cuda_plan.h"

#include <algorithm>

#include "sparsetron/model/cuda/glm5_model.h"
#include "sparsetron/optim/cuda/cuda_optimizer.h"
#include "sparsetron/optim/owner_assignment.h"
#include "sparsetron/parallel/context/cp_row_plan.h"
#include "sparsetron/runtime/cuda/cuda_pipeline.h"
#include "sparsetron/runtime/cuda/master_placement.h"
#include "sparsetron/runtime/cuda/step_staging.h"

namespace sparsetron {

cuda::ExchangeShape exchange_shape(const ModelConfig& m, int64_t tokens) {
    const int64_t received = m.moe_ep_received_rows(tokens);
    return {.experts = m.num_experts,
            .max_rows = std::max(tokens * m.moe_router_topk, received),
            .pair_rows = received / m.expert_parallel_ranks,
            .dim = m.hidden_size};
}

MemoryPlan cuda_memory_plan(const Recipe& recipe, const ParamStore& host_store,
                            int64_t max_documents, int64_t chunk_rows,
                            const std::vector<PipelineStage>& stages, int optimizer_rank) {
    MemoryPlan plan;
    ModelConfig m = recipe.model;
    m.expert_parallel_ranks = recipe.run.expert_model_parallel_size;
    const CpRowPlan cpp =
        cp_row_plan(recipe.run, recipe.run.tokens_per_microbatch(), max_documents);
    m.context_parallel_ranks = cpp.max_group;
    const OptimizerShard shard = planned_optimizer_shard(host_store, recipe.run, optimizer_rank);
    cuda::CudaGlm5Model model(
        m, host_store, plan, cpp.rows, cpp.max_documents, std::min(chunk_rows, cpp.rows),
        cpp.key_rows, recipe.run.fp8_blockwise(), stages, master_placement(shard, recipe.run));
    cuda::CudaOptimizer opt(model.cuda_params(), plan, recipe.model, recipe.run, shard);
    const bool pipeline = !stages.empty() && !stages.front().whole();
    if (pipeline) plan_pipeline_buffers(model, plan, pipeline_step_bound(recipe.run));
    if (recipe.run.cuda_graph_impl == "full_iteration" || pipeline)
        plan_step_staging(model, plan, recipe.run.microbatches_per_step());
    return plan;
}

std::string cuda_plan_shortfall(const Recipe& recipe, const ParamStore& host_store,
                                int64_t max_documents, int64_t chunk_rows, size_t planned,
                                size_t free_bytes, const std::vector<PipelineStage>& stages,
                                int optimizer_rank) {
    if (planned <= free_bytes) return "";
    const auto gib = [](size_t b) { return format_bytes(double(b)); };
    std::string largest;
    const auto kinds =
        cuda_memory_plan(recipe, host_store, max_documents, chunk_rows, stages, optimizer_rank)
            .kinds();
    for (size_t i = 0; i < kinds.size() && i < 3; ++i)
        largest += cat(i ? ", " : "", kinds[i].pattern, " (", kinds[i].count, " x ",
                       gib(kinds[i].bytes / size_t(kinds[i].count)), ")");
    std::string msg = cat("the device memory plan needs ", gib(planned), " but the GPU has ",
                          gib(free_bytes), " free; the largest kinds of buffer: ", largest,
                          " (`sparsetron plan --device cuda` lists the plan); ");
    if (!recipe.model.activation().recomputes_everything()) {
        Recipe r = recipe;
        r.model.recompute_granularity = "selective";
        r.model.recompute_modules = recompute_module_names();
        const size_t with =
            cuda_memory_plan(r, host_store, max_documents, chunk_rows, stages, optimizer_rank)
                .total_bytes();
        std::string mods;
        for (const std::string& m : recompute_module_names())
            mods += (mods.empty() ? "" : ", ") + m;
        msg += cat("with recompute_granularity: selective and recompute_modules: [", mods,
                   "] it plans ", gib(with), with <= free_bytes ? " and fits" : ", still too much",
                   "; ");
    }
    return msg + "shorter micro-batches (seq_length) or more context-parallel ranks need less";
}

std::string format_cuda_plan(const Recipe& recipe, const ParamStore& host_store,
                             int64_t max_documents, int64_t chunk_rows, size_t* total_bytes,
                             int top, const std::vector<PipelineStage>& stages,
                             int optimizer_rank) {
    const MemoryPlan plan =
        cuda_memory_plan(recipe, host_store, max_documents, chunk_rows, stages, optimizer_rank);
    const ModelConfig& m = recipe.model;
    std::string text = plan.format(top);
    size_t total = plan.total_bytes();
    if (recipe.run.expert_model_parallel_size > 1) {
        // Expert parallelism: the exchange's buffers, separate allocations. `auto` picks NVLink
        // on one node and NCCL across nodes: the plan counts the larger.
        Recipe ep = recipe;
        ep.model.expert_parallel_ranks = recipe.run.expert_model_parallel_size;
        // Sized by the rows this rank's MoE layers route (its CP share), as the engine's.
        const cuda::ExchangeShape shape = exchange_shape(
            ep.model,
            cp_row_plan(recipe.run, recipe.run.tokens_per_microbatch(), max_documents).rows);
        const int ranks = int(recipe.run.expert_model_parallel_size);
        const std::string& key = recipe.run.moe_expert_exchange;
        const ExchangeTransport t =
            key == "nvlink" ? ExchangeTransport::Nvlink : ExchangeTransport::Nccl;
        const int64_t bytes = cuda::expert_exchange_bytes(t, shape, ranks);
        total += size_t(bytes);
        text += cat("expert exchange buffers (", key == "auto" ? "auto: NCCL's, the larger" : key,
                    ") ", format_bytes(double(bytes)), "\ntotal with them        ",
                    format_bytes(double(total)), "\n");
    }
    if (m.fine_grained_activation_offloading) {
        // What offload saves: the same plan with every offloaded activation kept on the device.
        Recipe kept = recipe;
        kept.model.fine_grained_activation_offloading = false;
        const size_t without =
            cuda_memory_plan(kept, host_store, max_documents, chunk_rows, stages, optimizer_rank)
                .total_bytes();
        std::string mods;
        for (const std::string& o : m.offload_modules) mods += (mods.empty() ? "" : ", ") + o;
        text += cat("activation offload (", mods, "): saves ",
                    format_bytes(double(without) - double(plan.total_bytes())),
                    " of device memory (", format_bytes(double(without)), " without it) for ",
                    format_bytes(double(plan.host_offload_bytes())), " of pinned host memory\n");
    }
    text += "largest kinds of buffer (alike but for layer or expert numbers, summed):\n" +
            plan.format_kinds(top);
    if (total_bytes) *total_bytes = total;
    return text;
}

}  // namespace sparsetron
