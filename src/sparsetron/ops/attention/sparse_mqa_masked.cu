// Sparse MQA as masked dense GEMMs: when a row's top-k is a large share of its causal context
// (short documents, or contexts up to a few times k), it is cheaper to score a chunk of query rows
// against every earlier key with cuBLASLt and apply the top-k as a mask inside the softmax than to
// gather keys per row. The function is the one of sparse_mqa_forward/backward: unselected keys get
// probability exactly 0, so only the order of summation differs.
//
// Per chunk of cq tokens (R = cq * H query rows, contiguous in q's [T, H, dqk] layout) against keys
// 0..t1-1 (t1 = the chunk's end; causality bounds every selected key; with context parallelism
// query row t is not key row t, and every chunk scores all key_rows keys):
//   forward:  S = scale Q K^T (fp32) -> P = mask(exp(S - lse)) (bf16, lse computed) -> O = P V
//   backward: S again; P from the saved lse; dP = dO V^T; dV += P^T dO;
//             dS = scale P (dP - D), D = rowsum(dO o O), into P's buffer; dQ = dS K; dK += dS^T Q
// Workspace per chunk: S and dP fp32, P bf16, each [R, ld]. dkv accumulates through the GEMMs'
// beta = 1 in a fixed chunk order: deterministic, no atomics.
// With saved probabilities (sparse_mqa_saved_probs_elems; no context parallelism) the forward
// writes every chunk's P into the caller's buffer, chunk after chunk, and the backward skips the
// second S GEMM and the P kernel: dP = dO V^T; dV += P^T dO; dS = scale P (dP - D) from the saved
// bf16 P, into the workspace's P; dQ, dK as above. In the expanded form on sm_90 (v 256) dP and
// dS are one kernel with dP in registers (masked_dscores_wgmma.cu).
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/attention/attention_plan.h"
#include "sparsetron/ops/attention/masked_layout.h"
#include "sparsetron/ops/common/device_util.cuh"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron::cuda {

namespace {

constexpr int kThreads = 256;
using masked::kMaxProbsSmem;
using masked::leading_dim;
using masked::probs_smem_bytes;

// Query tokens per chunk that `bytes` of workspace hold.
int64_t chunk_tokens(int64_t tokens, int64_t heads, int64_t bytes) {
    const int64_t cq = masked::chunk_rows(tokens, heads, bytes);
    ST_CHECK(cq >= 1, "sparse MQA (masked): a workspace of ", bytes, " bytes holds no chunk");
    return std::min(cq, tokens);
}

struct Workspace {
    int64_t chunk;  // query tokens per chunk
    float *s, *dp;
    bf* p;
};
// `keys`: the widest key range of a chunk (tokens, or the key rows under context parallelism).
Workspace carve(void* ws, int64_t bytes, int64_t tokens, int64_t keys, int64_t heads) {
    const int64_t cq = std::min(tokens, chunk_tokens(keys, heads, bytes));
    const int64_t elems = cq * heads * leading_dim(keys);
    float* s = static_cast<float*>(ws);
    return Workspace{cq, s, s + elems, reinterpret_cast<bf*>(s + 2 * elems)};
}

constexpr int kWarps = kThreads / 32;

// The token's selected keys as a bitmask over 0..ld-1 in shared memory (ld / 32 words, rounded
// up): the kernels below then stream whole S rows with coalesced 16-byte loads and test a bit per
// key, instead of gathering S at the selected keys (random 4-byte reads) and scattering into a
// zeroed P (docs/perf/log/).
__device__ void build_key_mask(uint32_t* mask, int64_t words, const int32_t* sel, int64_t n) {
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) mask[i] = 0u;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        atomicOr(&mask[sel[j] >> 5], 1u << (sel[j] & 31));
    __syncthreads();
}
// The four mask bits of keys 4v .. 4v+3 (a group never straddles a word).
__device__ __forceinline__ uint32_t mask_bits4(const uint32_t* mask, int64_t v) {
    return (mask[v >> 3] >> ((v & 7) * 4)) & 0xFu;
}

// One block per token of the chunk and group of heads_per_block heads (all heads when the
// head-summed probabilities are wanted, kWarps otherwise: more blocks). Per head row the whole
// block streams S: with lse_out (the forward) a first sweep takes an online max/sum over the
// selected scores (block-reduced) and writes the lse; otherwise lse_in is read. The second sweep
// (the row is still in L1/L2) writes the full P row: exp(s - lse) at selected keys, 0 elsewhere.
// prob_sum: the head-summed probabilities per selected slot; each thread owns fixed key columns
// of a shared-memory row, added in head order (deterministic, no atomics).
__global__ void masked_probs_kernel(const float* s, bf* p, int64_t lds, const int32_t* idx,
                                    const int32_t* len, int64_t kslots, int64_t t0, int64_t tokens,
                                    int64_t heads, int64_t heads_per_block, const float* lse_in,
                                    float* lse_out, float* prob_sum) {
    extern __shared__ uint32_t smem[];
    const int64_t words = (lds + 31) / 32;
    uint32_t* mask = smem;
    float* keysum = reinterpret_cast<float*>(smem + (words + 3) / 4 * 4);  // [lds] with prob_sum
    __shared__ float red_m[2][kWarps], red_l[2][kWarps];
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int64_t h0 = int64_t(blockIdx.y) * heads_per_block;
    const int64_t h1 = std::min(heads, h0 + heads_per_block);
    const int32_t* sel = idx + t * kslots;
    const int64_t n = len[t];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    build_key_mask(mask, words, sel, n);
    const int64_t vecs = lds / 4;
    if (prob_sum)
        for (int64_t k = threadIdx.x; k < lds; k += blockDim.x) keysum[k] = 0.f;
    for (int64_t h = h0; h < h1; ++h) {
        const float4* srow = reinterpret_cast<const float4*>(s + (tl * heads + h) * lds);
        float m;
        if (lse_out) {
            float mx = -INFINITY, l = 0.f;
            for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
                const uint32_t bits = mask_bits4(mask, v);
                if (!bits) continue;
                const float4 x = srow[v];
                if (bits & 1u) online_add(mx, l, x.x);
                if (bits & 2u) online_add(mx, l, x.y);
                if (bits & 4u) online_add(mx, l, x.z);
                if (bits & 8u) online_add(mx, l, x.w);
            }
            for (int o = 16; o > 0; o >>= 1)
                online_merge(mx, l, __shfl_xor_sync(0xffffffffu, mx, o),
                             __shfl_xor_sync(0xffffffffu, l, o));
            // Two buffers by head parity: the next head's writes cannot race this head's reads
            // (the __syncthreads of the head in between separates them).
            const int b = int(h & 1);
            if (lane == 0) {
                red_m[b][warp] = mx;
                red_l[b][warp] = l;
            }
            __syncthreads();
            mx = -INFINITY;
            l = 0.f;
            for (int w = 0; w < kWarps; ++w) online_merge(mx, l, red_m[b][w], red_l[b][w]);
            m = n > 0 ? mx + logf(l) : 0.f;
            if (threadIdx.x == 0) lse_out[h * tokens + t] = m;
        } else {
            m = lse_in[h * tokens + t];
        }
        uint2* prow = reinterpret_cast<uint2*>(p + (tl * heads + h) * lds);
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
            const uint32_t bits = mask_bits4(mask, v);
            float4 e = make_float4(0.f, 0.f, 0.f, 0.f);
            if (bits) {
                const float4 x = srow[v];
                e.x = (bits & 1u) ? __expf(x.x - m) : 0.f;
                e.y = (bits & 2u) ? __expf(x.y - m) : 0.f;
                e.z = (bits & 4u) ? __expf(x.z - m) : 0.f;
                e.w = (bits & 8u) ? __expf(x.w - m) : 0.f;
                if (prob_sum) {
                    keysum[4 * v] += e.x;
                    keysum[4 * v + 1] += e.y;
                    keysum[4 * v + 2] += e.z;
                    keysum[4 * v + 3] += e.w;
                }
            }
            const __nv_bfloat162 lo = __floats2bfloat162_rn(e.x, e.y);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(e.z, e.w);
            prow[v] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                 *reinterpret_cast<const uint32_t*>(&hi));
        }
    }
    if (prob_sum) {
        __syncthreads();
        for (int64_t j = threadIdx.x; j < kslots; j += blockDim.x)
            prob_sum[t * kslots + j] = j < n ? keysum[sel[j]] : 0.f;
    }
}

// The same probabilities without the head sums, a warp per head row: block (token, group of kWarps
// heads), warp w takes head h0 + w, so the row's max / sum reductions are warp shuffles and no
// block barrier separates one head from the next. Each sweep issues four 16-byte loads per lane
// before using them. (One block per head row with a block reduction per head measured slower,
// the short rows of a first chunk most: docs/perf/log/.)
__global__ void masked_probs_rows_kernel(const float* s, bf* p, int64_t lds, const int32_t* idx,
                                         const int32_t* len, int64_t kslots, int64_t t0,
                                         int64_t tokens, int64_t heads, const float* lse_in,
                                         float* lse_out) {
    extern __shared__ uint32_t mask[];
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t h = int64_t(blockIdx.y) * kWarps + warp;
    const int64_t n = len[t];
    build_key_mask(mask, (lds + 31) / 32, idx + t * kslots, n);
    if (h >= heads) return;
    const int64_t vecs = lds / 4;
    constexpr int kUnroll = 4;
    const float4* srow = reinterpret_cast<const float4*>(s + (tl * heads + h) * lds);
    float m;
    if (lse_out) {
        float mx = -INFINITY, l = 0.f;
        for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
            float4 x[kUnroll];
            uint32_t bits[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int64_t v = v0 + 32 * u;
                bits[u] = v < vecs ? mask_bits4(mask, v) : 0u;
                if (bits[u]) x[u] = srow[v];
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (!bits[u]) continue;
                if (bits[u] & 1u) online_add(mx, l, x[u].x);
                if (bits[u] & 2u) online_add(mx, l, x[u].y);
                if (bits[u] & 4u) online_add(mx, l, x[u].z);
                if (bits[u] & 8u) online_add(mx, l, x[u].w);
            }
        }
        for (int o = 16; o > 0; o >>= 1)
            online_merge(mx, l, __shfl_xor_sync(0xffffffffu, mx, o),
                         __shfl_xor_sync(0xffffffffu, l, o));
        m = n > 0 ? mx + logf(l) : 0.f;
        if (lane == 0) lse_out[h * tokens + t] = m;
    } else {
        m = lse_in[h * tokens + t];
    }
    uint2* prow = reinterpret_cast<uint2*>(p + (tl * heads + h) * lds);
    for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
        float4 x[kUnroll];
        uint32_t bits[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + 32 * u;
            bits[u] = v < vecs ? mask_bits4(mask, v) : 0u;
            if (bits[u]) x[u] = srow[v];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + 32 * u;
            if (v >= vecs) break;
            float4 e = make_float4(0.f, 0.f, 0.f, 0.f);
            if (bits[u] & 1u) e.x = __expf(x[u].x - m);
            if (bits[u] & 2u) e.y = __expf(x[u].y - m);
            if (bits[u] & 4u) e.z = __expf(x[u].z - m);
            if (bits[u] & 8u) e.w = __expf(x[u].w - m);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(e.x, e.y);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(e.z, e.w);
            prow[v] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                 *reinterpret_cast<const uint32_t*>(&hi));
        }
    }
}

// D = rowsum(dO o O) of one head row (elements row0 .. row0 + dv - 1), by one warp (every lane
// gets it): the softmax backward's per-row term. bf16 pairs; dv odd adds the last element.
__device__ __forceinline__ float head_row_dot(const bf* out, const bf* dout, int64_t row0,
                                              int64_t dv, int lane) {
    const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(out + row0);
    const __nv_bfloat162* g = reinterpret_cast<const __nv_bfloat162*>(dout + row0);
    float d = 0.f;
    for (int64_t i = lane; i < dv / 2; i += 32) {
        const float2 a = __bfloat1622float2(o[i]), b = __bfloat1622float2(g[i]);
        d += a.x * b.x + a.y * b.y;
    }
    if (dv % 2 && lane == 0) d += ld(out + row0 + dv - 1) * ld(dout + row0 + dv - 1);
    return warp_sum(d);
}

// Each token's selected keys as bits of its mask row (mwords words): a block per token.
__global__ void token_key_masks_kernel(const int32_t* idx, const int32_t* len, int64_t kslots,
                                       int64_t mwords, uint32_t* mask) {
    extern __shared__ uint32_t bits[];
    const int64_t t = blockIdx.x;
    build_key_mask(bits, mwords, idx + t * kslots, len[t]);
    for (int64_t w = threadIdx.x; w < mwords; w += blockDim.x) mask[t * mwords + w] = bits[w];
}

// d[r] = D of head row r (rowsum(dO o O) over dv), a warp per row: what the fused dS kernel reads.
__global__ void head_row_dots_kernel(const bf* out, const bf* dout, int64_t rows, int64_t dv,
                                     float* d) {
    const int64_t r = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const float v = head_row_dot(out, dout, r * dv, dv, threadIdx.x & 31);
    if ((threadIdx.x & 31) == 0) d[r] = v;
}

// dS = scale P (dP - D) over the token's rows of kWarps heads (blockIdx.y's group), written over
// P as full rows (0 at unselected keys), P recomputed in fp32 from S and the lse. D =
// rowsum(dO o O) per head, a warp each, first.
__global__ void masked_dscores_kernel(const float* s, const float* dp, bf* ds, int64_t lds,
                                      const int32_t* idx, const int32_t* len, int64_t kslots,
                                      int64_t t0, int64_t tokens, int64_t heads, int64_t dv,
                                      const float* lse, const bf* out, const bf* dout,
                                      float scale) {
    extern __shared__ uint32_t mask[];
    __shared__ float dsum[kWarps];
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int64_t h0 = int64_t(blockIdx.y) * kWarps, h1 = std::min(heads, h0 + kWarps);
    const int32_t* sel = idx + t * kslots;
    const int64_t n = len[t];
    if (n == 0) return;  // P's rows are already 0
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (h0 + warp < h1) {
        const float d = head_row_dot(out, dout, (t * heads + h0 + warp) * dv, dv, lane);
        if (lane == 0) dsum[warp] = d;
    }
    build_key_mask(mask, (lds + 31) / 32, sel, n);  // its __syncthreads also publishes dsum
    const int64_t vecs = lds / 4;
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t r = (tl * heads + h) * lds;
        const float4* srow = reinterpret_cast<const float4*>(s + r);
        const float4* dprow = reinterpret_cast<const float4*>(dp + r);
        uint2* out_row = reinterpret_cast<uint2*>(ds + r);
        const float m = lse[h * tokens + t], d = dsum[h - h0];
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
            const uint32_t bits = mask_bits4(mask, v);
            float4 e = make_float4(0.f, 0.f, 0.f, 0.f);
            if (bits) {
                const float4 x = srow[v], g = dprow[v];
                e.x = (bits & 1u) ? scale * __expf(x.x - m) * (g.x - d) : 0.f;
                e.y = (bits & 2u) ? scale * __expf(x.y - m) * (g.y - d) : 0.f;
                e.z = (bits & 4u) ? scale * __expf(x.z - m) * (g.z - d) : 0.f;
                e.w = (bits & 8u) ? scale * __expf(x.w - m) * (g.w - d) : 0.f;
            }
            const __nv_bfloat162 lo = __floats2bfloat162_rn(e.x, e.y);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(e.z, e.w);
            out_row[v] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                    *reinterpret_cast<const uint32_t*>(&hi));
        }
    }
}

// dS = scale P (dP - D) from the forward's saved bf16 P ([rows, lds] of this chunk): P is 0 at
// unselected keys and past the chunk's keys, so no key mask is needed; dP past `keys` was never
// written (P = 0 there gives dS = 0 without reading it into the product). One block per token of
// the chunk and kWarps heads; D = rowsum(dO o O) per head, a warp each, first.
__global__ void masked_dscores_saved_kernel(const bf* p, const float* dp, bf* ds, int64_t lds,
                                            int64_t t0, int64_t heads, int64_t dv, const bf* out,
                                            const bf* dout, float scale) {
    __shared__ float dsum[kWarps];
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int64_t h0 = int64_t(blockIdx.y) * kWarps, h1 = std::min(heads, h0 + kWarps);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (h0 + warp < h1) {
        const float d = head_row_dot(out, dout, (t * heads + h0 + warp) * dv, dv, lane);
        if (lane == 0) dsum[warp] = d;
    }
    __syncthreads();
    const int64_t vecs = lds / 4;
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t r = (tl * heads + h) * lds;
        const uint2* prow = reinterpret_cast<const uint2*>(p + r);
        const float4* dprow = reinterpret_cast<const float4*>(dp + r);
        uint2* out_row = reinterpret_cast<uint2*>(ds + r);
        const float d = dsum[h - h0];
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
            const uint2 pv = prow[v];
            float4 e = make_float4(0.f, 0.f, 0.f, 0.f);
            if (pv.x | pv.y) {
                const float2 lo =
                    __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pv.x));
                const float2 hi =
                    __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pv.y));
                const float4 g = dprow[v];
                e.x = lo.x != 0.f ? scale * lo.x * (g.x - d) : 0.f;
                e.y = lo.y != 0.f ? scale * lo.y * (g.y - d) : 0.f;
                e.z = hi.x != 0.f ? scale * hi.x * (g.z - d) : 0.f;
                e.w = hi.y != 0.f ? scale * hi.y * (g.w - d) : 0.f;
            }
            const __nv_bfloat162 lo = __floats2bfloat162_rn(e.x, e.y);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(e.z, e.w);
            out_row[v] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                    *reinterpret_cast<const uint32_t*>(&hi));
        }
    }
}

size_t probs_smem(int64_t lds, bool prob_sum) {
    const size_t bytes = probs_smem_bytes(lds, prob_sum);
    ST_CHECK(bytes <= kMaxProbsSmem, "sparse MQA (masked): ", lds, " keys exceed shared memory");
    if (bytes > 48 * 1024) {
        allow_dynamic_smem<masked_probs_kernel>(kMaxProbsSmem);
        allow_dynamic_smem<masked_dscores_kernel>(kMaxProbsSmem);
        allow_dynamic_smem<masked_probs_rows_kernel>(kMaxProbsSmem);
    }
    return bytes;
}

// P (and with lse_out the lse, with prob_sum the head sums) of a chunk's n tokens from its S.
void launch_probs(const ExecContext& ctx, const float* s, bf* p, int64_t ld, const int32_t* idx,
                  const int32_t* len, int64_t kslots, int64_t t0, int64_t n, int64_t tokens,
                  int64_t heads, const float* lse_in, float* lse_out, float* prob_sum) {
    const size_t smem = probs_smem(ld, prob_sum != nullptr);
    // Without head sums the warp-per-row form; with them the block-per-token form, which keeps
    // the sums in shared memory.
    if (!prob_sum) {
        masked_probs_rows_kernel<<<dim3(unsigned(n), unsigned((heads + kWarps - 1) / kWarps)),
                                   kThreads, smem, stream_of(ctx)>>>(
            s, p, ld, idx, len, kslots, t0, tokens, heads, lse_in, lse_out);
    } else {
        // With prob_sum a block takes all heads of its token (the sum stays in the block).
        const int64_t hpb = prob_sum ? heads : kWarps;
        masked_probs_kernel<<<dim3(unsigned(n), unsigned((heads + hpb - 1) / hpb)), kThreads, smem,
                              stream_of(ctx)>>>(s, p, ld, idx, len, kslots, t0, tokens, heads, hpb,
                                                lse_in, lse_out, prob_sum);
    }
    ST_CUDA_LAUNCH_CHECK();
}

// dS = scale P (dP - D) of a chunk's n tokens into the workspace's P (read there by the dQ / dK
// GEMMs), from dP in the workspace and P: the forward's saved one, or recomputed from S and the
// lse (with the key mask) when `saved` is null.
void launch_dscores(const ExecContext& ctx, const Workspace& w, const bf16* saved, int64_t ld,
                    const int32_t* idx, const int32_t* len, int64_t kslots, int64_t t0, int64_t n,
                    int64_t tokens, int64_t heads, int64_t dv, const float* lse, const bf16* out,
                    const bf16* dout, float scale) {
    const dim3 grid(unsigned(n), unsigned((heads + kWarps - 1) / kWarps));
    if (saved)
        masked_dscores_saved_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
            dev(saved), w.dp, w.p, ld, t0, heads, dv, dev(out), dev(dout), scale);
    else
        masked_dscores_kernel<<<grid, kThreads, probs_smem(ld, false), stream_of(ctx)>>>(
            w.s, w.dp, w.p, ld, idx, len, kslots, t0, tokens, heads, dv, lse, dev(out), dev(dout),
            scale);
    ST_CUDA_LAUNCH_CHECK();
}

}  // namespace

void build_token_key_masks(const ExecContext& ctx, const int32_t* idx, const int32_t* len,
                           int64_t kslots, int64_t tokens, int64_t mwords, uint32_t* mask) {
    if (tokens == 0) return;
    const size_t smem = size_t(mwords) * sizeof(uint32_t);
    ST_CHECK(smem <= kMaxProbsSmem, "token key masks: ", mwords, " words per token");
    if (smem > 48 * 1024) allow_dynamic_smem<token_key_masks_kernel>(kMaxProbsSmem);
    token_key_masks_kernel<<<unsigned(tokens), kThreads, smem, stream_of(ctx)>>>(idx, len, kslots,
                                                                                 mwords, mask);
    ST_CUDA_LAUNCH_CHECK();
}

void sparse_mqa_forward_masked(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                               float* prob_sum, const MaskedWorkspace& ws) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    const int64_t key_rows = p.key_rows;
    void* workspace = ws.ptr;
    const int64_t workspace_bytes = ws.bytes;
    bf16* saved_probs = ws.saved_probs;
    ST_CHECK(!saved_probs || key_rows == 0,
             "sparse MQA (masked): saved probabilities without context parallelism only");
    const Workspace w =
        carve(workspace, workspace_bytes, tokens, key_rows > 0 ? key_rows : tokens, heads);
    const int64_t cq = w.chunk;
    bf* saved = saved_probs ? dev(saved_probs) : nullptr;
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), rows = (t1 - t0) * heads;
        const int64_t keys = key_rows > 0 ? key_rows : t1, ld = leading_dim(keys);
        bf* p = saved ? saved : w.p;
        gemm(ctx, false, true, rows, keys, dqk, scale, q + t0 * heads * dqk, dqk, kv, dqk, 0.f, w.s,
             ld, DType::BF16, DType::F32);
        launch_probs(ctx, w.s, p, ld, idx, len, kslots, t0, t1 - t0, tokens, heads, nullptr, lse,
                     prob_sum);
        gemm(ctx, false, false, rows, dv, keys, 1.f, p, ld, kv, dqk, 0.f, out + t0 * heads * dv,
             dv);
        if (saved) saved += rows * ld;
    }
}

void sparse_mqa_backward_masked(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dkv,
                                const MaskedWorkspace& ws) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16 *q = p.q, *kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    const int64_t key_rows = p.key_rows;
    void* workspace = ws.ptr;
    const int64_t workspace_bytes = ws.bytes;
    const bf16* saved_probs = ws.saved_probs;
    ST_CHECK(!saved_probs || key_rows == 0,
             "sparse MQA (masked): saved probabilities without context parallelism only");
    ST_CHECK(!p.dkv_accumulate, "sparse MQA (masked): dkv_accumulate is for the gathered forms");
    const Workspace w =
        carve(workspace, workspace_bytes, tokens, key_rows > 0 ? key_rows : tokens, heads);
    const int64_t cq = w.chunk;
    const auto BF = DType::BF16, F32 = DType::F32;
    ST_CUDA_CHECK(cudaMemsetAsync(dkv, 0, (key_rows > 0 ? key_rows : tokens) * dqk * sizeof(float),
                                  stream_of(ctx)));
    const bf16* saved = saved_probs;
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), rows = (t1 - t0) * heads;
        const int64_t keys = key_rows > 0 ? key_rows : t1, ld = leading_dim(keys);
        const bf16* qc = q + t0 * heads * dqk;
        const bf16* gc = dout + t0 * heads * dv;
        // P: the forward's (saved), or S recomputed and P formed from it in the workspace.
        const bf16* p = saved ? saved : reinterpret_cast<const bf16*>(w.p);
        if (!saved) {
            gemm(ctx, false, true, rows, keys, dqk, scale, qc, dqk, kv, dqk, 0.f, w.s, ld, BF, F32);
            launch_probs(ctx, w.s, w.p, ld, idx, len, kslots, t0, t1 - t0, tokens, heads, lse,
                         nullptr, nullptr);
        }
        gemm(ctx, false, true, rows, keys, dv, 1.f, gc, dv, kv, dqk, 0.f, w.dp, ld, BF, F32);
        // dV' (the first dv latent columns) += P^T dO
        gemm(ctx, true, false, keys, dv, rows, 1.f, p, ld, gc, dv, 1.f, dkv, dqk, BF, F32);
        launch_dscores(ctx, w, saved, ld, idx, len, kslots, t0, t1 - t0, tokens, heads, dv, lse,
                       out, dout, scale);
        gemm(ctx, false, false, rows, dqk, keys, 1.f, w.p, ld, kv, dqk, 0.f, dq + t0 * heads * dqk,
             dqk, BF, BF);
        gemm(ctx, true, false, keys, dqk, rows, 1.f, w.p, ld, qc, dqk, 1.f, dkv, dqk, BF, F32);
        if (saved) saved += rows * ld;
    }
}

// ---- The expanded form: the same chunks, masks and kernels; the GEMMs batched over the heads.
// Head h's rows of a chunk's S / dP / P are rows (t - t0) * H + h of [rows, ld]: one batch entry
// is every H-th row (ld * H apart), so the P / dS kernels see the absorbed form's layout.

void sparse_mha_forward_masked(const ExecContext& ctx, const SparseMha& p, bf16* out, float* lse,
                               float* prob_sum, const MaskedWorkspace& ws) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16* q = p.q;
    const HeadKV& kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    void* workspace = ws.ptr;
    const int64_t workspace_bytes = ws.bytes;
    bf16* saved_probs = ws.saved_probs;
    const Workspace w = carve(workspace, workspace_bytes, tokens, tokens, heads);
    const int64_t cq = w.chunk, H = heads;
    const auto BF = DType::BF16, F32 = DType::F32;
    bf* saved = saved_probs ? dev(saved_probs) : nullptr;
    // Without the head sums, on sm_90 with qk 256, P and the lse come from one kernel that keeps
    // the scores in registers; the tokens' key bits go into the S buffer it leaves unused.
    const int64_t mwords = token_key_mask_words(tokens);
    const bool fused = !prob_sum && masked_probs_wgmma_supported(dqk, kv) &&
                       tokens * mwords <= cq * H * leading_dim(tokens);
    uint32_t* mask = reinterpret_cast<uint32_t*>(w.s);
    if (fused) build_token_key_masks(ctx, idx, len, kslots, tokens, mwords, mask);
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), n = t1 - t0, ld = leading_dim(t1);
        bf* p = saved ? saved : w.p;
        if (fused) {
            masked_probs_wgmma(ctx, q, kv, mask, mwords, reinterpret_cast<bf16*>(p), ld, lse,
                               tokens, t0, n, t1, H, scale);
        } else {
            gemm(ctx, false, true, n, t1, dqk, scale, q + t0 * H * dqk, H * dqk, kv.k, kv.k_row,
                 0.f, w.s, H * ld, BF, F32, {H, dqk, kv.k_head, ld});
            launch_probs(ctx, w.s, p, ld, idx, len, kslots, t0, n, tokens, heads, nullptr, lse,
                         prob_sum);
        }
        gemm(ctx, false, false, n, dv, t1, 1.f, p, H * ld, kv.v, kv.v_row, 0.f, out + t0 * H * dv,
             H * dv, BF, BF, {H, ld, kv.v_head, dv});
        if (saved) saved += n * H * ld;
    }
}

void sparse_mha_backward_masked(const ExecContext& ctx, const SparseMha& p, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dk, float* dvv,
                                const MaskedWorkspace& ws) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv, kslots = p.kslots;
    const bf16* q = p.q;
    const HeadKV& kv = p.kv;
    const int32_t *idx = p.idx, *len = p.len;
    const float scale = p.scale;
    void* workspace = ws.ptr;
    const int64_t workspace_bytes = ws.bytes;
    const bf16* saved_probs = ws.saved_probs;
    const Workspace w = carve(workspace, workspace_bytes, tokens, tokens, heads);
    const int64_t cq = w.chunk, H = heads;
    const auto BF = DType::BF16, F32 = DType::F32;
    // The saved probabilities are laid out chunk after chunk in the forward's order; walk back
    // from their end.
    const int64_t saved_end =
        saved_probs ? sparse_mqa_saved_probs_elems(tokens, heads, workspace_bytes) : 0;
    int64_t saved_at = saved_end;
    const int64_t last = (tokens - 1) / cq * cq;
    // With saved P on sm_90 (v 256) dS comes from one kernel that keeps dP in registers; D for
    // every head row first, into the S buffer (unused when P is saved: tokens x H <= its size).
    const bool fused = saved_probs && masked_dscores_wgmma_supported(dv, kv);
    if (fused) {
        head_row_dots_kernel<<<blocks_for(tokens * H, kWarps), kThreads, 0, stream_of(ctx)>>>(
            dev(out), dev(dout), tokens * H, dv, w.s);
        ST_CUDA_LAUNCH_CHECK();
    }
    for (int64_t t0 = last; t0 >= 0; t0 -= cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), n = t1 - t0, ld = leading_dim(t1);
        // The last chunk scores every key: it writes dK and dV, the earlier chunks add.
        const float beta = t0 == last ? 0.f : 1.f;
        const bf16* qc = q + t0 * H * dqk;
        const bf16* gc = dout + t0 * H * dv;
        const bf16* saved = nullptr;
        if (saved_probs) {
            saved_at -= n * H * ld;
            saved = saved_probs + saved_at;
        }
        const bf16* p = saved ? saved : reinterpret_cast<const bf16*>(w.p);
        if (!saved) {
            gemm(ctx, false, true, n, t1, dqk, scale, qc, H * dqk, kv.k, kv.k_row, 0.f, w.s, H * ld,
                 BF, F32, {H, dqk, kv.k_head, ld});
            launch_probs(ctx, w.s, w.p, ld, idx, len, kslots, t0, t1 - t0, tokens, heads, lse,
                         nullptr, nullptr);
        }
        // dV_h (+)= P_h^T dO_h; dP_h = dO_h V_h^T (in the fused kernel's registers, or through
        // memory).
        gemm(ctx, true, false, t1, dv, n, 1.f, p, H * ld, gc, H * dv, beta, dvv, H * dv, BF, F32,
             {H, ld, dv, dv});
        if (fused) {
            masked_dscores_wgmma(ctx, dout, kv, saved, reinterpret_cast<bf16*>(w.p), ld, w.s, t0, n,
                                 t1, H, scale);
        } else {
            gemm(ctx, false, true, n, t1, dv, 1.f, gc, H * dv, kv.v, kv.v_row, 0.f, w.dp, H * ld,
                 BF, F32, {H, dv, kv.v_head, ld});
            launch_dscores(ctx, w, saved, ld, idx, len, kslots, t0, n, tokens, heads, dv, lse, out,
                           dout, scale);
        }
        // dQ_h = dS_h K_h; dK_h (+)= dS_h^T Q_h
        gemm(ctx, false, false, n, dqk, t1, 1.f, w.p, H * ld, kv.k, kv.k_row, 0.f,
             dq + t0 * H * dqk, H * dqk, BF, BF, {H, ld, kv.k_head, dqk});
        gemm(ctx, true, false, t1, dqk, n, 1.f, w.p, H * ld, qc, H * dqk, beta, dk, H * dqk, BF,
             F32, {H, ld, dqk, dqk});
    }
}

}  // namespace sparsetron::cuda
