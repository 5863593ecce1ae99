// Dynamic context parallelism's packing (SPEC §10; `dynamic_context_parallel`,
// `sequence_packing_scheduler: default_dynamic_cp`, `max_seqlen_per_dp_cp_rank`): the samples of a
// step are spread over micro-batches; in each micro-batch the DP x CP ranks are cut into
// power-of-two groups (contiguous aligned blocks, the sub-communicators made once), and each
// sample runs in one group at least as large as the smallest power of two that fits it.
//
// The packing (ours, after the description of Megatron's DefaultDynamicCPScheduler): samples by
// decreasing length; each opens the lowest free aligned block of its size, else joins the least
// loaded group of its size with room (workload L^2 / size, room size * max_seqlen_per_rank
// tokens), else waits for the next micro-batch; then groups whose same-size neighbour block is
// free double (idle ranks take a share of the work), smallest first. Deterministic.
#pragma once

#include <cstdint>
#include <vector>

namespace sparsetron {

struct DynamicCpGroup {
    int first_rank = 0, size = 1;  // ranks [first_rank, first_rank + size)
    std::vector<int> samples;      // indices into the step's samples
    int64_t tokens = 0;
};
struct DynamicCpMicroBatch {
    std::vector<DynamicCpGroup> groups;
    int idle_ranks = 0;
};

// The smallest power of two >= max(min_cp, ceil(length / max_per_rank)).
int dynamic_cp_size(int64_t length, int64_t max_per_rank, int min_cp = 1);

// Throws when a sample needs more than `ranks` ranks (naming max_seqlen_per_dp_cp_rank).
std::vector<DynamicCpMicroBatch> schedule_dynamic_cp(const std::vector<int64_t>& lengths, int ranks,
                                                     int64_t max_per_rank, int min_cp = 1);

}  // namespace sparsetron
