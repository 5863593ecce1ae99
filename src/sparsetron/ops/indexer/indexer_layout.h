// The indexer's GEMM forms' layout (indexer.cu scores, indexer_loss.cu backward): fp32 dot
// products [chunk rows, heads, keys] with rows padded to 4 elements, and the backward's fp32 dot
// products plus bf16 logit gradients with rows padded to 16. Host arithmetic shared by the
// kernels and the plan (indexer_plan.h).
#pragma once

#include <algorithm>
#include <cstdint>

namespace sparsetron::cuda::indexer_layout {

constexpr int64_t kDotsChunkElems = int64_t(32) << 20;  // 128 MiB of fp32 dot products
constexpr int64_t dots_ld(int64_t tokens) {
    return (tokens + 3) / 4 * 4;
}
constexpr int64_t dots_chunk_tokens(int64_t tokens, int64_t heads, int64_t elems) {
    return std::max<int64_t>(1, std::min(tokens, elems / (heads * dots_ld(tokens))));
}
// 16 elements: aligned bf16 rows for cuBLASLt and the kernel.
constexpr int64_t dlogits_ld(int64_t keys) {
    return (keys + 15) / 16 * 16;
}

}  // namespace sparsetron::cuda::indexer_layout
