#include "sparsetron/model/cuda/mla_attention.h"
#include "sparsetron/core/device_memory.h"
#include "sparsetron/cuda/device_caps.h"
#include "sparsetron/model/cuda/cp_keys.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/copy/copy.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/norm/norm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

namespace sparsetron::cuda {

using cuda::gemm;

CudaMlaAttention::CudaMlaAttention(const ModelConfig& c, const CudaParams& P, CudaBuffers& B,
                                   CudaShared& S, const std::string& p, int64_t tokens, bool dsa,
                                   int64_t key_tokens, IndexerTeacher teacher, bool shared_keys)
    : c_(c),
      P_(P),
      S_(S),
      T_(tokens),
      h_(c.hidden_size),
      H_(c.num_attention_heads),
      dq_(c.q_head_dim()),
      dn_(c.qk_head_dim),
      dr_(c.qk_pos_emb_head_dim),
      dv_(c.v_head_dim),
      qr_(c.q_lora_rank),
      kr_(c.kv_lora_rank),
      dsa_(dsa),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens),
      act_(c.activation()),
      recompute_up_(act_.recomputes(RecomputeModule::MlaUpProj)),
      recompute_core_(act_.recomputes(RecomputeModule::CoreAttn)) {
    ST_CHECK(!cp_ || dsa, "context parallelism needs the absorbed (DSA) attention");
    q_a_ = P.index(p + "q_a_proj.weight");
    q_a_norm_ = P.index(p + "q_a_layernorm.weight");
    q_b_ = P.index(p + "q_b_proj.weight");
    kv_a_ = P.index(p + "kv_a_proj_with_mqa.weight");
    kv_a_norm_ = P.index(p + "kv_a_layernorm.weight");
    kv_b_ = P.index(p + "kv_b_proj.weight");
    o_ = P.index(p + "o_proj.weight");
    if (S.fp8) {
        fp8_ = S.fp8;
        fqa_ = S.fp8->add(q_a_);
        fqb_ = S.fp8->add(q_b_);
        fkva_ = S.fp8->add(kv_a_);
        fo_ = S.fp8->add(o_);
    }
    const int64_t Tn = tokens, L = kr_ + dr_;
    B.scratch(dcq_, "grad.attn.q_a_norm_out", {Tn, qr_});
    B.scratch(dcq_raw_, "grad.attn.q_a", {Tn, qr_});
    B.scratch(dckv_, "grad.attn.kv_a", {Tn, L});
    B.scratch(dckv_n_, "grad.attn.kv_a_norm_out", {Tn, kr_});
    dqabs_ = doabs_ = dkv_ = nullptr;
    dkabs_ = dk32_ = dv32_ = nullptr;
    Bq_ = T_;
    absorbed_ = false;
    if (dsa) {
        // The form, its workspace, kept probabilities and query blocks: decided once, here.
        const int64_t keys = cp_ ? Tk_ : Tn;
        plan_ = plan_sparse_attention({.tokens = Tn,
                                       .key_rows = cp_ ? Tk_ : 0,
                                       .heads = H_,
                                       .dqk = kr_ + dr_,
                                       .dv = kr_,
                                       .topk = std::min(c.dsa_indexer_topk, keys),
                                       .sm90a = cuda_available() && has_sm90a(),
                                       .teacher = teacher,
                                       .shared_keys = shared_keys,
                                       .recompute_up = recompute_up_,
                                       .recompute_core = recompute_core_,
                                       .fp8 = S.fp8 != nullptr,
                                       .block_rows = c.recompute_block_rows,
                                       .saved_probs_max = c.dsa_saved_probs_max_mib << 20});
        absorbed_ = plan_.absorbed();
        Bq_ = plan_.query_block_rows;
    }
    if (absorbed_) {
        // The absorbed backward's gradients die in turn: o's (read by the two GEMMs that make
        // o''s) before the attention core's backward writes Q''s, o''s (read by that backward)
        // before q's is written; each pair shares a region, and with it a loss's rows, live only
        // between the forward and the backward (CudaBuffers::in_region).
        // One query block's rows.
        B.in_region(do_, "grad.attn.q_absorbed | grad.attn.o | head.dlogits", {Bq_, H_ * dv_});
        B.in_region(dqabs_, "grad.attn.q_absorbed | grad.attn.o | head.dlogits", {Bq_, H_ * L});
        B.in_region(doabs_, "grad.attn.o_latent | grad.attn.q | mtp.tv.draft_probs",
                    {Bq_, H_ * kr_});
        B.in_region(dq_b_, "grad.attn.o_latent | grad.attn.q | mtp.tv.draft_probs",
                    {Bq_, H_ * dq_});
    } else {
        // The expanded and dense backwards read o's gradient while writing q's.
        B.scratch(do_, "grad.attn.o", {Tn, H_ * dv_});
        B.scratch(dq_b_, "grad.attn.q", {Tn, H_ * dq_});
    }
    if (dsa) {
        if (absorbed_) {
            B.scratch(dkabs_, "grad.attn.k_latent_f32", {Tn, L});
        }
        if (cp_) {
            B.scratch(keys_f32_, "attn.cp_k_latent_all_rows_f32", {Tk_, L});
            B.scratch(cp_xfer_, "attn.cp_k_latent_exchange", {cp_key_exchange_floats(c_, Tn, L)});
        }
        if (plan_.workspace_bytes > 0)
            B.scratch(mqa_ws_, "attn.sparse_mqa_masked", {(plan_.workspace_bytes + 3) / 4});
    }
    if (!absorbed_) {
        B.scratch(dkv_, "grad.attn.kv", {Tn, H_ * (dn_ + dv_)});
        B.scratch(dk32_, "grad.attn.k_f32", {Tn, H_ * dq_});
        B.scratch(dv32_, "grad.attn.v_f32", {Tn, H_ * dv_});
    }
}

void CudaMlaAttention::declare(Acts& A, CudaBuffers& B, const std::string& p) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    A = Acts{};
    B.act(A.cq_raw, p + "q_a", {Tn, qr_});
    B.act(A.cq, p + "q_a_norm_out", {Tn, qr_});
    B.act(A.rstd_q, p + "q_a_norm_rstd", {Tn});
    B.act(A.ckv, p + "kv_a", {Tn, L});
    B.act(A.ckv_n, p + "kv_a_norm_out", {Tn, kr_});
    B.act(A.rstd_kv, p + "kv_a_norm_rstd", {Tn});
    // Recomputed outputs share one buffer ("attn.recomputed.<name>", or in query blocks
    // "attn.query_block.<name>" of one block's rows), kept ones have a buffer per layer,
    // offloaded ones a place in activation offload's region.
    using S = CudaBuffers::Saving;
    const bool blocks = Bq_ < Tn;
    auto keep = [&](S how, bf16*& ptr, const std::string& name, std::vector<int64_t> shape) {
        B.saved(how, ptr, p + name, (blocks ? "attn.query_block." : "attn.recomputed.") + name,
                std::move(shape));
    };
    const S up = saving(act_, RecomputeModule::MlaUpProj, OffloadModule::QkvLinear);
    keep(up, A.q, "q", {Bq_, H_ * dq_});
    if (absorbed_) {
        keep(up, A.qabs, "q_absorbed", {Bq_, H_ * L});
        B.act(A.kabs, p + "k_latent", {Tn, L});
        keep(saving(act_, RecomputeModule::CoreAttn, OffloadModule::CoreAttn), A.oabs, "o_latent",
             {Bq_, H_ * kr_});
        if (cp_) B.act(A.kkeys, p + "k_latent_all_rows", {Tk_, L});
    } else {
        keep(up, A.kv, "kv", {Tn, H_ * (dn_ + dv_)});
        keep(up, A.k, "k", {Tn, H_ * dq_});
    }
    if (plan_.saved_probs_elems > 0)
        keep(saving(act_, std::nullopt, OffloadModule::CoreAttn), A.probs, "attn_probs",
             {plan_.saved_probs_elems});
    keep(saving(act_, RecomputeModule::CoreAttn, OffloadModule::AttnProj), A.o, "attn_out",
         {Bq_, H_ * dv_});
    if (blocks)
        B.scratch(A.lse, "attn.query_block.lse", {H_, Bq_});
    else
        B.act(A.lse, p + "attn_lse", {H_, Tn});
}

cuda::HeadKV CudaMlaAttention::head_kv(const Acts& A) const {
    return cuda::HeadKV{A.k, H_ * dq_, dq_, A.kv + dn_, H_ * (dn_ + dv_), dn_ + dv_};
}

float CudaMlaAttention::scale() const {
    return float(1.0 / std::sqrt(double(dq_)));
}

void CudaMlaAttention::project(const ExecContext& ctx, const Acts& A, const bf16* a,
                               const CudaInputs& in) const {
    const int64_t Tn = T_, L = kr_ + dr_, B2 = sizeof(bf16);
    if (fp8_) {
        // q_a and kv_a read the same input: quantized once, both GEMMs before q_b's.
        fp8_->quantize_input(ctx, a, h_);
        fp8_->forward_quantized(ctx, fqa_, A.cq_raw, qr_, false);
        if (!A.kabs_shared) fp8_->forward_quantized(ctx, fkva_, A.ckv, L, false);
    } else
        gemm(ctx, false, true, Tn, qr_, h_, 1.f, a, h_, P_[q_a_].w, h_, 0.f, A.cq_raw, qr_);
    cuda::rmsnorm_forward(ctx, A.cq_raw, qr_, P_[q_a_norm_].w, Tn, qr_,
                          float(c_.latent_norm_epsilon), A.cq, qr_, A.rstd_q);
    if (!A.kabs_shared) {
        if (!fp8_) gemm(ctx, false, true, Tn, L, h_, 1.f, a, h_, P_[kv_a_].w, h_, 0.f, A.ckv, L);
        cuda::rmsnorm_forward(ctx, A.ckv, L, P_[kv_a_norm_].w, Tn, kr_,
                              float(c_.latent_norm_epsilon), A.ckv_n, kr_, A.rstd_kv);
        cuda::rope(ctx, A.ckv + kr_, Tn, 1, dr_, L, 0, in.positions, c_.rotary_base,
                   c_.rotary_interleaved, false);
    }
    if (absorbed_ && !A.kabs_shared) {
        cuda::copy_2d(ctx, A.kabs, L * B2, A.ckv_n, kr_ * B2, kr_ * B2, Tn);
        cuda::copy_2d(ctx, A.kabs + kr_, L * B2, A.ckv + kr_, L * B2, dr_ * B2, Tn);
        if (cp_) cp_gather_keys(ctx, in, A.kabs, L, cp_xfer_, A.kkeys);
    }
    if (Bq_ == Tn) up_project(ctx, A, in, 0, Tn);  // in query blocks: attend() per block
}

void CudaMlaAttention::up_project(const ExecContext& ctx, const Acts& A, const CudaInputs& in,
                                  int64_t r0, int64_t Tn) const {
    const int64_t L = kr_ + dr_, B2 = sizeof(bf16);
    ST_ASSERT(Tn == T_ || (absorbed_ && !fp8_), "MLA: query rows ", r0, "+", Tn, " of ", T_,
              " outside the absorbed bf16 form");
    if (fp8_)
        fp8_->forward(ctx, fqb_, A.cq, A.q, H_ * dq_, false);
    else
        gemm(ctx, false, true, Tn, H_ * dq_, qr_, 1.f, A.cq + r0 * qr_, qr_, P_[q_b_].w, qr_, 0.f,
             A.q, H_ * dq_);
    cuda::rope(ctx, A.q + dn_, Tn, H_, dr_, H_ * dq_, dq_, in.positions + r0, c_.rotary_base,
               c_.rotary_interleaved, false);
    if (absorbed_) {
        // Q'_h = [q_nope_h W_UK^h ; q_pe_h] (one batched GEMM over heads).
        gemm(ctx, false, false, Tn, kr_, dn_, 1.f, A.q, H_ * dq_, P_[kv_b_].w, kr_, 0.f, A.qabs,
             H_ * L, DType::BF16, DType::BF16, {H_, dq_, (dn_ + dv_) * kr_, L});
        cuda::copy_2d(ctx, A.qabs + kr_, L * B2, A.q + dn_, dq_ * B2, dr_ * B2, Tn * H_);
    } else {
        ST_ASSERT(!A.kabs_shared, "MLA: the expanded form does not attend over shared keys");
        gemm(ctx, false, true, Tn, H_ * (dn_ + dv_), kr_, 1.f, A.ckv_n, kr_, P_[kv_b_].w, kr_, 0.f,
             A.kv, H_ * (dn_ + dv_));
        cuda::mla_expanded_keys(ctx, A.kv, A.ckv + kr_, L, Tn, H_, dn_, dr_, dv_, A.k);
    }
}

cuda::SparseMqa CudaMlaAttention::absorbed(const Acts& A, const bf16* keys, const int32_t* idx,
                                           const int32_t* len, int64_t kslots, int64_t r0,
                                           int64_t n) const {
    // A query block attends over every key row, as CP's rows do.
    return {.tokens = n,
            .heads = H_,
            .dqk = kr_ + dr_,
            .dv = kr_,
            .q = A.qabs,
            .kv = keys,
            .idx = idx + r0 * kslots,
            .len = len + r0,
            .kslots = kslots,
            .scale = scale(),
            .key_rows = cp_      ? Tk_
                        : n < T_ ? T_
                                 : 0,
            .dkv_accumulate = r0 > 0};
}

cuda::SparseMha CudaMlaAttention::expanded(const Acts& A, const int32_t* idx, const int32_t* len,
                                           int64_t kslots) const {
    return {.tokens = T_,
            .heads = H_,
            .dqk = dq_,
            .dv = dv_,
            .q = A.q,
            .kv = head_kv(A),
            .idx = idx,
            .len = len,
            .kslots = kslots,
            .scale = scale()};
}

void CudaMlaAttention::attend(const ExecContext& ctx, const Acts& A, const CudaInputs& in,
                              const int32_t* idx, const int32_t* len, int64_t kslots, bf16* x_accum,
                              float* prob_sum) const {
    if (fp8_) {
        core(ctx, A, in, idx, len, kslots, prob_sum, 0, T_);
        fp8_->forward(ctx, fo_, A.o, x_accum, h_, true);
        return;
    }
    ST_ASSERT(!prob_sum || Bq_ == T_, "MLA: head probabilities in query blocks");
    for (int64_t r0 = 0; r0 < T_; r0 += Bq_) {
        const int64_t n = std::min(Bq_, T_ - r0);
        if (Bq_ < T_) up_project(ctx, A, in, r0, n);
        core(ctx, A, in, idx, len, kslots, prob_sum, r0, n);
        gemm(ctx, false, true, n, h_, H_ * dv_, 1.f, A.o, H_ * dv_, P_[o_].w, H_ * dv_, 1.f,
             x_accum + r0 * h_, h_);
    }
}

void CudaMlaAttention::core(const ExecContext& ctx, const Acts& A, const CudaInputs& in,
                            const int32_t* idx, const int32_t* len, int64_t kslots, float* prob_sum,
                            int64_t r0, int64_t Tn) const {
    ST_ASSERT(!dsa_ || idx, "MLA: a DSA layer attends without a top-k");
    ST_ASSERT(Tn == T_ || absorbed_, "MLA: query rows ", r0, "+", Tn, " of ", T_,
              " outside the absorbed form");
    if (absorbed_) {
        const bf16* K = A.kabs_shared ? A.kabs_shared : cp_ ? A.kkeys : A.kabs;
        cuda::sparse_mqa_forward(ctx, plan_, absorbed(A, K, idx, len, kslots, r0, Tn), A.oabs,
                                 A.lse, prob_sum, {mqa_ws_, A.probs});
        // o_h = o'_h W_UV^h^T, W_UV^h: rows h*(dn+dv)+dn .. +dv of kv_b_proj.
        gemm(ctx, false, true, Tn, dv_, kr_, 1.f, A.oabs, H_ * kr_, P_[kv_b_].w + dn_ * kr_, kr_,
             0.f, A.o, H_ * dv_, DType::BF16, DType::BF16, {H_, kr_, (dn_ + dv_) * kr_, dv_});
    } else {
        if (dsa_) {
            cuda::sparse_mha_forward(ctx, plan_, expanded(A, idx, len, kslots), A.o, A.lse,
                                     prob_sum, {mqa_ws_, A.probs});
        } else {
            cuda::AttnShape s{
                Tn, H_, dq_, dv_, H_ * dq_, dq_, H_ * dq_, dq_, H_ * (dn_ + dv_), dn_ + dv_};
            cuda::attention_forward(ctx, s, A.q, A.k, A.kv + dn_, in.row_begin, scale(), A.o,
                                    A.lse);
        }
    }
}

void CudaMlaAttention::query_backward(const ExecContext& ctx, const Acts& A, const bf16* dy,
                                      const CudaInputs& in, const int32_t* idx, const int32_t* len,
                                      int64_t kslots, int64_t r0, int64_t Tn) const {
    const int64_t L = kr_ + dr_, B2 = sizeof(bf16);
    const auto BF = DType::BF16;
    // kv_b's gradient (fp32, or a bf16 buffer): its address in bytes, for the K and V parts.
    char* gkvb = static_cast<char*>(P_[kv_b_].grad_out());
    const DType gkvb_type = P_[kv_b_].grad_type();
    const int64_t gkvb_elem = dtype_size(gkvb_type);
    const bf16* wkvb = P_[kv_b_].w;
    dy += r0 * h_;
    // Selective recompute: the forward's values again (the same kernels on the same inputs).
    if (recompute_up_) up_project(ctx, A, in, r0, Tn);
    if (recompute_core_) core(ctx, A, in, idx, len, kslots, nullptr, r0, Tn);
    if (fp8_) {
        fp8_->dgrad(ctx, fo_, dy, do_, false);
        fp8_->wgrad(ctx, fo_, dy, A.o);
    } else {
        gemm(ctx, false, false, Tn, H_ * dv_, h_, 1.f, dy, h_, P_[o_].w, H_ * dv_, 0.f, do_,
             H_ * dv_);
        gemm(ctx, true, false, h_, H_ * dv_, Tn, 1.f, dy, h_, A.o, H_ * dv_, P_.grad_beta(o_),
             P_[o_].grad_out(), H_ * dv_, BF, P_[o_].grad_type());
    }
    if (absorbed_) {
        const int64_t wstride = (dn_ + dv_) * kr_;
        // kv_b's gradient in two parts, every head's V rows here and its K rows below: one
        // decision (overwrite or add) for both, which together cover it; later blocks add.
        const float kvb_beta = r0 == 0 ? P_.grad_beta(kv_b_) : 1.f;
        gemm(ctx, false, false, Tn, kr_, dv_, 1.f, do_, H_ * dv_, wkvb + dn_ * kr_, kr_, 0.f,
             doabs_, H_ * kr_, BF, BF, {H_, dv_, wstride, kr_});
        gemm(ctx, true, false, dv_, kr_, Tn, 1.f, do_, H_ * dv_, A.oabs, H_ * kr_, kvb_beta,
             gkvb + dn_ * kr_ * gkvb_elem, kr_, BF, gkvb_type, {H_, dv_, kr_, wstride});
        const bf16* K = A.kabs_shared ? A.kabs_shared : cp_ ? A.kkeys : A.kabs;
        if (cp_) {
            // dK' of every key row, summed over the CP group; this rank keeps its rows.
            cuda::sparse_mqa_backward(ctx, plan_, absorbed(A, K, idx, len, kslots, r0, Tn), A.oabs,
                                      A.lse, doabs_, dqabs_, keys_f32_, {mqa_ws_, nullptr});
            cp_reduce_key_grads(ctx, in, keys_f32_, L, cp_xfer_, dkabs_);
        } else {
            cuda::sparse_mqa_backward(ctx, plan_, absorbed(A, K, idx, len, kslots, r0, Tn), A.oabs,
                                      A.lse, doabs_, dqabs_, dkabs_, {mqa_ws_, A.probs});
        }
        gemm(ctx, false, true, Tn, dn_, kr_, 1.f, dqabs_, H_ * L, wkvb, kr_, 0.f, dq_b_, H_ * dq_,
             BF, BF, {H_, L, wstride, dq_});
        gemm(ctx, true, false, dn_, kr_, Tn, 1.f, A.q, H_ * dq_, dqabs_, H_ * L, kvb_beta, gkvb,
             kr_, BF, gkvb_type, {H_, dq_, L, wstride});
        cuda::copy_2d(ctx, dq_b_ + dn_, dq_ * B2, dqabs_ + kr_, L * B2, dr_ * B2, Tn * H_);
    } else {
        ST_ASSERT(r0 == 0 && Tn == T_, "MLA: the expanded form runs in one block");
        if (dsa_) {
            cuda::sparse_mha_backward(ctx, plan_, expanded(A, idx, len, kslots), A.o, A.lse, do_,
                                      dq_b_, dk32_, dv32_, {mqa_ws_, A.probs});
        } else {
            cuda::AttnShape s{
                Tn, H_, dq_, dv_, H_ * dq_, dq_, H_ * dq_, dq_, H_ * (dn_ + dv_), dn_ + dv_};
            cuda::attention_backward(ctx, s, A.q, A.k, A.kv + dn_, A.o, A.lse, do_, in.row_begin,
                                     scale(), dq_b_, dk32_, dv32_);
        }
        cuda::mla_expanded_kv_grad(ctx, dk32_, dv32_, Tn, H_, dn_, dr_, dv_, dkv_, dckv_ + kr_, L);
        gemm(ctx, false, false, Tn, kr_, H_ * (dn_ + dv_), 1.f, dkv_, H_ * (dn_ + dv_), wkvb, kr_,
             0.f, dckv_n_, kr_);
        gemm(ctx, true, false, H_ * (dn_ + dv_), kr_, Tn, 1.f, dkv_, H_ * (dn_ + dv_), A.ckv_n, kr_,
             P_.grad_beta(kv_b_), gkvb, kr_, BF, gkvb_type);
    }
    cuda::rope(ctx, dq_b_ + dn_, Tn, H_, dr_, H_ * dq_, dq_, in.positions + r0, c_.rotary_base,
               c_.rotary_interleaved, true);
    if (fp8_) {
        fp8_->dgrad(ctx, fqb_, dq_b_, dcq_, false);
        fp8_->wgrad(ctx, fqb_, dq_b_, A.cq);
    } else {
        gemm(ctx, false, false, Tn, qr_, H_ * dq_, 1.f, dq_b_, H_ * dq_, P_[q_b_].w, qr_, 0.f,
             dcq_ + r0 * qr_, qr_);
        gemm(ctx, true, false, H_ * dq_, qr_, Tn, 1.f, dq_b_, H_ * dq_, A.cq + r0 * qr_, qr_,
             P_.grad_beta(q_b_), P_[q_b_].grad_out(), qr_, BF, P_[q_b_].grad_type());
    }
}

void CudaMlaAttention::backward(const ExecContext& ctx, const Acts& A, const bf16* a,
                                const bf16* dy, const CudaInputs& in, const int32_t* idx,
                                const int32_t* len, int64_t kslots, bf16* da,
                                float* kv_grad_accum) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    const auto BF = DType::BF16;
    for (int64_t r0 = 0; r0 < Tn; r0 += Bq_)
        query_backward(ctx, A, dy, in, idx, len, kslots, r0, std::min(Bq_, Tn - r0));
    const bool kv_path = !A.kabs_shared;
    if (absorbed_) {
        // Shared K': hand dK' to its owner; the owner adds what the sharers accumulated.
        if (kv_grad_accum) {
            if (A.kabs_shared)
                cuda::add_inplace(ctx, kv_grad_accum, dkabs_, Tn * L);
            else
                cuda::add_inplace(ctx, dkabs_, kv_grad_accum, Tn * L);
        }
        if (kv_path) {
            cuda::f32_to_bf16_2d(ctx, dkabs_, L, dckv_n_, kr_, Tn, kr_, false);
            cuda::f32_to_bf16_2d(ctx, dkabs_ + kr_, L, dckv_ + kr_, L, Tn, dr_, false);
        }
    } else {
        ST_ASSERT(!kv_grad_accum, "MLA: the expanded form has no shared latent keys");
    }
    if (kv_path) {
        cuda::rope(ctx, dckv_ + kr_, Tn, 1, dr_, L, 0, in.positions, c_.rotary_base,
                   c_.rotary_interleaved, true);
        cuda::rmsnorm_backward(ctx, dckv_n_, kr_, A.ckv, L, P_[kv_a_norm_].w, A.rstd_kv, Tn, kr_,
                               dckv_, L, false, P_.grad_to_add(ctx, kv_a_norm_), S_.norm_ws);
    }
    cuda::rmsnorm_backward(ctx, dcq_, qr_, A.cq_raw, qr_, P_[q_a_norm_].w, A.rstd_q, Tn, qr_,
                           dcq_raw_, qr_, false, P_.grad_to_add(ctx, q_a_norm_), S_.norm_ws);
    if (fp8_) {
        fp8_->dgrad(ctx, fqa_, dcq_raw_, da, false);
        if (kv_path) fp8_->dgrad(ctx, fkva_, dckv_, da, true);
        fp8_->quantize_input_columns(ctx, a, h_);
        fp8_->wgrad_quantized(ctx, fqa_, dcq_raw_);
        if (kv_path) fp8_->wgrad_quantized(ctx, fkva_, dckv_);
        return;
    }
    gemm(ctx, false, false, Tn, h_, qr_, 1.f, dcq_raw_, qr_, P_[q_a_].w, h_, 0.f, da, h_);
    gemm(ctx, true, false, qr_, h_, Tn, 1.f, dcq_raw_, qr_, a, h_, P_.grad_beta(q_a_),
         P_[q_a_].grad_out(), h_, BF, P_[q_a_].grad_type());
    if (kv_path) {
        gemm(ctx, false, false, Tn, h_, L, 1.f, dckv_, L, P_[kv_a_].w, h_, 1.f, da, h_);
        gemm(ctx, true, false, L, h_, Tn, 1.f, dckv_, L, a, h_, P_.grad_beta(kv_a_),
             P_[kv_a_].grad_out(), h_, BF, P_[kv_a_].grad_type());
    }
}

}  // namespace sparsetron::cuda
