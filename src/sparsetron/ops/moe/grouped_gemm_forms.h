// The CUDA forms of the grouped expert GEMM (moe.h's contract) that grouped_gemm chooses from,
// for the dispatch and the tests.
#pragma once

#include <cstdint>

#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

// The grouped GEMM's forms (grouped_gemm_plan.h picks one): the pipelined WMMA kernel
// (grouped_gemm_wmma.cu) and on sm_90a the warp-specialized persistent wgmma kernel
// (grouped_gemm_wgmma.cu), same contract; `max_blocks` > 0 caps its grid (tests: every block
// walks many tiles). Returns the blocks it launched.
void grouped_gemm_wmma(const ExecContext& ctx, const GroupedGemmArgs& g);
int grouped_gemm_wgmma(const ExecContext& ctx, const GroupedGemmArgs& g, int max_blocks = 0);

// Zeros for the weight gradient [elems] of every expert with no rows (`wstride` elements apart,
// `elem_bytes` 4 or 2; elems and wstride multiples of 8), for the weight-gradient GEMMs that write
// rather than add: their tile walks never reach those experts.
void zero_empty_expert_grads(const ExecContext& ctx, const int32_t* offsets, int64_t experts,
                             int64_t elems, int64_t wstride, int64_t elem_bytes, void* dw);

}  // namespace sparsetron::cuda
