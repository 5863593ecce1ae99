// The masked dense form's layout (sparse_mqa_masked.cu): a chunk of query rows holds S and dP
// (fp32) and P (bf16) for every head against the chunk's key range, rows padded to 16 elements;
// the kernels that mask a row by its selected keys hold a bitmask of the keys (and with the
// head-summed probabilities a float per key) in shared memory. Plain host arithmetic, shared by
// the kernels and the attention plan (attention_plan.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace sparsetron::cuda::masked {

// S / dP / P elements per chunk (512 query tokens at 4K context x 64 heads): fewer, larger GEMMs
// and more blocks per kernel; smaller chunks measured slower (docs/perf/log/).
constexpr int64_t kChunkElems = int64_t(128) << 20;
constexpr int64_t kBytesPerElem = 2 * sizeof(float) + 2;  // S, dP (fp32), P (bf16)
// The key-mask kernels' dynamic shared memory bound.
constexpr size_t kMaxProbsSmem = 200 * 1024;

// 16-element rows: aligned vector stores and GEMM operands.
constexpr int64_t leading_dim(int64_t tokens) {
    return (tokens + 15) / 16 * 16;
}
// Dynamic shared memory of a key-mask kernel: the mask, and with prob_sum a float per key.
constexpr size_t mask_smem(int64_t lds) {
    return size_t((lds + 31) / 32 + 3) / 4 * 4 * sizeof(uint32_t);
}
constexpr size_t probs_smem_bytes(int64_t lds, bool prob_sum) {
    return mask_smem(lds) + (prob_sum ? size_t(lds) * sizeof(float) : 0);
}
// Whether rows of `keys` keys fit the kernels at all (the head-summed probabilities need a float
// per key of shared memory).
constexpr bool fits(int64_t keys) {
    return probs_smem_bytes(leading_dim(keys), true) <= kMaxProbsSmem;
}
// Query rows per chunk that `bytes` of workspace hold against `keys` keys (0: none).
constexpr int64_t chunk_rows(int64_t keys, int64_t heads, int64_t bytes) {
    return bytes / (heads * leading_dim(keys) * kBytesPerElem);
}

}  // namespace sparsetron::cuda::masked
