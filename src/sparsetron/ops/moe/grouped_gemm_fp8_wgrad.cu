// The routed experts' weight gradients in FP8 on Hopper: dW_e (+)= dy_e^T x_e over expert e's rows
// (tokens), both operands quantized in 1x128 blocks along the tokens per expert segment
// (quantize_fp8_1x128_expert_columns: dy^T [n, padded] and x^T [k, padded], each expert's rows
// in its own 128-aligned, zero-padded segment), so a 128-deep slice of the reduction is one scale
// block of both operands and never mixes two experts' rows.
//
// The forward kernel's skeleton (grouped_gemm_fp8.cu): persistent clusters of two, a producer
// thread feeding a ring of stages by bulk tensor copies, two consumer warpgroups of 64 rows each
// issuing the next slice's MMAs before promoting this one. What the weight gradient changes:
//   - The reduction runs over the expert's own segment: a tile's slice count is its expert's
//     (rows rounded up to 128, over 128), and the walk covers each expert's n x k output tiles;
//     the cluster's two blocks take vertically adjacent tiles of one expert (the same x^T
//     columns), so their rings stay in step and B (x^T) is always multicast in halves.
//   - Both operands carry per-row scales along the reduction: a promotion multiplies each
//     accumulator by its row's dy^T scale times its column's x^T scale, both staged with the
//     operands (128 of each per stage).
//   - The output is fp32 (or a bf16 gradient buffer), added to or written through shared memory
//     by bulk tensor reduce-adds or stores; experts with no rows get zeros when written.
// Both operands K-major (token-contiguous), as wgmma reads e4m3.
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/common/tensor_map.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/grouped_gemm_tiles.cuh"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

namespace {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // tile rows (n), columns (k), slice (tokens)
constexpr int kStages = 5, kCluster = 2;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kTileBytes = kBM * kBK;
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kStagingBytes = 2 * 16384;      // a consumer warpgroup's 64 x 64 fp32 quarter
constexpr int kScaleBytes = (kBM + kBN) * 4;  // a stage's row scales of both operands
constexpr uint32_t kStageTx = uint32_t(kStageBytes + kScaleBytes);
constexpr size_t kSmemBytes =
    size_t(kStages) * (kStageBytes + kScaleBytes) + kStagingBytes + 1024 + 2 * kStages * 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

// One output tile: rows i0.. (of n) and columns j0.. (of k) of expert e's gradient, reduced over
// `slices` slices from padded token p0 (the expert's segment).
struct Tile {
    int32_t e, i0, j0, p0, slices;
};

// kBf16Grad: the gradient is a bf16 buffer (a template parameter: with the choice at run time
// ptxas moved the in-flight accumulators between the two stores and waited for their MMAs).
template <bool kBf16Grad>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_wgrad_kernel(const int32_t* offsets, int32_t experts, int32_t n, int32_t k,
                                  bool accumulate, const __grid_constant__ CUtensorMap map_a,
                                  const __grid_constant__ CUtensorMap map_b,
                                  const __grid_constant__ CUtensorMap map_sa,
                                  const __grid_constant__ CUtensorMap map_sb,
                                  const __grid_constant__ CUtensorMap map_c) {
#ifdef ST_WGMMA
    using namespace wgmma;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;
    auto tile_a = [&](uint32_t s) { return base + s * uint32_t(kStageBytes); };
    auto tile_b = [&](uint32_t s) { return tile_a(s) + uint32_t(kTileBytes); };
    const uint32_t staging = base + uint32_t(kStages * kStageBytes);
    const uint32_t scales = staging + uint32_t(kStagingBytes);
    // Per stage, 128-byte aligned for the bulk copies: dy^T's 128 row scales, then x^T's.
    auto scale_a = [&](uint32_t s) { return scales + s * uint32_t(kScaleBytes); };
    auto scale_b = [&](uint32_t s) { return scale_a(s) + uint32_t(kBM * 4); };
    const uint32_t bars = scales + uint32_t(kStages * kScaleBytes);
    auto full = [&](uint32_t s) { return bars + 8u * s; };
    auto empty = [&](uint32_t s) { return bars + 8u * (kStages + s); };
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), kCluster * kConsumerThreads / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    const uint32_t rank = cluster_rank();
    cluster_sync();
    const int64_t unit0 = blockIdx.x / kCluster, units = gridDim.x / kCluster;

    // Expert by expert (those with rows), a unit is a pair of row tiles of n at one column tile
    // of k; block `rank` takes row tile 2 p + rank (past n when n has an odd tile count: nothing
    // stored). The walk only moves forward: `w_e` the current expert, `w_first` its first unit,
    // `w_p0` its segment's first padded token.
    const int32_t m_pairs = (n + 2 * kBM - 1) / (2 * kBM), n_tiles = (k + kBN - 1) / kBN;
    int32_t w_e = 0, w_p0 = 0;
    int64_t w_first = 0;
    auto next_tile = [&](int64_t u, Tile& t) {
        for (; w_e < experts; ++w_e) {
            const int32_t rows = offsets[w_e + 1] - offsets[w_e];
            const int32_t slices = (rows + kBK - 1) / kBK;
            const int64_t count = rows > 0 ? int64_t(m_pairs) * n_tiles : int64_t(0);
            if (u < w_first + count) {
                const int32_t local = int32_t(u - w_first);
                t = {w_e, (local / n_tiles * 2 + int32_t(rank)) * kBM, local % n_tiles * kBN, w_p0,
                     slices};
                return true;
            }
            w_first += count;
            w_p0 += slices * kBK;
        }
        return false;
    };

    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tma_prefetch_map(&map_a), tma_prefetch_map(&map_b);
            tma_prefetch_map(&map_sa), tma_prefetch_map(&map_sb);
            constexpr uint16_t kBoth = uint16_t((1u << kCluster) - 1u);
            constexpr int kHalf = kBN / kCluster;
            uint32_t it = 0;
            Tile t;
            for (int64_t u = unit0; next_tile(u, t); u += units)
                for (int32_t sl = 0; sl < t.slices; ++sl, ++it) {
                    const uint32_t s = it % kStages;
                    mbar_wait(empty(s), ((it / kStages) & 1u) ^ 1u);
                    mbar_arrive_expect_tx(full(s), kStageTx);
                    // Rows past n, columns past k read as zero (the maps' bounds).
                    const int32_t kk = t.p0 + sl * kBK, blk = kk / kBK;
                    tma_load(tile_a(s), &map_a, kk, t.i0, full(s));
                    tma_load(scale_a(s), &map_sa, t.i0, blk, full(s));
                    tma_load(scale_b(s), &map_sb, t.j0, blk, full(s));
                    tma_load_multicast(tile_b(s) + uint32_t(int(rank) * kHalf * kBK), &map_b, kk,
                                       t.j0 + int32_t(rank) * kHalf, full(s), kBoth);
                }
        }
    } else {
        const int wg = (threadIdx.x - 128) >> 7, warp = (threadIdx.x >> 5) & 3,
                  lane = threadIdx.x & 31, q = lane & 3;
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
        const int row_a = wg * 64 + warp * 16 + lane / 4, row_b = row_a + 8;
        float acc0[64], acc1[64], sum[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
        uint32_t it = 0;  // fills consumed before this tile
        auto issue = [&](float(&a)[64], int64_t sl) {
            const uint32_t f = it + uint32_t(sl), s = f % kStages;
            mbar_wait(full(s), (f / kStages) & 1u);
            mma_slice_e4m3(a, tile_a(s) + uint32_t(wg * 64 * kBK), tile_b(s));
        };
        // Slice sl's group complete, scaled into sum: accumulator (row, column) by dy^T's scale
        // of the row times x^T's of the column; then the stage released in both blocks.
        auto promote = [&](auto behind, float(&a)[64], int64_t sl) {
            const uint32_t s = (it + uint32_t(sl)) % kStages;
            float sa0, sa1;
            asm volatile("ld.shared.f32 %0, [%1];\n"
                         : "=f"(sa0)
                         : "r"(scale_a(s) + uint32_t(4 * row_a))
                         : "memory");
            asm volatile("ld.shared.f32 %0, [%1];\n"
                         : "=f"(sa1)
                         : "r"(scale_a(s) + uint32_t(4 * row_b))
                         : "memory");
            wait_slice<decltype(behind)::value>(a);
            // x^T's scales of this thread's columns 8 j + 2 q, + 1, read as they are used (held
            // all at once, they pushed the accumulators out of registers).
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                float b0, b1;
                asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                             : "=f"(b0), "=f"(b1)
                             : "r"(scale_b(s) + uint32_t(4 * (8 * j + 2 * q)))
                             : "memory");
                sum[4 * j] += a[4 * j] * (sa0 * b0);
                sum[4 * j + 1] += a[4 * j + 1] * (sa0 * b1);
                sum[4 * j + 2] += a[4 * j + 2] * (sa1 * b0);
                sum[4 * j + 3] += a[4 * j + 3] * (sa1 * b1);
            }
            // The scales are read: the stage may be refilled.
            if (lane == 0)
                for (uint32_t r = 0; r < uint32_t(kCluster); ++r) mbar_arrive_cluster(empty(s), r);
        };
        auto store = [&](const Tile& t) {
            const uint32_t buf = staging + uint32_t(wg) * 16384u;
            if constexpr (kBf16Grad)
                reduce_acc_tma_bf16(sum, &map_c, buf, wg, t.i0 + wg * 64, t.j0, t.e, accumulate);
            else
                reduce_acc_tma(sum, &map_c, buf, wg, t.i0 + wg * 64, t.j0, t.e, accumulate);
        };
        Tile t;
        int64_t u = unit0;
        if (next_tile(u, t)) {
            issue(acc0, 0);  // on entry to each tile acc0's group (its first slice) is in flight
            for (;;) {
#pragma unroll
                for (int i = 0; i < 64; ++i) sum[i] = 0.f;
                run_slices(acc0, acc1, t.slices, issue, promote);
                it += uint32_t(t.slices);
                const Tile done = t;
                u += units;
                const bool more = next_tile(u, t);
                if (more)
                    issue(acc0, 0);  // the next tile's first slice, run while this one is stored
                store(done);
                if (!more) break;
            }
        }
        if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    cluster_sync();
#else
    __trap();  // dispatched only on sm_90a (has_sm90a)
#endif
}

// The launch of one gradient type's kernel (the arguments as grouped_gemm_fp8_weight_grad's).
template <bool kBf16Grad>
void launch(const ExecContext& ctx, const Fp8GroupedWeightGrad& g, int64_t units, int64_t most,
            int64_t wstride) {
    ClusterLaunch cl(kThreads, kSmemBytes, stream_of(ctx), kCluster);
    cl.size_grid<grouped_gemm_fp8_wgrad_kernel<kBf16Grad>>(units, most);
    // dy^T [n, padded] and x^T [k, padded] bytes: boxes of 128 x 128 and 128 x 64 (a block's half
    // of the x^T tile); their scales [blocks(padded)][round4(rows)] fp32, boxes of 128 rows.
    const int64_t pb = g.padded / 128;
    const CUtensorMap ma = u8_tensor_map(g.dyt.q, {g.padded, g.n}, {g.padded}, {kBK, kBM});
    const CUtensorMap mb =
        u8_tensor_map(g.xt.q, {g.padded, g.k}, {g.padded}, {kBK, kBN / kCluster});
    const CUtensorMap msa = f32_unswizzled_tensor_map(g.dyt.scale_inv, {fp8::round4(g.n), pb},
                                                      {fp8::round4(g.n) * 4}, {kBM, 1});
    const CUtensorMap msb = f32_unswizzled_tensor_map(g.xt.scale_inv, {fp8::round4(g.k), pb},
                                                      {fp8::round4(g.k) * 4}, {kBN, 1});
    const CUtensorMap mc =
        wgmma::weight_grad_tensor_map(g.dw, g.experts, g.n, g.k, wstride, kBf16Grad);
    ST_CUDA_CHECK(cudaLaunchKernelEx(&cl.config, grouped_gemm_fp8_wgrad_kernel<kBf16Grad>,
                                     g.offsets, int32_t(g.experts), int32_t(g.n), int32_t(g.k),
                                     g.accumulate, ma, mb, msa, msb, mc));
}

}  // namespace

void grouped_gemm_fp8_weight_grad(const ExecContext& ctx, const Fp8GroupedWeightGrad& g,
                                  int blocks) {
    ST_CHECK(grouped_gemm_fp8_available(),
             "the FP8 expert weight gradient needs an sm_90a GPU (Hopper's e4m3 wgmma)");
    ST_CHECK(g.n % 8 == 0 && g.k % 8 == 0 && g.padded % 128 == 0,
             "grouped_gemm_fp8_weight_grad: n (", g.n, ") and k (", g.k,
             ") must be multiples of 8 and the padded tokens (", g.padded, ") of 128");
    ST_CHECK(g.grad_type == DType::F32 || g.grad_type == DType::BF16,
             "grouped_gemm_fp8_weight_grad: fp32 or bf16 gradients");
    const int64_t wstride = g.weight_stride ? g.weight_stride : g.n * g.k;
    const bool bf16_grad = g.grad_type == DType::BF16;
    if (!g.accumulate)
        zero_empty_expert_grads(ctx, g.offsets, g.experts, g.n * g.k, wstride, bf16_grad ? 2 : 4,
                                g.dw);
    const int64_t units = g.experts * blocks_for(g.n, 2 * kBM) * blocks_for(g.k, kBN);
    if (units == 0 || g.padded == 0) return;
    const int64_t most = blocks > 0 ? std::max(blocks, kCluster) : 0;
    if (bf16_grad)
        launch<true>(ctx, g, units, most, wstride);
    else
        launch<false>(ctx, g, units, most, wstride);
}

}  // namespace sparsetron::cuda
