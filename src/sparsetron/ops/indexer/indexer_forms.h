// The CUDA forms of the indexer scores (indexer.h's contract) that indexer_scores chooses from,
// for the dispatch and the tests.
#pragma once

#include <cstdint>

#include "sparsetron/ops/indexer/indexer.h"

namespace sparsetron::cuda {

// The forms indexer_scores chooses from, for the harness and tests: the cuBLASLt chunks (a
// workspace is required) and the fused wgmma kernel (sm_90; 16 / 32 / 64 heads, 64 / 128 dims;
// key_row as in indexer_scores).
void indexer_scores_gemm(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                         const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                         float* scores, void* workspace, int64_t workspace_bytes);
bool indexer_scores_wgmma_supported(int64_t heads, int64_t dim);
void indexer_scores_wgmma(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                          const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                          float* scores, const int32_t* key_row = nullptr, int64_t keys = 0);

}  // namespace sparsetron::cuda
