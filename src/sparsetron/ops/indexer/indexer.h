// The DSA lightning indexer (SPEC §3, §3.1): scores I[t, s] = Σ_j w[t, j] relu(q[t, j] · k[s])
// over each row's causal keys in its document, the deterministic top-k, the KL loss against the
// attention's head-summed probabilities and its backward through the scores. CPU reference:
// indexer_cpu.cpp; CUDA: indexer.cu (scores, dispatch), indexer_wgmma.cu (the fused scores),
// topk_stream.cu (top-k), indexer_loss.cu (KL and backward). Tests: tests/ops/test_indexer.cpp,
// tests/gpu/ops/test_indexer_cuda.cpp, test_indexer_wgmma_cuda.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"
#include "sparsetron/ops/indexer/indexer_plan.h"

namespace sparsetron::cpu {

// Scores of one query row against keys s = begin .. last: out[s] = Σ_j w[j] relu(q[j] · k[s])
// (q [H, dim] the row's heads, w [H], k [keys, dim]); other entries of out are not written.
template <typename T>
void indexer_scores_row(const T* q, const T* w, const T* k, int64_t heads, int64_t dim,
                        int64_t begin, int64_t last, T* out);

// The top-k rule (SPEC §3): the min(k, n) largest of row[begin .. last] (n keys, `row` indexed by
// key), ties toward the smaller key index, written ascending into idx; returns how many.
// `order` is scratch.
template <typename T>
int64_t topk_row(const T* row, int64_t begin, int64_t last, int64_t k, int32_t* idx,
                 std::vector<int32_t>& order);

// What the indexer loss needs from the attention: Q' [tokens, heads, dim] of the query rows,
// K' [key rows, dim], the sparse attention's LSE [heads, tokens] and its scale.
template <typename T>
struct IndexerTeacher {
    const T* q;
    const T* k;
    const T* lse;
    int64_t heads, dim;
    double scale;
    int64_t tokens;  // query rows: the LSE's row stride
};

// The KL loss of query row t over its support (n key rows, ascending): teacher p = normalize(Σ_h
// exp(scale q'_h · k'_s - lse_h)) with the attention's LSE when `sparse`, recomputed over the
// support otherwise; student log q = log_softmax(scores[support]). Returns Σ p (log p - log q)
// and writes target[s] = q_s - p_s on the support (the loss's gradient with respect to the
// scores). `p` is scratch.
template <typename T>
double indexer_kl_row(const IndexerTeacher<T>& tc, int64_t t, bool sparse, const int32_t* support,
                      int64_t n, const T* scores, T* target, std::vector<double>& p);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// scores[t, s] = Σ_j w[t, j] relu(q[t, j] · k[s]) for s in [row_begin[t], t]; other columns of a
// row are not written. q: [T, H, d] bf16, k: [T, d] bf16, w: [T, H] fp32, scores: [T, T] fp32, in
// the planned form (indexer_plan.h): the Gemm form takes `workspace` (the plan's bytes; a smaller
// one means smaller chunks). The key-row form (key_row given; not the Gemm form): query row t is
// micro-batch row key_row[t], k holds `keys` micro-batch rows and scores rows are `keys` long.
void indexer_scores(const ExecContext& ctx, IndexerScoresForm form, const bf16* q, const bf16* k,
                    const float* w, const int32_t* row_begin, int64_t tokens, int64_t heads,
                    int64_t dim, float* scores, void* workspace = nullptr,
                    int64_t workspace_bytes = 0, const int32_t* key_row = nullptr,
                    int64_t keys = 0);
// Per row: the min(kslots, t - begin + 1) largest scores of [begin, t], ties toward the smaller
// key index (deterministic), written ascending; -1 padding; len[t]. Padding rows: len 0.
// key_row (context parallelism): row t's keys are [begin, key_row[t]].
void topk_rows(const ExecContext& ctx, const float* scores, int64_t ld, const int32_t* row_begin,
               int64_t tokens, int64_t kslots, int32_t* idx, int32_t* len,
               const int32_t* key_row = nullptr);

// Per row t with support S_t (sparse: idx[t, :len[t]]; dense: row_begin[t]..t):
//   teacher p = normalize(Σ_h softmax-probabilities of the attention, exp(scale q'_h·k'_s - lse_h))
//   (sparse: the attention's own lse [H, T]; dense: recomputed over S_t),
//   student log q = log_softmax(scores[t, S_t]); kl[t] = Σ p (log p - log q);
//   dscore[t, s] = q_s - p_s on the support (dense layout [T, T] like the scores).
// qabs [T, H, dl] and kabs [T, dl] are the absorbed query and latent key (bf16).
// teacher_sum (sparse loss only, may be null): the attention's Σ_h P [T, kslots] from
// sparse_mqa_forward; when given, qabs/kabs/lse are not read. Context parallelism: key_row[t] is
// query row t's micro-batch row and scores rows are `keys` long. A block of query rows (no CP):
// the rows are micro-batch rows first_row .. first_row + tokens - 1 (qabs, teacher_sum, scores,
// idx, len, row_begin, kl and dscore given from the block's first row, lse from its column
// first_row with rows lse_ld apart), their scores and dscore rows first_row + tokens long.
struct IndexerKl {
    bool sparse = true;
    const bf16* qabs = nullptr;
    const bf16* kabs = nullptr;
    const float* lse = nullptr;
    int64_t heads = 0, dl = 0;
    float scale = 1.f;
    const float* teacher_sum = nullptr;
    const float* scores = nullptr;
    const int32_t* idx = nullptr;
    const int32_t* len = nullptr;
    int64_t kslots = 0;
    const int32_t* row_begin = nullptr;
    int64_t tokens = 0;
    const int32_t* key_row = nullptr;
    int64_t keys = 0;
    int64_t first_row = 0;
    int64_t lse_ld = 0;  // the LSE's row stride: `tokens` when 0
};
void indexer_kl(const ExecContext& ctx, const IndexerKl& p, float* kl, float* dscore);
// Back through the scores: with g = dscore * grad_scale on the support,
//   dw[t, j] = Σ_s g relu'(.) (q_tj·k_s), dq[t, j] = Σ_s g w[t, j] 1[q·k > 0] k_s (bf16),
//   dk[s] += Σ_t g w[t, j] 1[q·k > 0] q_tj (fp32, zeroed first unless add_dk; [keys] rows under
//   CP, first_row + tokens rows for a block).
// grad_scale_dev (a device scalar, may be null) multiplies grad_scale. A block of query rows (no
// CP) as in IndexerKl: q, w, dscore, idx, len, row_begin, dw and dq from the block's first row,
// k and dk whole; the blocks of a micro-batch add their key gradients into one dk, zeroed
// before the first, with add_dk.
struct IndexerScoresBackward {
    bool sparse = true;
    const bf16* q = nullptr;
    const bf16* k = nullptr;
    const float* w = nullptr;
    const float* dscore = nullptr;
    float grad_scale = 1.f;
    const float* grad_scale_dev = nullptr;
    const int32_t* idx = nullptr;
    const int32_t* len = nullptr;
    int64_t kslots = 0;
    const int32_t* row_begin = nullptr;
    int64_t tokens = 0, heads = 0, dim = 0;
    const int32_t* key_row = nullptr;
    int64_t keys = 0;
    int64_t first_row = 0;
    bool add_dk = false;
    IndexerBackwardForm form = IndexerBackwardForm::Rows;
    void* workspace = nullptr;  // the Gemm form's
    int64_t workspace_bytes = 0;
};
void indexer_scores_backward(const ExecContext& ctx, const IndexerScoresBackward& p, float* dw,
                             bf16* dq, float* dk);
// The Gemm form (no key_row; workspace_bytes of at least indexer_scores_backward_bytes_per_token
// of the block's first_row + tokens keys) runs GEMMs over chunks of query tokens: the per-head
// logits Q K^T (fp32) against every earlier key, one kernel forming their gradient (bf16, 0 off
// the support) and dw, then dq = dD K and dk += dD^T Q by cuBLASLt (deterministic). The Rows form
// runs a kernel per query row with atomics.
// Σ kl over rows with len > 0 and the number of those rows: out[0] += Σ, out[1] += count.
void indexer_kl_sum(const ExecContext& ctx, const float* kl, const int32_t* len, int64_t tokens,
                    double* out);

}  // namespace sparsetron::cuda
