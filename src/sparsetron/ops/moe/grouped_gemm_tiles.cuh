// The grouped expert GEMM's tiles on warpgroup MMA (the bf16 kernel, grouped_gemm_wgmma.cu, and the
// FP8 one, grouped_gemm_fp8.cu): each kind's operand roles, a 64-deep slice's MMAs, the
// accumulator's store and the bulk-store staging, over the building blocks of ops/common/wgmma.cuh.
//
// Operand roles per kind (moe.h's GroupedGemm), for expert e with rows [r0, r1):
//   RowsTimesWeightT  M = rows, N = n, K = k:    A = x [rows, k] K-major,  B = W_e [n, k] K-major
//   RowsTimesWeight   M = rows, N = k, K = n:    A = dy [rows, n] K-major, B = W_e [n, k] MN-major
//   WeightGrad        M = n, N = k, K = rows:    A = dy^T (dy [rows, n]),  B = x [rows, k]: both
//                     MN-major; copies past the expert's rows zero-fill, so the reduction stops
//                     there.
#pragma once

#include <cstdint>
#include <type_traits>

#include "sparsetron/ops/common/tensor_map.h"
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

// The tensor map the weight-gradient stores above write through: dW [E][n][k] (`wstride` elements
// between experts), boxes of 64 x 64 bf16 (reduce_acc_tma_bf16) or 64 x 32 fp32 (reduce_acc_tma).
inline CUtensorMap weight_grad_tensor_map(void* dw, int64_t experts, int64_t n, int64_t k,
                                          int64_t wstride, bool bf16_grad) {
    return bf16_grad ? bf16_tensor_map(dw, {k, n, experts}, {k * 2, wstride * 2}, {64, 64, 1})
                     : f32_tensor_map(dw, {k, n, experts}, {k * 4, wstride * 4}, {32, 64, 1});
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

// d (=, or += with `acc`) A (64 x 32 e4m3) * B (32 x 128 e4m3), both K-major, fp32 accumulators in
// the m64nNk16 layout (wgmma.cuh, store_acc).
__device__ __forceinline__ void mma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db,
                                                    int acc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " ST_WGMMA_ACC64_REGS
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : ST_WGMMA_ACC64_OPERANDS(d)
        : "l"(da), "l"(db), "r"(acc));
}

// The FP8 kernels' slices (128 deep, one scale block): a warpgroup's four k32 MMAs of its 64 rows
// (`ta`, 32 bytes apart along the swizzled rows) against the 128-column B tile `tb`, into a
// fresh accumulator block `a`, as one committed group.
__device__ __forceinline__ void mma_slice_e4m3(float (&a)[64], uint32_t ta, uint32_t tb) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        mma_m64n128k32_e4m3(a, descriptor(ta + kk * 32, 16, 1024),
                            descriptor(tb + kk * 32, 16, 1024), kk > 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kBehind MMA groups are running (a's, issued before them, complete). The
// compiler sees a written when the MMAs are issued, not when the wait returns: the empty
// statements keep later reads of a below the wait.
template <int kBehind>
__device__ __forceinline__ void wait_slice(float (&a)[64]) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kBehind) : "memory");
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(a[i])::"memory");
}

using SlicesBehind0 = std::integral_constant<int, 0>;  // MMA groups left running by a promotion
using SlicesBehind1 = std::integral_constant<int, 1>;

// A tile's slices 0..slices-1 through two accumulator blocks: slice s + 1's MMAs issued into one
// before slice s is promoted from the other, so a consumer's own MMAs run during its promotions.
// On entry slice 0's group is in flight in acc0; on return every group has completed.
// issue(acc, s) issues slice s; promote(behind, acc, s) waits for it (wait_slice<behind>) and
// scales it into the tile's sum. The wait counts are constants on every path: ptxas then sees
// which groups a promotion reads (with a count chosen at run time it injected waits and
// serialized the MMAs).
template <class Issue, class Promote>
__device__ __forceinline__ void run_slices(float (&acc0)[64], float (&acc1)[64], int64_t slices,
                                           Issue issue, Promote promote) {
    int64_t sl = 0;
    for (; sl + 2 < slices; sl += 2) {
        issue(acc1, sl + 1);
        promote(SlicesBehind1{}, acc0, sl);
        issue(acc0, sl + 2);
        promote(SlicesBehind1{}, acc1, sl + 1);
    }
    if (sl + 1 < slices) {
        issue(acc1, sl + 1);
        promote(SlicesBehind1{}, acc0, sl);
        promote(SlicesBehind0{}, acc1, sl + 1);
    } else {
        promote(SlicesBehind0{}, acc0, sl);
    }
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

// The staging the epilogues use (the bf16 and FP8 kernels), a round at a time through a
// warpgroup's 16 KiB buffer: its leader waits until the buffer's previous bulk copies have read
// it, the warpgroup writes it (`write(round)`), fences the async proxy (the bulk copies read
// through it) and meets again on named barrier 1 + wg, then the leader issues the round's bulk
// copies (`issue(round)`) as one group. The copies run on while the warpgroup goes on to its next
// round or tile.
template <int kRounds, class Write, class Issue>
__device__ __forceinline__ void through_staging(int wg, Write write, Issue issue) {
    const bool leader = (threadIdx.x & 127) == 0;
    auto sync_warpgroup = [&] { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); };
#pragma unroll
    for (int u = 0; u < kRounds; ++u) {
        if (leader) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        sync_warpgroup();
        write(u);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        sync_warpgroup();
        if (leader) {
            issue(u);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
}

// Columns 128 h.. of a warpgroup's 64-row accumulator block (kAcc registers: 2 kAcc / 64 x 64
// columns) into `buf` as two 64 x 64 bf16 boxes (8 KiB, 128-byte rows, 16-byte chunk c of row r
// at c ^ (r % 8): the maps' 128-byte swizzle; the writes are free of bank conflicts).
// Accumulator layout: store_acc.
template <int kAcc>
__device__ __forceinline__ void stage_bf16_128(const float (&d)[kAcc], uint32_t buf, int h) {
    static_assert(kAcc % 64 == 0, "whole 128-column halves");
    const int t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {  // the half's 8-column groups
        const int j = 16 * h + jj, box = jj >> 3, chunk = jj & 7;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + lane / 4 + half * 8;
            const __nv_bfloat162 v =
                __float22bfloat162_rn(float2{d[4 * j + 2 * half], d[4 * j + 2 * half + 1]});
            const uint32_t addr = buf + box * 8192 + r * 128 + ((chunk ^ (r & 7)) << 4) + 4 * q;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr),
                         "r"(*reinterpret_cast<const uint32_t*>(&v))
                         : "memory");
        }
    }
}
// One box of a gradient [E][n][k] at column c0, rows row0.. of expert e from shared memory `src`:
// added into it by a bulk tensor reduce-add (`add`) or written by a bulk tensor store.
__device__ __forceinline__ void tma_store_or_add(const CUtensorMap* mc, uint32_t src, int32_t c0,
                                                 int64_t row0, int64_t e, bool add) {
    if (add)
        tma_reduce_add(mc, src, c0, int32_t(row0), int32_t(e));
    else
        tma_store(mc, src, c0, int32_t(row0), int32_t(e));
}

// A warpgroup's weight-gradient block (64 rows, kAcc / 32 x 64 columns) into a bf16 gradient (bf16
// gradient buffers): rounded to bf16 and added into it by bulk tensor reduce-adds (`add`; the
// map's element type, bf16, is the addition's) or written by bulk tensor stores, 64 x 128 at a
// time (stage_bf16_128), at rows row0.. of expert e's [n, k] gradient. Rows and columns past its
// edges are not written.
template <int kAcc>
__device__ __forceinline__ void reduce_acc_tma_bf16(const float (&d)[kAcc], const CUtensorMap* mc,
                                                    uint32_t buf, int wg, int64_t row0, int64_t j0,
                                                    int64_t e, bool add) {
    auto issue = [&](int h) {
        for (int box = 0; box < 2; ++box)
            tma_store_or_add(mc, buf + box * 8192, int32_t(j0 + 128 * h + 64 * box), row0, e, add);
    };
    through_staging<kAcc / 64>(
        wg, [&](int h) { stage_bf16_128(d, buf, h); }, issue);
}

// The same into an fp32 gradient: the warpgroup's fp32 block (rows row0.. of expert e's [n, k]
// gradient, columns j0..) added into it by bulk tensor reduce-adds (`add`) or written by bulk
// tensor stores (a gradient's first write: its old tiles are never read), in 64 x 64 quarters
// through the same buffer, each two 64-row x 32-column boxes (8 KiB, 128-byte rows of 32 floats,
// 16-byte chunk c of row r at c ^ (r % 8)). A thread's pair of columns 8j + 2q.. lands in chunk 2
// (j % 4) + q / 2 of box (j % 8) / 4, at byte 8 (q % 2) (two lanes per bank: the 256 bytes of a
// warp's store take the minimum two wavefronts). Rows and columns past the gradient's edges are not
// written (the map's bounds).
template <int kAcc>
__device__ __forceinline__ void reduce_acc_tma(const float (&d)[kAcc], const CUtensorMap* mc,
                                               uint32_t buf, int wg, int64_t row0, int64_t j0,
                                               int64_t e, bool add) {
    const int t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    auto write = [&](int u) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {  // the quarter's 8-column groups
            const int j = 8 * u + jj, box = jj >> 2, chunk = 2 * (jj & 3) + (q >> 1);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp * 16 + lane / 4 + half * 8;
                const uint32_t addr =
                    buf + box * 8192 + r * 128 + ((chunk ^ (r & 7)) << 4) + 8 * (q & 1);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr),
                             "f"(d[4 * j + 2 * half]), "f"(d[4 * j + 2 * half + 1])
                             : "memory");
            }
        }
    };
    auto issue = [&](int u) {
        for (int box = 0; box < 2; ++box)
            tma_store_or_add(mc, buf + box * 8192, int32_t(j0 + 64 * u + 32 * box), row0, e, add);
    };
    through_staging<kAcc / 32>(wg, write, issue);
}
#endif  // ST_WGMMA

}  // namespace sparsetron::cuda::wgmma
