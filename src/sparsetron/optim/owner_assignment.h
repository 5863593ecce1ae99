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

// The distributed optimizer's owner of each parameter among `ranks` ranks holding the same
// parameters, balanced by cost (Muon's Newton-Schulz ~ numel x min(rows, cols), AdamW ~ numel);
// -1 for what has no owner: buffers, and routed experts sharded over expert parallelism, which
// every rank updates itself (its expert-data-parallel group holds the same reduced gradients).
std::vector<int> parameter_owners(const ParamStore& params, const RunConfig& run, int ranks);

// Each parameter's optimizer state tensors (named "<parameter>.<state>") from the rank owning the
// parameter (owner[i] of `params`) to every rank of `comm`; negative owners (state every rank
// keeps whole, or none) are skipped. What a checkpoint save gathers first.
void broadcast_state_from_owners(Comm& comm, const ParamStore& params, const Optimizer& optimizer,
                                 const MemoryPlan& plan, const std::vector<int>& owner);

}  // namespace sparsetron
