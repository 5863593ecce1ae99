// The DSA indexer's KL loss against the attention's head-summed distribution and its gradient
// back through the indexer scores (SPEC §3.1). One block per query row; the support is the row's
// top-k (sparse loss) or its causal document keys (dense loss).
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/indexer/indexer_layout.h"

namespace sparsetron::cuda {
namespace {

constexpr int kThreads = 256;

struct Support {
    bool sparse;
    const int32_t *idx, *len, *row_begin;
    int64_t kslots;
    const int32_t* key_row;  // context parallelism: query row t is key row key_row[t]
    int64_t keys;            // key rows (the scores' row length)
    int64_t row0;            // a block of query rows (no CP): row t is micro-batch row row0 + t
    __device__ int64_t count(int64_t t) const {
        if (sparse) return len[t];
        return row_begin[t] < 0 ? 0 : (key_row ? int64_t(key_row[t]) : row0 + t) - row_begin[t] + 1;
    }
    __device__ int64_t key(int64_t t, int64_t j) const {
        return sparse ? idx[t * kslots + j] : row_begin[t] + j;
    }
};

__global__ void indexer_kl_kernel(Support sup, const bf* qabs, const bf* kabs, const float* lse,
                                  int64_t heads, int64_t dl, float scale, const float* scores,
                                  int64_t lse_ld, float* kl, float* dscore,
                                  const float* teacher_sum) {
    extern __shared__ float smem[];
    const int64_t t = blockIdx.x, n = sup.count(t);
    if (n == 0) {
        if (threadIdx.x == 0) kl[t] = 0.f;
        return;
    }
    float* qs = smem;    // [dl]
    float* z = qs + dl;  // [n]
    float* p = z + n;    // [n]
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        p[j] = teacher_sum ? teacher_sum[t * sup.kslots + j] : 0.f;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int64_t h = 0; !teacher_sum && h < heads; ++h) {
        __syncthreads();
        for (int64_t i = threadIdx.x; i < dl; i += blockDim.x)
            qs[i] = ld(qabs + (t * heads + h) * dl + i);
        __syncthreads();
        for (int64_t j = warp; j < n; j += nwarps) {
            const bf* k = kabs + sup.key(t, j) * dl;
            float d = 0;
            for (int64_t i = lane; i < dl; i += 32) d += qs[i] * ld(k + i);
            d = warp_sum(d);
            if (lane == 0) z[j] = d * scale;
        }
        __syncthreads();
        float l;
        if (sup.sparse) {
            l = lse[h * lse_ld + t];
        } else {
            float mx = -INFINITY;
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, z[j]);
            mx = block_max(mx);
            float s = 0;
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += __expf(z[j] - mx);
            l = mx + logf(block_sum(s));
        }
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) p[j] += __expf(z[j] - l);
    }
    __syncthreads();
    float ps = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) ps += p[j];
    ps = fmaxf(block_sum(ps), 1e-10f);
    const float* row = scores + t * sup.keys;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, row[sup.key(t, j)]);
    mx = block_max(mx);
    float s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += __expf(row[sup.key(t, j)] - mx);
    const float lse_i = mx + logf(block_sum(s));
    float k = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const int64_t key = sup.key(t, j);
        const float pj = p[j] / ps, logq = row[key] - lse_i;
        if (pj > 0) k += pj * (logf(pj) - logq);
        dscore[t * sup.keys + key] = __expf(logq) - pj;
    }
    k = block_sum(k);
    if (threadIdx.x == 0) kl[t] = k;
}

__global__ void indexer_scores_bwd_kernel(Support sup, const bf* q, const bf* k, const float* w,
                                          const float* dscore, float grad_scale_host,
                                          const float* grad_scale_dev, int64_t tokens,
                                          int64_t heads, int64_t dim, float* dw, bf* dq,
                                          float* dk) {
    extern __shared__ float smem[];
    const float grad_scale = grad_scale_host * (grad_scale_dev ? *grad_scale_dev : 1.f);
    const int64_t t = blockIdx.x, n = sup.count(t);
    float* qs = smem;                // [heads * dim]
    float* dqs = qs + heads * dim;   // [heads * dim]
    float* dws = dqs + heads * dim;  // [heads]
    for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x) {
        qs[i] = ld(q + t * heads * dim + i);
        dqs[i] = 0.f;
    }
    for (int64_t j = threadIdx.x; j < heads; j += blockDim.x) dws[j] = 0.f;
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int64_t j = warp; j < n; j += nwarps) {
        const int64_t s = sup.key(t, j);
        const float g = grad_scale * dscore[t * sup.keys + s];
        const bf* ks = k + s * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float* qh = qs + h * dim;
            float d = 0;
            for (int64_t i = lane; i < dim; i += 32) d += qh[i] * ld(ks + i);
            d = warp_sum(d);
            if (d <= 0.f) continue;  // ReLU
            if (lane == 0) atomicAdd(dws + h, g * d);
            const float a = g * w[t * heads + h];
            for (int64_t i = lane; i < dim; i += 32) {
                atomicAdd(dqs + h * dim + i, a * ld(ks + i));
                atomicAdd(dk + s * dim + i, a * qh[i]);
            }
        }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x)
        dq[t * heads * dim + i] = __float2bfloat16(dqs[i]);
    for (int64_t j = threadIdx.x; j < heads; j += blockDim.x) dw[t * heads + j] = dws[j];
}

// The GEMM form's middle step for one chunk: block (token of the chunk, group of kWarps heads),
// a warp per head row of the chunk's logits D [rows, ld] (keys 0 .. ld-1, row (t - t0) H + h).
// On the support, g = grad_scale dscore[t, s]: dw[t, h] = Σ g relu(D) (a warp sum: deterministic)
// and dD = g w[t, h] 1[D > 0]; dD is written as a full bf16 row, 0 off the support.
constexpr int kWarps = kThreads / 32;
__global__ void indexer_dlogits_kernel(Support sup, const float* dots, bf* dd, int64_t ld,
                                       const float* dscore, float grad_scale_host,
                                       const float* grad_scale_dev, const float* w, int64_t t0,
                                       int64_t heads, float* dw) {
    extern __shared__ uint32_t mask[];
    const float grad_scale = grad_scale_host * (grad_scale_dev ? *grad_scale_dev : 1.f);
    const int64_t tl = blockIdx.x, t = t0 + tl, n = sup.count(t);
    const int64_t words = (ld + 31) / 32;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) mask[i] = 0u;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        const int64_t s = sup.key(t, j);
        atomicOr(&mask[s >> 5], 1u << (s & 31));
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t h = int64_t(blockIdx.y) * kWarps + warp;
    if (h >= heads) return;
    const float* drow = dots + (tl * heads + h) * ld;
    const float* grow = dscore + t * sup.keys;
    const float wh = w[t * heads + h];
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(dd + (tl * heads + h) * ld);
    float acc = 0.f;
    for (int64_t v = lane; v < ld / 2; v += 32) {
        const uint32_t bits = (mask[v >> 4] >> ((v & 15) * 2)) & 3u;
        float r0 = 0.f, r1 = 0.f;
        if (bits) {
            const float2 d = reinterpret_cast<const float2*>(drow)[v];
            if ((bits & 1u) && d.x > 0.f) {
                const float g = grad_scale * grow[2 * v];
                acc += g * d.x;
                r0 = g * wh;
            }
            if ((bits & 2u) && d.y > 0.f) {
                const float g = grad_scale * grow[2 * v + 1];
                acc += g * d.y;
                r1 = g * wh;
            }
        }
        out[v] = __floats2bfloat162_rn(r0, r1);
    }
    acc = warp_sum(acc);
    if (lane == 0) dw[t * heads + h] = acc;
}

__global__ void kl_sum_kernel(const float* kl, const int32_t* len, int64_t tokens, double* out) {
    __shared__ double part[256];
    __shared__ long long cnt[256];
    double s = 0;
    long long c = 0;
    for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x)
        if (len[t] > 0) s += kl[t], ++c;
    part[threadIdx.x] = s, cnt[threadIdx.x] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0;
        long long rows = 0;
        for (int i = 0; i < int(blockDim.x); ++i) total += part[i], rows += cnt[i];
        out[0] += total, out[1] += double(rows);
    }
}

// prob_sum[t, j] = Σ_h exp(scale q'_h · k'_{idx[t, j]} - lse_h): the reference path's teacher.
__global__ void head_prob_sum_kernel(const bf* q, const bf* kv, const int32_t* idx,
                                     const int32_t* len, int64_t kslots, int64_t tokens,
                                     int64_t heads, int64_t dl, float scale, const float* lse,
                                     float* prob_sum) {
    const int64_t t = blockIdx.x, n = len[t];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int64_t j = warp; j < kslots; j += nwarps) {
        float s = 0;
        if (j < n) {
            const bf* k = kv + int64_t(idx[t * kslots + j]) * dl;
            for (int64_t h = 0; h < heads; ++h) {
                const bf* qh = q + (t * heads + h) * dl;
                float d = 0;
                for (int64_t i = lane; i < dl; i += 32) d += ld(qh + i) * ld(k + i);
                d = warp_sum(d);
                s += __expf(d * scale - lse[h * tokens + t]);
            }
        }
        if (lane == 0) prob_sum[t * kslots + j] = s;
    }
}

}  // namespace

void head_prob_sum(const ExecContext& ctx, const bf16* q, const bf16* kv, const int32_t* idx,
                   const int32_t* len, int64_t kslots, int64_t tokens, int64_t heads, int64_t dl,
                   float scale, const float* lse, float* prob_sum) {
    if (tokens == 0) return;
    head_prob_sum_kernel<<<tokens, kThreads, 0, stream_of(ctx)>>>(
        dev(q), dev(kv), idx, len, kslots, tokens, heads, dl, scale, lse, prob_sum);
    ST_CUDA_LAUNCH_CHECK();
}

void indexer_kl(const ExecContext& ctx, const IndexerKl& p, float* kl, float* dscore) {
    const bool sparse = p.sparse;
    const bf16 *qabs = p.qabs, *kabs = p.kabs;
    const float *lse = p.lse, *scores = p.scores, *teacher_sum = p.teacher_sum;
    const int64_t heads = p.heads, dl = p.dl, kslots = p.kslots, tokens = p.tokens;
    const float scale = p.scale;
    const int32_t *idx = p.idx, *len = p.len, *row_begin = p.row_begin, *key_row = p.key_row;
    int64_t keys = p.keys;
    if (tokens == 0) return;
    ST_ASSERT(!teacher_sum || sparse, "indexer_kl: a teacher sum is the sparse loss's");
    ST_ASSERT(!key_row || p.first_row == 0, "indexer_kl: a block of query rows is not under CP");
    if (!key_row) keys = p.first_row + tokens;
    const int64_t lse_ld = p.lse_ld > 0 ? p.lse_ld : tokens;
    const int64_t nmax = sparse ? kslots : keys;
    const size_t smem = (dl + 2 * nmax) * sizeof(float);
    ST_CHECK(smem <= 200 * 1024, "indexer_kl: a support of ", nmax, " keys does not fit");
    ST_CUDA_CHECK(cudaFuncSetAttribute(indexer_kl_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    indexer_kl_kernel<<<tokens, kThreads, smem, stream_of(ctx)>>>(
        Support{sparse, idx, len, row_begin, kslots, key_row, keys, p.first_row}, dev(qabs),
        dev(kabs), lse, heads, dl, scale, scores, lse_ld, kl, dscore, teacher_sum);
    ST_CUDA_LAUNCH_CHECK();
}

using indexer_layout::dlogits_ld;

void indexer_scores_backward(const ExecContext& ctx, const IndexerScoresBackward& p, float* dw,
                             bf16* dq, float* dk) {
    const bool sparse = p.sparse;
    const bf16 *q = p.q, *k = p.k;
    const float *w = p.w, *dscore = p.dscore, *grad_scale_dev = p.grad_scale_dev;
    const float grad_scale = p.grad_scale;
    const int32_t *idx = p.idx, *len = p.len, *row_begin = p.row_begin, *key_row = p.key_row;
    const int64_t kslots = p.kslots, tokens = p.tokens, heads = p.heads, dim = p.dim;
    int64_t keys = p.keys;
    void* workspace = p.workspace;
    const int64_t workspace_bytes = p.workspace_bytes;
    if (tokens == 0) return;
    const int64_t row0 = p.first_row;
    ST_ASSERT(!key_row || row0 == 0,
              "indexer_scores_backward: a block of query rows is not under CP");
    if (!key_row) keys = row0 + tokens;
    if (!p.add_dk) zero(ctx, dk, keys * dim * sizeof(float));
    const int64_t per_token = indexer_scores_backward_bytes_per_token(keys, heads);
    if (p.form == IndexerBackwardForm::Gemm) {
        ST_CHECK(workspace && !key_row && workspace_bytes >= per_token,
                 "indexer_scores_backward: the Gemm form takes query row = key row and a "
                 "workspace of a chunk's rows");
        // Chunks of cq query tokens against keys 0 .. row0 + t1 - 1 (every support key precedes
        // its query): D = Q_c K^T (fp32), dD (bf16) and dw, dq_c = dD K, dk += dD^T Q_c.
        const int64_t cq = std::min(tokens, workspace_bytes / per_token);
        const auto BF = DType::BF16, F32 = DType::F32;
        const Support sup{sparse, idx, len, row_begin, kslots, nullptr, keys, row0};
        for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
            const int64_t t1 = std::min(tokens, t0 + cq), rows = (t1 - t0) * heads;
            const int64_t kc = row0 + t1, ld = dlogits_ld(kc);
            float* dots = static_cast<float*>(workspace);
            bf* dd = reinterpret_cast<bf*>(dots + rows * ld);
            const bf16* qc = q + t0 * heads * dim;
            gemm(ctx, false, true, rows, kc, dim, 1.f, qc, dim, k, dim, 0.f, dots, ld, BF, F32);
            const size_t smem = size_t((ld + 31) / 32) * sizeof(uint32_t);
            indexer_dlogits_kernel<<<dim3(unsigned(t1 - t0),
                                          unsigned((heads + kWarps - 1) / kWarps)),
                                     kThreads, smem, stream_of(ctx)>>>(
                sup, dots, dd, ld, dscore, grad_scale, grad_scale_dev, w, t0, heads, dw);
            ST_CUDA_LAUNCH_CHECK();
            gemm(ctx, false, false, rows, dim, kc, 1.f, dd, ld, k, dim, 0.f, dq + t0 * heads * dim,
                 dim, BF, BF);
            gemm(ctx, true, false, kc, dim, rows, 1.f, dd, ld, qc, dim, 1.f, dk, dim, BF, F32);
        }
        return;
    }
    const size_t smem = (2 * heads * dim + heads) * sizeof(float);
    ST_CHECK(smem <= 200 * 1024, "indexer_scores_backward: ", heads, "x", dim, " does not fit");
    ST_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_bwd_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    indexer_scores_bwd_kernel<<<tokens, kThreads, smem, stream_of(ctx)>>>(
        Support{sparse, idx, len, row_begin, kslots, key_row, keys, row0}, dev(q), dev(k), w,
        dscore, grad_scale, grad_scale_dev, tokens, heads, dim, dw, dev(dq), dk);
    ST_CUDA_LAUNCH_CHECK();
}

void indexer_kl_sum(const ExecContext& ctx, const float* kl, const int32_t* len, int64_t tokens,
                    double* out) {
    kl_sum_kernel<<<1, 256, 0, stream_of(ctx)>>>(kl, len, tokens, out);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
