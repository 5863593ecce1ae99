// The CUDA kernels behind the sparse attention's forms (attention_plan.h), which the dispatch
// (attention.cu, sparse_mqa_masked.cu) runs by the plan's form and the tests call directly.
#pragma once

#include <cstdint>

#include "sparsetron/ops/attention/attention.h"

namespace sparsetron::cuda {

// The masked kernels' buffers: the workspace of `bytes` and the probabilities the forward keeps
// (null: recomputed by the backward).
struct MaskedWorkspace {
    void* ptr = nullptr;
    int64_t bytes = 0;
    bf16* saved_probs = nullptr;
};

// The flash-style wgmma forward (sm_90a, flash_shape: 64 heads, qk 576, v 512; no saved
// probabilities): the AbsorbedFlash and AbsorbedFlashMasked forms' forward.
void sparse_mqa_forward_wgmma(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                              float* prob_sum = nullptr);
bool sparse_mqa_forward_wgmma_supported(int64_t heads, int64_t dqk, int64_t dv);
// The flash-style wgmma backward (same shapes; sparse_mqa_wgmma_bwd.cu): dq overwritten, dkv
// [max(tokens, key_rows), dqk] zeroed then accumulated by reductions: the AbsorbedFlash form's.
void sparse_mqa_backward_wgmma(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                               const float* lse, const bf16* dout, bf16* dq, float* dkv);

// Tensor-core sparse MQA (sparse_mqa_tc.cu; gathered_shape): the AbsorbedGathered form.
void sparse_mqa_forward_tc(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                           float* prob_sum);
void sparse_mqa_backward_tc(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                            const float* lse, const bf16* dout, bf16* dq, float* dkv);

// Masked dense GEMMs (sparse_mqa_masked.cu): the masked forms' forward and backward, and the
// expanded form's.
void sparse_mqa_forward_masked(const ExecContext& ctx, const SparseMqa& p, bf16* out, float* lse,
                               float* prob_sum, const MaskedWorkspace& ws);
void sparse_mqa_backward_masked(const ExecContext& ctx, const SparseMqa& p, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dkv,
                                const MaskedWorkspace& ws);
void sparse_mha_forward_masked(const ExecContext& ctx, const SparseMha& p, bf16* out, float* lse,
                               float* prob_sum, const MaskedWorkspace& ws);
void sparse_mha_backward_masked(const ExecContext& ctx, const SparseMha& p, const bf16* out,
                                const float* lse, const bf16* dout, bf16* dq, float* dk, float* dv,
                                const MaskedWorkspace& ws);

// masked_dscores_wgmma.cu: the expanded masked backward's dS = scale P (dO V^T - D) from saved
// probabilities with dP in registers, for one chunk (query tokens t0 .. t0 + n - 1 against keys
// 0 .. t1 - 1; P and dS [n * heads, lds] in the chunk's layout; dsum[t * heads + h] = D of token
// t, head h). Supported on sm_90a with v 256.
bool masked_dscores_wgmma_supported(int64_t dv, const HeadKV& kv);
void masked_dscores_wgmma(const ExecContext& ctx, const bf16* dout, const HeadKV& kv, const bf16* p,
                          bf16* ds, int64_t lds, const float* dsum, int64_t t0, int64_t n,
                          int64_t t1, int64_t heads, float scale);

// masked_probs_wgmma.cu: the expanded masked forward's P (bf16, the chunk's layout [n * heads,
// lds]) and lse of one chunk with the scores in registers, from each token's selected keys as
// bits (build_token_key_masks: mask[t * mwords + w] bit b = key 32 w + b; mwords =
// token_key_mask_words(tokens)). Supported on sm_90a with qk 256; no head-summed probabilities
// (the indexer loss's layers keep the unfused form).
bool masked_probs_wgmma_supported(int64_t dqk, const HeadKV& kv);
int64_t token_key_mask_words(int64_t tokens);
void build_token_key_masks(const ExecContext& ctx, const int32_t* idx, const int32_t* len,
                           int64_t kslots, int64_t tokens, int64_t mwords, uint32_t* mask);
void masked_probs_wgmma(const ExecContext& ctx, const bf16* q, const HeadKV& kv,
                        const uint32_t* mask, int64_t mwords, bf16* p, int64_t lds, float* lse,
                        int64_t tokens, int64_t t0, int64_t n, int64_t t1, int64_t heads,
                        float scale);

// Σ_h P recomputed from Q', K' and the lse (the per-row form's teacher; indexer_loss.cu).
void head_prob_sum(const ExecContext& ctx, const bf16* q, const bf16* kv, const int32_t* idx,
                   const int32_t* len, int64_t kslots, int64_t tokens, int64_t heads, int64_t dl,
                   float scale, const float* lse, float* prob_sum);

}  // namespace sparsetron::cuda
