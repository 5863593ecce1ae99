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
#include "sparsetron/ops/cuda/device_util.cuh"
#include "sparsetron/ops/cuda/internal.h"
#include "sparsetron/ops/cuda/ops.h"

namespace sparsetron::cuda {

namespace {

constexpr int kThreads = 256;
// S / dP / P elements per chunk (1.25 GiB of workspace; 512 query tokens at 4K context x 64 heads):
// fewer, larger GEMMs and more blocks per kernel (measured: 128-token chunks take 1.4x as long as
// 256-token ones, 16-token chunks 6x).
constexpr int64_t kChunkElems = int64_t(128) << 20;

int64_t leading_dim(int64_t tokens) {
    return (tokens + 15) / 16 * 16;  // 16-element rows: aligned vector stores and GEMM operands
}
constexpr int64_t kBytesPerElem = 2 * sizeof(float) + sizeof(bf);  // S, dP, P
// Query tokens per chunk that `bytes` of workspace hold.
int64_t chunk_tokens(int64_t tokens, int64_t heads, int64_t bytes) {
    const int64_t cq = bytes / (heads * leading_dim(tokens) * kBytesPerElem);
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

// One block per token of the chunk and group of heads_per_block heads (all heads when the
// head-summed probabilities are wanted, kWarps otherwise: more blocks, more latency hidden): zero
// the group's probability rows over 0..ld-1, then a warp per head writes exp(s - lse) at the
// selected keys. With lse_out (the forward) the lse comes from an
// online max/sum over the selected scores and is written, and the head-summed probabilities too
// (per-warp partial rows in shared memory, added in warp order: deterministic); otherwise lse_in
// is read.
__global__ void masked_probs_kernel(const float* s, bf* p, int64_t lds, const int32_t* idx,
                                    const int32_t* len, int64_t kslots, int64_t t0, int64_t tokens,
                                    int64_t heads, int64_t heads_per_block, const float* lse_in,
                                    float* lse_out, float* prob_sum) {
    extern __shared__ float psum[];  // [kWarps][kslots] when prob_sum
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int64_t h0 = int64_t(blockIdx.y) * heads_per_block;
    const int64_t h1 = std::min(heads, h0 + heads_per_block);
    const int32_t* sel = idx + t * kslots;
    const int64_t n = len[t];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4* rows = reinterpret_cast<uint4*>(p + (tl * heads + h0) * lds);
    for (int64_t i = threadIdx.x; i < (h1 - h0) * lds / 8; i += blockDim.x)
        rows[i] = make_uint4(0, 0, 0, 0);
    if (prob_sum)
        for (int64_t j = threadIdx.x; j < kWarps * kslots; j += blockDim.x) psum[j] = 0.f;
    __syncthreads();  // zeros before the scatter below (other warps write the same rows)
    float* mine = psum + warp * kslots;
    for (int64_t h = h0 + warp; h < h1; h += kWarps) {
        const float* srow = s + (tl * heads + h) * lds;
        bf* prow = p + (tl * heads + h) * lds;
        float m;
        if (lse_out) {
            float mx = -INFINITY, l = 0.f;
            for (int64_t j = lane; j < n; j += 32) {
                const float x = srow[sel[j]];
                if (x > mx) {
                    l = l * __expf(mx - x) + 1.f;
                    mx = x;
                } else {
                    l += __expf(x - mx);
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
                const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
                const float mm = fmaxf(mx, m2);
                l = (mx == -INFINITY ? 0.f : l * __expf(mx - mm)) +
                    (m2 == -INFINITY ? 0.f : l2 * __expf(m2 - mm));
                mx = mm;
            }
            m = n > 0 ? mx + logf(l) : 0.f;
            if (lane == 0) lse_out[h * tokens + t] = m;
        } else {
            m = lse_in[h * tokens + t];
        }
        for (int64_t j = lane; j < n; j += 32) {
            const float pj = __expf(srow[sel[j]] - m);
            prow[sel[j]] = __float2bfloat16(pj);
            if (prob_sum) mine[j] += pj;
        }
    }
    if (prob_sum) {
        __syncthreads();
        for (int64_t j = threadIdx.x; j < kslots; j += blockDim.x) {
            float sum = 0.f;
            for (int w = 0; w < kWarps; ++w) sum += psum[w * kslots + j];
            prob_sum[t * kslots + j] = sum;
        }
    }
}

// dS = scale P (dP - D) at the selected keys of the token's rows of kWarps heads (blockIdx.y's
// group; a warp per head), written
// over P (whose other entries are already 0). P is recomputed in fp32 from S and the lse.
__global__ void masked_dscores_kernel(const float* s, const float* dp, bf* ds, int64_t lds,
                                      const int32_t* idx, const int32_t* len, int64_t kslots,
                                      int64_t t0, int64_t tokens, int64_t heads, int64_t dv,
                                      const float* lse, const bf* out, const bf* dout,
                                      float scale) {
    const int64_t tl = blockIdx.x, t = t0 + tl;
    const int64_t h1 = std::min(heads, int64_t(blockIdx.y + 1) * kWarps);
    const int32_t* sel = idx + t * kslots;
    const int64_t n = len[t];
    if (n == 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t h = int64_t(blockIdx.y) * kWarps + warp; h < h1; h += kWarps) {
        const __nv_bfloat162* o =
            reinterpret_cast<const __nv_bfloat162*>(out + (t * heads + h) * dv);
        const __nv_bfloat162* g =
            reinterpret_cast<const __nv_bfloat162*>(dout + (t * heads + h) * dv);
        float d = 0.f;
        for (int64_t i = lane; i < dv / 2; i += 32) {
            const float2 a = __bfloat1622float2(o[i]), b = __bfloat1622float2(g[i]);
            d += a.x * b.x + a.y * b.y;
        }
        if (dv % 2 && lane == 0)
            d += ld(out + (t * heads + h + 1) * dv - 1) * ld(dout + (t * heads + h + 1) * dv - 1);
        d = warp_sum(d);
        const int64_t r = (tl * heads + h) * lds;
        const float m = lse[h * tokens + t];
        for (int64_t j = lane; j < n; j += 32) {
            const int64_t key = sel[j];
            const float pj = __expf(s[r + key] - m);
            ds[r + key] = __float2bfloat16(scale * pj * (dp[r + key] - d));
        }
    }
}

// The forward's probability kernel keeps a float per top-k slot and warp in shared memory.
constexpr size_t kMaxProbsSmem = 200 * 1024;
size_t probs_smem(int64_t kslots, bool prob_sum) {
    const size_t bytes = prob_sum ? kWarps * kslots * sizeof(float) : 0;
    ST_CHECK(bytes <= kMaxProbsSmem, "sparse MQA (masked): top-k ", kslots,
             " exceeds shared memory");
    if (bytes > 48 * 1024) {
        static const bool configured = [] {
            ST_CUDA_CHECK(cudaFuncSetAttribute(masked_probs_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(kMaxProbsSmem)));
            return true;
        }();
        (void)configured;
    }
    return bytes;
}

}  // namespace

bool sparse_mqa_masked_preferred(int64_t keys, int64_t kslots) {
    // Dense work per row ~ t / 2 keys against <= kslots gathered ones; tensor-core GEMMs win by
    // far more than the 4x extra work this allows (docs/perf/). The head-summed probabilities
    // need kWarps floats per slot of shared memory.
    return keys <= 8 * kslots && kWarps * kslots * sizeof(float) <= kMaxProbsSmem;
}

int64_t sparse_mqa_workspace_bytes(int64_t tokens, int64_t heads, int64_t kslots,
                                   int64_t key_rows) {
    const int64_t keys = key_rows > 0 ? key_rows : tokens;
    if (tokens == 0 || !sparse_mqa_masked_preferred(keys, kslots)) return 0;
    const int64_t row = heads * leading_dim(keys);  // elements per query token
    const int64_t cq = std::max<int64_t>(1, std::min(tokens, kChunkElems / row));
    return cq * row * kBytesPerElem;
}

void sparse_mqa_forward_masked(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                               int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                               const int32_t* len, int64_t kslots, float scale, bf16* out,
                               float* lse, float* prob_sum, void* workspace,
                               int64_t workspace_bytes, int64_t key_rows) {
    const Workspace w =
        carve(workspace, workspace_bytes, tokens, key_rows > 0 ? key_rows : tokens, heads);
    const int64_t cq = w.chunk;
    const size_t smem = probs_smem(kslots, prob_sum != nullptr);
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), rows = (t1 - t0) * heads;
        const int64_t keys = key_rows > 0 ? key_rows : t1, ld = leading_dim(keys);
        gemm(ctx, false, true, rows, keys, dqk, scale, q + t0 * heads * dqk, dqk, kv, dqk, 0.f, w.s,
             ld, DType::BF16, DType::F32);
        // With prob_sum a block takes all heads of its token (the sum stays in the block).
        const int64_t hpb = prob_sum ? heads : kWarps;
        masked_probs_kernel<<<dim3(unsigned(t1 - t0), unsigned((heads + hpb - 1) / hpb)), kThreads,
                              smem, stream_of(ctx)>>>(w.s, w.p, ld, idx, len, kslots, t0, tokens,
                                                      heads, hpb, nullptr, lse, prob_sum);
        ST_CUDA_LAUNCH_CHECK();
        gemm(ctx, false, false, rows, dv, keys, 1.f, w.p, ld, kv, dqk, 0.f, out + t0 * heads * dv,
             dv);
    }
}

void sparse_mqa_backward_masked(const ExecContext& ctx, int64_t tokens, int64_t heads, int64_t dqk,
                                int64_t dv, const bf16* q, const bf16* kv, const int32_t* idx,
                                const int32_t* len, int64_t kslots, float scale, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dkv,
                                void* workspace, int64_t workspace_bytes, int64_t key_rows) {
    const Workspace w =
        carve(workspace, workspace_bytes, tokens, key_rows > 0 ? key_rows : tokens, heads);
    const int64_t cq = w.chunk;
    const auto BF = DType::BF16, F32 = DType::F32;
    ST_CUDA_CHECK(cudaMemsetAsync(dkv, 0, (key_rows > 0 ? key_rows : tokens) * dqk * sizeof(float),
                                  stream_of(ctx)));
    const size_t smem = probs_smem(kslots, false);
    for (int64_t t0 = 0; t0 < tokens; t0 += cq) {
        const int64_t t1 = std::min(tokens, t0 + cq), rows = (t1 - t0) * heads;
        const int64_t keys = key_rows > 0 ? key_rows : t1, ld = leading_dim(keys);
        const bf16* qc = q + t0 * heads * dqk;
        const bf16* gc = dout + t0 * heads * dv;
        gemm(ctx, false, true, rows, keys, dqk, scale, qc, dqk, kv, dqk, 0.f, w.s, ld, BF, F32);
        const dim3 grid(unsigned(t1 - t0), unsigned((heads + kWarps - 1) / kWarps));
        masked_probs_kernel<<<grid, kThreads, smem, stream_of(ctx)>>>(
            w.s, w.p, ld, idx, len, kslots, t0, tokens, heads, kWarps, lse, nullptr, nullptr);
        ST_CUDA_LAUNCH_CHECK();
        gemm(ctx, false, true, rows, keys, dv, 1.f, gc, dv, kv, dqk, 0.f, w.dp, ld, BF, F32);
        // dV' (the first dv latent columns) += P^T dO
        gemm(ctx, true, false, keys, dv, rows, 1.f, w.p, ld, gc, dv, 1.f, dkv, dqk, BF, F32);
        masked_dscores_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
            w.s, w.dp, w.p, ld, idx, len, kslots, t0, tokens, heads, dv, lse, dev(out), dev(dout),
            scale);
        ST_CUDA_LAUNCH_CHECK();
        gemm(ctx, false, false, rows, dqk, keys, 1.f, w.p, ld, kv, dqk, 0.f, dq + t0 * heads * dqk,
             dqk, BF, BF);
        gemm(ctx, true, false, keys, dqk, rows, 1.f, w.p, ld, qc, dqk, 1.f, dkv, dqk, BF, F32);
    }
}

}  // namespace sparsetron::cuda
