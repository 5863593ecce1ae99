#include "sparsetron/parallel/context/cp_row_plan.h"

#include <algorithm>

#include "sparsetron/data/packer.h"
#include "sparsetron/parallel/context/cp_shard.h"

namespace sparsetron {

CpRowPlan cp_row_plan(const RunConfig& run, int64_t slots, int64_t max_documents) {
    const int cp = static_cast<int>(run.context_parallel_size);
    CpRowPlan p{cp_local_tokens(slots, max_documents, cp), cp > 1 ? slots : 0, max_documents, slots,
                std::max(cp, 1)};
    if (run.dynamic_context_parallel && run.max_seqlen_per_dp_cp_rank > 0) {
        // The largest group is every DP x CP rank of a pipeline stage.
        const int64_t per_rank = run.max_seqlen_per_dp_cp_rank,
                      stage_ranks =
                          run.world_size / std::max<int64_t>(1, run.pipeline_model_parallel_size);
        p.slots = p.key_rows = stage_ranks * per_rank;
        p.max_documents = run.max_documents_per_microbatch > 0 ? run.max_documents_per_microbatch
                                                               : default_max_documents(p.slots);
        p.rows = std::min(p.key_rows, per_rank + 2 * p.max_documents);
        p.max_group = stage_ranks;
    }
    return p;
}

}  // namespace sparsetron
