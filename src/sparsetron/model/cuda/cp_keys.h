// Context parallelism's key rows (SPEC §10): a rank computes the keys of its own rows, while the
// attention, the indexer and e2e TV read every row of the micro-batch. Forward: the CP group
// all-gathers its rows in bf16 (rank-major blocks of `tokens` rows) and each rank scatters them
// to their key rows. Backward: a rank's gradients of every key row are picked out rank-major (row
// n of block r: the key row that rank r's row n is) and reduce-scattered in fp32, so each rank
// receives the sums of its own rows. Per key element that moves 2 bytes forward and 4 backward
// through each rank, where an fp32 all-reduce of every key row moves about 8 each way.
#pragma once

#include "sparsetron/model/cuda/cuda_common.h"

namespace sparsetron::cuda {

// Floats of the exchange buffer (`xfer` below) for rows of `dim`: the largest CP group's rows
// (ModelConfig::context_parallel_ranks x `tokens` rows per rank).
int64_t cp_key_exchange_floats(const ModelConfig& c, int64_t tokens, int64_t dim);

// keys [in.key_tokens, dim] <- every micro-batch row's keys (zero for padding), from this
// rank's `rows` [in.tokens, dim] and its CP group's.
void cp_gather_keys(const ExecContext& ctx, const CudaInputs& in, const bf16* rows, int64_t dim,
                    float* xfer, bf16* keys);

// drows [in.tokens, dim] <- this rank's rows of the key gradients, summed over the CP group;
// `dkeys` [in.key_tokens, dim]: this rank's gradients of every key row.
void cp_reduce_key_grads(const ExecContext& ctx, const CudaInputs& in, const float* dkeys,
                         int64_t dim, float* xfer, float* drows);

}  // namespace sparsetron::cuda
