// DSA lightning-indexer scores (the top-k: topk_stream.cu).
//
// On sm_90 with 16 / 32 / 64 heads of 64 or 128 dims, the fused wgmma kernel
// (indexer_wgmma.cu). Otherwise two forms. With a workspace: per chunk of query rows, the [rows x
// H, keys] dot products as one cuBLASLt GEMM (fp32 out) against keys 0..t1-1, then a kernel applies
// ReLU and the per-head weights column by column (coalesced). Without: one block per (query row,
// tile of kKeyTile keys), the row's H x d query and the tile's keys in shared memory, tiles outside
// [begin, t] exiting at once (the simple form; small shapes and the harness).
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/indexer/indexer_forms.h"
#include "sparsetron/ops/indexer/indexer_layout.h"
#include "sparsetron/ops/indexer/topk_row.cuh"

namespace sparsetron::cuda {
namespace {

constexpr int kKeyTile = 128;

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

using indexer_layout::dots_chunk_tokens;
using indexer_layout::dots_ld;

}  // namespace

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

void indexer_scores(const ExecContext& ctx, IndexerScoresForm form, const bf16* q, const bf16* k,
                    const float* w, const int32_t* row_begin, int64_t tokens, int64_t heads,
                    int64_t dim, float* scores, void* workspace, int64_t workspace_bytes,
                    const int32_t* key_row, int64_t keys) {
    if (tokens == 0) return;
    if (!key_row) keys = tokens;
    switch (form) {
        case IndexerScoresForm::Wgmma:
            indexer_scores_wgmma(ctx, q, k, w, row_begin, tokens, heads, dim, scores, key_row,
                                 keys);
            return;
        case IndexerScoresForm::Gemm:
            ST_CHECK(!key_row && workspace,
                     "indexer_scores: the Gemm form takes query row = key row and a workspace");
            indexer_scores_gemm(ctx, q, k, w, row_begin, tokens, heads, dim, scores, workspace,
                                workspace_bytes);
            return;
        case IndexerScoresForm::Rows:
            break;
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

}  // namespace sparsetron::cuda
