// The CUDA engine's device memory plan, built without touching a GPU: what `sparsetron plan
// --device cuda` prints, what the engine checks against the free memory before allocating, and
// what the plan tests assert. Each throws "built without CUDA" in a CPU-only build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/pipeline_stage.h"
#include "sparsetron/config/recipe.h"
#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/parallel/expert/expert_exchange.h"

namespace sparsetron {

// The device plan the CUDA engine allocates for `recipe`, unallocated. `host_store`: the
// parameter table of `stages` (pipeline parallelism: the stages one rank holds, its chunks under
// interleaving; the whole model by default).
// `optimizer_rank`: the rank's place among the world_size / pipeline_model_parallel_size ranks
// holding the same parameters, whose share of the masters and optimizer state it holds under
// use_distributed_optimizer (planned_optimizer_shard).
MemoryPlan cuda_memory_plan(const Recipe& recipe, const ParamStore& host_store,
                            int64_t max_documents, int64_t chunk_rows,
                            const std::vector<PipelineStage>& stages = {}, int optimizer_rank = 0);

// Why a device plan of `planned` bytes cannot be allocated in `free_bytes`, and what would make it
// fit: the plan with every selective recompute module when the recipe does not use them all
// (its size, and whether it fits), else shorter micro-batches or more context-parallel ranks.
// Empty when it fits.
std::string cuda_plan_shortfall(const Recipe& recipe, const ParamStore& host_store,
                                int64_t max_documents, int64_t chunk_rows, size_t planned,
                                size_t free_bytes, const std::vector<PipelineStage>& stages = {},
                                int optimizer_rank = 0);

// The same plan as the per-class table of MemoryPlan::format() (`top` buffers per class), with
// expert parallelism's exchange buffers added to the total.
std::string format_cuda_plan(const Recipe& recipe, const ParamStore& host_store,
                             int64_t max_documents, int64_t chunk_rows, size_t* total_bytes,
                             int top = 6, const std::vector<PipelineStage>& stages = {},
                             int optimizer_rank = 0);

// What the expert exchange carries per rank: a rank publishes its routed rows (dispatch) or the
// results of the rows its experts received (combine); one source sends one owner at most a W-th
// of what the owner may receive. `tokens`: the rows a rank's MoE layers route (its CP share).
cuda::ExchangeShape exchange_shape(const ModelConfig& m, int64_t tokens);

}  // namespace sparsetron
