// How many rows the model of one rank is planned for under context parallelism (fixed or
// dynamic), shared by the CPU training plan and the CUDA engine so both plan the same shapes.
#pragma once

#include <cstdint>

#include "sparsetron/config/run_config.h"

namespace sparsetron {

struct CpRowPlan {
    int64_t rows = 0;           // rows one rank computes (the model's `tokens`)
    int64_t key_rows = 0;       // micro-batch rows the attention reads (0: no CP)
    int64_t max_documents = 0;  // documents of the micro-batches the model takes
    int64_t slots = 0;          // token slots of those micro-batches
    int64_t max_group = 1;      // ranks of the largest CP group a micro-batch runs over
};

// `slots` / `max_documents`: the packed micro-batches'. Fixed CP: cp_local_tokens rows of those.
// Dynamic CP: a group of s ranks packs up to s x max_seqlen_per_dp_cp_rank tokens (the largest
// group is every DP x CP rank of a pipeline stage); a rank holds fewer than per_rank + 2 x
// documents rows of any group's micro-batch (two chunks per document).
CpRowPlan cp_row_plan(const RunConfig& run, int64_t slots, int64_t max_documents);

}  // namespace sparsetron
