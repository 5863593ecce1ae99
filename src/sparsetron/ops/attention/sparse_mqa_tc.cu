// Sparse MQA (absorbed MLA over the DSA top-k) on tensor cores. All query heads of a row share
// one latent key/value set, so a block takes one token and a group of kHb heads and computes the
// [kHb x n] score matrix as a GEMM: S = Q K^T (kHb x 576 by 576 x n), then O = P V (kHb x n by
// n x 512), over chunks of gathered keys staged in shared memory (bf16 WMMA, fp32 accumulation;
// accumulators live in shared memory, loaded and stored around each chunk's MMAs).
//
// Forward: two passes over the keys (row max and sum first, then O = Σ exp(s - lse) V), so the
// output never needs rescaling. Backward: per chunk S and P are recomputed from the saved lse,
// dP = dO V^T, dS = P (dP - D); dQ accumulates in shared memory; the chunk's dK'/dV' (dS^T Q +
// P^T dO) are summed over the block's heads before one fp32 atomic add per element (kHb times
// fewer atomics than a block per head).
#include <mma.h>

#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/attention_plan.h"
#include "sparsetron/ops/attention/sparse_mqa_tc_shape.h"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

using namespace nvcuda;
// The block shape (sparse_mqa_tc_shape.h: what the plan checks a shape against).
constexpr int kWarps = tc_shape::kWarps, kThreadsTc = kWarps * 32;
constexpr int kHb = tc_shape::kHeadsPerBlock;
constexpr int kKcF = tc_shape::kForwardKeys;
constexpr int kKcB = tc_shape::kBackwardKeys;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::row_major>;
using FragAc = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::row_major>;
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Gather kc latent rows (zero rows past n) into ks [kc][dqk] with 16-byte loads.
__device__ void gather_keys(const bf* kv, const int32_t* sel, int64_t c0, int64_t n, int64_t dqk,
                            int kc, bf* ks) {
    const int vec = int(dqk / 8);  // uint4 = 8 bf16
    for (int i = threadIdx.x; i < kc * vec; i += blockDim.x) {
        const int j = i / vec, c = i % vec;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (c0 + j < n) v = reinterpret_cast<const uint4*>(kv + int64_t(sel[c0 + j]) * dqk)[c];
        reinterpret_cast<uint4*>(ks + j * dqk)[c] = v;
    }
}

__device__ void copy_rows(const bf* src, bf* dst, int64_t elems) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < elems / 8; i += blockDim.x) d[i] = s[i];
}

// C (+)= A B for one 16x16 tile; A row-major [.. x K] at a (lda), B^T stored row-major (col_major
// view) at b (ldb): C[i][j] = Σ_k A[i][k] B[j][k].
__device__ void tile_abt(const bf* a, unsigned lda, const bf* b, unsigned ldb, int64_t K,
                         FragC& acc) {
    for (int k = 0; k < K; k += 16) {
        FragA fa;
        FragBc fb;
        wmma::load_matrix_sync(fa, a + k, lda);
        wmma::load_matrix_sync(fb, b + k, ldb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
}

__global__ void __launch_bounds__(kThreadsTc, 1)
    mqa_fwd_tc(const bf* q, const bf* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
               int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, float scale, bf* out,
               float* lse, float* prob_sum) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf* qs = reinterpret_cast<bf*>(smem_raw);               // [kHb][dqk]
    bf* ks = qs + kHb * dqk;                                // [kKcF][dqk]
    float* os = reinterpret_cast<float*>(ks + kKcF * dqk);  // [kHb][dv] output accumulator
    float* ss = os + kHb * dv;                              // [kHb][kKcF]
    bf* ps = reinterpret_cast<bf*>(ss + kHb * kKcF);        // [kHb][kKcF]
    __shared__ float row_m[kHb], row_l[kHb];
    const int64_t t = blockIdx.x, h0 = int64_t(blockIdx.y) * kHb;
    const int64_t n = len[t];
    const int32_t* sel = idx + t * kslots;
    const int warp = threadIdx.x >> 5;
    copy_rows(q + (t * heads + h0) * dqk, qs, kHb * dqk);
    for (int64_t i = threadIdx.x; i < kHb * dv; i += blockDim.x) os[i] = 0.f;
    if (threadIdx.x < kHb) row_m[threadIdx.x] = -INFINITY, row_l[threadIdx.x] = 0.f;
    __syncthreads();
    const int si = warp >> 2, sj = warp & 3;  // S tiles: 2 x 4
    for (int pass = 0; pass < 2; ++pass) {
        for (int64_t c0 = 0; c0 < n; c0 += kKcF) {
            const int cnt = int(min(int64_t(kKcF), n - c0));
            gather_keys(kv, sel, c0, n, dqk, kKcF, ks);
            __syncthreads();
            {
                FragC acc;
                wmma::fill_fragment(acc, 0.f);
                tile_abt(qs + si * 16 * dqk, unsigned(dqk), ks + sj * 16 * dqk, unsigned(dqk), dqk,
                         acc);
                wmma::store_matrix_sync(ss + si * 16 * kKcF + sj * 16, acc, kKcF,
                                        wmma::mem_row_major);
            }
            __syncthreads();
            if (pass == 0) {
                if (threadIdx.x < kHb) {
                    const int h = threadIdx.x;
                    float m = row_m[h], l = row_l[h];
                    for (int j = 0; j < cnt; ++j) {
                        const float s = ss[h * kKcF + j] * scale;
                        if (s > m)
                            l = l * __expf(m - s) + 1.f, m = s;
                        else
                            l += __expf(s - m);
                    }
                    row_m[h] = m, row_l[h] = l;
                }
            } else {
                for (int i = threadIdx.x; i < kHb * kKcF; i += blockDim.x) {
                    const int h = i / kKcF, j = i % kKcF;
                    ps[i] = __float2bfloat16(j < cnt ? __expf(ss[i] * scale - row_m[h]) : 0.f);
                }
                // The indexer loss's teacher: Σ over this block's heads, one atomic per key.
                if (prob_sum && threadIdx.x < cnt) {
                    const int j = threadIdx.x;
                    float sum = 0;
                    for (int h = 0; h < kHb; ++h)
                        sum += __expf(ss[h * kKcF + j] * scale - row_m[h]);
                    atomicAdd(prob_sum + t * kslots + c0 + j, sum);
                }
                __syncthreads();
                // O += P V: 2 x dv/16 tiles over the warps.
                const int ntn = int(dv / 16);
                for (int tile = warp; tile < 2 * ntn; tile += kWarps) {
                    const int oi = tile / ntn, on = tile % ntn;
                    FragC acc;
                    float* o = os + oi * 16 * dv + on * 16;
                    wmma::load_matrix_sync(acc, o, unsigned(dv), wmma::mem_row_major);
                    for (int k = 0; k < kKcF; k += 16) {
                        FragA fa;
                        FragB fb;
                        wmma::load_matrix_sync(fa, ps + oi * 16 * kKcF + k, kKcF);
                        wmma::load_matrix_sync(fb, ks + k * dqk + on * 16, unsigned(dqk));
                        wmma::mma_sync(acc, fa, fb, acc);
                    }
                    wmma::store_matrix_sync(o, acc, unsigned(dv), wmma::mem_row_major);
                }
            }
            __syncthreads();
        }
        if (pass == 0) {
            if (threadIdx.x < kHb) {
                const int h = threadIdx.x;
                const float L = n ? row_m[h] + logf(row_l[h]) : 0.f;
                lse[(h0 + h) * tokens + t] = L;
                row_m[h] = L;  // pass 2 reads the final lse here
            }
            __syncthreads();
        }
    }
    for (int64_t i = threadIdx.x; i < kHb * dv; i += blockDim.x)
        out[(t * heads + h0) * dv + i] = __float2bfloat16(os[i]);
}

__global__ void __launch_bounds__(kThreadsTc, 1)
    mqa_bwd_tc(const bf* q, const bf* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
               int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, float scale, const bf* out,
               const float* lse, const bf* dout, bf* dq, float* dkv) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf* qs = reinterpret_cast<bf*>(smem_raw);                   // [kHb][dqk]
    bf* dos = qs + kHb * dqk;                                   // [kHb][dv]
    bf* ks = dos + kHb * dv;                                    // [kKcB][dqk]
    float* dqs = reinterpret_cast<float*>(ks + kKcB * dqk);     // [kHb][dqk] dQ accumulator
    float* ss = dqs + kHb * dqk;                                // [kHb][kKcB]
    float* sp = ss + kHb * kKcB;                                // [kHb][kKcB]
    bf* pb = reinterpret_cast<bf*>(sp + kHb * kKcB);            // [kHb][kKcB]
    bf* dsb = pb + kHb * kKcB;                                  // [kHb][kKcB]
    float* stage = reinterpret_cast<float*>(dsb + kHb * kKcB);  // per warp 16x16
    __shared__ float row_lse[kHb], row_d[kHb];
    __shared__ int32_t rows[kKcB];
    const int64_t t = blockIdx.x, h0 = int64_t(blockIdx.y) * kHb;
    const int64_t n = len[t];
    const int32_t* sel = idx + t * kslots;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    copy_rows(q + (t * heads + h0) * dqk, qs, kHb * dqk);
    copy_rows(dout + (t * heads + h0) * dv, dos, kHb * dv);
    for (int64_t i = threadIdx.x; i < kHb * dqk; i += blockDim.x) dqs[i] = 0.f;
    for (int h = warp; h < kHb; h += kWarps) {
        const int64_t r = (t * heads + h0 + h) * dv;
        float s = 0;
        for (int64_t d = lane; d < dv; d += 32) s += ld(dout + r + d) * ld(out + r + d);
        s = warp_sum(s);
        if (lane == 0) row_d[h] = s, row_lse[h] = lse[(h0 + h) * tokens + t];
    }
    __syncthreads();
    const int ntq = int(dqk / 16);
    for (int64_t c0 = 0; c0 < n; c0 += kKcB) {
        const int cnt = int(min(int64_t(kKcB), n - c0));
        gather_keys(kv, sel, c0, n, dqk, kKcB, ks);
        if (threadIdx.x < kKcB) rows[threadIdx.x] = threadIdx.x < cnt ? sel[c0 + threadIdx.x] : -1;
        __syncthreads();
        {
            // Warps 0-3: S = Q K^T tiles; warps 4-7: dP = dO V^T tiles (2 x 2 each).
            const int w = warp & 3, ti = w >> 1, tj = w & 1;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            if (warp < 4) {
                tile_abt(qs + ti * 16 * dqk, unsigned(dqk), ks + tj * 16 * dqk, unsigned(dqk), dqk,
                         acc);
                wmma::store_matrix_sync(ss + ti * 16 * kKcB + tj * 16, acc, kKcB,
                                        wmma::mem_row_major);
            } else {
                tile_abt(dos + ti * 16 * dv, unsigned(dv), ks + tj * 16 * dqk, unsigned(dqk), dv,
                         acc);
                wmma::store_matrix_sync(sp + ti * 16 * kKcB + tj * 16, acc, kKcB,
                                        wmma::mem_row_major);
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kHb * kKcB; i += blockDim.x) {
            const int h = i / kKcB, j = i % kKcB;
            float p = 0.f, ds = 0.f;
            if (j < cnt) {
                p = __expf(ss[i] * scale - row_lse[h]);
                ds = p * (sp[i] - row_d[h]) * scale;
            }
            pb[i] = __float2bfloat16(p);
            dsb[i] = __float2bfloat16(ds);
        }
        __syncthreads();
        // dQ += dS K: 2 x dqk/16 tiles.
        for (int tile = warp; tile < 2 * ntq; tile += kWarps) {
            const int qi = tile / ntq, qn = tile % ntq;
            FragC acc;
            float* d = dqs + qi * 16 * dqk + qn * 16;
            wmma::load_matrix_sync(acc, d, unsigned(dqk), wmma::mem_row_major);
            for (int k = 0; k < kKcB; k += 16) {
                FragA fa;
                FragB fb;
                wmma::load_matrix_sync(fa, dsb + qi * 16 * kKcB + k, kKcB);
                wmma::load_matrix_sync(fb, ks + k * dqk + qn * 16, unsigned(dqk));
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(d, acc, unsigned(dqk), wmma::mem_row_major);
        }
        // dK'_j (+ dV'_j in the first dv columns) = dS^T Q + P^T dO over the block's heads.
        float* st = stage + warp * 256;
        for (int tile = warp; tile < 2 * ntq; tile += kWarps) {
            const int kj = tile / ntq, kn = tile % ntq;
            FragC acc;
            wmma::fill_fragment(acc, 0.f);
            for (int h = 0; h < kHb; h += 16) {
                FragAc fa;
                FragB fb;
                wmma::load_matrix_sync(fa, dsb + h * kKcB + kj * 16, kKcB);
                wmma::load_matrix_sync(fb, qs + h * dqk + kn * 16, unsigned(dqk));
                wmma::mma_sync(acc, fa, fb, acc);
                if (kn * 16 < dv) {
                    wmma::load_matrix_sync(fa, pb + h * kKcB + kj * 16, kKcB);
                    wmma::load_matrix_sync(fb, dos + h * dv + kn * 16, unsigned(dv));
                    wmma::mma_sync(acc, fa, fb, acc);
                }
            }
            wmma::store_matrix_sync(st, acc, 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int j = kj * 16 + e / 16, d = kn * 16 + e % 16;
                if (rows[j] >= 0) atomicAdd(dkv + int64_t(rows[j]) * dqk + d, st[e]);
            }
            __syncwarp();
        }
        __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < kHb * dqk; i += blockDim.x)
        dq[(t * heads + h0) * dqk + i] = __float2bfloat16(dqs[i]);
}

size_t fwd_smem(int64_t dqk, int64_t dv) {
    return tc_shape::forward_smem(dqk, dv);
}
size_t bwd_smem(int64_t dqk, int64_t dv) {
    return tc_shape::backward_smem(dqk, dv);
}

}  // namespace

void sparse_mqa_forward_tc(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                           float* prob_sum) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    const size_t smem = fwd_smem(dqk, dv);
    if (prob_sum)
        ST_CUDA_CHECK(
            cudaMemsetAsync(prob_sum, 0, tokens * kslots * sizeof(float), stream_of(ctx)));
    ST_CUDA_CHECK(
        cudaFuncSetAttribute(mqa_fwd_tc, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    mqa_fwd_tc<<<dim3(unsigned(tokens), unsigned(heads / kHb)), kThreadsTc, smem, stream_of(ctx)>>>(
        dev(q), dev(kv), idx, len, kslots, tokens, heads, dqk, dv, scale, dev(out), lse, prob_sum);
    ST_CUDA_LAUNCH_CHECK();
}

void sparse_mqa_backward_tc(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                            const float* lse, const bf16* dout, bf16* dq, float* dkv) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    const size_t smem = bwd_smem(dqk, dv);
    ST_CUDA_CHECK(
        cudaFuncSetAttribute(mqa_bwd_tc, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (!p.dkv_accumulate)
        ST_CUDA_CHECK(cudaMemsetAsync(dkv, 0, tokens * dqk * sizeof(float), stream_of(ctx)));
    mqa_bwd_tc<<<dim3(unsigned(tokens), unsigned(heads / kHb)), kThreadsTc, smem, stream_of(ctx)>>>(
        dev(q), dev(kv), idx, len, kslots, tokens, heads, dqk, dv, scale, dev(out), lse, dev(dout),
        dev(dq), dkv);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsetron::cuda
