#include "sparsetron/model/cuda/decoder_layer.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/norm/norm.h"

#include <algorithm>
#include <string>

namespace sparsetron::cuda {

namespace {
// The workspace phases of a layer's modules (CudaBuffers::Phase).
constexpr const char* kAttentionPhase = "attention";
constexpr const char* kMoePhase = "moe";
constexpr const char* kMlpPhase = "mlp";
}  // namespace

CudaDecoderLayer::CudaDecoderLayer(const ModelConfig& c, const CudaParams& P, CudaBuffers& B,
                                   CudaShared& S, int64_t layer0, int64_t tokens,
                                   int64_t key_tokens)
    : c_(c),
      P_(P),
      S_(S),
      layer_(layer0),
      T_(tokens),
      h_(c.hidden_size),
      act_(c.activation()),
      recompute_norms_(act_.recomputes(RecomputeModule::Layernorm)) {
    const std::string p = cat("model.layers.", layer0, ".");
    const bool is_mtp = layer0 >= c.num_layers;  // MTP layers (distinct ones follow the first)
    in_norm_ = P.index(p + "input_layernorm.weight");
    post_norm_ = P.index(p + "post_attention_layernorm.weight");
    // What the layer's indexer loss reads of the attention, and whether MTP's kv sharing hands
    // its latent keys on: the attention plan's choices depend on both (attention_plan.h).
    const bool loss = c.uses_dsa() && dsa_layer_is_full(c, layer0) && c.dsa_indexer_loss_coeff > 0;
    const IndexerTeacher teacher = !loss                           ? IndexerTeacher::None
                                   : c.dsa_indexer_use_sparse_loss ? IndexerTeacher::Sparse
                                                                   : IndexerTeacher::Dense;
    const bool shared_keys = is_mtp && c.dsa_mtp_index_kv_share;
    {
        // The attention and its indexer: one phase (the indexer runs between the attention's
        // projections and its core, whose recomputed buffers outlive it).
        CudaBuffers::Phase phase(B, kAttentionPhase);
        attn_ = std::make_unique<CudaMlaAttention>(c, P, B, S, p + "self_attn.", tokens,
                                                   c.uses_dsa(), key_tokens, teacher, shared_keys);
        if (c.uses_dsa() && dsa_layer_is_full(c, layer0))
            indexer_ = std::make_unique<CudaDsaIndexer>(c, P, B, S, p + "self_attn.indexer.",
                                                        tokens, key_tokens);
    }
    if (c.uses_dsa()) {
        kslots_ = std::min(c.dsa_indexer_topk, key_tokens > 0 ? key_tokens : tokens);
        if (indexer_ && c.dsa_indexer_loss_coeff > 0 && c.dsa_indexer_use_sparse_loss)
            B.scratch(prob_sum_, "attn.head_prob_sum", {tokens, kslots_});
    }
    if (c.is_moe_layer(is_mtp ? c.num_layers - 1 : layer0)) {
        CudaBuffers::Phase phase(B, kMoePhase);
        moe_ = std::make_unique<CudaMoeLayer>(c, P, B, p + "mlp.", tokens, S.max_docs, S.moe_stash,
                                              S.fp8);
    } else {
        CudaBuffers::Phase phase(B, kMlpPhase);
        mlp_ = std::make_unique<CudaSwiGluMlp>(P, B, p + "mlp.", h_, c.ffn_hidden_size, tokens,
                                               "mlp", act_.recomputes(RecomputeModule::Mlp), S.fp8,
                                               c.recompute_block_rows);
    }
    // The two norm outputs' gradients take turns in one buffer: the MLP's (or MoE's) is read by
    // the post-attention norm's backward before the attention's backward writes its own.
    B.scratch(da_, "grad.layer.norm_out", {tokens, h_});
    B.scratch(dm_, "grad.layer.norm_out", {tokens, h_});
}

void CudaDecoderLayer::declare(Acts& A, CudaBuffers& B, const std::string& p) const {
    A = Acts{};
    // Selective recompute of layernorm: the two norm outputs take turns in one buffer, rewritten
    // from the kept inputs and rstd before the backward reads them (the forward's attention,
    // indexer loss included, reads the first before the second is written; the backward's MLP or
    // MoE reads the second before the first is written again).
    B.saved(saving(act_, RecomputeModule::Layernorm, OffloadModule::AttnNorm), A.a,
            p + "attn_norm_out", "layer.recomputed.norm_out", {T_, h_});
    B.saved(saving(act_, RecomputeModule::Layernorm, OffloadModule::MlpNorm), A.m,
            p + "mlp_norm_out", "layer.recomputed.norm_out", {T_, h_});
    B.act(A.rstd_in, p + "attn_norm_rstd", {T_});
    B.act(A.x_mid, p + "x_mid", {T_, h_});
    B.act(A.rstd_post, p + "mlp_norm_rstd", {T_});
    {
        CudaBuffers::Phase phase(B, kAttentionPhase);
        attn_->declare(A.attn, B, p);
        if (indexer_) indexer_->declare(A.idx, B, p);
    }
    if (mlp_) {
        CudaBuffers::Phase phase(B, kMlpPhase);
        mlp_->declare(A.mlp, B, p + "mlp_");
    }
    if (moe_) {
        CudaBuffers::Phase phase(B, kMoePhase);
        moe_->declare(A.moe, B, p + "moe.");
    }
}

void CudaDecoderLayer::forward(const ExecContext& ctx, Acts& A, const bf16* x, bf16* out,
                               const CudaInputs& in, float indexer_grad_scale) const {
    const int64_t Tn = T_, B2 = sizeof(bf16);
    const float eps = float(c_.norm_epsilon);
    cuda::rmsnorm_forward(ctx, x, h_, P_[in_norm_].w, Tn, h_, eps, A.a, h_, A.rstd_in);
    attn_->project(ctx, A.attn, A.a, in);
    const bool run_indexer = indexer_ && !A.skip_indexer;
    if (run_indexer) {
        indexer_->forward(ctx, A.idx, A.a, A.attn.cq, in);
        A.topk = A.idx.topk, A.topk_len = A.idx.len;
    }
    ST_ASSERT(!c_.uses_dsa() || A.topk, "DSA layer ", layer_, " has no top-k source");
    cuda::copy_2d(ctx, A.x_mid, h_ * B2, x, h_ * B2, h_ * B2, Tn);
    // The sparse indexer loss's teacher from the masked attention's probabilities (no second
    // pass); the flash and gathered forms would pay one inside the attention, so the loss
    // recomputes it there.
    float* prob_sum = run_indexer && prob_sum_ && attn_->gives_prob_sum() ? prob_sum_ : nullptr;
    attn_->attend(ctx, A.attn, in, A.topk, A.topk_len, kslots_, A.x_mid, prob_sum);
    if (run_indexer && !in.recompute) {
        ST_ASSERT(c_.dsa_indexer_loss_coeff == 0 || prob_sum || attn_->absorbed(), "DSA layer ",
                  layer_, ": the indexer loss's teacher needs the absorbed attention");
        CudaDsaIndexer::Teacher t{A.attn.qabs,
                                  A.attn.kkeys ? A.attn.kkeys : A.attn.kabs,
                                  A.attn.lse,
                                  c_.num_attention_heads,
                                  attn_->latent_dim(),
                                  attn_->scale(),
                                  prob_sum};
        indexer_->loss(ctx, A.idx, A.a, A.attn.cq, in, t, indexer_grad_scale, A.indexer_sums);
    }
    cuda::rmsnorm_forward(ctx, A.x_mid, h_, P_[post_norm_].w, Tn, h_, eps, A.m, h_, A.rstd_post);
    cuda::copy_2d(ctx, out, h_ * B2, A.x_mid, h_ * B2, h_ * B2, Tn);
    if (mlp_) mlp_->forward(ctx, A.mlp, A.m, out);
    if (moe_) moe_->forward(ctx, A.moe, A.m, in, out);
}

void CudaDecoderLayer::backward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* dx,
                                const CudaInputs& in, float* kv_grad_accum) const {
    const int64_t Tn = T_;
    const float eps = float(c_.norm_epsilon);
    if (recompute_norms_)
        cuda::rmsnorm_forward(ctx, A.x_mid, h_, P_[post_norm_].w, Tn, h_, eps, A.m, h_,
                              A.rstd_post);
    if (mlp_) mlp_->backward(ctx, A.mlp, A.m, dx, dm_, false);
    if (moe_) moe_->backward(ctx, A.moe, A.m, dx, in, dm_);
    cuda::rmsnorm_backward(ctx, dm_, h_, A.x_mid, h_, P_[post_norm_].w, A.rstd_post, Tn, h_, dx, h_,
                           true, P_.grad_to_add(ctx, post_norm_), S_.norm_ws);
    if (recompute_norms_)
        cuda::rmsnorm_forward(ctx, x, h_, P_[in_norm_].w, Tn, h_, eps, A.a, h_, A.rstd_in);
    attn_->backward(ctx, A.attn, A.a, dx, in, A.topk, A.topk_len, kslots_, da_, kv_grad_accum);
    cuda::rmsnorm_backward(ctx, da_, h_, x, h_, P_[in_norm_].w, A.rstd_in, Tn, h_, dx, h_, true,
                           P_.grad_to_add(ctx, in_norm_), S_.norm_ws);
}

}  // namespace sparsetron::cuda
