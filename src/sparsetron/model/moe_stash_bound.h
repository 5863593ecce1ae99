// The size of the MoE paged stash's pool from its bound (moe_paged_stash; the CUDA stash is
// model/cuda/moe_stash.h). Plain arithmetic, so it is tested on the CPU.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/config/model_config.h"
#include "sparsetron/config/pipeline_stage.h"

namespace sparsetron {

struct MoeStashBound {
    // MoE forward passes per micro-batch: the MoE layers (a pipeline rank's own: its stage's, or
    // its chunks' under interleaving), plus on the last stage the MTP depths when the MTP layer is
    // an MoE layer (it repeats the last backbone layer's kind).
    int64_t applications = 0;
    // The most rows one application routes and keeps: tokens x top-k, or capacity x experts
    // when moe_capacity_factor bounds it lower; under expert parallelism the most its experts
    // receive (ModelConfig::moe_ep_received_rows).
    int64_t max_rows = 0;
    // The rows one application keeps when the routing is balanced: max_rows, but tokens x top-k
    // under expert parallelism (what a rank sends, and on average receives). The pool's base.
    int64_t balanced_rows = 0;
    int64_t page_rows = 0;
    int64_t pages_per_application = 0;  // ceil(max_rows / page_rows): one page table's bound
    int64_t balanced_pages = 0;         // applications x ceil(balanced_rows / page_rows)
    // ceil(moe_paged_stash_buffer_size_factor_cuda x balanced_pages), >= 1 (Megatron's sizing:
    // a factor over what the layers keep on balanced routing).
    int64_t pool_pages = 0;
};

// `stages`: the pipeline stages one rank holds (empty: the whole model).
MoeStashBound moe_stash_bound(const ModelConfig& c, int64_t tokens,
                              const std::vector<PipelineStage>& stages = {});

}  // namespace sparsetron
