// Grouped expert GEMM on tensor cores with a cp.async pipeline: 128x128 output tiles, 32-deep
// reduction slices, 3 shared-memory stages, 4 warps of 64x64 each (bf16 WMMA, fp32 accumulation;
// a 64x64 warp tile loads 8 fragments per 16 MMAs): the grouped GEMM on GPUs without sm_90a's
// wgmma.
// Expert e's row range [offsets[e], offsets[e+1]) is read from device memory; tiles past it exit,
// reductions over rows (weight gradients) zero-fill past it, so nothing is decided on the host.
//
// Operand layouts per kind (the contiguous dimension is what 16-byte copies run along):
//   RowsTimesWeightT  A [rows, K] K-contiguous,   B = W_e [N, K] K-contiguous
//   RowsTimesWeight   A [rows, K] K-contiguous,   B = W_e [K, N] N-contiguous
//   WeightGrad        A = X_e^T (X [rows, M]),    B = Y_e [rows, N]: both reduction-major
// Needs every leading dimension and expert stride to be a multiple of 8 elements (16 bytes);
// grouped_gemm() runs the simple kernel otherwise.
#include <mma.h>

#include <type_traits>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

namespace {

using namespace nvcuda;
constexpr int TM = 128, TN = 128;  // output tile
constexpr int kPad = 8;            // bf16 elements of row padding (bank spread, 16 B)

// Tile configuration: warps (WarpsM x WarpsN over the 128 x 128 tile), reduction slice TK, stages.
template <int WarpsM_, int WarpsN_, int TK_, int Stages_>
struct Cfg {
    static constexpr int WarpsM = WarpsM_, WarpsN = WarpsN_, TK = TK_, Stages = Stages_;
    static constexpr int WarpTileM = TM / WarpsM, WarpTileN = TN / WarpsN;
    static constexpr int FragsM = WarpTileM / 16, FragsN = WarpTileN / 16;
    static constexpr int Threads = 32 * WarpsM * WarpsN;
    static constexpr int RowMajorLd = TK + kPad;  // [128][TK] tiles (reduction-contiguous)
    static constexpr int KMajorLd = TM + kPad;    // [TK][128] tiles (reduction-major)
    static constexpr int TileElems = TM * RowMajorLd > TK* KMajorLd ? TM* RowMajorLd : TK* KMajorLd;
    static constexpr int StageElems = 2 * TileElems;  // A and B
    static constexpr int EpilogueLd = TN + 4;
    static constexpr size_t SmemBytes = Stages * StageElems * sizeof(bf) >
                                                TM* EpilogueLd * sizeof(float)
                                            ? Stages* StageElems * sizeof(bf)
                                            : TM* EpilogueLd * sizeof(float);
};
// Four warps of 64x64, 32-deep slices, three stages: the fastest of the tile configurations tried
// at the proxy's shapes (docs/perf/log/).
using Default = Cfg<2, 2, 32, 3>;

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, gmem is not read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One operand's 128 x TK slice. kMajor: stored [TK][128] from a source whose reduction index is
// the row (ld elements apart) and whose 128-wide index is contiguous; otherwise [128][TK] from a
// source whose 128-wide index is the row. Rows/columns past `extent` / reduction past `depth`
// are zero-filled.
template <class C, bool kMajor>
__device__ __forceinline__ void load_slice(bf* s, const bf* src, int64_t ld, int64_t base,
                                           int64_t extent, int64_t k0, int64_t depth) {
    constexpr int TK = C::TK, kChunks = TM * TK / 8;  // 16-byte chunks per slice
    static_assert(kChunks % C::Threads == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int it = 0; it < kChunks / C::Threads; ++it) {
        const int c = threadIdx.x + it * C::Threads;
        if constexpr (kMajor) {
            const int kk = c / (TM / 8), i = (c % (TM / 8)) * 8;
            const bool ok = k0 + kk < depth && base + i < extent;
            const bf* g = ok ? src + (k0 + kk) * ld + base + i : src;
            cp_async16(s + kk * C::KMajorLd + i, g, ok);
        } else {
            const int i = c / (TK / 8), kk = (c % (TK / 8)) * 8;
            const bool ok = base + i < extent && k0 + kk < depth;
            const bf* g = ok ? src + (base + i) * ld + k0 + kk : src;
            cp_async16(s + i * C::RowMajorLd + kk, g, ok);
        }
    }
}

template <class C, GroupedGemm kKind>
__global__ void __launch_bounds__(C::Threads)
    grouped_gemm_tc_kernel(const int32_t* offsets, int64_t n, int64_t k, int64_t wstride,
                           bool accumulate, bool grad_bf16, const bf* a, const bf* b, void* c) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf* smem = reinterpret_cast<bf*>(smem_raw);
    const int64_t e = blockIdx.z;
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    // A is reduction-major only for weight gradients; B is N-contiguous except for x W^T.
    constexpr bool kAkMajor = kKind == GroupedGemm::WeightGrad;
    constexpr bool kBkMajor = kKind != GroupedGemm::RowsTimesWeightT;
    int64_t M, N, K, lda, ldb;
    const bf *A, *B;
    if constexpr (kKind == GroupedGemm::RowsTimesWeightT) {
        M = rows, N = n, K = k, A = a + r0 * k, lda = k, B = b + e * wstride, ldb = k;
    } else if constexpr (kKind == GroupedGemm::RowsTimesWeight) {
        M = rows, N = k, K = n, A = a + r0 * n, lda = n, B = b + e * wstride, ldb = k;
    } else {
        M = n, N = k, K = rows, A = a + r0 * n, lda = n, B = b + r0 * k, ldb = k;
    }
    const int64_t i0 = int64_t(blockIdx.y) * TM, j0 = int64_t(blockIdx.x) * TN;
    if (i0 >= M || j0 >= N) return;
    // An empty expert: its weight gradient gets nothing added, or zeros written (no slices).
    if (K == 0 && accumulate) return;
    constexpr int TK = C::TK, kStages = C::Stages, kFragsM = C::FragsM, kFragsN = C::FragsN;
    constexpr int kWarpTileM = C::WarpTileM, kWarpTileN = C::WarpTileN;
    constexpr int kRowMajorLd = C::RowMajorLd, kKMajorLd = C::KMajorLd;
    constexpr int kEpilogueLd = C::EpilogueLd;
    const int warp = threadIdx.x >> 5, wm = warp / C::WarpsN, wn = warp % C::WarpsN;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsM][kFragsN];
#pragma unroll
    for (int x = 0; x < kFragsM; ++x)
#pragma unroll
        for (int y = 0; y < kFragsN; ++y) wmma::fill_fragment(acc[x][y], 0.f);

    const int64_t slices = (K + TK - 1) / TK;
    auto stage_a = [&](int s) { return smem + s * C::StageElems; };
    auto stage_b = [&](int s) { return smem + s * C::StageElems + C::TileElems; };
    auto load = [&](int64_t slice, int s) {
        const int64_t k0 = slice * TK;
        load_slice<C, kAkMajor>(stage_a(s), A, lda, i0, M, k0, K);
        load_slice<C, kBkMajor>(stage_b(s), B, ldb, j0, N, k0, K);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < slices) load(s, s);
        cp_async_commit();
    }
    for (int64_t t = 0; t < slices; ++t) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // slice t is visible; every warp is done with slice t - 1's stage
        const int64_t next = t + kStages - 1;
        if (next < slices) load(next, int(next % kStages));
        cp_async_commit();
        const bf* As = stage_a(int(t % kStages));
        const bf* Bs = stage_b(int(t % kStages));
#pragma unroll
        for (int kk = 0; kk < TK; kk += 16) {
            using LayoutA = std::conditional_t<kAkMajor, wmma::col_major, wmma::row_major>;
            using LayoutB = std::conditional_t<kBkMajor, wmma::row_major, wmma::col_major>;
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, LayoutA> fa[kFragsM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, LayoutB> fb[kFragsN];
#pragma unroll
            for (int x = 0; x < kFragsM; ++x) {
                const int i = wm * kWarpTileM + x * 16;
                if constexpr (kAkMajor)
                    wmma::load_matrix_sync(fa[x], As + kk * kKMajorLd + i, kKMajorLd);
                else
                    wmma::load_matrix_sync(fa[x], As + i * kRowMajorLd + kk, kRowMajorLd);
            }
#pragma unroll
            for (int y = 0; y < kFragsN; ++y) {
                const int j = wn * kWarpTileN + y * 16;
                if constexpr (kBkMajor)
                    wmma::load_matrix_sync(fb[y], Bs + kk * kKMajorLd + j, kKMajorLd);
                else
                    wmma::load_matrix_sync(fb[y], Bs + j * kRowMajorLd + kk, kRowMajorLd);
            }
#pragma unroll
            for (int x = 0; x < kFragsM; ++x)
#pragma unroll
                for (int y = 0; y < kFragsN; ++y)
                    wmma::mma_sync(acc[x][y], fa[x], fb[y], acc[x][y]);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory becomes the epilogue tile
    float* cs = reinterpret_cast<float*>(smem_raw);
#pragma unroll
    for (int x = 0; x < kFragsM; ++x)
#pragma unroll
        for (int y = 0; y < kFragsN; ++y)
            wmma::store_matrix_sync(
                cs + (wm * kWarpTileM + x * 16) * kEpilogueLd + wn * kWarpTileN + y * 16, acc[x][y],
                kEpilogueLd, wmma::mem_row_major);
    __syncthreads();
    // 4 columns per thread per step; N is a multiple of 8, so a group is all in or all out.
    for (int l = threadIdx.x; l < TM * TN / 4; l += C::Threads) {
        const int ii = l / (TN / 4), jj = (l % (TN / 4)) * 4;
        const int64_t gi = i0 + ii, gj = j0 + jj;
        if (gi >= M || gj >= N) continue;
        const float4 v = *reinterpret_cast<const float4*>(cs + ii * kEpilogueLd + jj);
        if (kKind == GroupedGemm::WeightGrad && !grad_bf16) {
            float4* dst =
                reinterpret_cast<float4*>(static_cast<float*>(c) + e * wstride + gi * N + gj);
            float4 o = v;
            if (accumulate) {
                const float4 q = *dst;
                o.x += q.x, o.y += q.y, o.z += q.z, o.w += q.w;
            }
            *dst = o;
        } else {
            // bf16 rows of C, or of a bf16 weight gradient (bf16 gradient buffers).
            const int64_t at =
                kKind == GroupedGemm::WeightGrad ? e * wstride + gi * N + gj : (r0 + gi) * N + gj;
            __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(static_cast<bf*>(c) + at);
            float2 lo{v.x, v.y}, hi{v.z, v.w};
            if (accumulate) {
                const float2 plo = __bfloat1622float2(dst[0]), phi = __bfloat1622float2(dst[1]);
                lo.x += plo.x, lo.y += plo.y, hi.x += phi.x, hi.y += phi.y;
            }
            dst[0] = __float22bfloat162_rn(lo);
            dst[1] = __float22bfloat162_rn(hi);
        }
    }
}

template <class C, GroupedGemm kKind>
void launch(const ExecContext& ctx, dim3 grid, const int32_t* offsets, int64_t n, int64_t k,
            int64_t wstride, bool accumulate, bool grad_bf16, const bf16* a, const bf16* b,
            void* c) {
    allow_dynamic_smem<grouped_gemm_tc_kernel<C, kKind>>(C::SmemBytes);  // stages exceed 48 KiB
    grouped_gemm_tc_kernel<C, kKind><<<grid, C::Threads, C::SmemBytes, stream_of(ctx)>>>(
        offsets, n, k, wstride, accumulate, grad_bf16, dev(a), dev(b), c);
    ST_CUDA_LAUNCH_CHECK();
}

template <class C>
void run(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets, int64_t experts,
         int64_t max_rows, int64_t n, int64_t k, const bf16* a, const bf16* b, void* c,
         int64_t weight_stride, bool accumulate, bool grad_bf16) {
    // Grid: the worst case per expert; tiles past an expert's actual rows exit at once.
    switch (kind) {
        case GroupedGemm::RowsTimesWeightT:
            launch<C, GroupedGemm::RowsTimesWeightT>(
                ctx, dim3(blocks_for(n, TN), blocks_for(max_rows, TM), unsigned(experts)), offsets,
                n, k, weight_stride, accumulate, false, a, b, c);
            break;
        case GroupedGemm::RowsTimesWeight:
            launch<C, GroupedGemm::RowsTimesWeight>(
                ctx, dim3(blocks_for(k, TN), blocks_for(max_rows, TM), unsigned(experts)), offsets,
                n, k, weight_stride, accumulate, false, a, b, c);
            break;
        default:
            launch<C, GroupedGemm::WeightGrad>(
                ctx, dim3(blocks_for(k, TN), blocks_for(n, TM), unsigned(experts)), offsets, n, k,
                weight_stride, accumulate, grad_bf16, a, b, c);
            break;
    }
}

}  // namespace

void grouped_gemm_wmma(const ExecContext& ctx, const GroupedGemmArgs& g) {
    if (g.experts == 0) return;
    run<Default>(ctx, g.kind, g.offsets, g.experts, g.max_rows, g.n, g.k, g.a, g.b, g.c,
                 g.weight_stride ? g.weight_stride : g.n * g.k, g.accumulate,
                 g.grad_type == DType::BF16);
}

}  // namespace sparsetron::cuda
