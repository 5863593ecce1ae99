// Grouped expert GEMM on Hopper's warpgroup MMA (wgmma, sm_90a): the WMMA kernel of
// grouped_gemm_tc.cu spends its time loading fragments from shared memory into registers;
// wgmma reads both operands straight from shared memory, asynchronously, at up to twice mma.sync's
// rate. Same contract and operand layouts as grouped_gemm_tc (see there and ops.h).
//
// Block: 128 x 128 output tile, two warpgroups of 64 x 128 (m64n128k16, fp32 accumulators in
// registers), 64-deep reduction slices in a 3-stage cp.async pipeline (96 KiB: two blocks per
// SM, so one block's MMAs run while the other waits on its wgmma group or its copies).
//
// grouped_gemm_wgmma() dispatches to the warp-specialized persistent kernel (grouped_gemm_ws.cu)
// for every kind; this file's kernels run with SPARSETRON_GROUPED_GEMM=blocked (for measuring)
// and in the perf harness. The swizzled operand tiles, the descriptors and each kind's operand
// roles: wgmma.cuh.
#include <string>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/cuda/wgmma.cuh"

namespace sparsetron::cuda {

namespace {

using wgmma::BK;
using wgmma::BM;
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

template <class C, GroupedGemm kKind>
__global__ void __launch_bounds__(kThreads, C::MinBlocks)
    grouped_gemm_wgmma_kernel(const int32_t* offsets, int64_t n, int64_t k, int64_t wstride,
                              bool accumulate, const bf* a, const bf* b, void* c) {
#ifdef ST_WGMMA
    using namespace wgmma;
    constexpr int BN = C::BN, kStages = C::Stages, kAhead = C::Ahead;
    constexpr bool kAK = a_k_major<kKind>, kBK = b_k_major<kKind>;
    extern __shared__ unsigned char smem_raw[];
    const int64_t e = blockIdx.z;
    const Problem p = problem<kKind>(offsets, e, n, k, wstride, a, b);
    const int64_t i0 = int64_t(blockIdx.y) * BM, j0 = int64_t(blockIdx.x) * BN;
    if (i0 >= p.M || j0 >= p.N || p.K == 0) return;

    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 B
    auto tile_a = [&](int s) { return base + uint32_t(s * C::StageBytes); };
    auto tile_b = [&](int s) { return base + uint32_t(s * C::StageBytes + C::ABytes); };
    const int64_t slices = (p.K + BK - 1) / BK;
    auto load = [&](int64_t slice, int s) {
        load_tile<kAK, BM, kThreads>(tile_a(s), p.A, p.lda, i0, p.M, slice * BK, p.K, threadIdx.x);
        load_tile<kBK, BN, kThreads>(tile_b(s), p.B, p.ldb, j0, p.N, slice * BK, p.K, threadIdx.x);
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
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        // A: this warpgroup's 64 rows (8 KiB into a K-major tile, the second atom of MN-major).
        mma_slice<kKind>(d, tile_a(s) + uint32_t(wg * 8192), tile_b(s));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if constexpr (C::InFlight)
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        else
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::);
    store_acc<kKind>(d, p, e, wstride, i0 + wg * 64, j0, accumulate, c);
#else
    __trap();  // dispatched only on sm_90 (grouped_gemm_wgmma_available)
#endif
}

template <class C, GroupedGemm kKind>
void launch(const ExecContext& ctx, dim3 grid, const int32_t* offsets, int64_t n, int64_t k,
            int64_t wstride, bool accumulate, const bf16* a, const bf16* b, void* c) {
    allow_dynamic_smem<grouped_gemm_wgmma_kernel<C, kKind>>(C::SmemBytes);
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

namespace {
// SPARSETRON_GROUPED_GEMM picks other kernels than the engine's, to measure them against it in
// one process: "blocked" runs this file's kernels for every kind; "async", "tma" (without the
// multicast) and "waits" the warp-specialized kernel with that feed, "pair" the engine's without
// the bulk tensor stores, "reduce" the engine's with the weight gradient's fp32 adds as bulk
// tensor reduce-adds (grouped_gemm_ws.cu's configurations 3, 5, 0, 7 and 11).
enum class Choice { Engine, Blocked, CopiesArrive, Tma, TmaPair, TmaReduce, ProducerWaits };
Choice forced_choice() {
    static const Choice choice = [] {
        if (env_is("SPARSETRON_GROUPED_GEMM", "blocked")) return Choice::Blocked;
        if (env_is("SPARSETRON_GROUPED_GEMM", "async")) return Choice::CopiesArrive;
        if (env_is("SPARSETRON_GROUPED_GEMM", "tma")) return Choice::Tma;
        if (env_is("SPARSETRON_GROUPED_GEMM", "pair")) return Choice::TmaPair;
        if (env_is("SPARSETRON_GROUPED_GEMM", "reduce")) return Choice::TmaReduce;
        if (env_is("SPARSETRON_GROUPED_GEMM", "waits")) return Choice::ProducerWaits;
        return Choice::Engine;
    }();
    return choice;
}
}  // namespace

void grouped_gemm_wgmma(const ExecContext& ctx, GroupedGemm kind, const int32_t* offsets,
                        int64_t experts, int64_t max_rows, int64_t row_capacity, int64_t n,
                        int64_t k, const bf16* a, const bf16* b, void* c, int64_t weight_stride,
                        bool accumulate) {
    // The warp-specialized kernel with the TMA feed, B multicast to clusters of two and bulk
    // tensor stores of the bf16 outputs, every kind (docs/perf/2026-12-01-grouped-gemm-tma.md,
    // 17533f2, same call: x W^T / dy W / weight gradient 909 / 869 / 700 TFLOP/s against
    // 837 / 703 / 699 without the stores, 800 / 684 / 660 by TMA alone). This file's kernels only
    // when SPARSETRON_GROUPED_GEMM=blocked.
    const Choice choice = forced_choice();
    if (choice != Choice::Blocked) {
        int config = 9;
        if (choice == Choice::CopiesArrive) config = 3;
        if (choice == Choice::Tma) config = 5;
        if (choice == Choice::TmaPair) config = 7;
        if (choice == Choice::TmaReduce) config = 11;
        if (choice == Choice::ProducerWaits) config = 0;
        grouped_gemm_ws(ctx, config, kind, offsets, experts, max_rows, row_capacity, n, k, a, b, c,
                        weight_stride, accumulate);
        return;
    }
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
    return 6 + kGroupedGemmWsConfigs;
}

std::string grouped_gemm_wgmma_config(const ExecContext& ctx, int config, GroupedGemm kind,
                                      const int32_t* offsets, int64_t experts, int64_t max_rows,
                                      int64_t row_capacity, int64_t n, int64_t k, const bf16* a,
                                      const bf16* b, void* c) {
    const int64_t ws = n * k;
    switch (config) {
        case 0:
            grouped_gemm_wgmma(ctx, kind, offsets, experts, max_rows, row_capacity, n, k, a, b, c,
                               ws, false);
            return forced_choice() == Choice::Engine
                       ? "wgmma, the engine's choice (warp-specialized, TMA, B multicast, TMA "
                         "stores)"
                       : "wgmma, as SPARSETRON_GROUPED_GEMM sets";
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
        case 5:
            run<WgWideLongK>(ctx, kind, offsets, experts, max_rows, n, k, a, b, c, ws, false);
            return "wgmma 128x256, k64, 4 stages, a group in flight";
        default: {
            const int blocks = grouped_gemm_ws(ctx, config - 6, kind, offsets, experts, max_rows,
                                               row_capacity, n, k, a, b, c, ws, false);
            return std::string(grouped_gemm_ws_name(config - 6)) + ", " + std::to_string(blocks) +
                   " blocks";
        }
    }
}

}  // namespace sparsetron::cuda
