// Grouped expert GEMM on wgmma with warp specialization, persistent: one block per SM walks the
// output tiles of every expert; a producer warpgroup copies operand slices into a ring of
// shared-memory stages while two consumer warpgroups multiply (64 rows of the 128-row tile each)
// and store. Same contract as grouped_gemm (moe.h); operand roles and tile layouts: wgmma.cuh.
//
// Why: without warp specialization (docs/perf/log/) the SM ran at half its throughput with half of
// the L2 bandwidth in use and several times cuBLASLt's instructions per cycle: every warp issues
// the copies and the whole block meets at a barrier
// each 64-deep slice, so MMAs wait on copies and on each other. Here the consumers only wait for
// their slice's mbarrier, and the producer refills a stage as soon as both consumers release it,
// including the next tile's first stages while the consumers store this tile.
//
// Operands arrive by TMA bulk tensor copies, B multicast to clusters of two; the bf16 outputs
// leave by bulk tensor stores and the weight gradient's fp32 tiles by bulk tensor reduce-adds
// (or, for a step's first weight gradient, stores).
//
// A weight gradient that is written, not added to (accumulate false), also needs zeros for the
// experts with no rows, which the tile walk skips: zero_empty_expert_grads, before the GEMM.
//
// Per stage s (fill number f = it, round f / Stages):
//   producer (one thread of one warp; the other producer warps have nothing to do): wait empty[s],
//     arrive on full[s] expecting the stage's bytes, issue the bulk tensor copies (a 2-d or 3-d
//     box per operand, 64-wide atoms for the MN-major ones) that complete on full[s] as bytes.
//   consumer: wait full[s], four wgmma, commit; after the next slice's wgmma is issued and the
//     previous group has completed, each warp arrives once on that slice's empty[] (in every
//     block of the cluster: its B part came from all of them).
// The boxes read whole tiles: rows past an expert belong to the next expert (their output rows are
// not stored), rows past the row buffer's capacity and columns past n or k read as zero. Only the
// weight gradient reduces over rows, so in its last, partial slice of an expert the consumers zero
// the rows past the expert before multiplying (zero_tail_rows).
//
// Clusters of two: the pair takes vertically adjacent tiles (the same B columns, the next 128
// rows); each block loads its own A and half of B, multicast to both blocks' stages, so a block
// reads 32 of the stage's 48 KiB from L2.
#include <string>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/tensor_map.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/moe/grouped_gemm_forms.h"
#include "sparsetron/ops/moe/grouped_gemm_tiles.cuh"
#include "sparsetron/ops/moe/moe.h"

namespace sparsetron::cuda {

namespace {

using wgmma::BK;
using wgmma::BM;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kProducerThreads = 128, kConsumerThreads = 256;
static_assert(kProducerThreads + kConsumerThreads == kThreads, "one producer, two consumers");

// 128 x 256 output tiles (kBN), four 48 KiB stages, clusters of two blocks: the pair takes
// vertically adjacent tiles (the same columns of B) and each block loads half of the B tile,
// multicast to both, so each block reads a third fewer bytes from L2. bf16 outputs (not added to)
// leave through shared memory by bulk tensor stores, a consumer warpgroup's 64 x 128 half-tile at
// a time (16 KiB each), where the warpgroup's rows are all the expert's (otherwise the st.global
// epilogue, 16-byte half-sectors, 8 rows per instruction); the weight gradient's fp32 tiles leave
// the same way as bulk tensor reduce-adds (or stores) of 64 x 64 quarters.
constexpr int kBN = 256, kStages = 4, kCluster = 2;
constexpr int kABytes = BM * BK * 2, kBBytes = kBN * BK * 2;
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kStagingBytes = 2 * 16384;  // per consumer warpgroup
// Stages, the store staging, alignment slack for the 1024-byte swizzle period, the full and empty
// mbarriers.
constexpr size_t kSmemBytes =
    size_t(kStages) * kStageBytes + kStagingBytes + 1024 + 2 * kStages * 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

// Output tiles of expert e in (row tile, column tile) order, experts in order: consecutive tiles
// (the ones the blocks hold at the same time) share A's rows and the expert's weights in L2.
// m_tiles is the worst case per expert (from max_rows: it sizes the grid); the kernel walks each
// expert's own row tiles. n_tiles is every expert's.
struct TileSpace {
    int64_t m_tiles, n_tiles;
};

#ifdef ST_WGMMA
// One stage's operand tiles by bulk tensor copies, completing on `bar` (the maps: tensor_maps
// below). K-major tiles are one box of 64 x width; MN-major tiles are width / 64 boxes of 64 x 64
// (the wgmma.cuh atoms, 8 KiB apart). The row coordinate of a row operand is r0 + the tile's own.
// In a cluster of kCluster blocks, block `rank` loads the rank-th part of the B tile (rows of a
// K-major tile, atoms of an MN-major one) for every block of the cluster; where the blocks' tiles
// are of different experts (`shared` false: x W^T and dy W, see the walk), each block loads
// every part of its own B instead, into its own tile only.
template <GroupedGemm kKind>
__device__ __forceinline__ void tma_stage(uint32_t ta, uint32_t tb, const CUtensorMap* ma,
                                          const CUtensorMap* mb, int64_t r0, int64_t e, int64_t i0,
                                          int64_t j0, int64_t k0, uint32_t bar, uint32_t rank,
                                          bool shared) {
    using namespace wgmma;
    const int32_t ex = int32_t(e), kk = int32_t(k0);
    constexpr uint16_t kAll = uint16_t((1u << kCluster) - 1u);
    constexpr int BN = kBN;
    // One box of B into this block's tile (a tile of its own) or every block's (multicast).
    auto load_b = [&](uint32_t dst, int32_t c0, int32_t c1, auto... c2) {
        if (!shared)
            tma_load(dst, mb, c0, c1, c2..., bar);
        else
            tma_load_multicast(dst, mb, c0, c1, c2..., bar, kAll);
    };
    if constexpr (kKind == GroupedGemm::RowsTimesWeightT) {
        tma_load(ta, ma, kk, int32_t(r0 + i0), bar);
        constexpr int kRows = BN / kCluster;  // the part's B rows (the map's box)
        for (int part = 0; part < kCluster; ++part)
            if (!shared || part == int(rank))
                load_b(tb + part * kRows * 128, kk, int32_t(j0 + part * kRows), ex);
    } else if constexpr (kKind == GroupedGemm::RowsTimesWeight) {
        tma_load(ta, ma, kk, int32_t(r0 + i0), bar);
        constexpr int kAtoms = BN / 64 / kCluster;
        for (int part = 0; part < kCluster; ++part) {
            if (shared && part != int(rank)) continue;
#pragma unroll
            for (int u = 0; u < kAtoms; ++u) {
                const int t = part * kAtoms + u;
                load_b(tb + t * 8192, int32_t(j0 + 64 * t), kk, ex);
            }
        }
    } else {
        const int32_t row = int32_t(r0 + k0);
#pragma unroll
        for (int t = 0; t < BM / 64; ++t)
            tma_load(ta + t * 8192, ma, int32_t(i0 + 64 * t), row, bar);
        constexpr int kAtoms = BN / 64 / kCluster;
#pragma unroll
        for (int u = 0; u < kAtoms; ++u) {
            const int t = int(rank) * kAtoms + u;
            load_b(tb + t * 8192, int32_t(j0 + 64 * t), row);
        }
    }
}

// The weight gradient's reduction is over an expert's rows, but the TMA boxes read whole 64-row
// slices: past the expert's last row they hold the next expert's rows, or whatever lies past
// offsets[E] (NaN in the tests). The consumers zero reduction rows valid.. of every atom of both
// MN-major tiles (whole 128-byte rows, so the swizzle does not matter) once the stage has landed,
// before either warpgroup's MMAs read it: both warpgroups share the B tile, so all 256 consumer
// threads write and meet on named barrier 3 (the epilogues use 1 and 2). Only an expert's last
// slice of a tile takes this: at most 48 KiB, 12 16-byte stores per thread.
template <int BN>
__device__ __forceinline__ void zero_tail_rows(uint32_t tile_a, uint32_t tile_b, int valid) {
    // Thread t zeroes 16-byte chunk t % 8 of rows valid + t / 8, + 32, ... in every atom.
    const int t = int(threadIdx.x) - kProducerThreads;  // 0..255
    const uint32_t ch = uint32_t(t & 7) * 16;
    for (int r = valid + (t >> 3); r < 64; r += kConsumerThreads / 8) {
        const uint32_t off = uint32_t(r) * 128 + ch;
#pragma unroll
        for (int atom = 0; atom < wgmma::BM / 64 + BN / 64; ++atom) {
            const uint32_t addr = atom < wgmma::BM / 64
                                      ? tile_a + atom * 8192 + off
                                      : tile_b + (atom - wgmma::BM / 64) * 8192 + off;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0)
                         : "memory");
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // seen by wgmma
    asm volatile("bar.sync 3, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// A consumer warpgroup's 64 x 256 accumulator block (rows row0.. of the expert, all of them its
// rows; columns j0..) through its staging buffer `buf` by bulk tensor stores, in two 64 x 128
// halves (stage_bf16_128).
__device__ __forceinline__ void store_acc_tma(const float (&d)[128], const CUtensorMap* mc,
                                              uint32_t buf, int wg, int64_t row0, int64_t j0) {
    auto issue = [&](int h) {
        for (int box = 0; box < 2; ++box)
            wgmma::tma_store(mc, buf + box * 8192, int32_t(j0 + 128 * h + 64 * box), int32_t(row0));
    };
    wgmma::through_staging<2>(
        wg, [&](int h) { wgmma::stage_bf16_128(d, buf, h); }, issue);
}

#endif

template <GroupedGemm kKind>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_ws_kernel(const int32_t* offsets, int64_t experts, TileSpace space, int64_t n,
                           int64_t k, int64_t wstride, bool accumulate, bool grad_bf16, const bf* a,
                           const bf* b, void* c, const __grid_constant__ CUtensorMap map_a,
                           const __grid_constant__ CUtensorMap map_b,
                           const __grid_constant__ CUtensorMap map_c) {
#ifdef ST_WGMMA
    using namespace wgmma;
    constexpr int BN = kBN, kUnitRows = kCluster * BM;  // a cluster's tile rows
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats every 1024 B
    auto tile_a = [&](int s) { return base + uint32_t(s * kStageBytes); };
    auto tile_b = [&](int s) { return base + uint32_t(s * kStageBytes + kABytes); };
    const uint32_t staging = base + uint32_t(kStages * kStageBytes);
    const uint32_t bars = staging + uint32_t(kStagingBytes);
    auto full = [&](uint32_t s) { return bars + 8u * s; };
    auto empty = [&](uint32_t s) { return bars + 8u * (kStages + s); };
    // A stage is released by each consumer warp of every block in the cluster (its B part went
    // to all of them).
    constexpr uint32_t kReleases = kCluster * kConsumerThreads / 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), kReleases);
        }
        // Visible to the other block's arrivals and multicasts.
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    const uint32_t rank = cluster_rank();
    cluster_sync();
    // Clusters walk the tiles in units of kCluster vertically adjacent tiles.
    const int64_t unit0 = blockIdx.x / kCluster, units = gridDim.x / kCluster;

    // The same walk for every role over the experts' real tiles only (row tiles up to each
    // expert's own rows, experts with no rows or no reduction skipped), so the blocks' tile
    // counts differ by at most one however the routing is skewed. The walk only moves forward:
    // `w_e` is the current expert and `w_first` the linear index of its first tile (unit).
    //
    // x W^T and dy W (kPairsAcross): a unit is two consecutive 128-row tiles
    // of the experts' row tiles in order, of one expert or of two, so an expert whose rows end in
    // the first half of a 256-row unit leaves no empty tile (under training's routing such
    // tiles took a noticeable share of the time). Both tiles of one expert share B (multicast);
    // tiles of two experts each load their own (`shared` false). An odd last tile pairs with an
    // empty one past its expert's rows (nothing stored). `w_first` then counts row tiles, not
    // units.
    constexpr bool kPairsAcross = kKind != GroupedGemm::WeightGrad;
    int64_t w_e = 0, w_first = 0;
    auto next_tile = [&](int64_t t, int64_t& e, int64_t& i0, int64_t& j0, Problem& p,
                         bool& shared) {
        shared = true;
        if constexpr (kPairsAcross) {
            const int64_t g0 = t / space.n_tiles * 2;  // the unit's first row tile
            for (; w_e < experts; ++w_e) {
                p = problem<kKind>(offsets, w_e, n, k, wstride, a, b);
                const int64_t count = p.M > 0 && p.K > 0 ? (p.M + BM - 1) / BM : int64_t(0);
                if (g0 < w_first + count) {
                    const int64_t local = g0 - w_first;
                    e = w_e, j0 = t % space.n_tiles * BN, i0 = (local + int64_t(rank)) * BM;
                    if (local + 1 < count) return true;
                    // The second tile is the next expert's first, if one has rows.
                    for (int64_t e1 = w_e + 1; e1 < experts; ++e1) {
                        const Problem q = problem<kKind>(offsets, e1, n, k, wstride, a, b);
                        if (q.M > 0 && q.K > 0) {
                            shared = false;
                            if (rank == 1) e = e1, p = q, i0 = 0;
                            return true;
                        }
                    }
                    return true;  // an odd last tile: its partner multiplies rows past M
                }
                w_first += count;
            }
            return false;
        } else {
            for (; w_e < experts; ++w_e) {
                p = problem<kKind>(offsets, w_e, n, k, wstride, a, b);
                const int64_t count = p.M > 0 && p.K > 0
                                          ? (p.M + kUnitRows - 1) / kUnitRows * space.n_tiles
                                          : int64_t(0);
                if (t < w_first + count) {
                    const int64_t local = t - w_first;
                    e = w_e, j0 = local % space.n_tiles * BN;
                    i0 = local / space.n_tiles * kUnitRows + int64_t(rank) * BM;
                    return true;
                }
                w_first += count;
            }
            return false;
        }
    };

    // The producer's walk: every slice of every tile this block takes, in order, each into the
    // ring's next stage once the consumers (of every block of the cluster) have released it;
    // round 0 passes at once. fill(s, it, p, e, i0, j0, k0) loads fill number `it` into stage s.
    // Returns the fills issued.
    auto fill_ring = [&](auto fill) {
        uint32_t it = 0;
        int64_t e, i0, j0;
        Problem p;
        bool shared;
        for (int64_t t = unit0; next_tile(t, e, i0, j0, p, shared); t += units) {
            const int64_t slices = (p.K + BK - 1) / BK;
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                mbar_wait(empty(s), ((it / kStages) & 1u) ^ 1u);
                fill(s, it, p, e, i0, j0, sl * BK, shared);
            }
        }
        return it;
    };

    if (threadIdx.x < kProducerThreads) {
        // One warp feeds the ring; the other producer warps only meet the cluster at the end.
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            if (lane == 0) tma_prefetch_map(&map_a), tma_prefetch_map(&map_b);
            fill_ring([&](uint32_t s, uint32_t, const Problem& p, int64_t e, int64_t i0, int64_t j0,
                          int64_t k0, bool shared) {
                if (lane == 0) {
                    mbar_arrive_expect_tx(full(s), uint32_t(kStageBytes));
                    tma_stage<kKind>(tile_a(int(s)), tile_b(int(s)), &map_a, &map_b, p.r0, e, i0,
                                     j0, k0, full(s), rank, shared);
                }
                __syncwarp();
            });
        }
    } else {
        const int wg = (threadIdx.x - kProducerThreads) >> 7;  // this warpgroup's 64 rows
        // Stage s read by this warp (after its wgmma wait): one arrival per warp on the stage's
        // empty barrier in every block of the cluster.
        auto release = [&](uint32_t s) {
            if ((threadIdx.x & 31) != 0) return;
            for (uint32_t r = 0; r < uint32_t(kCluster); ++r) mbar_arrive_cluster(empty(s), r);
        };
        uint32_t it = 0;  // slices consumed so far, across tiles
        int64_t e, i0, j0;
        Problem p;
        bool shared;  // the producers' business
        for (int64_t t = unit0; next_tile(t, e, i0, j0, p, shared); t += units) {
            const int64_t slices = (p.K + BK - 1) / BK;
            float d[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
            for (int64_t sl = 0; sl < slices; ++sl, ++it) {
                const uint32_t s = it % kStages;
                mbar_wait(full(s), (it / kStages) & 1u);
                if constexpr (kKind == GroupedGemm::WeightGrad) {
                    // An expert's last, partial slice of rows: the boxes read on past them.
                    const int64_t valid = p.K - sl * BK;
                    if (valid < BK) zero_tail_rows<BN>(tile_a(int(s)), tile_b(int(s)), int(valid));
                }
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
                mma_slice<kKind>(d, tile_a(int(s)) + uint32_t(wg * 8192), tile_b(int(s)));
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // The previous slice's group has completed: its stage can be refilled.
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (sl > 0) release((it - 1) % kStages);
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            release((it - 1) % kStages);
            if constexpr (kKind == GroupedGemm::WeightGrad) {
                if (grad_bf16)
                    wgmma::reduce_acc_tma_bf16(d, &map_c, staging + uint32_t(wg) * 16384u, wg,
                                               i0 + wg * 64, j0, e, accumulate);
                else
                    wgmma::reduce_acc_tma(d, &map_c, staging + uint32_t(wg) * 16384u, wg,
                                          i0 + wg * 64, j0, e, accumulate);
            } else if (!accumulate && i0 + wg * 64 + 64 <= p.M) {
                store_acc_tma(d, &map_c, staging + uint32_t(wg) * 16384u, wg, p.r0 + i0 + wg * 64,
                              j0);
            } else {
                store_acc<kKind>(d, p, e, wstride, i0 + wg * 64, j0, accumulate, c);
            }
        }
        // The last stores have read their staging before the block's shared memory goes.
        if ((threadIdx.x & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    // A block's arrivals on the others' barriers (and their multicasts into it) are over only
    // when every block of the cluster is here.
    cluster_sync();
#else
    __trap();  // dispatched only on sm_90 (has_sm90a)
#endif
}

// The two operands' tensor maps for the TMA feed, boxes as tma_stage reads them (rows: the row
// buffers' capacity; weights [E][n][k] with `wstride` elements between experts; a K-major B tile
// in kCluster parts).
template <GroupedGemm kKind>
void tensor_maps(CUtensorMap& ma, CUtensorMap& mb, int64_t experts, int64_t rows, int64_t n,
                 int64_t k, int64_t wstride, const bf16* a, const bf16* b) {
    const int64_t e2 = 2;  // bytes per element
    if constexpr (kKind == GroupedGemm::RowsTimesWeightT) {
        ma = bf16_tensor_map(a, {k, rows}, {k * e2}, {BK, BM});
        mb = bf16_tensor_map(b, {k, n, experts}, {k * e2, wstride * e2}, {BK, kBN / kCluster, 1});
    } else if constexpr (kKind == GroupedGemm::RowsTimesWeight) {
        ma = bf16_tensor_map(a, {n, rows}, {n * e2}, {BK, BM});
        mb = bf16_tensor_map(b, {k, n, experts}, {k * e2, wstride * e2}, {64, BK, 1});
    } else {
        ma = bf16_tensor_map(a, {n, rows}, {n * e2}, {64, BK});
        mb = bf16_tensor_map(b, {k, rows}, {k * e2}, {64, BK});
    }
}

template <GroupedGemm kKind>
int launch(const ExecContext& ctx, int max_blocks, const int32_t* offsets, int64_t experts,
           int64_t rows, TileSpace space, int64_t n, int64_t k, int64_t wstride, bool accumulate,
           bool grad_bf16, const bf16* a, const bf16* b, void* c) {
    if (kKind == GroupedGemm::WeightGrad && !accumulate && experts > 0 && n * k > 0) {
        zero_empty_expert_grads(ctx, offsets, experts, n * k, wstride, grad_bf16 ? 2 : 4, c);
    }
    const int64_t units = experts * blocks_for(space.m_tiles, kCluster) * space.n_tiles;
    if (units == 0 || rows == 0) return 0;  // no rows: nothing to multiply (zeros written above)
    ClusterLaunch cl(kThreads, kSmemBytes, stream_of(ctx), kCluster);
    cl.size_grid<grouped_gemm_ws_kernel<kKind>>(units, max_blocks);
    CUtensorMap ma{}, mb{}, mc{};
    tensor_maps<kKind>(ma, mb, experts, rows, n, k, wstride, a, b);
    if constexpr (kKind != GroupedGemm::WeightGrad) {
        // C [rows, N] bf16, boxes of 64 x 64 (store_acc_tma).
        const int64_t N = kKind == GroupedGemm::RowsTimesWeightT ? n : k;
        mc = bf16_tensor_map(c, {N, rows}, {N * 2}, {64, 64});
    } else {
        mc = wgmma::weight_grad_tensor_map(c, experts, n, k, wstride, grad_bf16);
    }
    ST_CUDA_CHECK(cudaLaunchKernelEx(&cl.config, grouped_gemm_ws_kernel<kKind>, offsets, experts,
                                     space, n, k, wstride, accumulate, grad_bf16, dev(a), dev(b), c,
                                     ma, mb, mc));
    return int(cl.config.gridDim.x);
}

}  // namespace

// Zeros for the weight gradient [n * k] (elems) of every expert with no rows, when the gradient
// is written rather than added to: the GEMM's walk never reaches those experts. A grid row per
// expert; an expert with rows returns at once (training's usual case: 16 x 128 empty blocks).
// `elem_bytes`: 4 (fp32 gradients) or 2 (bf16 gradient buffers).
__global__ void zero_empty_experts_kernel(const int32_t* offsets, int64_t elems, int64_t wstride,
                                          int64_t elem_bytes, void* dw) {
    const int64_t e = blockIdx.y;
    if (offsets[e + 1] > offsets[e]) return;
    // elems, wstride: multiples of 8, so an expert's gradient is whole 16-byte vectors.
    uint4* d = reinterpret_cast<uint4*>(static_cast<char*>(dw) + e * wstride * elem_bytes);
    const int64_t vectors = elems * elem_bytes / 16, stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += stride)
        d[i] = make_uint4(0u, 0u, 0u, 0u);
}

void zero_empty_expert_grads(const ExecContext& ctx, const int32_t* offsets, int64_t experts,
                             int64_t elems, int64_t wstride, int64_t elem_bytes, void* dw) {
    if (experts == 0 || elems == 0) return;
    zero_empty_experts_kernel<<<dim3(128, unsigned(experts)), 256, 0, stream_of(ctx)>>>(
        offsets, elems, wstride, elem_bytes, dw);
    ST_CUDA_LAUNCH_CHECK();
}

int grouped_gemm_wgmma(const ExecContext& ctx, const GroupedGemmArgs& g, int max_blocks) {
    const int64_t wstride = g.weight_stride ? g.weight_stride : g.n * g.k;
    // Tile space: the worst case per expert (max_rows) sizes the grid; the tensor maps span the
    // row buffers' capacity.
    const int64_t rows = g.row_capacity;
    switch (g.kind) {
        case GroupedGemm::RowsTimesWeightT:
            return launch<GroupedGemm::RowsTimesWeightT>(
                ctx, max_blocks, g.offsets, g.experts, rows,
                {blocks_for(g.max_rows, BM), blocks_for(g.n, kBN)}, g.n, g.k, wstride, g.accumulate,
                false, g.a, g.b, g.c);
        case GroupedGemm::RowsTimesWeight:
            return launch<GroupedGemm::RowsTimesWeight>(
                ctx, max_blocks, g.offsets, g.experts, rows,
                {blocks_for(g.max_rows, BM), blocks_for(g.k, kBN)}, g.n, g.k, wstride, g.accumulate,
                false, g.a, g.b, g.c);
        default:
            return launch<GroupedGemm::WeightGrad>(ctx, max_blocks, g.offsets, g.experts, rows,
                                                   {blocks_for(g.n, BM), blocks_for(g.k, kBN)}, g.n,
                                                   g.k, wstride, g.accumulate,
                                                   g.grad_type == DType::BF16, g.a, g.b, g.c);
    }
}

}  // namespace sparsetron::cuda
