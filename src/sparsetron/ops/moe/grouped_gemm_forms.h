// The CUDA forms of the grouped expert GEMM (moe.h's contract) that grouped_gemm chooses from,
// for the dispatch and the tests.
#pragma once

#include <cstdint>

#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

// The grouped GEMM's forms (grouped_gemm picks one): the pipelined WMMA kernel
// (grouped_gemm_tc.cu) where rows are 16-byte aligned, and on sm_90a the warp-specialized
// persistent wgmma kernel (grouped_gemm_ws.cu), same contract; `max_blocks` > 0 caps its grid
// (tests: every block walks many tiles). Returns the blocks it launched.
bool grouped_gemm_wmma_supported(int64_t n, int64_t k, int64_t weight_stride, const void* a,
                                 const void* b, const void* c);
void grouped_gemm_wmma(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets,
                       int64_t experts, int64_t max_rows, int64_t n, int64_t k, const bf16* a,
                       const bf16* b, void* c, int64_t weight_stride, bool accumulate);
int grouped_gemm_wgmma(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets,
                       int64_t experts, int64_t max_rows, int64_t row_capacity, int64_t n,
                       int64_t k, const bf16* a, const bf16* b, void* c, int64_t weight_stride,
                       bool accumulate, int max_blocks = 0);

}  // namespace sparsetron::cuda
