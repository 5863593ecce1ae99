// A run that cannot fit in host memory stops before it plans, naming the sizes: planning a model
// of millions of experts takes long, and allocating it fails only at the end.
#pragma once

#include <cstdint>

#include "sparsetron/config/recipe.h"

namespace sparsetron {

// A lower bound on this rank's parameter count, from the config alone: the embedding, the head
// and the routed experts this rank holds (the bulk of an MoE model; every other weight is left
// out, so the bound never exceeds the planned count).
int64_t parameter_count_lower_bound(const ModelConfig& m);

// Bytes of host memory available to a new allocation (Linux: MemAvailable), or 0 when unknown.
uint64_t available_host_memory();

// Throws, naming both sizes, when the CPU backend's fp32 weights, gradients and one optimizer
// moment for the lower bound above already exceed the available host memory.
void check_host_memory_for_training(const Recipe& recipe);

}  // namespace sparsetron
