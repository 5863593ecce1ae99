#include "sparsetron/model/gpu/gpu_ffn.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace sparsetron::gpu {

using cuda::gemm;
constexpr auto BF = DType::BF16;
constexpr auto F32 = DType::F32;

GpuMlp::GpuMlp(const GpuParams& P, GpuBuffers& B, const std::string& p, int64_t hidden, int64_t ffn,
               int64_t tokens, const std::string& tag)
    : P_(P), h_(hidden), f_(ffn), T_(tokens) {
    gate_ = P.index(p + "gate_proj.weight");
    up_ = P.index(p + "up_proj.weight");
    down_ = P.index(p + "down_proj.weight");
    B.scratch(dact_, "grad." + tag + ".act", {tokens, ffn});
    B.scratch(dg_, "grad." + tag + ".gate", {tokens, ffn});
    B.scratch(du_, "grad." + tag + ".up", {tokens, ffn});
}

void GpuMlp::declare(Acts& A, GpuBuffers& B, const std::string& p) const {
    B.act(A.g, p + "gate", {T_, f_});
    B.act(A.u, p + "up", {T_, f_});
    B.act(A.act, p + "act", {T_, f_});
}

void GpuMlp::forward(const ExecContext& ctx, const Acts& A, const bf16* x, bf16* y) const {
    gemm(ctx, false, true, T_, f_, h_, 1.f, x, h_, P_[gate_].w, h_, 0.f, A.g, f_);
    gemm(ctx, false, true, T_, f_, h_, 1.f, x, h_, P_[up_].w, h_, 0.f, A.u, f_);
    cuda::swiglu_forward(ctx, A.g, A.u, T_ * f_, A.act);
    gemm(ctx, false, true, T_, h_, f_, 1.f, A.act, f_, P_[down_].w, f_, 1.f, y, h_);
}

void GpuMlp::backward(const ExecContext& ctx, const Acts& A, const bf16* x, const bf16* dy,
                      bf16* dx, bool accumulate) const {
    gemm(ctx, false, false, T_, f_, h_, 1.f, dy, h_, P_[down_].w, f_, 0.f, dact_, f_);
    gemm(ctx, true, false, h_, f_, T_, 1.f, dy, h_, A.act, f_, 1.f, P_[down_].grad, f_, BF, F32);
    cuda::swiglu_backward(ctx, A.g, A.u, dact_, T_ * f_, dg_, du_);
    gemm(ctx, false, false, T_, h_, f_, 1.f, dg_, f_, P_[gate_].w, h_, accumulate ? 1.f : 0.f, dx,
         h_);
    gemm(ctx, false, false, T_, h_, f_, 1.f, du_, f_, P_[up_].w, h_, 1.f, dx, h_);
    gemm(ctx, true, false, f_, h_, T_, 1.f, dg_, f_, x, h_, 1.f, P_[gate_].grad, h_, BF, F32);
    gemm(ctx, true, false, f_, h_, T_, 1.f, du_, f_, x, h_, 1.f, P_[up_].grad, h_, BF, F32);
}

GpuMoe::GpuMoe(const ModelConfig& c, const GpuParams& P, GpuBuffers& B, const std::string& p,
               int64_t tokens, const MoeStash* stash)
    : c_(c),
      P_(P),
      stash_(stash),
      T_(tokens),
      h_(c.hidden_size),
      E_(c.num_experts),
      k_(c.moe_router_topk),
      F_(c.moe_ffn_hidden_size),
      Fs_(c.moe_shared_expert_intermediate_size) {
    ST_CHECK(c.moe_aux_loss_coeff == 0,
             "moe_aux_loss_coeff > 0 is not implemented on CUDA yet (use 0: aux-loss-free "
             "balancing through the router bias)");
    capacity_ = c.moe_expert_capacity(tokens);
    router_ = P.index(p + "gate.weight");
    bias_ = P.index(p + "gate.e_score_correction_bias");
    gate0_ = P.index(p + "experts.0.gate_proj.weight");
    up0_ = P.index(p + "experts.0.up_proj.weight");
    down0_ = P.index(p + "experts.0.down_proj.weight");
    wstride_ = E_ > 1 ? P.index(p + "experts.1.gate_proj.weight") - gate0_ : 0;  // in params
    if (Fs_ > 0)
        shared_ =
            std::make_unique<GpuMlp>(P, B, p + "shared_experts.", h_, Fs_, tokens, "moe.shared");
    const int64_t R = tokens * k_;
    B.scratch(dxperm_, "grad.moe.x_permuted", {R, h_});
    B.scratch(doutperm_, "grad.moe.out_permuted", {R, h_});
    B.scratch(dact_, "grad.moe.act", {R, F_});
    B.scratch(dg_, "grad.moe.gate", {R, F_});
    B.scratch(du_, "grad.moe.up", {R, F_});
    B.scratch(dgates_, "grad.moe.gates", {tokens, k_});
    B.scratch(dlogits_, "grad.moe.router_logits", {tokens, E_});
    B.scratch(dlogits_bf_, "grad.moe.router_logits_bf16", {tokens, E_});
    // Routing statistics of this layer (device; read when metrics are logged).
    B.act(load_, p + "stats.load", {E_});
    B.act(dropped_, p + "stats.dropped", {1});
}

void GpuMoe::declare(Acts& A, GpuBuffers& B, const std::string& p) const {
    const int64_t Tn = T_, R = T_ * k_;
    A = Acts{};
    B.act(A.m32, p + "router_input_f32", {Tn, h_});
    B.act(A.logits, p + "router_logits", {Tn, E_});
    B.act(A.probs, p + "router_probs", {Tn, E_});
    B.act(A.gates, p + "router_gates", {Tn, k_});
    B.act(A.topk, p + "router_topk", {Tn, k_});
    B.act(A.counts, p + "expert_counts", {E_});
    B.act(A.offsets, p + "expert_offsets", {E_ + 1});
    B.act(A.slot_row, p + "slot_row", {R});
    B.act(A.perm_token, p + "perm_token", {R});
    if (stash_) {
        B.scratch(A.xperm, "moe.work.x_permuted", {R, h_});
        B.scratch(A.g, "moe.work.expert_gate", {R, F_});
        B.scratch(A.u, "moe.work.expert_up", {R, F_});
        B.scratch(A.act, "moe.work.expert_act", {R, F_});
        B.scratch(A.out_perm, "moe.work.expert_out", {R, h_});
        stash_->declare_table(A.stash_table, B, p);
    } else {
        B.act(A.xperm, p + "x_permuted", {R, h_});
        B.act(A.g, p + "expert_gate", {R, F_});
        B.act(A.u, p + "expert_up", {R, F_});
        B.act(A.act, p + "expert_act", {R, F_});
        B.act(A.out_perm, p + "expert_out", {R, h_});
    }
    if (shared_) shared_->declare(A.shared, B, p + "shared_");
}

StashRows GpuMoe::stashed(const Acts& A) const {
    StashRows s;
    s.count = 3;
    s.data[0] = A.g, s.width[0] = F_;
    s.data[1] = A.u, s.width[1] = F_;
    s.data[2] = A.out_perm, s.width[2] = h_;
    return s;
}

void GpuMoe::forward(const ExecContext& ctx, const Acts& A, const bf16* m, const GpuInputs& in,
                     bf16* y) const {
    const int64_t Tn = T_, R = T_ * k_;
    // The expert weights are consecutive parameters: one stride apart in every arena.
    const int64_t ws = E_ > 1 ? P_[gate0_ + wstride_].w - P_[gate0_].w : F_ * h_;
    cuda::bf16_to_f32(ctx, m, A.m32, Tn * h_);
    gemm(ctx, false, true, Tn, E_, h_, 1.f, A.m32, h_, P_[router_].master, h_, 0.f, A.logits, E_,
         F32, F32);
    cuda::router_topk(ctx, A.logits, P_[bias_].master, in.row_begin, Tn, E_, k_,
                      c_.moe_router_force_load_balancing, float(c_.moe_router_topk_scaling_factor),
                      A.probs, A.topk, A.gates);
    cuda::moe_permute(ctx, A.topk, Tn, E_, k_, capacity_, A.counts, A.offsets, A.slot_row,
                      A.perm_token);
    cuda::moe_count_load(ctx, A.counts, E_, capacity_, load_, dropped_);
    cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, A.xperm);
    using K = cuda::GroupedGemm;
    cuda::grouped_gemm(ctx, K::RowsTimesWeightT, A.offsets, E_, capacity_, F_, h_, A.xperm,
                       P_[gate0_].w, A.g, ws);
    cuda::grouped_gemm(ctx, K::RowsTimesWeightT, A.offsets, E_, capacity_, F_, h_, A.xperm,
                       P_[up0_].w, A.u, ws);
    cuda::swiglu_forward(ctx, A.g, A.u, R * F_, A.act);
    cuda::grouped_gemm(ctx, K::RowsTimesWeightT, A.offsets, E_, capacity_, h_, F_, A.act,
                       P_[down0_].w, A.out_perm, ws);
    cuda::moe_combine(ctx, A.out_perm, A.slot_row, A.gates, Tn, k_, h_, y);
    // The kept rows (offsets[E] of them) into pages: the next application reuses the buffers.
    if (stash_) stash_->push(ctx, A.stash_table, A.offsets + E_, stashed(A));
    if (shared_) shared_->forward(ctx, A.shared, m, y);
}

void GpuMoe::backward(const ExecContext& ctx, const Acts& A, const bf16* m, const bf16* dy,
                      bf16* dm) const {
    const int64_t Tn = T_, R = T_ * k_;
    const int64_t ws = E_ > 1 ? P_[gate0_ + wstride_].w - P_[gate0_].w : F_ * h_;
    using K = cuda::GroupedGemm;
    if (stash_) {
        // Back from the pages; the permuted input and the SwiGLU are recomputed (the same
        // kernels on the same values: bit-identical to what the forward used).
        stash_->pop(ctx, A.stash_table, A.offsets + E_, stashed(A));
        cuda::moe_gather(ctx, m, A.perm_token, A.offsets, E_, R, h_, A.xperm);
        cuda::swiglu_forward(ctx, A.g, A.u, R * F_, A.act);
    }
    cuda::moe_combine_backward(ctx, dy, A.out_perm, A.slot_row, A.gates, Tn, k_, h_, doutperm_,
                               dgates_);
    cuda::grouped_gemm(ctx, K::RowsTimesWeight, A.offsets, E_, capacity_, h_, F_, doutperm_,
                       P_[down0_].w, dact_, ws);
    cuda::grouped_gemm(ctx, K::WeightGrad, A.offsets, E_, capacity_, h_, F_, doutperm_, A.act,
                       P_[down0_].grad, P_[gate0_ + wstride_].grad - P_[gate0_].grad);
    cuda::swiglu_backward(ctx, A.g, A.u, dact_, R * F_, dg_, du_);
    cuda::grouped_gemm(ctx, K::RowsTimesWeight, A.offsets, E_, capacity_, F_, h_, dg_, P_[gate0_].w,
                       dxperm_, ws);
    cuda::grouped_gemm(ctx, K::RowsTimesWeight, A.offsets, E_, capacity_, F_, h_, du_, P_[up0_].w,
                       dxperm_, ws, true);
    const int64_t gs = E_ > 1 ? P_[gate0_ + wstride_].grad - P_[gate0_].grad : F_ * h_;
    cuda::grouped_gemm(ctx, K::WeightGrad, A.offsets, E_, capacity_, F_, h_, dg_, A.xperm,
                       P_[gate0_].grad, gs);
    cuda::grouped_gemm(ctx, K::WeightGrad, A.offsets, E_, capacity_, F_, h_, du_, A.xperm,
                       P_[up0_].grad, gs);
    cuda::moe_gather_backward(ctx, dxperm_, A.slot_row, Tn, k_, h_, dm, false);
    if (shared_) shared_->backward(ctx, A.shared, m, dy, dm, true);
    cuda::router_backward(ctx, A.probs, A.topk, dgates_, Tn, E_, k_,
                          float(c_.moe_router_topk_scaling_factor), dlogits_);
    gemm(ctx, true, false, E_, h_, Tn, 1.f, dlogits_, E_, A.m32, h_, 1.f, P_[router_].grad, h_, F32,
         F32);
    cuda::f32_to_bf16(ctx, dlogits_, dlogits_bf_, Tn * E_);
    gemm(ctx, false, false, Tn, h_, E_, 1.f, dlogits_bf_, E_, P_[router_].w, h_, 1.f, dm, h_);
}

void GpuMoe::check_layout() const {
    for (int64_t first : {gate0_, up0_, down0_}) {
        const int64_t ws = E_ > 1 ? P_[first + wstride_].w - P_[first].w : 0;
        const int64_t gs = E_ > 1 ? P_[first + wstride_].grad - P_[first].grad : 0;
        for (int64_t e = 0; e < E_; ++e) {
            const GpuParam& p = P_[first + e * wstride_];
            ST_CHECK(p.w == P_[first].w + e * ws && p.grad == P_[first].grad + e * gs,
                     "CUDA MoE: expert ", e, " of '", P_.store().params()[first].name,
                     "' is not at a fixed stride (the grouped GEMM needs one)");
        }
    }
    ST_CHECK(E_ <= 1 ||
                 (P_[gate0_ + wstride_].w - P_[gate0_].w == P_[up0_ + wstride_].w - P_[up0_].w &&
                  P_[gate0_ + wstride_].w - P_[gate0_].w == P_[down0_ + wstride_].w - P_[down0_].w),
             "CUDA MoE: gate/up/down expert strides differ");
}

void GpuMoe::reset_stats(const ExecContext& ctx) const {
    cuda::zero(ctx, load_, E_ * sizeof(int64_t));
    cuda::zero(ctx, dropped_, sizeof(int64_t));
}

void GpuMoe::update_bias(const ExecContext& ctx, double rate) const {
    if (rate == 0) return;
    cuda::moe_update_bias(ctx, load_, E_, float(rate), P_[bias_].master);
}

}  // namespace sparsetron::gpu
