// DSA lightning-indexer scores on wgmma, fused: I[t, s] = Σ_j w[t, j] relu(q[t, j] · k[s]) with
// the per-head dot products never leaving the SM (sm_90).
//
// Why: the GEMM form (indexer.cu) writes the [rows x heads, keys] fp32 dot products to memory and
// reads them back for the ReLU and the weighted head sum: heads x 4 bytes per score, a
// memory-bound pass (docs/perf/README.md, kernel rooflines).
//
// Roles: the keys are the MMA's M (64 per consumer warpgroup), the block's 256 (token, head)
// columns its N (256 / heads tokens, their heads contiguous), the head dim its K (64 per slice).
// A thread's accumulator holds, for each of its two key rows, columns 8j + 2 (lane % 4) + {0, 1}
// (wgmma.cuh's store_acc): every token's heads are whole 8-column groups, so a thread sums its
// share of each token's heads, and the four lanes of a quad finish the sum with two shuffle steps
// that halve the values each lane carries (16 -> 8 -> 4 at 32 heads).
//
// One block per token tile holds the tile's queries in shared memory for the whole key walk; a
// producer warpgroup streams 64-key fills of k into a ring of stages; the two consumer
// warpgroups take alternate fills, so one's ReLU / head-sum epilogue runs while the other's MMAs
// do. Tiles are issued longest key range first (the causal triangle's long rows), keys from the
// tile's earliest document start to its last row; scores outside a row's [begin, row] are not
// written (indexer_scores' contract).
#include <climits>

#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/common/wgmma.cuh"
#include "sparsetron/ops/indexer/indexer_forms.h"

namespace sparsetron::cuda {

namespace {

using wgmma::BK;
// [[maybe_unused]]: the host compilation pass (and the sm_100 one) sees no kernel body.
constexpr int kThreads = 384;
[[maybe_unused]] constexpr int kProducerThreads = 128;
constexpr int kN = 256;     // (token, head) columns per block
constexpr int kFill = 64;   // keys per fill: one consumer warpgroup's M
constexpr int kStages = 8;  // fills in flight
[[maybe_unused]] constexpr int kLag = kStages - 2;

template <int kHeads, int kSlices>
struct IxCfg {
    static_assert(kHeads % 8 == 0 && kN % kHeads == 0, "a token's heads are whole 8-column groups");
    static constexpr int Tokens = kN / kHeads;
    static constexpr int QSliceBytes = kN * BK * 2, KSliceBytes = kFill * BK * 2;
    static constexpr int QBytes = kSlices * QSliceBytes, FillBytes = kSlices * KSliceBytes;
    // Alignment slack for the 1024-byte swizzle period, queries, fills, full / empty mbarriers,
    // the tile's head weights and each token's key range.
    static constexpr size_t SmemBytes =
        1024 + QBytes + size_t(kStages) * FillBytes + 2 * kStages * 8 + kN * 4 + 2 * Tokens * 8;
    static_assert(SmemBytes <= 227 * 1024, "shared memory per block");
};

// The four lanes of a quad each hold a partial sum of every (token, row half) value v[kN]; after
// this each lane holds the full sums of kN / 4 of them: value index i = (lane bit 1) kN / 2 +
// (lane bit 0) kN / 4 + m of r[m]. Each step sends the half a lane gives up and adds the half it
// keeps, so 3 kN / 4 shuffles instead of 2 kN.
template <int kV>
__device__ __forceinline__ void quad_reduce(const float (&v)[kV], float (&r)[kV / 4], int quad) {
    static_assert(kV % 4 == 0, "four lanes share the values");
    const bool hi1 = quad & 2, hi0 = quad & 1;
    float u[kV / 2];
#pragma unroll
    for (int m = 0; m < kV / 2; ++m) {
        const float keep = hi1 ? v[kV / 2 + m] : v[m], give = hi1 ? v[m] : v[kV / 2 + m];
        u[m] = keep + __shfl_xor_sync(0xffffffffu, give, 2);
    }
#pragma unroll
    for (int m = 0; m < kV / 4; ++m) {
        const float keep = hi0 ? u[kV / 4 + m] : u[m], give = hi0 ? u[m] : u[kV / 4 + m];
        r[m] = keep + __shfl_xor_sync(0xffffffffu, give, 1);
    }
}

template <int kHeads, int kSlices>
__global__ void __launch_bounds__(kThreads, 1)
    indexer_wgmma_kernel(const bf* q, const bf* k, const float* w, const int32_t* row_begin,
                         const int32_t* key_row, int64_t tokens, int64_t keys, float* scores) {
#ifdef ST_WGMMA
    using namespace wgmma;
    using C = IxCfg<kHeads, kSlices>;
    constexpr int TT = C::Tokens, kGroups = kHeads / 8, kDim = kSlices * BK;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base = (raw + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - raw);
    auto q_tile = [&](int sl) { return base + uint32_t(sl * C::QSliceBytes); };
    auto k_tile = [&](uint32_t s, int sl) {
        return base + uint32_t(C::QBytes + s * C::FillBytes + sl * C::KSliceBytes);
    };
    const uint32_t bars = base + uint32_t(C::QBytes + kStages * C::FillBytes);
    auto full = [&](uint32_t s) { return bars + 8u * s; };
    auto empty = [&](uint32_t s) { return bars + 8u * (kStages + s); };
    float* w_s =
        reinterpret_cast<float*>(gbase + C::QBytes + kStages * C::FillBytes + 2 * kStages * 8);
    int64_t* begin_s = reinterpret_cast<int64_t*>(w_s + kN);  // -1: padding (or past the end)
    int64_t* row_s = begin_s + TT;                            // the row's last key

    const int tid = threadIdx.x;
    const int64_t tiles = (tokens + TT - 1) / TT;
    const int64_t t0 = (tiles - 1 - blockIdx.x) * TT;  // longest key ranges first
    if (tid < kN) {
        const int64_t t = t0 + tid / kHeads;
        w_s[tid] = t < tokens ? w[t * kHeads + tid % kHeads] : 0.f;
    }
    if (tid < TT) {
        const int64_t t = t0 + tid;
        const int64_t b = t < tokens ? int64_t(row_begin[t]) : -1;
        begin_s[tid] = b;
        row_s[tid] = b < 0 ? -1 : (key_row ? int64_t(key_row[t]) : t);
    }
    if (tid == 0)
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), kProducerThreads);
            mbar_init(empty(s), kN / 2);  // one consumer warpgroup per fill
        }
    __syncthreads();
    int64_t lo = LLONG_MAX, hi = -1;
#pragma unroll
    for (int i = 0; i < TT; ++i)
        if (begin_s[i] >= 0) lo = min(lo, begin_s[i]), hi = max(hi, row_s[i]);
    if (hi < 0) return;  // padding rows only
    const int64_t f0 = lo / kFill, fills = hi / kFill - f0 + 1;

    if (tid < kProducerThreads) {
        // The queries go with the first fill's copies: publishing any fill implies them.
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl)
            load_tile_walk<true, kN, kProducerThreads>(q_tile(sl), q, kDim, t0 * kHeads,
                                                       tokens * kHeads, sl * BK, kDim, tid);
        for (int64_t f = 0; f < fills; ++f) {
            const uint32_t s = uint32_t(f % kStages);
            mbar_wait(empty(s), (uint32_t(f / kStages) & 1u) ^ 1u);  // round 0 passes at once
#pragma unroll
            for (int sl = 0; sl < kSlices; ++sl)
                load_tile_walk<true, kFill, kProducerThreads>(
                    k_tile(s, sl), k, kDim, (f0 + f) * kFill, keys, sl * BK, kDim, tid);
            asm volatile("cp.async.commit_group;\n" ::);
            if (f >= kLag) {
                asm volatile("cp.async.wait_group %0;\n" ::"n"(kLag));
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                mbar_arrive(full(uint32_t((f - kLag) % kStages)));
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (int64_t f = fills >= kLag ? fills - kLag : 0; f < fills; ++f)
            mbar_arrive(full(uint32_t(f % kStages)));
        return;
    }
    const int wg = (tid - kProducerThreads) >> 7;
    const int warp = (tid >> 5) & 3, lane = tid & 31, quad = lane & 3;
    for (int64_t f = wg; f < fills; f += 2) {
        const uint32_t s = uint32_t(f % kStages);
        float d[kN / 2];
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) d[i] = 0.f;
        mbar_wait(full(s), uint32_t(f / kStages) & 1u);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk)
                mma_m64k16<0, 0>(d, slice_descriptor<true>(k_tile(s, sl), kk),
                                 slice_descriptor<true>(q_tile(sl), kk));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        mbar_arrive(empty(s));
        // v[2 tok + half]: this thread's share of token tok's weighted ReLU sum for key row half.
        float v[2 * TT];
#pragma unroll
        for (int tok = 0; tok < TT; ++tok)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float acc = 0.f;
#pragma unroll
                for (int g = 0; g < kGroups; ++g) {
                    const int j = tok * kGroups + g;
                    const float2 wj = *reinterpret_cast<const float2*>(w_s + 8 * j + 2 * quad);
                    acc = fmaf(wj.x, fmaxf(d[4 * j + 2 * half], 0.f), acc);
                    acc = fmaf(wj.y, fmaxf(d[4 * j + 2 * half + 1], 0.f), acc);
                }
                v[2 * tok + half] = acc;
            }
        float r[TT / 2];
        quad_reduce<2 * TT>(v, r, quad);
        const int64_t key0 = (f0 + f) * kFill + warp * 16 + lane / 4;
#pragma unroll
        for (int m = 0; m < TT / 2; ++m) {
            const int i = (quad & 2 ? TT : 0) + (quad & 1 ? TT / 2 : 0) + m;
            const int tok = i / 2;
            const int64_t key = key0 + 8 * (i % 2), b = begin_s[tok];
            if (b >= 0 && key >= b && key <= row_s[tok]) scores[(t0 + tok) * keys + key] = r[m];
        }
    }
#else
    __trap();  // dispatched only on sm_90 (has_sm90a)
#endif
}

template <int kHeads, int kSlices>
void launch(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
            const int32_t* row_begin, const int32_t* key_row, int64_t tokens, int64_t keys,
            float* scores) {
    using C = IxCfg<kHeads, kSlices>;
    allow_dynamic_smem<indexer_wgmma_kernel<kHeads, kSlices>>(C::SmemBytes);
    const int64_t tiles = (tokens + C::Tokens - 1) / C::Tokens;
    indexer_wgmma_kernel<kHeads, kSlices>
        <<<unsigned(tiles), kThreads, C::SmemBytes, stream_of(ctx)>>>(
            dev(q), dev(k), w, row_begin, key_row, tokens, keys, scores);
    ST_CUDA_LAUNCH_CHECK();
}

template <int kSlices>
void launch_heads(const ExecContext& ctx, int64_t heads, const bf16* q, const bf16* k,
                  const float* w, const int32_t* row_begin, const int32_t* key_row, int64_t tokens,
                  int64_t keys, float* scores) {
    switch (heads) {
        case 16:
            return launch<16, kSlices>(ctx, q, k, w, row_begin, key_row, tokens, keys, scores);
        case 32:
            return launch<32, kSlices>(ctx, q, k, w, row_begin, key_row, tokens, keys, scores);
        default:
            return launch<64, kSlices>(ctx, q, k, w, row_begin, key_row, tokens, keys, scores);
    }
}

}  // namespace

bool indexer_scores_wgmma_supported(int64_t heads, int64_t dim) {
    return has_sm90a() && indexer_wgmma_shape(heads, dim);
}

void indexer_scores_wgmma(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                          const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                          float* scores, const int32_t* key_row, int64_t keys) {
    ST_CHECK(indexer_scores_wgmma_supported(heads, dim), "indexer_scores_wgmma: ", heads,
             " heads x ", dim, " dims need an sm_90 device, 16 / 32 / 64 heads and 64 / 128 dims");
    if (tokens == 0) return;
    if (!key_row) keys = tokens;
    if (dim == 64)
        launch_heads<1>(ctx, heads, q, k, w, row_begin, key_row, tokens, keys, scores);
    else
        launch_heads<2>(ctx, heads, q, k, w, row_begin, key_row, tokens, keys, scores);
}

}  // namespace sparsetron::cuda
