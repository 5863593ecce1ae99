// The parallel layout of a job (SPEC §10): which ranks form each process group. Pipeline stages
// are the slowest dimension (Megatron's "tp-cp-ep-dp-pp" order; tensor parallelism is 1 in this
// engine): rank = stage_rank + stage_size * pp_rank, where the stage's ranks hold the same layers.
// Within a stage, dense layers see stage = CP x DP, CP fastest: stage_rank = cp_rank + CP *
// dp_rank; expert layers fold CP into the data dimension: stage = EP x EDP, EP fastest:
// stage_rank = ep_rank + EP * edp_rank. Dynamic CP draws power-of-two sub-groups from a stage's
// DP x CP ranks as contiguous aligned blocks. Every group below lies inside one stage except the
// pipeline group (one rank per stage, equal stage_rank) and the embedding group (the first and
// last stages' ranks of equal stage_rank: the embedding they both hold).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/config/run_config.h"

namespace sparsetron {

struct ParallelLayout {
    int world = 1, dp = 1, cp = 1, ep = 1, pp = 1;

    int stage_size() const { return world / pp; }
    int stage_rank(int rank) const { return rank % stage_size(); }
    int pp_rank(int rank) const { return rank / stage_size(); }
    int cp_rank(int rank) const { return stage_rank(rank) % cp; }
    int dp_rank(int rank) const { return stage_rank(rank) / cp; }
    int ep_rank(int rank) const { return stage_rank(rank) % ep; }
    int edp_rank(int rank) const { return stage_rank(rank) / ep; }
    int edp() const { return stage_size() / ep; }

    // Members of `rank`'s group, ascending.
    std::vector<int> cp_group(int rank) const;   // same dp_rank: attention's CP ring
    std::vector<int> dp_group(int rank) const;   // same cp_rank: dense gradient reduction
    std::vector<int> ep_group(int rank) const;   // same edp_rank: token dispatch (all-to-all)
    std::vector<int> edp_group(int rank) const;  // same ep_rank: expert gradient reduction
    // The stage's ranks (dense gradients are reduced over its DP x CP).
    std::vector<int> stage_group(int rank) const;
    std::vector<int> pp_group(int rank) const;  // same stage_rank: activations stage to stage
    // Dynamic CP: the aligned block of `size` ranks (a power of two) that holds `rank`.
    std::vector<int> dynamic_cp_group(int rank, int size) const;
    // Power-of-two sub-group sizes dynamic CP may use: min_size .. stage_size().
    std::vector<int> dynamic_cp_sizes(int min_size) const;
    // A color per group kind for Comm::split: ranks with equal colors form one group (the
    // groups inside a stage carry the stage in their color).
    int cp_color(int rank) const { return in_stage(rank, dp_rank(rank)); }
    int dp_color(int rank) const { return in_stage(rank, cp_rank(rank)); }
    int ep_color(int rank) const { return in_stage(rank, edp_rank(rank)); }
    int edp_color(int rank) const { return in_stage(rank, ep_rank(rank)); }
    int stage_color(int rank) const { return pp_rank(rank); }
    int pp_color(int rank) const { return stage_rank(rank); }
    // The first and last stages' ranks pair up; the middle stages' ranks are groups of one.
    int embedding_color(int rank) const {
        const int p = pp_rank(rank);
        return p == 0 || p == pp - 1 ? stage_rank(rank) : world + rank;
    }
    int dynamic_cp_color(int rank, int size) const { return rank / size; }

    std::string describe() const;

  private:
    int in_stage(int rank, int color) const { return pp_rank(rank) * world + color; }
};

// From the recipe's sizes and the number of processes; throws naming the sizes that do not divide.
ParallelLayout make_layout(const RunConfig& run, int world);

}  // namespace sparsetron
