// Splitting optimizer work over data-parallel ranks (the distributed optimizer, SPEC §10): each
// item (a parameter, a Newton-Schulz batch) goes whole to one rank.
#pragma once

#include <vector>

#include "sparsetron/core/memory_plan.h"
#include "sparsetron/model/param_store.h"
#include "sparsetron/optim/optimizer.h"
#include "sparsetron/parallel/comm/comm.h"

namespace sparsetron {

// Item i (cost[i] >= 0; a negative cost: no owner, -1) to the least-loaded rank, largest cost
// first, ties by index. Deterministic, so every rank computes the same map.
std::vector<int> assign_owners_greedy(const std::vector<double>& cost, int ranks);

// The owner of a parameter every rank of the shard holds an equal range of rows of: AdamW's
// matrices (the embedding and the output layer, SPEC §10), as Megatron's distributed optimizer
// shards AdamW flat. Whole, one of them would leave its owner several times the others' share.
constexpr int kRowSplit = -2;

// The distributed optimizer's owner of each parameter among `ranks` ranks holding the same
// parameters, balanced by the memory the owner keeps (the fp32 master and the state: 2 numel
// for a Muon matrix, 3 for AdamW), which also spreads Newton-Schulz's work by matrix size;
// kRowSplit for AdamW's matrices whose rows the ranks divide evenly; -1 for what has no owner:
// buffers, and routed experts sharded over expert parallelism, which every rank updates itself
// (its expert-data-parallel group holds the same reduced gradients).
std::vector<int> parameter_owners(const ParamStore& params, const RunConfig& run, int ranks);

// A rank's part of the distributed optimizer (use_distributed_optimizer over more than one
// rank holding the same parameters): each parameter's owner (parameter_owners), and this rank.
// The owner alone keeps the parameter's fp32 master and optimizer state, updates it and
// broadcasts the new weights; ranks == 1 (no sharding) leaves every owner -1.
struct OptimizerShard {
    int rank = 0, ranks = 1;
    std::vector<int> owner;  // per parameter; -1: every rank keeps and updates it
    bool sharded() const { return ranks > 1; }
    // This rank keeps the parameter's master and state, whole or (split) its rows.
    bool mine(size_t i) const { return owner.empty() || owner[i] < 0 || owner[i] == rank; }
    bool split(size_t i) const { return !owner.empty() && owner[i] == kRowSplit; }
};

// Rank r's equal share [r bytes / ranks, (r + 1) bytes / ranks) of a row-split tensor of `bytes`
// (kRowSplit: the ranks divide its rows) from rank r to every rank: the whole tensor on each.
void gather_row_shares(Comm& comm, void* data, int64_t bytes);
OptimizerShard optimizer_shard(const ParamStore& params, const RunConfig& run, int rank, int ranks);
// The shard of the rank at `rank` among the world_size / pipeline_model_parallel_size ranks that
// hold the same parameters in a run of `run` (what `plan` shows for that rank).
OptimizerShard planned_optimizer_shard(const ParamStore& params, const RunConfig& run, int rank);

// Each parameter's optimizer state tensors (named "<parameter>.<state>") from the rank owning the
// parameter (owner[i] of `params`; kRowSplit: each rank's rows from it) to every rank of `comm`;
// -1 (state every rank keeps whole, or none) is skipped. What a checkpoint save gathers first.
void broadcast_state_from_owners(Comm& comm, const ParamStore& params, const Optimizer& optimizer,
                                 const MemoryPlan& plan, const std::vector<int>& owner);

}  // namespace sparsetron
