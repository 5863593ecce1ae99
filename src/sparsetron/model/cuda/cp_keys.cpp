// The CP key exchange (cp_keys.h).
#include "sparsetron/model/cuda/cp_keys.h"

#include "sparsetron/ops/copy/copy.h"

namespace sparsetron::cuda {

namespace {

// Ranks of the micro-batch's CP group that exchange (1: this rank holds every key row's source).
int group_of(const CudaInputs& in) {
    return in.cp ? in.cp->size() : 1;
}

}  // namespace

int64_t cp_key_exchange_floats(const ModelConfig& c, int64_t tokens, int64_t dim) {
    return c.context_parallel_ranks * tokens * dim;
}

void cp_gather_keys(const ExecContext& ctx, const CudaInputs& in, const bf16* rows, int64_t dim,
                    float* xfer, bf16* keys) {
    const int64_t T = in.tokens;
    const int g = group_of(in);
    if (g == 1) {
        rows_to_keys(ctx, rows, T, dim, in.key_row, keys, in.key_tokens);
        return;
    }
    bf16* blocks = reinterpret_cast<bf16*>(xfer);
    const int64_t block_bytes = T * dim * int64_t(sizeof(bf16));
    copy_2d(ctx, blocks + in.cp->rank() * T * dim, 0, rows, 0, block_bytes, 1);
    in.cp->device_allgather(blocks, block_bytes, ctx.stream);
    rows_to_keys(ctx, blocks, g * T, dim, in.all_key_rows, keys, in.key_tokens);
}

void cp_reduce_key_grads(const ExecContext& ctx, const CudaInputs& in, const float* dkeys,
                         int64_t dim, float* xfer, float* drows) {
    const int64_t T = in.tokens;
    const int g = group_of(in);
    if (g == 1) {
        keys_to_rows(ctx, dkeys, dim, in.key_row, T, drows);
        return;
    }
    keys_to_rows(ctx, dkeys, dim, in.all_key_rows, g * T, xfer);
    in.cp->device_reduce_scatter_sum(xfer, drows, T * dim, ctx.stream);
}

}  // namespace sparsetron::cuda
