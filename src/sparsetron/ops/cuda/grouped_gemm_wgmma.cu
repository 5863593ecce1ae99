// Grouped expert GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): the WMMA kernel of
// grouped_gemm_tc.cu spends its time loading fragments from shared memory into registers;
// wgmma reads both operands straight from shared memory, asynchronously, at up to twice mma.sync's
// rate. Same contract and operand layouts as grouped_gemm_tc (see there and ops.h).
//
// Block: 128 x 128 output tile, two warpgroups of 64 x 128 (m64n128k16, fp32 accumulators in
// registers), 64-deep reduction slices in a 3-stage cp.async pipeline (96 KiB: two blocks per
// SM, so one block's MMAs run while the other waits on its wgmma group or its copies).
//
// Shared memory operand tiles use the 128-byte swizzle wgmma reads (PTX "matrix descriptor";
// CuTe's Swizzle<3,4,3>): a 128-byte row's 16-byte chunk c is stored at chunk c ^ (row % 8).
//   K-major (reduction contiguous in memory, e.g. x [rows, K]): [128 rows][64] tile, rows 128 B
//     apart, 8-row groups 1024 B apart (SBO). A k16 step advances the start address by 32 B.
//   MN-major (the 128-wide index contiguous, e.g. W [K, N] or X^T): two 64-wide atoms
//     [64 k][64], each k row 128 B; atoms 8 KiB apart (LBO), 8-k groups 1024 B apart (SBO). A
//     k16 step advances the start address by 2048 B; wgmma's transpose flag reads it.
#include <string>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ST_WGMMA 1
#endif

namespace sparsetron::cuda {

namespace {

constexpr int BM = 128, BK = 64;
constexpr int kThreads = 256;  // two warpgroups, 64 rows of the tile each

// Tile width BN (128 or 256), pipeline stages, and whether one wgmma group stays in flight
// across slices (the copies then run kStages - 2 slices ahead instead of kStages - 1).
template <int BN_, int Stages_, bool InFlight_>
struct WgCfg {
    static constexpr int BN = BN_, Stages = Stages_;
    static constexpr bool InFlight = InFlight_;
    static constexpr int Ahead = InFlight ? Stages - 2 : Stages - 1;  // slices loaded ahead
    static constexpr int ABytes = BM * BK * 2, BBytes = BN * BK * 2;
    static constexpr int StageBytes = ABytes + BBytes;
    static constexpr size_t SmemBytes = size_t(Stages) * StageBytes + 1024;  // + alignment slack
    static constexpr int MinBlocks = SmemBytes * 2 <= 227 * 1024 ? 2 : 1;
    static_assert(Ahead >= 1, "at least one slice in flight");
};
// The configurations the engine picks from (grouped_gemm_wgmma); measured at the proxy's shapes
// (16 experts x 2048 rows, 6144 <-> 2048) against each other by grouped_gemm_wgmma_config.
using WgPlain = WgCfg<128, 3, false>;     // weight gradients: 412-428 TFLOP/s
using WgInFlight = WgCfg<128, 3, true>;   // dy W (and x W^T over a short reduction): 454
using WgWideLongK = WgCfg<256, 4, true>;  // x W^T over K >= 4096: 530

#ifdef ST_WGMMA
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

// One operand's slice into its swizzled tile of kWidth x 64. kMajorK: the source's rows are the
// tile's kWidth rows and the reduction is contiguous; otherwise the source's rows are the
// reduction and the tile's kWidth-wide index is contiguous (kWidth / 64 atoms, 8 KiB apart).
// Out-of-range rows / columns / reduction are zero-filled.
template <bool kMajorK, int kWidth>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf* src, int64_t ld, int64_t base,
                                          int64_t extent, int64_t k0, int64_t depth) {
    static_assert(kWidth * BK / 8 % kThreads == 0, "every thread copies the same chunk count");
#pragma unroll
    for (int it = 0; it < kWidth * BK / 8 / kThreads; ++it) {
        const int c = threadIdx.x + it * kThreads;
        if constexpr (kMajorK) {
            const int row = c >> 3, ch = c & 7;
            const bool ok = base + row < extent && k0 + ch * 8 < depth;
            const bf* g = ok ? src + (base + row) * ld + k0 + ch * 8 : src;
            cp_async16(tile + row * 128 + ((ch ^ (row & 7)) << 4), g, ok);
        } else {
            constexpr int kChunksPerRow = kWidth / 8;
            const int kk = c / kChunksPerRow, mn = c % kChunksPerRow, atom = mn >> 3, ch = mn & 7;
            const bool ok = k0 + kk < depth && base + mn * 8 < extent;
            const bf* g = ok ? src + (k0 + kk) * ld + base + mn * 8 : src;
            cp_async16(tile + atom * 8192 + kk * 128 + ((ch ^ (kk & 7)) << 4), g, ok);
        }
    }
}

// The 64-bit shared memory matrix descriptor: start, leading and stride byte offsets (all in
// 16-byte units), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
           (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// d += A (64 x 16) * B (16 x N), N = 2 x the accumulator count; kTA / kTB: the operand is
// MN-major (transposed). One overload per N the kernel uses.
template <int kTA, int kTB>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n"
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
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}
template <int kTA, int kTB>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, "
        "%73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, "
        "%91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, "
        "%107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, "
        "%122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n"
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
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1), "n"(kTA), "n"(kTB));
}

#endif  // ST_WGMMA

template <class C, GroupedGemm kKind>
__global__ void __launch_bounds__(kThreads, C::MinBlocks)
    grouped_gemm_wgmma_kernel(const int32_t* offsets, int64_t n, int64_t k, int64_t wstride,
                              bool accumulate, const bf* a, const bf* b, void* c) {
#ifdef ST_WGMMA
    constexpr int BN = C::BN, kStages = C::Stages, kAhead = C::Ahead;
    extern __shared__ unsigned char smem_raw[];
    const int64_t e = blockIdx.z;
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    // The same operand roles as grouped_gemm_tc: A is MN-major only for weight gradients, B is
    // K-major only for x W^T.
    constexpr bool kAK = kKind != GroupedGemm::WeightGrad;
    constexpr bool kBK = kKind == GroupedGemm::RowsTimesWeightT;
    int64_t M, N, K, lda, ldb;
    const bf *A, *B;
    if constexpr (kKind == GroupedGemm::RowsTimesWeightT) {
        M = rows, N = n, K = k, A = a + r0 * k, lda = k, B = b + e * wstride, ldb = k;
    } else if constexpr (kKind == GroupedGemm::RowsTimesWeight) {
        M = rows, N = k, K = n, A = a + r0 * n, lda = n, B = b + e * wstride, ldb = k;
    } else {
        M = n, N = k, K = rows, A = a + r0 * n, lda = n, B = b + r0 * k, ldb = k;
    }
    const int64_t i0 = int64_t(blockIdx.y) * BM, j0 = int64_t(blockIdx.x) * BN;
    if (i0 >= M || j0 >= N || K == 0) return;

    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 B
    auto tile_a = [&](int s) { return base + uint32_t(s * C::StageBytes); };
    auto tile_b = [&](int s) { return base + uint32_t(s * C::StageBytes + C::ABytes); };
    const int64_t slices = (K + BK - 1) / BK;
    auto load = [&](int64_t slice, int s) {
        load_tile<kAK, BM>(tile_a(s), A, lda, i0, M, slice * BK, K);
        load_tile<kBK, BN>(tile_b(s), B, ldb, j0, N, slice * BK, K);
    };
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
        if (s < slices) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    const int wg = threadIdx.x >> 7;  // this warpgroup's 64 rows of the tile
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    for (int64_t t = 0; t < slices; ++t) {
        // kAhead + t groups are committed; slice t's is complete when kAhead - 1 remain.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kAhead - 1));
        // cp.async writes are generic-proxy; wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // Slice t is visible to all. The stage the next copies overwrite held slice
        // t + kAhead - kStages: t - 1 (waited for below in the last iteration) or, with a group
        // in flight, t - 2 (complete: at most one group, t - 1's, was left pending).
        __syncthreads();
        const int64_t next = t + kAhead;
        if (next < slices) load(next, int(next % kStages));
        asm volatile("cp.async.commit_group;\n" ::);
        const int s = int(t % kStages);
        const uint32_t sa = tile_a(s) + uint32_t(wg * 8192), sb = tile_b(s);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const uint64_t da =
                kAK ? descriptor(sa + kk * 32, 16, 1024) : descriptor(sa + kk * 2048, 8192, 1024);
            const uint64_t db =
                kBK ? descriptor(sb + kk * 32, 16, 1024) : descriptor(sb + kk * 2048, 8192, 1024);
            wgmma_m64k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if constexpr (C::InFlight)
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        else
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::);

    // Accumulator layout (m64nNk16, fp32): warp w of the warpgroup holds rows 16w + lane / 4
    // (+ 8); register 4j + {0, 1} (+ {2, 3} for the +8 row) is column 8j + 2 (lane % 4) + {0, 1}.
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int64_t row0 = i0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int64_t gj = j0 + j * 8 + 2 * (lane % 4);
        if (gj >= N) continue;  // N is a multiple of 8: a pair is all in or all out
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t gi = row0 + half * 8;
            if (gi >= M) continue;
            const float v0 = d[4 * j + 2 * half], v1 = d[4 * j + 2 * half + 1];
            if constexpr (kKind == GroupedGemm::WeightGrad) {
                float2* dst =
                    reinterpret_cast<float2*>(static_cast<float*>(c) + e * wstride + gi * N + gj);
                float2 o = *dst;
                o.x += v0, o.y += v1;
                *dst = o;
            } else {
                __nv_bfloat162* dst =
                    reinterpret_cast<__nv_bfloat162*>(static_cast<bf*>(c) + (r0 + gi) * N + gj);
                float2 o{v0, v1};
                if (accumulate) {
                    const float2 p = __bfloat1622float2(*dst);
                    o.x += p.x, o.y += p.y;
                }
                *dst = __float22bfloat162_rn(o);
            }
        }
    }
#else
    __trap();  // dispatched only on sm_90 (grouped_gemm_wgmma_available)
#endif
}

template <class C, GroupedGemm kKind>
void launch(const ExecContext& ctx, dim3 grid, const int32_t* offsets, int64_t n, int64_t k,
            int64_t wstride, bool accumulate, const bf16* a, const bf16* b, void* c) {
    static const bool configured = [] {  // once per instance, before any capture
        ST_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_wgmma_kernel<C, kKind>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(C::SmemBytes)));
        return true;
    }();
    (void)configured;
    grouped_gemm_wgmma_kernel<C, kKind><<<grid, kThreads, C::SmemBytes, stream_of(ctx)>>>(
        offsets, n, k, wstride, accumulate, dev(a), dev(b), c);
    ST_CUDA_LAUNCH_CHECK();
}

template <class C>
void run(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets, int64_t experts,
         int64_t max_rows, int64_t n, int64_t k, const bf16* a, const bf16* b, void* c,
         int64_t weight_stride, bool accumulate) {
    // Grid: the worst case per expert; tiles past an expert's actual rows exit at once.
    const unsigned ex = unsigned(experts);
    switch (kind) {
        case GroupedGemm::RowsTimesWeightT:
            launch<C, GroupedGemm::RowsTimesWeightT>(
                ctx, dim3(blocks_for(n, C::BN), blocks_for(max_rows, BM), ex), offsets, n, k,
                weight_stride, accumulate, a, b, c);
            break;
        case GroupedGemm::RowsTimesWeight:
            launch<C, GroupedGemm::RowsTimesWeight>(
                ctx, dim3(blocks_for(k, C::BN), blocks_for(max_rows, BM), ex), offsets, n, k,
                weight_stride, accumulate, a, b, c);
            break;
        default:
            launch<C, GroupedGemm::WeightGrad>(ctx,
                                               dim3(blocks_for(k, C::BN), blocks_for(n, BM), ex),
                                               offsets, n, k, weight_stride, accumulate, a, b, c);
            break;
    }
}

}  // namespace

bool grouped_gemm_wgmma_available() {
    static const bool hopper = [] {
        int device = 0, major = 0, minor = 0;
        ST_CUDA_CHECK(cudaGetDevice(&device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        ST_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        return major == 9 && minor == 0;
    }();
    return hopper;
}

void grouped_gemm_wgmma(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets,
                        int64_t experts, int64_t max_rows, int64_t n, int64_t k, const bf16* a,
                        const bf16* b, void* c, int64_t weight_stride, bool accumulate) {
    // Per kind, the fastest configuration in the perf harness (docs/perf/
    // 2026-11-30-wgmma-grouped-gemm.md): the wide tile pays off only over a long reduction.
    switch (kind) {
        case GroupedGemm::RowsTimesWeightT:
            if (k >= 4096)
                run<WgWideLongK>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c,
                                 weight_stride, accumulate);
            else
                run<WgInFlight>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                                accumulate);
            break;
        case GroupedGemm::RowsTimesWeight:
            run<WgInFlight>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                            accumulate);
            break;
        default:
            run<WgPlain>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                         accumulate);
            break;
    }
}

int grouped_gemm_wgmma_configs() {
    return 6;
}

std::string grouped_gemm_wgmma_config(const ExecContext& ctx, int config, GroupedGemm kind,
                                      const int32_t* offsets, int64_t experts, int64_t max_rows,
                                      int64_t n, int64_t k, const bf16* a, const bf16* b, void* c) {
    const int64_t ws = n * k;
    switch (config) {
        case 0:
            grouped_gemm_wgmma(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws, false);
            return "wgmma, the engine's choice per kind and reduction depth";
        case 1:
            run<WgPlain>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws, false);
            return "wgmma 128x128, k64, 3 stages";
        case 2:
            run<WgInFlight>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws, false);
            return "wgmma 128x128, k64, 3 stages, a group in flight";
        case 3:
            run<WgCfg<128, 4, true>>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws,
                                     false);
            return "wgmma 128x128, k64, 4 stages, a group in flight";
        case 4:
            run<WgCfg<256, 3, true>>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws,
                                     false);
            return "wgmma 128x256, k64, 3 stages, a group in flight";
        default:
            run<WgWideLongK>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws, false);
            return "wgmma 128x256, k64, 4 stages, a group in flight";
    }
}

}  // namespace sparsetron::cuda
