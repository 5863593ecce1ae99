// DSA lightning-indexer scores and the per-row top-k.
//
// Scores: on sm_90 with 16 / 32 / 64 heads of 64 or 128 dims, the fused wgmma kernel
// (indexer_wgmma.cu). Otherwise two forms. With a workspace: per chunk of query rows, the [rows x
// H, keys] dot products as one cuBLASLt GEMM (fp32 out) against keys 0..t1-1, then a kernel applies
// ReLU and the per-head weights column by column (coalesced). Without: one block per (query row,
// tile of kKeyTile keys), the row's H x d query and the tile's keys in shared memory, tiles outside
// [begin, t] exiting at once (the simple form; small shapes and the harness).
// Top-k: one block per row, an exact radix select on the order-preserving integer image of the
// fp32 scores, then one ordered pass that keeps every score above the threshold and the first
// `need` equal ones by index, so ties go to the smaller key index and the result is
// deterministic; block scans give each kept key its ascending output slot. Rows up to 32768 keys:
// 1024 threads hold the row in registers (read once, coalesced), select in 3 passes of 11 / 11 /
// 10 bits (topk_threshold, topk_row.cuh: the last two over the threshold bin's keys only) and
// place the kept keys with ballots and block scans. Longer rows: the 4-pass kernel, 512 threads
// reading the row from memory, 4 passes of 8 bits and two block scans per 512 keys.
#include <cub/block/block_scan.cuh>

#include <cstdlib>
#include <string>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"
#include "sparsetron/ops/cuda/topk_row.cuh"

namespace sparsetron::cuda {
namespace {

constexpr int kKeyTile = 128;
constexpr int kTopkThreads = 512;

__global__ void indexer_scores_kernel(const bf* q, const bf* k, const float* w,
                                      const int32_t* row_begin, const int32_t* key_row,
                                      int64_t keys, int64_t heads, int64_t dim, float* scores) {
    extern __shared__ float smem[];
    const int64_t t = blockIdx.x, s0 = int64_t(blockIdx.y) * kKeyTile;
    const int32_t begin = row_begin[t];
    const int64_t row = query_key_row(key_row, t);
    if (begin < 0 || s0 > row || s0 + kKeyTile <= begin) return;
    float* qs = smem;                            // [heads * dim]
    float* ws = qs + heads * dim;                // [heads]
    bf* ks = reinterpret_cast<bf*>(ws + heads);  // [kKeyTile, dim + 2]
    const int64_t kld = dim + 2;
    for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x)
        qs[i] = ld(q + t * heads * dim + i);
    for (int64_t j = threadIdx.x; j < heads; j += blockDim.x) ws[j] = w[t * heads + j];
    for (int64_t i = threadIdx.x; i < kKeyTile * dim; i += blockDim.x) {
        const int64_t r = i / dim, c = i % dim, s = s0 + r;
        ks[r * kld + c] = s < keys ? k[s * dim + c] : __float2bfloat16(0.f);
    }
    __syncthreads();
    const int64_t s = s0 + threadIdx.x;
    if (s < begin || s > row) return;
    const bf* kr = ks + threadIdx.x * kld;
    float acc = 0;
    for (int64_t j = 0; j < heads; ++j) {
        const float* qj = qs + j * dim;
        float d = 0;
        for (int64_t c = 0; c < dim; ++c) d += qj[c] * __bfloat162float(kr[c]);
        acc += ws[j] * fmaxf(d, 0.f);
    }
    scores[t * keys + s] = acc;
}

// scores[t, s] = Σ_j w[t, j] relu(dots[(t - t0) H + j, s]) for s in [begin, t].
__global__ void indexer_weighted_relu_kernel(const float* dots, int64_t ldd, const float* w,
                                             const int32_t* row_begin, int64_t t0, int64_t tokens,
                                             int64_t heads, float* scores) {
    const int64_t t = t0 + blockIdx.y, s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int32_t begin = row_begin[t];
    if (begin < 0 || s < begin || s > t) return;
    const float* col = dots + int64_t(blockIdx.y) * heads * ldd + s;
    const float* wt = w + t * heads;
    float acc = 0.f;
    for (int64_t j = 0; j < heads; ++j) acc += wt[j] * fmaxf(col[j * ldd], 0.f);
    scores[t * tokens + s] = acc;
}

constexpr int64_t kDotsChunkElems = int64_t(32) << 20;  // 128 MiB of fp32 dot products
int64_t dots_ld(int64_t tokens) {
    return (tokens + 3) / 4 * 4;
}
int64_t dots_chunk_tokens(int64_t tokens, int64_t heads, int64_t elems) {
    return std::max<int64_t>(1, std::min(tokens, elems / (heads * dots_ld(tokens))));
}

__global__ void topk_kernel(const float* scores, int64_t ld, const int32_t* row_begin,
                            const int32_t* key_row, int64_t kslots, int32_t* idx, int32_t* len) {
    using Scan = cub::BlockScan<int, kTopkThreads>;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int hist[256];
    __shared__ uint32_t prefix_s;
    __shared__ int remaining_s;
    const int64_t t = blockIdx.x;
    const TopkRow r = topk_row(scores, ld, row_begin, key_row, kslots, idx, t);
    if (topk_short_row(r, kslots, len, t)) return;
    const auto [begin, n, row, out] = r;
    // Radix select: the kslots-th largest key, one byte at a time from the top.
    uint32_t prefix = 0, mask = 0;
    int remaining = int(kslots);
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const uint32_t u = order_key(row[j]);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = 0, b = 255;
            for (; b > 0; --b) {
                if (acc + hist[b] >= remaining) break;
                acc += hist[b];
            }
            prefix_s = prefix | (uint32_t(b) << shift);
            remaining_s = remaining - acc;
        }
        __syncthreads();
        prefix = prefix_s, remaining = remaining_s;
        mask |= 0xffu << shift;
        __syncthreads();
    }
    const uint32_t thr = prefix;
    const int need = remaining;  // how many keys equal to thr are kept (the smallest indices)
    int eq_base = 0, out_base = 0;
    for (int64_t c0 = 0; c0 < n; c0 += blockDim.x) {
        const int64_t j = c0 + threadIdx.x;
        const uint32_t u = j < n ? order_key(row[j]) : 0u;
        const int gt = j < n && u > thr, eq = j < n && u == thr;
        int eq_rank, eq_total;
        Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
        __syncthreads();
        const int sel = gt || (eq && eq_base + eq_rank < need);
        int pos, sel_total;
        Scan(scan_tmp).ExclusiveSum(sel, pos, sel_total);
        __syncthreads();
        if (sel) out[out_base + pos] = int32_t(begin + j);
        eq_base += eq_total, out_base += sel_total;
    }
    if (threadIdx.x == 0) len[t] = int32_t(kslots);
}

constexpr int kRegTopkThreads = 1024;

// The registers form above: thread i holds keys i + 1024 m, m < kPer (coalesced loads), rows of
// at most kPer x 1024 keys, the threshold by topk_threshold (topk_row.cuh). Placement in key
// order: per (m, warp) a ballot counts the warp's kept keys, one block scan over the kPer x 32
// counts (m-major: key order) gives each its base, the lanes below a key in its ballot its offset.
// When every key equal to the threshold is kept (no tie straddles the k-th place: the usual case),
// kept = above or equal and the tie ranks are skipped.
template <int kPer>
__global__ void __launch_bounds__(kRegTopkThreads, 1)
    topk_regs_kernel(const float* scores, int64_t ld, const int32_t* row_begin,
                     const int32_t* key_row, int64_t kslots, int32_t* idx, int32_t* len) {
    static_assert(kPer * 32 <= kRegTopkThreads && kPer <= 32, "one scan entry per (m, warp)");
    using Scan = cub::BlockScan<int, kRegTopkThreads>;
    __shared__ TopkSelectShared<kRegTopkThreads> sm;
    const int64_t t = blockIdx.x;
    const TopkRow r = topk_row(scores, ld, row_begin, key_row, kslots, idx, t);
    if (topk_short_row(r, kslots, len, t)) return;
    const auto [begin, n, row, out] = r;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t below = (1u << lane) - 1u;  // lanes before this one in a ballot
    // This thread's keys: m < held (n <= kPer x 1024, so held <= kPer).
    const int held = n > tid ? int((n - tid + kRegTopkThreads - 1) / kRegTopkThreads) : 0;
    uint32_t u[kPer];
    const float* mine = row + tid;
#pragma unroll
    for (int m = 0; m < kPer; ++m) u[m] = m < held ? order_key(mine[m * kRegTopkThreads]) : 0u;
    const TopkThreshold th = topk_threshold(sm, kslots, [&](auto f) {
#pragma unroll
        for (int m = 0; m < kPer; ++m)
            if (m < held) f(u[m]);
    });
    const uint32_t thr = th.thr;
    const int need = th.need;  // how many keys equal to thr are kept (the smallest indices)
    int* hist = sm.hist;       // reused for the placement's per-(m, warp) bases
    // Key-order bases of each (m, warp)'s flagged keys, in hist[m * 32 + warp].
    auto bases = [&](auto flag) {
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, flag(m));
            if (lane == 0) hist[m * 32 + warp] = __popc(b);
        }
        __syncthreads();
        const int c = tid < kPer * 32 ? hist[tid] : 0;
        int base;
        Scan(sm.scan).ExclusiveSum(c, base);
        if (tid < kPer * 32) hist[tid] = base;
        __syncthreads();
    };
    uint32_t keep = 0;  // bit m: key i + 1024 m is kept
    if (need == th.equal) {
        // Every key equal to the threshold is kept.
#pragma unroll
        for (int m = 0; m < kPer; ++m)
            if (m < held && u[m] >= thr) keep |= 1u << m;
    } else {
        auto is_eq = [&](int m) { return m < held && u[m] == thr; };
        bases(is_eq);
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
            const uint32_t b = __ballot_sync(0xffffffffu, is_eq(m));
            const int rank = hist[m * 32 + warp] + __popc(b & below);
            if (m < held && (u[m] > thr || (u[m] == thr && rank < need))) keep |= 1u << m;
        }
        __syncthreads();  // every rank read before the second scan overwrites hist
    }
    auto kept = [&](int m) { return (keep >> m) & 1u; };
    bases(kept);
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
        const uint32_t b = __ballot_sync(0xffffffffu, kept(m));
        if (kept(m))
            out[hist[m * 32 + warp] + __popc(b & below)] =
                int32_t(begin + int64_t(m) * kRegTopkThreads + tid);
    }
    if (tid == 0) len[t] = int32_t(kslots);
}

// SPARSETRON_INDEXER=gemm keeps the cuBLASLt / simple forms on sm_90 (measuring them against
// the fused kernel in one process).
bool indexer_forced_gemm() {
    static const bool forced = [] {
        const char* e = std::getenv("SPARSETRON_INDEXER");
        return e && std::string(e) == "gemm";
    }();
    return forced;
}

// SPARSETRON_TOPK=stream: the streaming top-k (topk_stream.cu; opt-in until it has run on the GPU
// machine).
bool topk_stream_chosen() {
    static const bool chosen = [] {
        const char* e = std::getenv("SPARSETRON_TOPK");
        return e && std::string(e) == "stream";
    }();
    return chosen;
}

}  // namespace

int64_t indexer_scores_workspace_bytes(int64_t tokens, int64_t heads) {
    return dots_chunk_tokens(tokens, heads, kDotsChunkElems) * heads * dots_ld(tokens) *
           int64_t(sizeof(float));
}

void indexer_scores_gemm(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                         const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                         float* scores, void* workspace, int64_t workspace_bytes) {
    if (tokens == 0) return;
    float* dots = static_cast<float*>(workspace);
    const int64_t elems = workspace_bytes / int64_t(sizeof(float));
    ST_CHECK(elems >= heads * dots_ld(tokens), "indexer_scores: a workspace of ", workspace_bytes,
             " bytes holds no query row");
    const int64_t cq = dots_chunk_tokens(tokens, heads, elems);
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), ldd = dots_ld(t1);
        gemm(ctx, false, true, (t1 - t0) * heads, t1, dim, 1.f, q + t0 * heads * dim, dim, k, dim,
             0.f, dots, ldd, DType::BF16, DType::F32);
        dim3 grid(blocks_for(t1, 256), unsigned(t1 - t0));
        indexer_weighted_relu_kernel<<<grid, 256, 0, stream_of(ctx)>>>(dots, ldd, w, row_begin, t0,
                                                                       tokens, heads, scores);
        ST_CUDA_LAUNCH_CHECK();
    }
}

void indexer_scores(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                    const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                    float* scores, void* workspace, int64_t workspace_bytes, const int32_t* key_row,
                    int64_t keys) {
    if (tokens == 0) return;
    ST_CHECK(!key_row || !workspace, "indexer_scores: the GEMM form takes query row = key row");
    if (!key_row) keys = tokens;
    // The fused wgmma kernel where the shape and device allow it (the workspace then goes unused;
    // docs/perf/2026-11-30-indexer-scores-wgmma.md).
    if (indexer_scores_wgmma_supported(heads, dim) && !indexer_forced_gemm()) {
        indexer_scores_wgmma(ctx, q, k, w, row_begin, tokens, heads, dim, scores, key_row, keys);
        return;
    }
    if (workspace) {
        indexer_scores_gemm(ctx, q, k, w, row_begin, tokens, heads, dim, scores, workspace,
                            workspace_bytes);
        return;
    }
    const size_t smem = (heads * dim + heads) * sizeof(float) + kKeyTile * (dim + 2) * sizeof(bf);
    ST_CHECK(smem <= 200 * 1024, "indexer_scores: ", heads, " heads x ", dim,
             " dims do not fit in shared memory");
    ST_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(static_cast<unsigned>(tokens), blocks_for(keys, kKeyTile));
    indexer_scores_kernel<<<grid, kKeyTile, smem, stream_of(ctx)>>>(
        dev(q), dev(k), w, row_begin, key_row, keys, heads, dim, scores);
    ST_CUDA_LAUNCH_CHECK();
}

void topk_rows(const ExecContext& ctx, const float* scores, int64_t ld, const int32_t* row_begin,
               int64_t tokens, int64_t kslots, int32_t* idx, int32_t* len, const int32_t* key_row) {
    if (tokens == 0) return;
    if (topk_stream_chosen())
        return topk_rows_stream(ctx, scores, ld, row_begin, tokens, kslots, idx, len, key_row);
    // Rows are at most ld keys: the registers form's smallest run that holds them.
    const int64_t per = (ld + kRegTopkThreads - 1) / kRegTopkThreads;
    auto regs = [&](auto kernel) {
        kernel<<<tokens, kRegTopkThreads, 0, stream_of(ctx)>>>(scores, ld, row_begin, key_row,
                                                               kslots, idx, len);
    };
    if (per <= 4)
        regs(topk_regs_kernel<4>);
    else if (per <= 8)
        regs(topk_regs_kernel<8>);
    else if (per <= 16)
        regs(topk_regs_kernel<16>);
    else if (per <= 32)
        regs(topk_regs_kernel<32>);
    else
        topk_kernel<<<tokens, kTopkThreads, 0, stream_of(ctx)>>>(scores, ld, row_begin, key_row,
                                                                 kslots, idx, len);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
