// Attention: dense causal attention within packed documents (MLA's expanded form without DSA),
// sparse multi-query attention over the indexer's top-k (the absorbed MLA of SPEC §2-3), the same
// sparse attention in MLA's expanded per-head form, and the MLA key/value helpers. CPU references:
// dense_attention_cpu.cpp, sparse_attention_cpu.cpp; CUDA forms and which runs when:
// attention.cu, attention_forms.h and docs/cuda.md. Tests: tests/ops/test_attention.cpp,
// tests/gpu/ops/test_attention_cuda.cpp, test_sparse_mqa_wgmma_cuda.cpp,
// test_sparse_mha_masked_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/attention/attention_plan.h"

namespace sparsetron::cpu {

// Causal attention within packed documents. q,k: [T, H, dqk], v: [T, H, dv] with token/head
// strides (unit stride inside a head); out: [T, H, dv] contiguous; lse: [H, T].
// Rows outside every document (padding) get out = 0 and lse = 0.
struct AttnShape {
    int64_t tokens, heads, dqk, dv;
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;  // strides (tokens, heads)
};
template <typename T>
void attention_forward(const AttnShape& s, const T* q, const T* k, const T* v,
                       const int32_t* cu_seqlens, int64_t num_docs, double scale, T* out, T* lse);
// dq, dk: same strides as q, k; dv: same strides as v. All three are overwritten.
template <typename T>
void attention_backward(const AttnShape& s, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const T* dout, const int32_t* cu_seqlens, int64_t num_docs,
                        double scale, T* dq, T* dk, T* dv);

// Sparse multi-query attention over selected keys (the absorbed MLA of SPEC §2-3): one key/value
// head shared by all query heads. q: [T, H, dqk]; kv: [T, dqk] with v = kv[:, :dv]; idx: [T, K]
// ascending key rows (-1 = unused) with len[t] valid entries; out: [T, H, dv]; lse: [H, T].
// Rows with no key get out = 0, lse = 0.
template <typename T>
void sparse_mqa_forward(int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, const T* q,
                        const T* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
                        double scale, T* out, T* lse);
// dq: [T, H, dqk] (overwritten); dkv: [keys, dqk] (overwritten; the value gradient is added into
// its first dv columns because v aliases them). dkv_heads: scratch [H, keys, dqk] (per-head
// partials, summed in head order so the result does not depend on threads). keys: rows of kv
// (0: tokens; context parallelism attends over more key rows than it has queries).
template <typename T>
void sparse_mqa_backward(int64_t tokens, int64_t heads, int64_t dqk, int64_t dv, const T* q,
                         const T* kv, const int32_t* idx, const int32_t* len, int64_t kslots,
                         double scale, const T* out, const T* lse, const T* dout, T* dq,
                         T* dkv_heads, T* dkv, int64_t keys = 0);

// The DSA indexer loss's teacher before normalization: sums[t, j] = Σ_h exp(scale q_h ·
// kv[idx[t, j]] - lse[h, t]) for each selected key j < len[t], 0 past it (fp64 sums; sums [T, K]).
template <typename T>
void sparse_mqa_prob_sums(int64_t tokens, int64_t heads, int64_t dqk, const T* q, const T* kv,
                          const int32_t* idx, const int32_t* len, int64_t kslots, double scale,
                          const T* lse, T* sums);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// Document layout: row_begin[t] = first row of t's document, -1 for padding rows (no document).
void doc_row_begin(const ExecContext& ctx, const int32_t* cu_seqlens, const int32_t* num_docs,
                   int64_t tokens, int32_t* row_begin);

// Dense causal attention within documents (the expanded MLA path). Strides as cpu::AttnShape.
// out: [T, H, dv] bf16, lse: [H, T] fp32 (0 for padding rows).
struct AttnShape {
    int64_t tokens, heads, dqk, dv;
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh;
};
void attention_forward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                       const bf16* v, const int32_t* row_begin, float scale, bf16* out, float* lse);
// dq: bf16 with q's strides (overwritten); dk [T, H, dqk], dv [T, H, dv]: fp32, contiguous,
// overwritten (zeroed, then accumulated with atomics).
void attention_backward(const ExecContext& ctx, const AttnShape& s, const bf16* q, const bf16* k,
                        const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                        const int32_t* row_begin, float scale, bf16* dq, float* dk, float* dv);

// One sparse MQA problem: q [tokens, heads, dqk], the latent rows kv [key rows, dqk] (the value
// is their first dv columns), each query row's selected key rows idx [tokens, kslots] (ascending,
// len[t] of them) and the softmax scale. key_rows: rows of kv (0: tokens, query row t being key
// row t; context parallelism has more key rows than queries, and the masked forms score every
// chunk of queries against all of them, the top-k still selecting which count).
struct SparseMqa {
    int64_t tokens = 0, heads = 0, dqk = 0, dv = 0;
    const bf16* q = nullptr;
    const bf16* kv = nullptr;
    const int32_t* idx = nullptr;
    const int32_t* len = nullptr;
    int64_t kslots = 0;
    float scale = 1.f;
    int64_t key_rows = 0;  // rows of kv (0: tokens)
    // Add into dkv, which already holds other query rows' sum (the query blocks of one attention),
    // instead of zeroing it first. Gathered forms only.
    bool dkv_accumulate = false;
};
// The buffers a plan's form needs (attention_plan.h): the masked forms' workspace of
// plan.workspace_bytes, and the plan.saved_probs_elems probabilities a masked forward keeps for
// its backward.
struct SparseAttentionBuffers {
    void* workspace = nullptr;
    bf16* saved_probs = nullptr;
};
// Sparse MQA over selected keys (absorbed MLA), like cpu::sparse_mqa_forward, in the plan's form
// (an absorbed one). With prob_sum ([T, kslots] fp32), also writes Σ_h P[h, t, j] for each
// selected key j (0 past len[t]): the DSA indexer loss's teacher before normalization, so the
// loss needs no second pass over Q'K'.
void sparse_mqa_forward(const ExecContext& ctx, const SparseAttentionPlan& plan, const SparseMqa& p,
                        bf16* out, float* lse, float* prob_sum = nullptr,
                        const SparseAttentionBuffers& buffers = {});
// dq bf16 (overwritten); dkv fp32 [key rows, dqk] (zeroed unless dkv_accumulate, then
// accumulated: atomics when gathered, chunk-ordered GEMM accumulation when masked).
void sparse_mqa_backward(const ExecContext& ctx, const SparseAttentionPlan& plan,
                         const SparseMqa& p, const bf16* out, const float* lse, const bf16* dout,
                         bf16* dq, float* dkv, const SparseAttentionBuffers& buffers = {});
// The same sparse attention in MLA's expanded form (per-head keys and values, the top-k shared by
// the heads; the plan's form ExpandedMasked), as masked dense GEMMs batched over the heads: the
// absorbed masked form's workspace, its saved probabilities and its P / dS kernels;
// scores over dqk and values of dv per head instead of the latent's L and kr (at the GLM-5 shape
// 256 + 256 against 576 + 512: 0.47x the GEMM FLOPs). q [T, H, dqk], out [T, H, dv], dq
// (overwritten) contiguous; head h's keys at k + t * k_row + h * k_head, values likewise.
// Backward: dk [T, H, dqk] and dv [T, H, dv] fp32, overwritten (chunks in reverse order: the last
// covers every key and writes, the others add; deterministic). Not for context parallelism.
struct HeadKV {
    const bf16* k;
    int64_t k_row, k_head;
    const bf16* v;
    int64_t v_row, v_head;
};
struct SparseMha {
    int64_t tokens = 0, heads = 0, dqk = 0, dv = 0;
    const bf16* q = nullptr;
    HeadKV kv{};
    const int32_t* idx = nullptr;
    const int32_t* len = nullptr;
    int64_t kslots = 0;
    float scale = 1.f;
};
void sparse_mha_forward(const ExecContext& ctx, const SparseAttentionPlan& plan, const SparseMha& p,
                        bf16* out, float* lse, float* prob_sum,
                        const SparseAttentionBuffers& buffers);
void sparse_mha_backward(const ExecContext& ctx, const SparseAttentionPlan& plan,
                         const SparseMha& p, const bf16* out, const float* lse, const bf16* dout,
                         bf16* dq, float* dk, float* dv, const SparseAttentionBuffers& buffers);

// MLA helpers. Expanded-attention keys from the kv_b output [T, H, dn + dvh] and the shared RoPE
// key (row t at pe + t * ld_pe): k[t, h, :dn] = kv[t, h, :dn], k[t, h, dn:] = pe[t, :dr]. One
// launch for all heads (the shared key broadcast to every head).
void mla_expanded_keys(const ExecContext& ctx, const bf16* kv, const bf16* pe, int64_t ld_pe,
                       int64_t tokens, int64_t heads, int64_t dn, int64_t dr, int64_t dvh, bf16* k);
// Expanded-attention key/value gradients back to the kv_b output and the shared RoPE key:
// dkv[t, h*(dn+dv) + i] = dk[t, h, i] (i < dn), dkv[t, h*(dn+dv) + dn + i] = dv[t, h, i];
// dpe[t * ld_pe + i] = Σ_h dk[t, h, dn + i].
void mla_expanded_kv_grad(const ExecContext& ctx, const float* dk, const float* dv, int64_t tokens,
                          int64_t heads, int64_t dn, int64_t dr, int64_t dvh, bf16* dkv, bf16* dpe,
                          int64_t ld_pe);

}  // namespace sparsetron::cuda
