// Grouped expert GEMM on wgmma, warp-specialized and persistent like grouped_gemm_ws.cu, with
// the two consumer warpgroups on alternate output tiles ("ping-pong") instead of halves of one:
// while one warpgroup stores its tile, the other's MMAs run, so the tensor cores are not idle
// during a store. Same contract and operand roles as grouped_gemm_wgmma (wgmma.cuh).
//
// Why (docs/perf/2026-11-30-grouped-gemm-warp-specialized.md): in grouped_gemm_ws.cu both
// consumers store at the same time with the tensor cores idle. That costs the weight gradient
// most (its store is an fp32 read-modify-write of the gradient, ~8 us per 128 x 256 tile against
// ~17 us of MMAs: 362 TFLOP/s against x W^T's 797), then dy W (K = 2048: 32 slices per tile
// against x W^T's 96, 638 TFLOP/s).
//
// Pipeline: one producer warpgroup fills a ring of stages with every tile's slices in the
// block's tile order (as in grouped_gemm_ws.cu). Consumer warpgroup w takes the block's tiles
// w, w + 2, ...: it waits only for its own tiles' stages (skipping the other's slices in the fill
// count) and releases each stage to the producer alone (128 arrivals). A consumer owns a whole
// TM x BN tile: kHalves row halves of 64 (two m64 MMAs per k16 step sharing B) or one.
//
// Turn order: a consumer starts a tile only once the other has waited for the previous tile's
// last stage (an mbarrier per consumer, "turn"). The stage waits are by phase parity, which
// cannot tell a phase from the one two rounds earlier: without the turn, a consumer done with
// its tile would wait on its next tile's first stage while that stage is still two or more
// rounds behind (the other consumer mid-tile) and pass on a stale phase. (The first form had
// no turn: it passed the tests' 4-slice tiles and hung at the proxy's 32-slice ones.)
#include <string>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/cuda/wgmma.cuh"

namespace sparsetron::cuda {

namespace {

using wgmma::BK;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kProducerThreads = 128, kConsumerThreads = 128;  // a consumer: one warpgroup
static_assert(kProducerThreads + 2 * kConsumerThreads == kThreads, "one producer, two consumers");

// A consumer's tile: kHalves x 64 rows by BN columns (128 accumulators per thread either way).
template <int kHalves_, int Stages_>
struct PpCfg {
    static constexpr int kHalves = kHalves_, TM = 64 * kHalves_, BN = 256 / kHalves_;
    static constexpr int Stages = Stages_;
    static constexpr int Lag = Stages - 2;  // as in grouped_gemm_ws.cu's WsCfg
    static constexpr int ABytes = TM * BK * 2, BBytes = BN * BK * 2;
    static constexpr int StageBytes = ABytes + BBytes;
    // Stages, alignment slack, the full and empty mbarriers per stage and the two turn barriers.
    static constexpr size_t SmemBytes = size_t(Stages) * StageBytes + 1024 + (2 * Stages + 2) * 8;
    static_assert(Lag >= 1, "at least three stages");
    static_assert(SmemBytes <= 227 * 1024, "shared memory per block");
    static_assert(kHalves == 1 || kHalves == 2, "m64n256 or two m64n128 per k16 step");
};
using PpSquare = PpCfg<2, 6>;  // 128 x 128 per consumer, 6 x 32 KiB stages
using PpWide = PpCfg<1, 5>;    // 64 x 256 per consumer, 5 x 40 KiB stages

struct TileSpace {
    int64_t m_tiles, n_tiles;
};

template <class C, GroupedGemm kKind>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_pingpong_kernel(const int32_t* offsets, int64_t experts, TileSpace space,
                                 int64_t n, int64_t k, int64_t wstride, bool accumulate,
                                 const bf* a, const bf* b, void* c) {
#ifdef ST_WGMMA
    using namespace wgmma;
    constexpr int TM = C::TM, BN = C::BN, kStages = C::Stages, kLag = C::Lag;
    constexpr bool kAK = a_k_major<kKind>, kBK = b_k_major<kKind>;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 B
    auto tile_a = [&](int s) { return base + uint32_t(s * C::StageBytes); };
    auto tile_b = [&](int s) { return base + uint32_t(s * C::StageBytes + C::ABytes); };
    const uint32_t bars = base + uint32_t(kStages * C::StageBytes);
    auto full = [&](uint32_t s) { return bars + 8u * s; };
    auto empty = [&](uint32_t s) { return bars + 8u * (kStages + s); };
    // turn(w): consumer w may start its next tile (the other consumer arrives on it).
    auto turn = [&](int64_t w) { return bars + 8u * (2 * kStages + uint32_t(w)); };
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), kProducerThreads);
            mbar_init(empty(s), kConsumerThreads);
        }
        mbar_init(turn(0), kConsumerThreads);
        mbar_init(turn(1), kConsumerThreads);
    }
    __syncthreads();

    const int64_t tiles = experts * space.m_tiles * space.n_tiles;
    // The same walk for every role: a tile is skipped when it lies past its expert's rows.
    auto next_tile = [&](int64_t& t, int64_t& e, int64_t& i0, int64_t& j0, Problem& p) {
        for (; t < tiles; t += gridDim.x) {
            const int64_t per_expert = space.m_tiles * space.n_tiles;
            e = t / per_expert;
            const int64_t mi = t % per_expert / space.n_tiles, nj = t % space.n_tiles;
            p = problem<kKind>(offsets, e, n, k, wstride, a, b);
            i0 = mi * TM, j0 = nj * BN;
            if (i0 < p.M && j0 < p.N && p.K > 0) return true;
        }
        return false;
    };

    if (threadIdx.x < kProducerThreads) {
        const int tid = threadIdx.x;
        uint32_t it = 0;  // fills issued so far, across tiles
        int64_t e, i0, j0;
        Problem p;
        for (int64_t t = blockIdx.x; next_tile(t, e, i0, j0, p); t += gridDim.x) {
            const int64_t slices = (p.K + BK - 1) / BK;
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                mbar_wait(empty(s), ((it / kStages) & 1u) ^ 1u);  // round 0 passes at once
                load_tile_walk<kAK, TM, kProducerThreads>(tile_a(int(s)), p.A, p.lda, i0, p.M,
                                                          sl * BK, p.K, tid);
                load_tile_walk<kBK, BN, kProducerThreads>(tile_b(int(s)), p.B, p.ldb, j0, p.N,
                                                          sl * BK, p.K, tid);
                asm volatile("cp.async.commit_group;\n" ::);
                if (it >= uint32_t(kLag)) {
                    asm volatile("cp.async.wait_group %0;\n" ::"n"(kLag));
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    mbar_arrive(full((it - kLag) % kStages));
                }
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (uint32_t f = it >= uint32_t(kLag) ? it - kLag : 0; f < it; ++f)
            mbar_arrive(full(f % kStages));
    } else {
        const int64_t mine = (threadIdx.x - kProducerThreads) >> 7;  // takes tiles mine, mine + 2..
        uint32_t it = 0;  // the producer's fill count at this slice, across both consumers' tiles
        int64_t e, i0, j0, local = 0;
        Problem p;
        for (int64_t t = blockIdx.x; next_tile(t, e, i0, j0, p); t += gridDim.x, ++local) {
            const int64_t slices = (p.K + BK - 1) / BK;
            if ((local & 1) != mine) {  // the other consumer's tile
                it += uint32_t(slices);
                continue;
            }
            // The other consumer's tile local - 1 has had all its stages: its turn number
            // (local - 1) / 2 is this wait's phase.
            if (local > 0) mbar_wait(turn(mine), uint32_t((local - 1) >> 1) & 1u);
            float d[C::kHalves][BN / 2];
#pragma unroll
            for (int h = 0; h < C::kHalves; ++h)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) d[h][i] = 0.f;
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                mbar_wait(full(s), (it / kStages) & 1u);
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
                // Row half h of the A tile: 64 K-major rows of 128 B, or the next 64-wide atom
                // when MN-major: 8 KiB on either layout.
#pragma unroll
                for (int h = 0; h < C::kHalves; ++h)
                    mma_slice<kKind>(d[h], tile_a(int(s)) + uint32_t(h * 8192), tile_b(int(s)));
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // The previous slice's group has completed: its stage can be refilled.
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (sl > 0) mbar_arrive(empty((it - 1) % kStages));
            }
            mbar_arrive(turn(1 - mine));  // every stage of this tile has been waited for
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            mbar_arrive(empty((it - 1) % kStages));
#pragma unroll
            for (int h = 0; h < C::kHalves; ++h)
                store_acc<kKind>(d[h], p, e, wstride, i0 + 64 * h, j0, accumulate, c);
        }
    }
#else
    __trap();  // dispatched only on sm_90 (grouped_gemm_wgmma_available)
#endif
}

template <class C, GroupedGemm kKind>
void launch(const ExecContext& ctx, int max_blocks, const int32_t* offsets, int64_t experts,
            TileSpace space, int64_t n, int64_t k, int64_t wstride, bool accumulate, const bf16* a,
            const bf16* b, void* c) {
    allow_dynamic_smem<grouped_gemm_pingpong_kernel<C, kKind>>(C::SmemBytes);
    const int64_t tiles = experts * space.m_tiles * space.n_tiles;
    if (tiles == 0) return;
    const int blocks = int(std::min<int64_t>(tiles, max_blocks > 0 ? max_blocks : sm_count()));
    grouped_gemm_pingpong_kernel<C, kKind><<<blocks, kThreads, C::SmemBytes, stream_of(ctx)>>>(
        offsets, experts, space, n, k, wstride, accumulate, dev(a), dev(b), c);
    ST_CUDA_LAUNCH_CHECK();
}

template <class C>
void run(const ExecContext& ctx, int max_blocks, GroupedGemm kind, const int32_t* offsets,
         int64_t experts, int64_t max_rows, int64_t n, int64_t k, const bf16* a, const bf16* b,
         void* c, int64_t wstride, bool accumulate) {
    // Tile space: the worst case per expert (max_rows); tiles past an expert's rows are skipped.
    switch (kind) {
        case GroupedGemm::RowsTimesWeightT:
            launch<C, GroupedGemm::RowsTimesWeightT>(
                ctx, max_blocks, offsets, experts,
                {blocks_for(max_rows, C::TM), blocks_for(n, C::BN)}, n, k, wstride, accumulate, a,
                b, c);
            break;
        case GroupedGemm::RowsTimesWeight:
            launch<C, GroupedGemm::RowsTimesWeight>(
                ctx, max_blocks, offsets, experts,
                {blocks_for(max_rows, C::TM), blocks_for(k, C::BN)}, n, k, wstride, accumulate, a,
                b, c);
            break;
        default:
            launch<C, GroupedGemm::WeightGrad>(ctx, max_blocks, offsets, experts,
                                               {blocks_for(n, C::TM), blocks_for(k, C::BN)}, n, k,
                                               wstride, accumulate, a, b, c);
            break;
    }
}

}  // namespace

void grouped_gemm_pingpong(const ExecContext& ctx, int config, GroupedGemm kind,
                           const int32_t* offsets, int64_t experts, int64_t max_rows, int64_t n,
                           int64_t k, const bf16* a, const bf16* b, void* c, int64_t weight_stride,
                           bool accumulate) {
    switch (config) {
        case 0:
            run<PpSquare>(ctx, 0, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                          accumulate);
            break;
        case 1:
            run<PpWide>(ctx, 0, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                        accumulate);
            break;
        default:
            // Three blocks: each consumer takes many tiles and skips the other's, and the stage
            // ring wraps across tiles (what the correctness test needs to see).
            run<PpSquare>(ctx, 3, kind, offsets, experts, max_rows, n, k, a, b, c, weight_stride,
                          accumulate);
            break;
    }
}

const char* grouped_gemm_pingpong_name(int config) {
    switch (config) {
        case 0:
            return "wgmma ping-pong persistent, 128x128 per consumer, k64, 6 stages";
        case 1:
            return "wgmma ping-pong persistent, 64x256 per consumer, k64, 5 stages";
        default:
            return "wgmma ping-pong 128x128 on 3 blocks (test of the tile walk)";
    }
}

}  // namespace sparsetron::cuda
