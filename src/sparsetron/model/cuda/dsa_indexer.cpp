#include "sparsetron/model/cuda/dsa_indexer.h"
#include "sparsetron/core/device_memory.h"
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/model/cuda/cp_keys.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/norm/norm.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace sparsetron::cuda {

using cuda::gemm;

CudaDsaIndexer::CudaDsaIndexer(const ModelConfig& c, const CudaParams& P, CudaBuffers& B,
                               CudaShared& S, const std::string& p, int64_t tokens,
                               int64_t key_tokens)
    : c_(c),
      P_(P),
      S_(S),
      T_(tokens),
      h_(c.hidden_size),
      HI_(c.dsa_indexer_n_heads),
      dI_(c.dsa_indexer_head_dim),
      dr_(c.qk_pos_emb_head_dim),
      qr_(c.q_lora_rank),
      K_(std::min(c.dsa_indexer_topk, key_tokens > 0 ? key_tokens : tokens)),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens),
      wscale_(float(1.0 / std::sqrt(double(c.dsa_indexer_n_heads) * c.dsa_indexer_head_dim))) {
    wq_ = P.index(p + "wq_b.weight");
    wk_ = P.index(p + "wk.weight");
    knw_ = P.index(p + "k_norm.weight");
    knb_ = P.index(p + "k_norm.bias");
    ww_ = P.index(p + "weights_proj.weight");
    const int64_t Tn = tokens;
    // Blocks take the CP form of the kernels (query row t against key rows up to in.rows[t],
    // or under CP in.key_row[t]), which the fused wgmma scores serve like the whole. The
    // forward keeps only each block's top-k; the loss (after the attention) scores each block
    // again, so neither the scores nor their gradient is ever [rows, key rows].
    const bool loss = c.dsa_indexer_loss_coeff != 0;
    // The forms, query blocks and workspace: decided once, here (indexer_plan.h).
    plan_ = plan_indexer({.tokens = Tn,
                          .key_rows = cp_ ? Tk_ : 0,
                          .heads = HI_,
                          .dim = dI_,
                          .query_block = c.dsa_indexer_query_block,
                          .loss = loss,
                          .sm90a = cuda_available() && has_sm90a()});
    block_ = plan_.query_block_rows;
    B.scratch(scores_, "dsa.scores", {block_, Tk_});
    dots_bytes_ = plan_.workspace_bytes;
    dots_ = nullptr;
    if (dots_bytes_ > 0) B.scratch(dots_, "dsa.score_dots", {dots_bytes_ / 4});
    if (cp_) {
        B.scratch(keys_f32_, "dsa.cp_k_all_rows_f32", {Tk_, dI_});
        B.scratch(cp_xfer_, "dsa.cp_k_exchange", {cp_key_exchange_floats(c, Tn, dI_)});
    }
    if (loss) B.scratch(dscore_, "dsa.loss_grad", {block_, Tk_});
    B.scratch(kl_, "dsa.kl_rows", {Tn});
    B.scratch(dw32_, "grad.dsa.weights", {Tn, HI_});
    B.scratch(dwb_, "grad.dsa.weights_bf16", {Tn, HI_});
    B.scratch(dk32_, "grad.dsa.k_f32", {Tn, dI_});
    B.scratch(dq_, "grad.dsa.q", {Tn, HI_ * dI_});
    B.scratch(dk_, "grad.dsa.k", {Tn, dI_});
    B.scratch(dkraw_, "grad.dsa.k_raw", {Tn, dI_});
}

void CudaDsaIndexer::declare(Acts& A, CudaBuffers& B, const std::string& p) const {
    A = Acts{};
    // Read only inside the layer's forward (the loss and its gradient run there): one buffer each
    // for every indexer, in the workspace.
    B.scratch(A.q, "dsa.q", {T_, HI_ * dI_});
    B.scratch(A.k_raw, "dsa.k_raw", {T_, dI_});
    B.scratch(A.k, "dsa.k", {T_, dI_});
    B.scratch(A.mean, "dsa.k_mean", {T_});
    B.scratch(A.rstd, "dsa.k_rstd", {T_});
    B.scratch(A.w, "dsa.weights", {T_, HI_});
    B.act(A.topk, p + "topk_indices", {T_, K_});
    B.act(A.len, p + "topk_length", {T_});
    if (cp_) B.act(A.kkeys, p + "indexer_k_all_rows", {Tk_, dI_});
}

void CudaDsaIndexer::forward(const ExecContext& ctx, const Acts& A, const bf16* a, const bf16* cq,
                             const CudaInputs& in) const {
    const int64_t Tn = T_;
    gemm(ctx, false, true, Tn, HI_ * dI_, qr_, 1.f, cq, qr_, P_[wq_].w, qr_, 0.f, A.q, HI_ * dI_);
    cuda::rope(ctx, A.q, Tn, HI_, dr_, HI_ * dI_, dI_, in.positions, c_.rotary_base,
               c_.dsa_indexer_rope_interleaved, false);
    gemm(ctx, false, true, Tn, dI_, h_, 1.f, a, h_, P_[wk_].w, h_, 0.f, A.k_raw, dI_);
    cuda::layernorm_forward(ctx, A.k_raw, P_[knw_].w, P_[knb_].w, Tn, dI_, 1e-6f, A.k, A.mean,
                            A.rstd);
    cuda::rope(ctx, A.k, Tn, 1, dr_, dI_, 0, in.positions, c_.rotary_base,
               c_.dsa_indexer_rope_interleaved, false);
    gemm(ctx, false, true, Tn, HI_, h_, wscale_, a, h_, P_[ww_].w, h_, 0.f, A.w, HI_, DType::BF16,
         DType::F32);
    if (cp_) {
        // Every micro-batch row's k_I; scores and top-k over micro-batch key rows.
        cp_gather_keys(ctx, in, A.k, dI_, cp_xfer_, A.kkeys);
    } else if (block_ == Tn) {
        cuda::indexer_scores(ctx, plan_.scores, A.q, A.k, A.w, in.row_begin, Tn, HI_, dI_, scores_,
                             dots_, dots_bytes_);
        cuda::topk_rows(ctx, scores_, Tn, in.row_begin, Tn, K_, A.topk, A.len);
        return;
    }
    for (int64_t t0 = 0; t0 < Tn; t0 += block_) {
        const int64_t n = std::min(block_, Tn - t0);
        score_block(ctx, A, in, t0, n);
        cuda::topk_rows(ctx, scores_, cp_ ? Tk_ : t0 + n, in.row_begin + t0, n, K_,
                        A.topk + t0 * K_, A.len + t0, (cp_ ? in.key_row : in.rows) + t0);
    }
}

void CudaDsaIndexer::score_block(const ExecContext& ctx, const Acts& A, const CudaInputs& in,
                                 int64_t t0, int64_t n) const {
    // Row t of the block scores key rows up to in.rows[t0 + t] of the block's first t0 + n rows,
    // or under CP up to in.key_row[t0 + t] of the micro-batch's gathered keys.
    // The key-row form: the Gemm scores (query row = key row) are the whole micro-batch's only.
    const IndexerScoresForm form =
        plan_.scores == IndexerScoresForm::Gemm ? IndexerScoresForm::Rows : plan_.scores;
    cuda::indexer_scores(ctx, form, A.q + t0 * HI_ * dI_, cp_ ? A.kkeys : A.k, A.w + t0 * HI_,
                         in.row_begin + t0, n, HI_, dI_, scores_, nullptr, 0,
                         (cp_ ? in.key_row : in.rows) + t0, cp_ ? Tk_ : t0 + n);
}

void CudaDsaIndexer::loss(const ExecContext& ctx, const Acts& A, const bf16* a, const bf16* cq,
                          const CudaInputs& in, const Teacher& tc, float grad_scale,
                          double* sums) const {
    const double coeff = c_.dsa_indexer_loss_coeff;
    if (coeff == 0) return;
    const int64_t Tn = T_;
    const bool backward = grad_scale != 0;
    if (block_ == Tn) {
        block_loss(ctx, A, in, tc, 0, Tn, backward);  // the forward's scores are still in scores_
    } else {
        // Every block adds its key gradients (each reaches the keys before its end; under CP
        // every gathered key row, summed over the CP ranks after).
        if (backward)
            cuda::zero(ctx, cp_ ? keys_f32_ : dk32_,
                       (cp_ ? Tk_ : Tn) * dI_ * int64_t(sizeof(float)));
        for (int64_t t0 = 0; t0 < Tn; t0 += block_) {
            const int64_t n = std::min(block_, Tn - t0);
            score_block(ctx, A, in, t0, n);
            block_loss(ctx, A, in, tc, t0, n, backward);
        }
    }
    cuda::indexer_kl_sum(ctx, kl_, A.len, Tn, sums);
    if (!backward) return;
    if (cp_) {
        cp_reduce_key_grads(ctx, in, keys_f32_, dI_, cp_xfer_, dk32_);
    }
    const auto BF = DType::BF16;
    cuda::f32_to_bf16(ctx, dw32_, dwb_, Tn * HI_);
    gemm(ctx, true, false, HI_, h_, Tn, wscale_, dwb_, HI_, a, h_, P_.grad_beta(ww_),
         P_[ww_].grad_out(), h_, BF, P_[ww_].grad_type());
    cuda::rope(ctx, dq_, Tn, HI_, dr_, HI_ * dI_, dI_, in.positions, c_.rotary_base,
               c_.dsa_indexer_rope_interleaved, true);
    gemm(ctx, true, false, HI_ * dI_, qr_, Tn, 1.f, dq_, HI_ * dI_, cq, qr_, P_.grad_beta(wq_),
         P_[wq_].grad_out(), qr_, BF, P_[wq_].grad_type());
    cuda::f32_to_bf16(ctx, dk32_, dk_, Tn * dI_);
    cuda::rope(ctx, dk_, Tn, 1, dr_, dI_, 0, in.positions, c_.rotary_base,
               c_.dsa_indexer_rope_interleaved, true);
    cuda::layernorm_backward(ctx, dk_, A.k_raw, P_[knw_].w, A.mean, A.rstd, Tn, dI_, dkraw_,
                             P_.grad_to_add(ctx, knw_), P_.grad_to_add(ctx, knb_), S_.norm_ws);
    gemm(ctx, true, false, dI_, h_, Tn, 1.f, dkraw_, dI_, a, h_, P_.grad_beta(wk_),
         P_[wk_].grad_out(), h_, BF, P_[wk_].grad_type());
}

void CudaDsaIndexer::block_loss(const ExecContext& ctx, const Acts& A, const CudaInputs& in,
                                const Teacher& tc, int64_t t0, int64_t n, bool backward) const {
    const bool sparse = c_.dsa_indexer_use_sparse_loss;
    // Under CP a block is its rows' slice (key_row from t0, scores rows Tk_ long); without, the
    // kernels' block form (rows first_row .. first_row + n - 1 against the keys before them).
    const int32_t* key_row = cp_ ? in.key_row + t0 : nullptr;
    const int64_t first_row = cp_ ? 0 : t0;
    cuda::indexer_kl(ctx,
                     {.sparse = sparse,
                      .qabs = tc.q ? tc.q + t0 * tc.heads * tc.dim : nullptr,
                      .kabs = tc.k,
                      .lse = tc.lse ? tc.lse + t0 : nullptr,
                      .heads = tc.heads,
                      .dl = tc.dim,
                      .scale = tc.scale,
                      .teacher_sum = sparse && tc.prob_sum ? tc.prob_sum + t0 * K_ : nullptr,
                      .scores = scores_,
                      .idx = A.topk + t0 * K_,
                      .len = A.len + t0,
                      .kslots = K_,
                      .row_begin = in.row_begin + t0,
                      .tokens = n,
                      .key_row = key_row,
                      .keys = Tk_,
                      .first_row = first_row,
                      .lse_ld = T_},
                     kl_ + t0, dscore_);
    if (!backward) return;
    // dI = g (q - p) with g = scale * coeff / rows (rows = the micro-batch's real rows), read from
    // the device (in.loss_scales[1]) so a captured step follows each micro-batch's value.
    // Under CP the key side lands on every micro-batch row's k_I (keys_f32_); the blocks add
    // theirs into dk32_.
    cuda::indexer_scores_backward(ctx,
                                  {.sparse = sparse,
                                   .q = A.q + t0 * HI_ * dI_,
                                   .k = cp_ ? A.kkeys : A.k,
                                   .w = A.w + t0 * HI_,
                                   .dscore = dscore_,
                                   .grad_scale = 1.f,
                                   .grad_scale_dev = in.loss_scales + 1,
                                   .idx = A.topk + t0 * K_,
                                   .len = A.len + t0,
                                   .kslots = K_,
                                   .row_begin = in.row_begin + t0,
                                   .tokens = n,
                                   .heads = HI_,
                                   .dim = dI_,
                                   .key_row = key_row,
                                   .keys = Tk_,
                                   .first_row = first_row,
                                   .add_dk = block_ < T_,
                                   .form = plan_.backward,
                                   .workspace = dots_,
                                   .workspace_bytes = dots_bytes_},
                                  dw32_ + t0 * HI_, dq_ + t0 * HI_ * dI_, cp_ ? keys_f32_ : dk32_);
}

}  // namespace sparsetron::cuda
