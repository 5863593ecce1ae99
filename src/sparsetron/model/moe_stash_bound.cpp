#include "sparsetron/model/moe_stash_bound.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sparsetron {

MoeStashBound moe_stash_bound(const ModelConfig& c, int64_t tokens,
                              const std::vector<PipelineStage>& stages) {
    MoeStashBound b;
    const std::vector<PipelineStage> held =
        stages.empty() ? std::vector<PipelineStage>{PipelineStage{}} : stages;
    for (const PipelineStage& stage : held) {
        const int64_t end = stage.end_layer < 0 ? c.num_layers : stage.end_layer;
        for (int64_t l = stage.first_layer; l < end; ++l) b.applications += c.is_moe_layer(l);
        if (stage.last() && c.mtp_num_layers > 0 && c.is_moe_layer(c.num_layers - 1))
            b.applications += c.mtp_num_layers;
    }
    b.max_rows = tokens * c.moe_router_topk;
    if (c.moe_capacity_factor > 0 && c.num_experts > 0)
        b.max_rows = std::min(b.max_rows, c.moe_expert_capacity(tokens) * c.num_experts);
    b.balanced_rows = b.max_rows;
    // Expert parallelism: an application keeps the rows its experts received, at most the
    // receive bound, on balanced routing what the rank sent.
    if (c.expert_parallel_ranks > 1) b.max_rows = c.moe_ep_received_rows(tokens);
    b.page_rows = c.moe_paged_stash_page_size;
    b.pages_per_application = (b.max_rows + b.page_rows - 1) / b.page_rows;
    b.balanced_pages = b.applications * ((b.balanced_rows + b.page_rows - 1) / b.page_rows);
    b.pool_pages = std::max<int64_t>(
        1,
        int64_t(std::ceil(c.moe_paged_stash_buffer_size_factor_cuda * double(b.balanced_pages))));
    return b;
}

}  // namespace sparsetron
