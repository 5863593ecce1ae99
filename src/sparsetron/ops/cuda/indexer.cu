// DSA lightning-indexer scores and the per-row top-k.
//
// Scores, two forms. With a workspace: per chunk of query rows, the [rows x H, keys] dot products
// as one cuBLASLt GEMM (fp32 out) against keys 0..t1-1, then a kernel applies ReLU and the
// per-head weights column by column (coalesced). Without: one block per (query row, tile of
// kKeyTile keys), the row's H x d query and the tile's keys in shared memory, tiles outside
// [begin, t] exiting at once (the simple form; small shapes and the harness).
// Top-k: one block per row, an exact radix select on the order-preserving integer image of the
// fp32 scores (4 passes of 8 bits), then one ordered pass that keeps every score above the
// threshold and the first `need` equal ones by index, so ties go to the smaller key index and the
// result is deterministic; block scans give each kept key its ascending output slot.
#include <cub/block/block_scan.cuh>

#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {
namespace {

constexpr int kKeyTile = 128;
constexpr int kTopkThreads = 512;

// Query row t is key row `row` (key_row[t] under context parallelism, else t); keys: key rows.
__device__ __forceinline__ int64_t query_key_row(const int32_t* key_row, int64_t t) {
    return key_row ? int64_t(key_row[t]) : t;
}

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

__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void topk_kernel(const float* scores, int64_t ld, const int32_t* row_begin,
                            const int32_t* key_row, int64_t kslots, int32_t* idx, int32_t* len) {
    using Scan = cub::BlockScan<int, kTopkThreads>;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int hist[256];
    __shared__ uint32_t prefix_s;
    __shared__ int remaining_s;
    const int64_t t = blockIdx.x;
    const int32_t begin = row_begin[t];
    const int64_t n = begin < 0 ? 0 : query_key_row(key_row, t) - begin + 1;
    const float* row = scores + t * ld + (begin < 0 ? 0 : begin);
    int32_t* out = idx + t * kslots;
    if (n <= kslots) {
        for (int64_t j = threadIdx.x; j < kslots; j += blockDim.x)
            out[j] = j < n ? int32_t(begin + j) : -1;
        if (threadIdx.x == 0) len[t] = int32_t(n);
        return;
    }
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

}  // namespace

int64_t indexer_scores_workspace_bytes(int64_t tokens, int64_t heads) {
    return dots_chunk_tokens(tokens, heads, kDotsChunkElems) * heads * dots_ld(tokens) *
           int64_t(sizeof(float));
}

void indexer_scores(const ExecContext& ctx, const bf16* q, const bf16* k, const float* w,
                    const int32_t* row_begin, int64_t tokens, int64_t heads, int64_t dim,
                    float* scores, void* workspace, int64_t workspace_bytes, const int32_t* key_row,
                    int64_t keys) {
    if (tokens == 0) return;
    ST_CHECK(!key_row || !workspace, "indexer_scores: the GEMM form takes query row = key row");
    if (!key_row) keys = tokens;
    if (workspace) {
        float* dots = static_cast<float*>(workspace);
        const int64_t elems = workspace_bytes / int64_t(sizeof(float));
        ST_CHECK(elems >= heads * dots_ld(tokens), "indexer_scores: a workspace of ",
                 workspace_bytes, " bytes holds no query row");
        const int64_t cq = dots_chunk_tokens(tokens, heads, elems);
        for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
            const int64_t t1 = std::min(tokens, t0 + cq), ldd = dots_ld(t1);
            gemm(ctx, false, true, (t1 - t0) * heads, t1, dim, 1.f, q + t0 * heads * dim, dim, k,
                 dim, 0.f, dots, ldd, DType::BF16, DType::F32);
            dim3 grid(blocks_for(t1, 256), unsigned(t1 - t0));
            indexer_weighted_relu_kernel<<<grid, 256, 0, stream_of(ctx)>>>(
                dots, ldd, w, row_begin, t0, tokens, heads, scores);
            ST_CUDA_LAUNCH_CHECK();
        }
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
    topk_kernel<<<tokens, kTopkThreads, 0, stream_of(ctx)>>>(scores, ld, row_begin, key_row, kslots,
                                                             idx, len);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
