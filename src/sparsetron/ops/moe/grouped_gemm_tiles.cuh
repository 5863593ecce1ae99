// The grouped expert GEMM's tiles on warpgroup MMA (the bf16 kernel, grouped_gemm_wgmma.cu, and the
// FP8 one, grouped_gemm_fp8.cu): each kind's operand roles, a 64-deep slice's MMAs and the
// accumulator's store, over the building blocks of ops/common/wgmma.cuh.
//
// Operand roles per kind (moe.h's GroupedGemm), for expert e with rows [r0, r1):
//   RowsTimesWeightT  M = rows, N = n, K = k:    A = x [rows, k] K-major,  B = W_e [n, k] K-major
//   RowsTimesWeight   M = rows, N = k, K = n:    A = dy [rows, n] K-major, B = W_e [n, k] MN-major
//   WeightGrad        M = n, N = k, K = rows:    A = dy^T (dy [rows, n]),  B = x [rows, k]: both
//                     MN-major; copies past the expert's rows zero-fill, so the reduction stops
//                     there.
#pragma once

#include <cstdint>

#include "sparsetron/ops/common/wgmma.cuh"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda::wgmma {

template <GroupedGemm kKind>
constexpr bool a_k_major = kKind != GroupedGemm::WeightGrad;
template <GroupedGemm kKind>
constexpr bool b_k_major = kKind == GroupedGemm::RowsTimesWeightT;

// Expert e's GEMM: C (M x N) += A (M x K) B (K x N) in the roles above.
struct Problem {
    int64_t r0, M, N, K, lda, ldb;
    const bf *A, *B;
};
template <GroupedGemm kKind>
__device__ __forceinline__ Problem problem(const int32_t* offsets, int64_t e, int64_t n, int64_t k,
                                           int64_t wstride, const bf* a, const bf* b) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if constexpr (kKind == GroupedGemm::RowsTimesWeightT)
        return {r0, rows, n, k, k, k, a + r0 * k, b + e * wstride};
    else if constexpr (kKind == GroupedGemm::RowsTimesWeight)
        return {r0, rows, k, n, n, k, a + r0 * n, b + e * wstride};
    else
        return {r0, n, k, rows, n, k, a + r0 * n, b + r0 * k};
}

#ifdef ST_WGMMA
// One 64-deep slice for this warpgroup: four k16 MMAs on its 64 rows (`ta` already offset to
// them) against the whole B tile.
template <GroupedGemm kKind, int kAcc>
__device__ __forceinline__ void mma_slice(float (&d)[kAcc], uint32_t ta, uint32_t tb) {
    constexpr bool kAK = a_k_major<kKind>, kBK = b_k_major<kKind>;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
        mma_m64k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, slice_descriptor<kAK>(ta, kk),
                                             slice_descriptor<kBK>(tb, kk));
}

// Stores a warpgroup's 64 x (2 kAcc / 64 * 64) accumulator block at rows row0.., columns j0..:
// bf16 rows of the expert or, for weight gradients, fp32 rows of its gradient; added to with
// `accumulate`. Accumulator layout (m64nNk16, fp32): warp w of the warpgroup holds rows
// 16w + lane / 4 (+ 8); register 4j + {0, 1} (+ {2, 3} for the +8 row) is column
// 8j + 2 (lane % 4) + {0, 1}. The weight gradient's fp32 adds are reductions
// (`red.global.add.v2.f32`); as a load-add-store per pair they held the consumers for the
// loads' latency with the tensor cores idle (docs/perf/log/).
template <GroupedGemm kKind, int kAcc>
__device__ __forceinline__ void store_acc(const float (&d)[kAcc], const Problem& p, int64_t e,
                                          int64_t wstride, int64_t row0, int64_t j0,
                                          bool accumulate, void* c) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int64_t r = row0 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < kAcc / 4; ++j) {
        const int64_t gj = j0 + j * 8 + 2 * (lane % 4);
        if (gj >= p.N) continue;  // N is a multiple of 8: a pair is all in or all out
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t gi = r + half * 8;
            if (gi >= p.M) continue;
            const float v0 = d[4 * j + 2 * half], v1 = d[4 * j + 2 * half + 1];
            if constexpr (kKind == GroupedGemm::WeightGrad) {
                // A reduction, not a load-add-store: the thread does not wait for the old value,
                // so the consumers go on to the next tile's MMAs while L2 adds. One block owns
                // each element: one add per element, in no race, as deterministic as the load.
                float* dst = static_cast<float*>(c) + e * wstride + gi * p.N + gj;
                if (accumulate)
                    red_add2(dst, v0, v1);
                else
                    *reinterpret_cast<float2*>(dst) = float2{v0, v1};
            } else {
                __nv_bfloat162* dst =
                    reinterpret_cast<__nv_bfloat162*>(static_cast<bf*>(c) + (p.r0 + gi) * p.N + gj);
                float2 o{v0, v1};
                if (accumulate) {
                    const float2 q = __bfloat1622float2(*dst);
                    o.x += q.x, o.y += q.y;
                }
                *dst = __float22bfloat162_rn(o);
            }
        }
    }
}
#endif  // ST_WGMMA

}  // namespace sparsetron::cuda::wgmma
