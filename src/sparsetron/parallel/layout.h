// The parallel layout of a job (SPEC §10): which ranks form each process group. Dense layers see
// world = CP x DP (tensor and pipeline parallelism are 1 in this engine), CP fastest: rank =
// cp_rank + CP * dp_rank (Megatron's "tp-cp-ep-dp-pp" order). Expert layers fold CP into the data
// dimension: world = EP x EDP, EP fastest: rank = ep_rank + EP * edp_rank. Dynamic CP draws
// power-of-two sub-groups from the DP x CP ranks as contiguous aligned blocks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/run_config.h"

namespace sparsetron {

struct ParallelLayout {
    int world = 1, dp = 1, cp = 1, ep = 1;

    int cp_rank(int rank) const { return rank % cp; }
    int dp_rank(int rank) const { return rank / cp; }
    int ep_rank(int rank) const { return rank % ep; }
    int edp_rank(int rank) const { return rank / ep; }
    int edp() const { return world / ep; }

    // Members of `rank`'s group, ascending.
    std::vector<int> cp_group(int rank) const;   // same dp_rank: attention's CP ring
    std::vector<int> dp_group(int rank) const;   // same cp_rank: dense gradient reduction
    std::vector<int> ep_group(int rank) const;   // same edp_rank: token dispatch (all-to-all)
    std::vector<int> edp_group(int rank) const;  // same ep_rank: expert gradient reduction
    // Every rank (dense gradients are reduced over DP x CP).
    std::vector<int> dp_cp_group() const;
    // Dynamic CP: the aligned block of `size` ranks (a power of two) that holds `rank`.
    std::vector<int> dynamic_cp_group(int rank, int size) const;
    // Power-of-two sub-group sizes dynamic CP may use: min_size .. world.
    std::vector<int> dynamic_cp_sizes(int min_size) const;
    // A color per group kind for Comm::split: ranks with equal colors form one group.
    int cp_color(int rank) const { return dp_rank(rank); }
    int dp_color(int rank) const { return cp_rank(rank); }
    int ep_color(int rank) const { return edp_rank(rank); }
    int edp_color(int rank) const { return ep_rank(rank); }
    int dynamic_cp_color(int rank, int size) const { return rank / size; }

    std::string describe() const;
};

// From the recipe's sizes and the number of processes; throws naming the sizes that do not divide.
ParallelLayout make_layout(const RunConfig& run, int world);

}  // namespace sparsetron
