// Attention over a per-row list of keys, used twice: dense causal attention within documents
// (keys begin..t, separate K and V heads) and sparse MQA over the indexer's top-k (one shared
// latent row is both key and value). One block per (row, head); keys in chunks of kChunk with an
// online softmax, so any key count fits: the form for shapes no tensor-core kernel takes. The
// dense attention (MLA's expanded form without DSA) always runs here.
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/attention/attention_forms.h"
#include "sparsetron/ops/common/device_util.cuh"

namespace sparsetron::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 128;
constexpr int kMaxPerThread = 8;  // head dims up to kThreads * kMaxPerThread = 1024

// Dense: the keys of row t are its document's rows begin..t, each head with its own K and V.
struct DenseKeys {
    const bf *k, *v;
    int64_t k_st, k_sh, v_st, v_sh;
    const int32_t* row_begin;
    __device__ int64_t count(int64_t t) const {
        int32_t b = row_begin[t];
        return b < 0 ? 0 : t - b + 1;
    }
    __device__ int64_t row(int64_t t, int64_t j) const { return row_begin[t] + j; }
    __device__ const bf* key(int64_t r, int64_t h) const { return k + r * k_st + h * k_sh; }
    __device__ const bf* value(int64_t r, int64_t h) const { return v + r * v_st + h * v_sh; }
};

// Sparse MQA: row t's keys are idx[t, 0:len[t]]; the latent row is the key, its head the value.
struct SparseKeys {
    const bf* kv;
    int64_t dqk, kslots;
    const int32_t *idx, *len;
    __device__ int64_t count(int64_t t) const { return len[t]; }
    __device__ int64_t row(int64_t t, int64_t j) const { return idx[t * kslots + j]; }
    __device__ const bf* key(int64_t r, int64_t) const { return kv + r * dqk; }
    __device__ const bf* value(int64_t r, int64_t) const { return kv + r * dqk; }
};

__device__ float warp_dot(const float* a, const bf* b, int64_t n) {
    float s = 0;
    for (int64_t i = threadIdx.x & 31; i < n; i += 32) s += a[i] * ld(b + i);
    return warp_sum(s);
}

template <typename Keys>
__global__ void attn_fwd_kernel(Keys keys, int64_t tokens, int64_t heads, int64_t dqk, int64_t dv,
                                const bf* q, int64_t q_st, int64_t q_sh, float scale, bf* out,
                                float* lse) {
    extern __shared__ float smem[];
    float* qs = smem;        // [dqk]
    float* sc = smem + dqk;  // [kChunk]
    __shared__ int64_t rows[kChunk];
    const int64_t t = blockIdx.x, h = blockIdx.y;
    const int64_t n = keys.count(t);
    for (int64_t i = threadIdx.x; i < dqk; i += blockDim.x) qs[i] = ld(q + t * q_st + h * q_sh + i);
    float acc[kMaxPerThread] = {};
    float m = -INFINITY, l = 0;
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int cnt = int(min(int64_t(kChunk), n - c0));
        if (threadIdx.x < cnt) rows[threadIdx.x] = keys.row(t, c0 + threadIdx.x);
        __syncthreads();
        for (int j = warp; j < cnt; j += nwarps) {
            float d = warp_dot(qs, keys.key(rows[j], h), dqk);
            if ((threadIdx.x & 31) == 0) sc[j] = d * scale;
        }
        __syncthreads();
        const float cmax = block_max(threadIdx.x < cnt ? sc[threadIdx.x] : -INFINITY);
        const float m_new = fmaxf(m, cmax), corr = __expf(m - m_new);
        float p = 0;
        if (threadIdx.x < cnt) p = sc[threadIdx.x] = __expf(sc[threadIdx.x] - m_new);
        l = l * corr + block_sum(p);  // block_sum's barriers also publish sc
        m = m_new;
        for (int e = 0; e < kMaxPerThread; ++e) {
            const int64_t d = threadIdx.x + int64_t(e) * blockDim.x;
            if (d >= dv) break;
            float a = acc[e] * corr;
            for (int j = 0; j < cnt; ++j) a += sc[j] * ld(keys.value(rows[j], h) + d);
            acc[e] = a;
        }
        __syncthreads();
    }
    bf* o = out + (t * heads + h) * dv;
    for (int e = 0; e < kMaxPerThread; ++e) {
        const int64_t d = threadIdx.x + int64_t(e) * blockDim.x;
        if (d < dv) st(o + d, n ? acc[e] / l : 0.f);
    }
    if (threadIdx.x == 0) lse[h * tokens + t] = n ? m + logf(l) : 0.f;
}

// dS_j = P_j (dout · v_j - dout · out); dq = scale Σ dS_j k_j; dk_j += scale dS_j q;
// dv_j += P_j dout. dk/dv are fp32 and shared between rows (atomics).
template <typename Keys>
__global__ void attn_bwd_kernel(Keys keys, int64_t tokens, int64_t heads, int64_t dqk, int64_t dv,
                                const bf* q, int64_t q_st, int64_t q_sh, const bf* out,
                                const float* lse, const bf* dout, float scale, bf* dq, float* dk,
                                int64_t dk_st, int64_t dk_sh, float* dvv, int64_t dv_st,
                                int64_t dv_sh) {
    extern __shared__ float smem[];
    float* qs = smem;         // [dqk]
    float* dos = qs + dqk;    // [dv]
    float* ps = dos + dv;     // [kChunk] probabilities
    float* ds = ps + kChunk;  // [kChunk] score gradients
    __shared__ int64_t rows[kChunk];
    const int64_t t = blockIdx.x, h = blockIdx.y;
    const int64_t n = keys.count(t);
    const bf* qrow = q + t * q_st + h * q_sh;
    for (int64_t i = threadIdx.x; i < dqk; i += blockDim.x) qs[i] = ld(qrow + i);
    const bf *orow = out + (t * heads + h) * dv, *dorow = dout + (t * heads + h) * dv;
    float dsum = 0;
    for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) {
        dos[i] = ld(dorow + i);
        dsum += dos[i] * ld(orow + i);
    }
    const float D = block_sum(dsum);
    const float L = lse[h * tokens + t];
    float dqa[kMaxPerThread] = {};
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
        const int cnt = int(min(int64_t(kChunk), n - c0));
        if (threadIdx.x < cnt) rows[threadIdx.x] = keys.row(t, c0 + threadIdx.x);
        __syncthreads();
        for (int j = warp; j < cnt; j += nwarps) {
            const float s = warp_dot(qs, keys.key(rows[j], h), dqk) * scale;
            const float dp = warp_dot(dos, keys.value(rows[j], h), dv);
            if ((threadIdx.x & 31) == 0) {
                const float p = __expf(s - L);
                ps[j] = p;
                ds[j] = p * (dp - D);
            }
        }
        __syncthreads();
        for (int e = 0; e < kMaxPerThread; ++e) {
            const int64_t d = threadIdx.x + int64_t(e) * blockDim.x;
            if (d >= dqk) break;
            float a = dqa[e];
            for (int j = 0; j < cnt; ++j) {
                a += ds[j] * ld(keys.key(rows[j], h) + d);
                atomicAdd(dk + rows[j] * dk_st + h * dk_sh + d, scale * ds[j] * qs[d]);
            }
            dqa[e] = a;
        }
        for (int64_t d = threadIdx.x; d < dv; d += blockDim.x)
            for (int j = 0; j < cnt; ++j)
                atomicAdd(dvv + rows[j] * dv_st + h * dv_sh + d, ps[j] * dos[d]);
        __syncthreads();
    }
    for (int e = 0; e < kMaxPerThread; ++e) {
        const int64_t d = threadIdx.x + int64_t(e) * blockDim.x;
        if (d < dqk) st(dq + t * q_st + h * q_sh + d, scale * dqa[e]);
    }
}

__global__ void row_begin_kernel(const int32_t* cu, const int32_t* num_docs, int64_t tokens,
                                 int32_t* row_begin) {
    const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (t >= tokens) return;
    // Binary search for the document d with cu[d] <= t < cu[d+1].
    int lo = 0, hi = *num_docs;
    if (hi <= 0 || t >= cu[hi]) {
        row_begin[t] = -1;
        return;
    }
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    row_begin[t] = cu[lo];
}

void check_dims(int64_t dqk, int64_t dv) {
    ST_CHECK(dqk <= kThreads * kMaxPerThread && dv <= kThreads * kMaxPerThread,
             "attention head dims up to ", kThreads * kMaxPerThread, " are supported (got qk ", dqk,
             ", v ", dv, ")");
}

}  // namespace

void doc_row_begin(const ExecContext& ctx, const int32_t* cu_seqlens, const int32_t* num_docs,
                   int64_t tokens, int32_t* row_begin) {
    if (tokens == 0) return;
    row_begin_kernel<<<blocks_for(tokens, 256), 256, 0, stream_of(ctx)>>>(cu_seqlens, num_docs,
                                                                          tokens, row_begin);
    ST_CUDA_LAUNCH_CHECK();
}

void attention_forward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                       const bf16* v, const int32_t* row_begin, float scale, bf16* out,
                       float* lse) {
    check_dims(s.dqk, s.dv);
    if (s.tokens == 0) return;
    DenseKeys keys{dev(k), dev(v), s.k_st, s.k_sh, s.v_st, s.v_sh, row_begin};
    const size_t smem = (s.dqk + kChunk) * sizeof(float);
    attn_fwd_kernel<<<dim3(s.tokens, s.heads), kThreads, smem, stream_of(ctx)>>>(
        keys, s.tokens, s.heads, s.dqk, s.dv, dev(q), s.q_st, s.q_sh, scale, dev(out), lse);
    ST_CUDA_LAUNCH_CHECK();
}

void attention_backward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                        const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                        const int32_t* row_begin, float scale, bf16* dq, float* dk, float* dv) {
    check_dims(s.dqk, s.dv);
    if (s.tokens == 0) return;
    cudaStream_t st_ = stream_of(ctx);
    ST_CUDA_CHECK(cudaMemsetAsync(dk, 0, s.tokens * s.heads * s.dqk * sizeof(float), st_));
    ST_CUDA_CHECK(cudaMemsetAsync(dv, 0, s.tokens * s.heads * s.dv * sizeof(float), st_));
    DenseKeys keys{dev(k), dev(v), s.k_st, s.k_sh, s.v_st, s.v_sh, row_begin};
    const size_t smem = (s.dqk + s.dv + 2 * kChunk) * sizeof(float);
    attn_bwd_kernel<<<dim3(s.tokens, s.heads), kThreads, smem, st_>>>(
        keys, s.tokens, s.heads, s.dqk, s.dv, dev(q), s.q_st, s.q_sh, dev(out), lse, dev(dout),
        scale, dev(dq), dk, s.heads * s.dqk, s.dqk, dv, s.heads * s.dv, s.dv);
    ST_CUDA_LAUNCH_CHECK();
}

namespace {

// The masked kernels' buffers as the plan sizes them; a masked form without its workspace, or
// kept probabilities without their buffer, is a planning error.
MaskedWorkspace masked_buffers(const SparseAttentionPlan& plan, const SparseAttentionBuffers& b) {
    ST_CHECK(b.workspace && plan.workspace_bytes > 0, "sparse attention (", form_name(plan.form),
             "): the masked form runs without its planned workspace");
    ST_CHECK(plan.saved_probs_elems == 0 || b.saved_probs, "sparse attention (",
             form_name(plan.form), "): the plan keeps probabilities but gives no buffer");
    return {b.workspace, plan.workspace_bytes,
            plan.saved_probs_elems > 0 ? b.saved_probs : nullptr};
}

}  // namespace

void sparse_mqa_forward(const ExecContext& ctx, const SparseAttentionPlan& plan, const SparseMqa& p,
                        bf16* out, float* lse, float* prob_sum,
                        const SparseAttentionBuffers& buffers) {
    check_dims(p.dqk, p.dv);
    if (p.tokens == 0) return;
    switch (plan.form) {
        case SparseAttentionForm::AbsorbedFlash:
        case SparseAttentionForm::AbsorbedFlashMasked:
            return sparse_mqa_forward_wgmma(ctx, p, out, lse, prob_sum);
        case SparseAttentionForm::AbsorbedMasked:
            return sparse_mqa_forward_masked(ctx, p, out, lse, prob_sum,
                                             masked_buffers(plan, buffers));
        case SparseAttentionForm::AbsorbedGathered:
            return sparse_mqa_forward_tc(ctx, p, out, lse, prob_sum);
        case SparseAttentionForm::AbsorbedReference:
            break;
        case SparseAttentionForm::ExpandedMasked:
            throw Error("sparse_mqa_forward: the expanded form runs sparse_mha_forward");
    }
    SparseKeys keys{dev(p.kv), p.dqk, p.kslots, p.idx, p.len};
    const size_t smem = (p.dqk + kChunk) * sizeof(float);
    attn_fwd_kernel<<<dim3(p.tokens, p.heads), kThreads, smem, stream_of(ctx)>>>(
        keys, p.tokens, p.heads, p.dqk, p.dv, dev(p.q), p.heads * p.dqk, p.dqk, p.scale, dev(out),
        lse);
    ST_CUDA_LAUNCH_CHECK();
    if (prob_sum)
        head_prob_sum(ctx, p.q, p.kv, p.idx, p.len, p.kslots, p.tokens, p.heads, p.dqk, p.scale,
                      lse, prob_sum);
}

void sparse_mqa_backward(const ExecContext& ctx, const SparseAttentionPlan& plan,
                         const SparseMqa& p, const bf16* out, const float* lse, const bf16* dout,
                         bf16* dq, float* dkv, const SparseAttentionBuffers& buffers) {
    const int64_t tokens = p.tokens, heads = p.heads, dqk = p.dqk, dv = p.dv;
    check_dims(dqk, dv);
    if (tokens == 0) return;
    cudaStream_t st_ = stream_of(ctx);
    switch (plan.form) {
        case SparseAttentionForm::AbsorbedFlash:
            return sparse_mqa_backward_wgmma(ctx, p, out, lse, dout, dq, dkv);
        case SparseAttentionForm::AbsorbedMasked:
        case SparseAttentionForm::AbsorbedFlashMasked:
            return sparse_mqa_backward_masked(ctx, p, out, lse, dout, dq, dkv,
                                              masked_buffers(plan, buffers));
        case SparseAttentionForm::AbsorbedGathered:
            // Context parallelism: more key rows than queries. The gathered kernels zero the
            // first `tokens` rows and accumulate; zero them all here.
            if (p.key_rows > tokens && !p.dkv_accumulate)
                ST_CUDA_CHECK(cudaMemsetAsync(dkv, 0, p.key_rows * dqk * sizeof(float), st_));
            return sparse_mqa_backward_tc(ctx, p, out, lse, dout, dq, dkv);
        case SparseAttentionForm::AbsorbedReference:
            break;
        case SparseAttentionForm::ExpandedMasked:
            throw Error("sparse_mqa_backward: the expanded form runs sparse_mha_backward");
    }
    if (!p.dkv_accumulate)
        ST_CUDA_CHECK(
            cudaMemsetAsync(dkv, 0, std::max(tokens, p.key_rows) * dqk * sizeof(float), st_));
    SparseKeys keys{dev(p.kv), dqk, p.kslots, p.idx, p.len};
    const size_t smem = (dqk + dv + 2 * kChunk) * sizeof(float);
    // The value is the first dv columns of the latent row: dv goes into dkv with dkv's strides.
    attn_bwd_kernel<<<dim3(tokens, heads), kThreads, smem, st_>>>(
        keys, tokens, heads, dqk, dv, dev(p.q), heads * dqk, dqk, dev(out), lse, dev(dout), p.scale,
        dev(dq), dkv, dqk, 0, dkv, dqk, 0);
    ST_CUDA_LAUNCH_CHECK();
}

void sparse_mha_forward(const ExecContext& ctx, const SparseAttentionPlan& plan, const SparseMha& p,
                        bf16* out, float* lse, float* prob_sum,
                        const SparseAttentionBuffers& buffers) {
    ST_CHECK(plan.form == SparseAttentionForm::ExpandedMasked, "sparse_mha_forward: the ",
             form_name(plan.form), " form is the absorbed attention's");
    if (p.tokens == 0) return;
    sparse_mha_forward_masked(ctx, p, out, lse, prob_sum, masked_buffers(plan, buffers));
}

void sparse_mha_backward(const ExecContext& ctx, const SparseAttentionPlan& plan,
                         const SparseMha& p, const bf16* out, const float* lse, const bf16* dout,
                         bf16* dq, float* dk, float* dv, const SparseAttentionBuffers& buffers) {
    ST_CHECK(plan.form == SparseAttentionForm::ExpandedMasked, "sparse_mha_backward: the ",
             form_name(plan.form), " form is the absorbed attention's");
    if (p.tokens == 0) return;
    sparse_mha_backward_masked(ctx, p, out, lse, dout, dq, dk, dv, masked_buffers(plan, buffers));
}

}  // namespace sparsetron::cuda
