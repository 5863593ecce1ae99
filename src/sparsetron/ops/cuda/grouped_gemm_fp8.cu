// FP8 blockwise grouped expert GEMM on Hopper (the routed experts under `fp8_recipe: blockwise`):
// for every expert e, y[rows of e] (+)= x[rows of e] W_e^T with x e4m3 in 1x128 blocks along k
// and W_e e4m3 in 128x128 blocks, the DeepSeek-V3 recipe (ops.h, grouped_gemm_fp8). cuBLASLt's
// block-scaled GEMM takes one matrix per call, and a loop over the experts would need their
// row counts on the host (a sync in the step); this kernel reads them from `offsets` on the GPU.
//
// Same skeleton as the bf16 kernel (grouped_gemm_ws.cu): persistent, one block per SM walking
// the experts' real output tiles; a producer thread fills a ring of stages by bulk tensor copies
// (TMA, 128-byte swizzle); two consumer warpgroups multiply 64 rows each. What FP8 changes:
//   - A slice is 128 deep (128 bytes per row: the same tile bytes and swizzle as bf16's 64), so a
//     stage is exactly one scale block of k: four m64n128k32 e4m3 MMAs.
//   - The scales differ per 128-deep block, so the MMAs of a block accumulate into a fresh
//     register block that is then scaled (x's row scale times W's block scale) and added to the
//     tile's fp32 sum in registers ("promotion", as DeepGEMM does). That takes two accumulator
//     blocks, hence 128-wide tiles (64 + 64 registers per thread) rather than bf16's 256.
//   - The consumers wait for each block's MMAs before promoting; the other warpgroup's MMAs keep
//     the tensor cores busy meanwhile. The scales are loaded before the stage's wait.
//   - Clusters of two take horizontally adjacent tiles (the same 128 rows of x, the next 128
//     columns of W_e) and share the x tile: each block loads 64 of its rows, multicast to both.
//     At FP8's rate a lone 128 x 128 tile reads ~7 TB/s from L2 at 900 TFLOP/s (measured: the
//     bf16 kernel's rate, no faster); sharing x cuts the reads per stage from 32 to 24 KiB. An
//     odd last column tile pairs with one past n (its MMAs read zeros, nothing is stored). So a
//     stage of block X is filled by X's B copy and both blocks' halves of x: it is refilled only
//     when the consumers of both blocks have released it (every consumer warp arrives on the
//     empty barrier of both).
// wgmma reads e4m3 operands K-major only: both operands here have k contiguous (the input
// gradient runs the same kernel on W^T copies, Fp8Weights).
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/cuda/tensor_map.h"
#include "sparsetron/ops/cuda/wgmma.cuh"
#include "sparsetron/ops/fp8_scale_layout.h"

namespace sparsetron::cuda {

namespace {

constexpr int kBM = 128, kBN = 128, kBK = 128;  // tile rows, columns, slice depth (bytes)
constexpr int kStages = 6;
constexpr int kCluster = 2;    // blocks sharing the x tile
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kTileBytes = kBM * kBK;
static_assert(kBN * kBK == kTileBytes, "A and B tiles of one size");
constexpr int kStageBytes = 2 * kTileBytes;
// Stages, alignment slack for the 1024-byte swizzle period, the full and empty mbarriers.
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 1024 + 2 * kStages * 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

#ifdef ST_WGMMA
// d (=, or += with `acc`) A (64 x 32 e4m3) * B (32 x 128 e4m3), both K-major, fp32 accumulators in
// the m64nNk16 layout (wgmma.cuh, store_acc).
__device__ __forceinline__ void mma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db,
                                                    int acc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc));
}
#endif

// Scale operands as the kernel reads them: x's 1x128 scales [blocks(k)][x_ld] (x_ld =
// round4(row capacity)), W's 128x128 scales per expert, `w_stride` floats apart.
struct Scales {
    const float* x;
    int64_t x_ld;
    const float* w;
    int64_t w_stride;
    int64_t w_ld;  // round4(blocks(k)): one 128-row block of W's scales
};

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
            mbar_init(empty(s), kCluster * 8);  // each consumer warp of the cluster
        }
        // Visible to the other block's arrivals and multicasts.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    const uint32_t rank = cluster_rank();
    cluster_sync();

    // Expert by expert over its row tiles x column-tile pairs (units: a cluster's two tiles);
    // the walk only moves forward (w_e, and w_first the linear index of its first unit), experts
    // with no rows skipped. Block `rank` of the cluster takes column tile 2 pair + rank.
    const int64_t pairs = (n + kCluster * kBN - 1) / (kCluster * kBN);
    const int64_t slices = (k + kBK - 1) / kBK;
    const int64_t unit0 = blockIdx.x / kCluster, units = gridDim.x / kCluster;
    int64_t w_e = 0, w_first = 0;
    auto next_tile = [&](int64_t t, int64_t& e, int64_t& r0, int64_t& rows, int64_t& i0,
                         int64_t& j0) {
        for (; w_e < experts; ++w_e) {
            r0 = offsets[w_e], rows = offsets[w_e + 1] - r0;
            const int64_t count = rows > 0 ? (rows + kBM - 1) / kBM * pairs : int64_t(0);
            if (t < w_first + count) {
                const int64_t local = t - w_first;
                e = w_e, i0 = local / pairs * kBM;
                j0 = (local % pairs * kCluster + rank) * kBN;
                return true;
            }
            w_first += count;
        }
        return false;
    };

    int64_t e, r0, rows, i0, j0;
    if (threadIdx.x < 128) {
        if (threadIdx.x == 0) {  // one thread feeds the ring; the others wait for the cluster
            tma_prefetch_map(&map_a), tma_prefetch_map(&map_b);
            constexpr int kHalf = kBM / kCluster;  // rows of x this block loads for both
            uint32_t it = 0;
            for (int64_t t = unit0; next_tile(t, e, r0, rows, i0, j0); t += units)
                for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                    const uint32_t s = it % kStages;
                    mbar_wait(empty(s), ((it / kStages) & 1u) ^ 1u);
                    mbar_arrive_expect_tx(full(s), uint32_t(kStageBytes));
                    // Rows past the buffer and columns past k or n read as zero (the maps'
                    // bounds).
                    tma_load_multicast(tile_a(s) + rank * kHalf * kBK, &map_a, int32_t(sl * kBK),
                                       int32_t(r0 + i0 + rank * kHalf), full(s), 0x3);
                    tma_load(tile_b(s), &map_b, int32_t(sl * kBK), int32_t(j0), int32_t(e),
                             full(s));
                }
        }
    } else {
        const int wg = (threadIdx.x - 128) >> 7, warp = (threadIdx.x >> 5) & 3,
                  lane = threadIdx.x & 31;
        uint32_t it = 0;
        float acc[64], sum[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        for (int64_t t = unit0; next_tile(t, e, r0, rows, i0, j0); t += units) {
#pragma unroll
            for (int i = 0; i < 64; ++i) sum[i] = 0.f;
            // This thread's two accumulator rows (store_acc's layout), inside the buffer: rows past
            // the expert multiply whatever is there and are not stored.
            const int64_t ra = r0 + i0 + wg * 64 + warp * 16 + lane / 4;
            const int64_t row_a = min(ra, row_capacity - 1), row_b = min(ra + 8, row_capacity - 1);
            // A tile past n (an odd last pair's) reads the last block's scales: never stored.
            const int64_t rb = min(j0, n - 1) / kBN;
            const float* sw = sc.w + e * sc.w_stride + rb * sc.w_ld;
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                const float bscale = __ldg(sw + sl);
                const float s0 = __ldg(sc.x + sl * sc.x_ld + row_a) * bscale;
                const float s1 = __ldg(sc.x + sl * sc.x_ld + row_b) * bscale;
                mbar_wait(full(s), (it / kStages) & 1u);
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
                const uint32_t ta = tile_a(s) + uint32_t(wg * 64 * kBK), tb = tile_b(s);
                // k32 steps: 32 bytes along the swizzled rows.
#pragma unroll
                for (int kk = 0; kk < kBK / 32; ++kk)
                    mma_m64n128k32_e4m3(acc, descriptor(ta + kk * 32, 16, 1024),
                                        descriptor(tb + kk * 32, 16, 1024), kk > 0);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                // The compiler sees acc written when the MMAs are issued, not when the wait
                // returns: this keeps the promotion's reads of acc below the wait.
#pragma unroll
                for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(acc[i])::"memory");
                if (lane == 0)  // released in both blocks: both fill this stage
                    for (uint32_t r = 0; r < uint32_t(kCluster); ++r)
                        mbar_arrive_cluster(empty(s), r);
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    sum[4 * j] += acc[4 * j] * s0;
                    sum[4 * j + 1] += acc[4 * j + 1] * s0;
                    sum[4 * j + 2] += acc[4 * j + 2] * s1;
                    sum[4 * j + 3] += acc[4 * j + 3] * s1;
                }
            }
            const Problem p{r0, rows, n, k, 0, 0, nullptr, nullptr};
            store_acc<GroupedGemm::RowsTimesWeightT>(sum, p, e, 0, i0 + wg * 64, j0, accumulate, y);
        }
    }
    // The other block's arrivals on this one's barriers and its multicasts into this one's
    // stages are over only when both blocks are here.
    cluster_sync();
#else
    __trap();  // dispatched only on sm_90a (grouped_gemm_wgmma_available)
#endif
}

}  // namespace

bool grouped_gemm_fp8_available() {
    return grouped_gemm_wgmma_available();
}

void grouped_gemm_fp8(const ExecContext& ctx, const int32_t* offsets, int64_t experts,
                      int64_t max_rows, int64_t row_capacity, int64_t n, int64_t k, Fp8Operand x,
                      Fp8Operand w, bf16* y, bool accumulate, int blocks) {
    ST_CHECK(grouped_gemm_fp8_available(),
             "the FP8 grouped expert GEMM needs an sm_90a GPU (Hopper's e4m3 wgmma)");
    ST_CHECK(!x.blocks_128x128 && w.blocks_128x128,
             "grouped_gemm_fp8: x takes 1x128 scales and the expert weights 128x128");
    ST_CHECK(k % 16 == 0 && n % 8 == 0, "grouped_gemm_fp8: k (", k,
             ") must be a multiple of 16 and n (", n, ") of 8");
    const int64_t units =
        experts * ((max_rows + kBM - 1) / kBM) * ((n + kCluster * kBN - 1) / (kCluster * kBN));
    if (units == 0 || row_capacity == 0 || k == 0) return;
    allow_dynamic_smem<grouped_gemm_fp8_kernel>(kSmemBytes);
    // x [row_capacity, k] and the experts' W [E][n][k], bytes; boxes of 128 x 128.
    const CUtensorMap ma = u8_tensor_map(x.q, {k, row_capacity}, {k}, {kBK, kBM / kCluster});
    const CUtensorMap mb = u8_tensor_map(w.q, {k, n, experts}, {k, n * k}, {kBK, kBN, 1});
    const Scales sc{x.scale_inv, fp8::round4(row_capacity), w.scale_inv, fp8::scales_128x128(n, k),
                    fp8::round4(fp8::blocks(k))};
    cudaLaunchConfig_t config{};
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    config.stream = stream_of(ctx);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kCluster, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    config.attrs = &attr, config.numAttrs = 1;
    // One cluster per two SMs that can hold one (the GPCs' SM counts may leave some SMs out).
    static const int resident = [&] {
        cudaLaunchConfig_t probe = config;
        probe.gridDim = dim3(unsigned(kCluster * sm_count()));
        int clusters = 0;
        ST_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, grouped_gemm_fp8_kernel, &probe));
        ST_CHECK(clusters > 0, "grouped_gemm_fp8: no cluster of ", kCluster, " blocks fits");
        return clusters;
    }();
    const int64_t most = blocks > 0 ? (blocks + kCluster - 1) / kCluster : resident;
    config.gridDim = dim3(unsigned(std::min<int64_t>(units, most) * kCluster));
    ST_CUDA_CHECK(cudaLaunchKernelEx(&config, grouped_gemm_fp8_kernel, offsets, experts, n, k,
                                     row_capacity, sc, accumulate, dev(y), ma, mb));
}

}  // namespace sparsetron::cuda
