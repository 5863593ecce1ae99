// Splitting optimizer work over data-parallel ranks (the distributed optimizer, SPEC §10): each
// item (a parameter, a Newton-Schulz batch) goes whole to one rank.
#pragma once

#include <vector>

namespace sparsetron {

// Item i (cost[i] >= 0; a negative cost: no owner, -1) to the least-loaded rank, largest cost
// first, ties by index. Deterministic, so every rank computes the same map.
std::vector<int> assign_owners_greedy(const std::vector<double>& cost, int ranks);

}  // namespace sparsetron
