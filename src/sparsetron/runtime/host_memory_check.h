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

// Host bytes of one step's packed micro-batches: `count` of `slots` token slots and
// `max_documents` documents each (tokens, targets, positions, cu_seqlens), held twice (the
// step's and a lookahead copy). Both backends pack on the host, outside the memory plan.
double step_batch_host_bytes(int64_t count, int64_t slots, int64_t max_documents);

// Throws, naming the keys, when the host buffers of one step's packed micro-batches (`count` of
// `slots` token slots and `max_documents` documents each) exceed the available host memory.
void check_host_memory_for_batches(const Recipe& recipe, int64_t count, int64_t slots,
                                   int64_t max_documents);

// Throws when the CPU backend's memory plan (`plan_bytes`, every class) exceeds the available
// host memory, before it is allocated.
void check_host_memory_for_cpu_plan(uint64_t plan_bytes);

}  // namespace sparsetron
