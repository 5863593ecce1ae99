// FP8 blockwise grouped expert GEMM on Hopper (the routed experts under `fp8_recipe: blockwise`):
// for every expert e, y[rows of e] (+)= x[rows of e] W_e^T with x e4m3 in 1x128 blocks along k
// and W_e e4m3 in 128x128 blocks, the DeepSeek-V3 recipe (fp8.h, grouped_gemm_fp8). cuBLASLt's
// block-scaled GEMM takes one matrix per call, and a loop over the experts would need their
// row counts on the host (a sync in the step); this kernel reads them from `offsets` on the GPU.
//
// Same skeleton as the bf16 kernel (grouped_gemm_wgmma.cu): persistent, one block per SM walking
// the experts' real output tiles; a producer thread fills a ring of stages by bulk tensor copies
// (TMA, 128-byte swizzle); two consumer warpgroups multiply 64 rows each. What FP8 changes:
//   - A slice is 128 deep (128 bytes per row: the same tile bytes and swizzle as bf16's 64), so a
//     stage is exactly one scale block of k: four m64n128k32 e4m3 MMAs.
//   - The scales differ per 128-deep block, so the MMAs of a block accumulate into a fresh
//     register block that is then scaled (x's row scale times W's block scale) and added to the
//     tile's fp32 sum in registers ("promotion", as DeepGEMM does). That takes more than one
//     accumulator block, hence 128-wide tiles (64 registers each) rather than bf16's 256.
//   - A consumer issues the next slice's MMAs into a second register block before it promotes
//     this one, so its own MMAs keep the tensor cores busy during the promotion (waiting for each
//     slice before promoting leaves that to the other warpgroup, and measured slower).
// wgmma reads e4m3 operands K-major only: both operands here have k contiguous (the input
// gradient runs the same kernel on W^T copies, Fp8Weights).

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/fp8_scale_layout.h"
#include "sparsetron/ops/common/tensor_map.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/moe/grouped_gemm_tiles.cuh"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

namespace {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // tile rows, columns, slice depth (bytes)
constexpr int kStages = 6;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kTileBytes = kBM * kBK;
static_assert(kBN * kBK == kTileBytes, "A and B tiles of one size");
constexpr int kStageBytes = 2 * kTileBytes;
// Stages, alignment slack for the 1024-byte swizzle period, the full and empty mbarriers.
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 1024 + 2 * kStages * 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

// Scale operands as the kernel reads them: x's 1x128 scales [blocks(k)][x_ld] (x_ld =
// round4(row capacity)), W's 128x128 scales per expert, `w_stride` floats apart.
struct Scales {
    const float* x;
    int64_t x_ld;
    const float* w;
    int64_t w_stride;
    int64_t w_ld;  // round4(blocks(k)): one 128-row block of W's scales
};

// A consumer warpgroup issues slice s + 1's MMAs into a second register block before it promotes
// slice s.
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_kernel(const int32_t* offsets, int64_t experts, int64_t n, int64_t k,
                            int64_t row_capacity, Scales sc, bool accumulate, bf* y,
                            const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b) {
#ifdef ST_WGMMA
    using namespace wgmma;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 B
    auto tile_a = [&](uint32_t s) { return base + s * uint32_t(kStageBytes); };
    auto tile_b = [&](uint32_t s) { return tile_a(s) + uint32_t(kTileBytes); };
    const uint32_t bars = base + uint32_t(kStages * kStageBytes);
    auto full = [&](uint32_t s) { return bars + 8u * s; };
    auto empty = [&](uint32_t s) { return bars + 8u * (kStages + s); };
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 8);  // one arrival per consumer warp
        }
    }
    __syncthreads();

    // Expert by expert over its row tiles x column tiles; the walk only moves forward (w_e, and
    // w_first the linear index of its first tile), experts with no rows skipped.
    const int64_t n_tiles = (n + kBN - 1) / kBN, slices = (k + kBK - 1) / kBK;
    int64_t w_e = 0, w_first = 0;
    auto next_tile = [&](int64_t t, int64_t& e, int64_t& r0, int64_t& rows, int64_t& i0,
                         int64_t& j0) {
        for (; w_e < experts; ++w_e) {
            r0 = offsets[w_e], rows = offsets[w_e + 1] - r0;
            const int64_t count = rows > 0 ? (rows + kBM - 1) / kBM * n_tiles : int64_t(0);
            if (t < w_first + count) {
                const int64_t local = t - w_first;
                e = w_e, i0 = local / n_tiles * kBM, j0 = local % n_tiles * kBN;
                return true;
            }
            w_first += count;
        }
        return false;
    };

    int64_t e, r0, rows, i0, j0;
    if (threadIdx.x < 128) {
        // The consumers hold three register blocks: the producer gives its registers up (40 + 2 x
        // 232 per thread of each warpgroup: the SM's 64K).
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x != 0) return;  // one thread feeds the ring
        tma_prefetch_map(&map_a), tma_prefetch_map(&map_b);
        uint32_t it = 0;
        for (int64_t t = blockIdx.x; next_tile(t, e, r0, rows, i0, j0); t += gridDim.x)
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                mbar_wait(empty(s), ((it / kStages) & 1u) ^ 1u);
                mbar_arrive_expect_tx(full(s), uint32_t(kStageBytes));
                // Rows past the buffer and columns past k or n read as zero (the maps' bounds).
                tma_load(tile_a(s), &map_a, int32_t(sl * kBK), int32_t(r0 + i0), full(s));
                tma_load(tile_b(s), &map_b, int32_t(sl * kBK), int32_t(j0), int32_t(e), full(s));
            }
        return;
    }
    const int wg = (threadIdx.x - 128) >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    uint32_t it = 0;  // slices consumed before this tile
    float acc0[64], acc1[64], sum[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
    for (int64_t t = blockIdx.x; next_tile(t, e, r0, rows, i0, j0); t += gridDim.x) {
#pragma unroll
        for (int i = 0; i < 64; ++i) sum[i] = 0.f;
        // This thread's two accumulator rows (store_acc's layout), inside the buffer: rows past
        // the expert multiply whatever is there and are not stored.
        const int64_t ra = r0 + i0 + wg * 64 + warp * 16 + lane / 4;
        const int64_t row_a = min(ra, row_capacity - 1), row_b = min(ra + 8, row_capacity - 1);
        const float* sw = sc.w + e * sc.w_stride + (j0 / kBN) * sc.w_ld;
        auto issue = [&](float(&a)[64], int64_t sl) {
            const uint32_t f = it + uint32_t(sl), s = f % kStages;
            mbar_wait(full(s), (f / kStages) & 1u);
            mma_slice_e4m3(a, tile_a(s) + uint32_t(wg * 64 * kBK), tile_b(s));
        };
        // Slice sl's group complete, its stage released, a scaled by the slice's scales into sum.
        auto promote = [&](auto behind, float(&a)[64], int64_t sl) {
            const float bscale = __ldg(sw + sl);
            const float s0 = __ldg(sc.x + sl * sc.x_ld + row_a) * bscale;
            const float s1 = __ldg(sc.x + sl * sc.x_ld + row_b) * bscale;
            wait_slice<decltype(behind)::value>(a);
            if (lane == 0) mbar_arrive(empty((it + uint32_t(sl)) % kStages));
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                sum[4 * j] += a[4 * j] * s0;
                sum[4 * j + 1] += a[4 * j + 1] * s0;
                sum[4 * j + 2] += a[4 * j + 2] * s1;
                sum[4 * j + 3] += a[4 * j + 3] * s1;
            }
        };
        issue(acc0, 0);
        run_slices(acc0, acc1, slices, issue, promote);
        it += uint32_t(slices);
        const Problem p{r0, rows, n, k, 0, 0, nullptr, nullptr};
        store_acc<GroupedGemm::RowsTimesWeightT>(sum, p, e, 0, i0 + wg * 64, j0, accumulate, y);
    }
#else
    __trap();  // dispatched only on sm_90a (has_sm90a)
#endif
}

}  // namespace

bool grouped_gemm_fp8_available() {
    return has_sm90a();
}

void grouped_gemm_fp8(const ExecContext& ctx, const Fp8GroupedGemm& g, int blocks) {
    const int32_t* offsets = g.offsets;
    const int64_t experts = g.experts, max_rows = g.max_rows, row_capacity = g.row_capacity,
                  n = g.n, k = g.k;
    const Fp8Operand x = g.x, w = g.w;
    bf16* y = g.y;
    const bool accumulate = g.accumulate;
    ST_CHECK(grouped_gemm_fp8_available(),
             "the FP8 grouped expert GEMM needs an sm_90a GPU (Hopper's e4m3 wgmma)");
    ST_CHECK(!x.blocks_128x128 && w.blocks_128x128,
             "grouped_gemm_fp8: x takes 1x128 scales and the expert weights 128x128");
    ST_CHECK(k % 16 == 0 && n % 8 == 0, "grouped_gemm_fp8: k (", k,
             ") must be a multiple of 16 and n (", n, ") of 8");
    const int64_t units = experts * ((max_rows + kBM - 1) / kBM) * ((n + kBN - 1) / kBN);
    if (units == 0 || row_capacity == 0 || k == 0) return;
    auto* kernel = grouped_gemm_fp8_kernel;
    allow_dynamic_smem<grouped_gemm_fp8_kernel>(kSmemBytes);
    // x [row_capacity, k] and the experts' W [E][n][k], bytes; boxes of 128 x 128.
    const CUtensorMap ma = u8_tensor_map(x.q, {k, row_capacity}, {k}, {kBK, kBM});
    const CUtensorMap mb = u8_tensor_map(w.q, {k, n, experts}, {k, n * k}, {kBK, kBN, 1});
    const Scales sc{x.scale_inv, fp8::round4(row_capacity), w.scale_inv, fp8::scales_128x128(n, k),
                    fp8::round4(fp8::blocks(k))};
    const int most = blocks > 0 ? blocks : sm_count();
    kernel<<<unsigned(std::min<int64_t>(units, most)), kThreads, kSmemBytes, stream_of(ctx)>>>(
        offsets, experts, n, k, row_capacity, sc, accumulate, dev(y), ma, mb);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
