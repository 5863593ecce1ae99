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

constexpr int BM = 128, BN = 128, BK = 64;
constexpr int kStages = 3;
constexpr int kThreads = 256;                                        // two warpgroups
constexpr int kTileBytes = BM * BK * 2;                              // 16 KiB per operand tile
constexpr int kStageBytes = 2 * kTileBytes;                          // A and B
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes + 1024;  // + alignment slack

#ifdef ST_WGMMA
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

// One operand's slice into its swizzled tile. kMajorK: the source's rows are the tile's 128
// rows and the reduction is contiguous; otherwise the source's rows are the reduction and the
// tile's 128-wide index is contiguous. Out-of-range rows / columns / reduction are zero-filled.
template <bool kMajorK>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf* src, int64_t ld, int64_t base,
                                          int64_t extent, int64_t k0, int64_t depth) {
#pragma unroll
    for (int it = 0; it < BM * BK / 8 / kThreads; ++it) {
        const int c = threadIdx.x + it * kThreads;
        if constexpr (kMajorK) {
            const int row = c >> 3, ch = c & 7;
            const bool ok = base + row < extent && k0 + ch * 8 < depth;
            const bf* g = ok ? src + (base + row) * ld + k0 + ch * 8 : src;
            cp_async16(tile + row * 128 + ((ch ^ (row & 7)) << 4), g, ok);
        } else {
            const int kk = c >> 4, mn = c & 15, atom = mn >> 3, ch = mn & 7;
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

// d[64] += A (64 x 16) * B (16 x 128); kTA / kTB: the operand is MN-major (transposed).
template <int kTA, int kTB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"  // scale-d: 1 accumulates into d
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
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
#endif

template <GroupedGemm kKind>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_gemm_wgmma_kernel(const int32_t* offsets, int64_t n, int64_t k, int64_t wstride,
                              bool accumulate, const bf* a, const bf* b, void* c) {
#ifdef ST_WGMMA
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
    auto tile_a = [&](int s) { return base + uint32_t(s * kStageBytes); };
    auto tile_b = [&](int s) { return base + uint32_t(s * kStageBytes + kTileBytes); };
    const int64_t slices = (K + BK - 1) / BK;
    auto load = [&](int64_t slice, int s) {
        load_tile<kAK>(tile_a(s), A, lda, i0, M, slice * BK, K);
        load_tile<kBK>(tile_b(s), B, ldb, j0, N, slice * BK, K);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < slices) load(s, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    const int wg = threadIdx.x >> 7;  // this warpgroup's 64 rows of the tile
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    for (int64_t t = 0; t < slices; ++t) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
        // cp.async writes are generic-proxy; wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();  // slice t visible to all; every warpgroup is done with slice t - 1
        const int64_t next = t + kStages - 1;
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
            wgmma_m64n128k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
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

template <GroupedGemm kKind>
void launch(const ExecContext& ctx, dim3 grid, const int32_t* offsets, int64_t n, int64_t k,
            int64_t wstride, bool accumulate, const bf16* a, const bf16* b, void* c) {
    static const bool configured = [] {  // once per kind, before any capture
        ST_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_wgmma_kernel<kKind>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(kSmemBytes)));
        return true;
    }();
    (void)configured;
    grouped_gemm_wgmma_kernel<kKind><<<grid, kThreads, kSmemBytes, stream_of(ctx)>>>(
        offsets, n, k, wstride, accumulate, dev(a), dev(b), c);
    ST_CUDA_LAUNCH_CHECK();
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
    // Grid: the worst case per expert; tiles past an expert's actual rows exit at once.
    const unsigned ex = unsigned(experts);
    switch (kind) {
        case GroupedGemm::RowsTimesWeightT:
            launch<GroupedGemm::RowsTimesWeightT>(
                ctx, dim3(blocks_for(n, BN), blocks_for(max_rows, BM), ex), offsets, n, k,
                weight_stride, accumulate, a, b, c);
            break;
        case GroupedGemm::RowsTimesWeight:
            launch<GroupedGemm::RowsTimesWeight>(
                ctx, dim3(blocks_for(k, BN), blocks_for(max_rows, BM), ex), offsets, n, k,
                weight_stride, accumulate, a, b, c);
            break;
        default:
            launch<GroupedGemm::WeightGrad>(ctx, dim3(blocks_for(k, BN), blocks_for(n, BM), ex),
                                            offsets, n, k, weight_stride, accumulate, a, b, c);
            break;
    }
}

}  // namespace sparsetron::cuda
