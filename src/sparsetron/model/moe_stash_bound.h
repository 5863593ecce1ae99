// The size of the MoE paged stash's pool from its bound (moe_paged_stash; the CUDA stash is
// model/cuda/moe_stash.h). Plain arithmetic, so it is tested on the CPU.
#pragma once

#include <cstdint>

#include "sparsetron/config/model_config.h"

namespace sparsetron {

struct MoeStashBound {
    // MoE forward passes per micro-batch: the MoE layers, plus the MTP depths when the MTP layer
    // is an MoE layer (it repeats the last backbone layer's kind).
    int64_t applications = 0;
    // The most rows one application routes and keeps: tokens x top-k, or capacity x experts
    // when moe_capacity_factor bounds it lower; under expert parallelism the most its experts
    // receive (ModelConfig::moe_ep_received_rows).
    int64_t max_rows = 0;
    int64_t page_rows = 0;
    int64_t pages_per_application = 0;  // ceil(max_rows / page_rows): one page table's bound
    // ceil(moe_paged_stash_buffer_size_factor x applications x pages_per_application), >= 1.
    int64_t pool_pages = 0;
};

MoeStashBound moe_stash_bound(const ModelConfig& c, int64_t tokens);

}  // namespace sparsetron
