#include "sparsetron/model/glm5_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "sparsetron/core/error.h"
#include "sparsetron/core/parallel.h"
#include "sparsetron/ops/cpu/kernels.h"

namespace sparsetron {

using cpu::gemm;

template <typename T>
Glm5Model<T>::Glm5Model(const ModelConfig& cfg, MemoryPlan& plan, int64_t tokens, int64_t max_docs,
                        int64_t chunk_rows)
    : cfg_(cfg), plan_(plan), T_(tokens), max_docs_(max_docs), chunk_rows_(chunk_rows) {
    ST_CHECK(tokens > 0 && max_docs > 0 && chunk_rows > 0, "model: bad micro-batch shape");
    const DType dt = dtype_of<T>();
    store_ = std::make_unique<ParamStore>(cfg, plan, dt);
    const int64_t h = cfg.hidden_size, H = cfg.num_attention_heads, dq = cfg.q_head_dim();
    const int64_t dn = cfg.qk_head_dim, dv = cfg.v_head_dim, qr = cfg.q_lora_rank;
    const int64_t kr = cfg.kv_lora_rank, dr = cfg.qk_pos_emb_head_dim, F = cfg.ffn_hidden_size;
    const int64_t Tn = tokens;

    auto act = [&](const std::string& name, std::vector<int64_t> shape) {
        return plan.add(MemClass::Activations, name, dt, std::move(shape));
    };
    auto ws = [&](const std::string& name, std::vector<int64_t> shape) {
        return plan.add(MemClass::Workspace, name, dt, std::move(shape));
    };
    s_tokens_ = plan.add(MemClass::Activations, "inputs.tokens", DType::I32, {Tn});
    s_targets_ = plan.add(MemClass::Activations, "inputs.targets", DType::I32, {Tn});
    s_positions_ = plan.add(MemClass::Activations, "inputs.positions", DType::I32, {Tn});
    s_cu_ = plan.add(MemClass::Activations, "inputs.cu_seqlens", DType::I32, {max_docs + 1});
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
        const std::string p = cat("layers.", l, ".");
        LayerSlots s{};
        s.x_in = act(p + "x_in", {Tn, h});
        s.a = act(p + "attn_norm_out", {Tn, h});
        s.rstd_in = act(p + "attn_norm_rstd", {Tn});
        s.cq_raw = act(p + "q_a", {Tn, qr});
        s.cq = act(p + "q_a_norm_out", {Tn, qr});
        s.rstd_q = act(p + "q_a_norm_rstd", {Tn});
        s.q = act(p + "q", {Tn, H * dq});
        s.ckv = act(p + "kv_a", {Tn, kr + dr});
        s.ckv_n = act(p + "kv_a_norm_out", {Tn, kr});
        s.rstd_kv = act(p + "kv_a_norm_rstd", {Tn});
        s.kv = act(p + "kv", {Tn, H * (dn + dv)});
        s.k = act(p + "k", {Tn, H * dq});
        s.o = act(p + "attn_out", {Tn, H * dv});
        s.lse = act(p + "attn_lse", {H, Tn});
        s.x_mid = act(p + "x_mid", {Tn, h});
        s.m = act(p + "mlp_norm_out", {Tn, h});
        s.rstd_post = act(p + "mlp_norm_rstd", {Tn});
        s.g = act(p + "mlp_gate", {Tn, F});
        s.u = act(p + "mlp_up", {Tn, F});
        s.act = act(p + "mlp_act", {Tn, F});
        slots_.push_back(s);
    }
    s_x_final_ = act("final.x", {Tn, h});
    s_h_final_ = act("final.norm_out", {Tn, h});
    s_rstd_final_ = act("final.norm_rstd", {Tn});
    s_dx_ = ws("grad.residual", {Tn, h});
    s_dh_ = ws("grad.final_norm_out", {Tn, h});
    s_da_ = ws("grad.attn_norm_out", {Tn, h});
    s_dq_ = ws("grad.q", {Tn, H * dq});
    s_dk_ = ws("grad.k", {Tn, H * dq});
    s_dkv_ = ws("grad.kv", {Tn, H * (dn + dv)});
    s_do_ = ws("grad.attn_out", {Tn, H * dv});
    s_dcq_ = ws("grad.q_a_norm_out", {Tn, qr});
    s_dcq_raw_ = ws("grad.q_a", {Tn, qr});
    s_dckv_ = ws("grad.kv_a", {Tn, kr + dr});
    s_dckv_n_ = ws("grad.kv_a_norm_out", {Tn, kr});
    s_dm_ = ws("grad.mlp_norm_out", {Tn, h});
    s_dg_ = ws("grad.mlp_gate", {Tn, F});
    s_du_ = ws("grad.mlp_up", {Tn, F});
    s_dact_ = ws("grad.mlp_act", {Tn, F});
    s_logits_ = ws("head.logits_chunk", {std::min(chunk_rows, Tn), cfg.vocab_size});

    embed_ = store_->index_of("model.embed_tokens.weight");
    final_norm_ = store_->index_of("model.norm.weight");
    head_ = store_->index_of("lm_head.weight");
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
        const std::string p = cat("model.layers.", l, ".");
        auto ix = [&](const char* n) { return store_->index_of(p + n); };
        lp_.push_back({ix("input_layernorm.weight"), ix("self_attn.q_a_proj.weight"),
                       ix("self_attn.q_a_layernorm.weight"), ix("self_attn.q_b_proj.weight"),
                       ix("self_attn.kv_a_proj_with_mqa.weight"),
                       ix("self_attn.kv_a_layernorm.weight"), ix("self_attn.kv_b_proj.weight"),
                       ix("self_attn.o_proj.weight"), ix("post_attention_layernorm.weight"),
                       ix("mlp.gate_proj.weight"), ix("mlp.up_proj.weight"),
                       ix("mlp.down_proj.weight")});
    }
}

template <typename T>
void Glm5Model<T>::bind() {
    auto P = [&](MemoryPlan::Slot s) { return plan_.view(s).template ptr<T>(); };
    auto I = [&](MemoryPlan::Slot s) { return plan_.view(s).template ptr<int32_t>(); };
    tokens_ = I(s_tokens_), targets_ = I(s_targets_), positions_ = I(s_positions_), cu_ = I(s_cu_);
    acts_.clear();
    for (const auto& s : slots_) {
        acts_.push_back({P(s.x_in),   P(s.a),         P(s.rstd_in), P(s.cq_raw), P(s.cq),
                         P(s.rstd_q), P(s.q),         P(s.ckv),     P(s.ckv_n),  P(s.rstd_kv),
                         P(s.kv),     P(s.k),         P(s.o),       P(s.lse),    P(s.x_mid),
                         P(s.m),      P(s.rstd_post), P(s.g),       P(s.u),      P(s.act)});
    }
    x_final_ = P(s_x_final_), h_final_ = P(s_h_final_), rstd_final_ = P(s_rstd_final_);
    dx_ = P(s_dx_), dh_ = P(s_dh_), da_ = P(s_da_), dq_ = P(s_dq_), dk_ = P(s_dk_);
    dkv_ = P(s_dkv_), do_ = P(s_do_), dcq_ = P(s_dcq_), dcq_raw_ = P(s_dcq_raw_);
    dckv_ = P(s_dckv_), dckv_n_ = P(s_dckv_n_), dm_ = P(s_dm_), dg_ = P(s_dg_), du_ = P(s_du_);
    dact_ = P(s_dact_), logits_ = P(s_logits_);
    param_ptr_.clear();
    grad_ptr_.clear();
    for (const auto& p : store_->params()) {
        param_ptr_.push_back(P(p.param_slot));
        grad_ptr_.push_back(P(p.grad_slot));
    }
}

template <typename T>
void Glm5Model<T>::load_inputs(const MicroBatch& mb) {
    ST_CHECK(mb.capacity == T_ && mb.max_documents == max_docs_, "micro-batch of ", mb.capacity,
             " slots / ", mb.max_documents, " documents does not match the plan (", T_, " / ",
             max_docs_, ")");
    for (int64_t i = 0; i < T_; ++i)
        ST_CHECK(mb.tokens[i] >= 0 && mb.tokens[i] < cfg_.vocab_size, "token id ", mb.tokens[i],
                 " is outside the vocabulary (vocab_size ", cfg_.vocab_size, ")");
    std::memcpy(tokens_, mb.tokens.data(), T_ * sizeof(int32_t));
    std::memcpy(targets_, mb.targets.data(), T_ * sizeof(int32_t));
    std::memcpy(positions_, mb.positions.data(), T_ * sizeof(int32_t));
    std::memcpy(cu_, mb.cu_seqlens.data(), (max_docs_ + 1) * sizeof(int32_t));
    num_docs_ = mb.num_documents;
}

template <typename T>
void Glm5Model<T>::forward_layer(int64_t l) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, H = c.num_attention_heads, dq = c.q_head_dim();
    const int64_t dn = c.qk_head_dim, dv = c.v_head_dim, qr = c.q_lora_rank;
    const int64_t kr = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim, F = c.ffn_hidden_size;
    const int64_t Tn = T_;
    const LayerPtrs& A = acts_[l];
    const LayerParams& W = lp_[l];
    T* out = l + 1 < c.num_layers ? acts_[l + 1].x_in : x_final_;

    cpu::rmsnorm_forward(A.x_in, h, param(W.in_norm), Tn, h, c.norm_epsilon, A.a, h, A.rstd_in);
    gemm<T>(false, true, Tn, qr, h, 1, A.a, h, param(W.q_a), h, 0, A.cq_raw, qr);
    cpu::rmsnorm_forward(A.cq_raw, qr, param(W.q_a_norm), Tn, qr, c.latent_norm_epsilon, A.cq, qr,
                         A.rstd_q);
    gemm<T>(false, true, Tn, H * dq, qr, 1, A.cq, qr, param(W.q_b), qr, 0, A.q, H * dq);
    cpu::rope(A.q + dn, Tn, H, dr, H * dq, dq, positions_, c.rotary_base, c.rotary_interleaved,
              false);
    gemm<T>(false, true, Tn, kr + dr, h, 1, A.a, h, param(W.kv_a), h, 0, A.ckv, kr + dr);
    cpu::rmsnorm_forward(A.ckv, kr + dr, param(W.kv_a_norm), Tn, kr, c.latent_norm_epsilon, A.ckv_n,
                         kr, A.rstd_kv);
    cpu::rope(A.ckv + kr, Tn, 1, dr, kr + dr, 0, positions_, c.rotary_base, c.rotary_interleaved,
              false);
    gemm<T>(false, true, Tn, H * (dn + dv), kr, 1, A.ckv_n, kr, param(W.kv_b), kr, 0, A.kv,
            H * (dn + dv));
    // K_h = [k_nope_h ; k_pe] with the one RoPE key shared by all heads.
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t)
                for (int64_t hh = 0; hh < H; ++hh) {
                    T* kd = A.k + (t * H + hh) * dq;
                    std::copy_n(A.kv + (t * H + hh) * (dn + dv), dn, kd);
                    std::copy_n(A.ckv + t * (kr + dr) + kr, dr, kd + dn);
                }
        },
        16);
    cpu::AttnShape s{Tn, H, dq, dv, H * dq, dq, H * dq, dq, H * (dn + dv), dn + dv};
    cpu::attention_forward(s, A.q, A.k, A.kv + dn, cu_, num_docs_, 1.0 / std::sqrt(double(dq)), A.o,
                           A.lse);
    std::copy_n(A.x_in, Tn * h, A.x_mid);
    gemm<T>(false, true, Tn, h, H * dv, 1, A.o, H * dv, param(W.o), H * dv, 1, A.x_mid, h);

    cpu::rmsnorm_forward(A.x_mid, h, param(W.post_norm), Tn, h, c.norm_epsilon, A.m, h,
                         A.rstd_post);
    gemm<T>(false, true, Tn, F, h, 1, A.m, h, param(W.gate), h, 0, A.g, F);
    gemm<T>(false, true, Tn, F, h, 1, A.m, h, param(W.up), h, 0, A.u, F);
    cpu::swiglu_forward(A.g, A.u, Tn * F, A.act);
    std::copy_n(A.x_mid, Tn * h, out);
    gemm<T>(false, true, Tn, h, F, 1, A.act, F, param(W.down), F, 1, out, h);
}

template <typename T>
void Glm5Model<T>::backward_layer(int64_t l, T* dx) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, H = c.num_attention_heads, dq = c.q_head_dim();
    const int64_t dn = c.qk_head_dim, dv = c.v_head_dim, qr = c.q_lora_rank;
    const int64_t kr = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim, F = c.ffn_hidden_size;
    const int64_t Tn = T_;
    const LayerPtrs& A = acts_[l];
    const LayerParams& W = lp_[l];

    // MLP: out = x_mid + down(swiglu(gate(m), up(m))), m = RMSNorm(x_mid).
    gemm<T>(false, false, Tn, F, h, 1, dx, h, param(W.down), F, 0, dact_, F);
    gemm<T>(true, false, h, F, Tn, 1, dx, h, A.act, F, 1, grad(W.down), F);
    cpu::swiglu_backward(A.g, A.u, dact_, Tn * F, dg_, du_);
    gemm<T>(false, false, Tn, h, F, 1, dg_, F, param(W.gate), h, 0, dm_, h);
    gemm<T>(false, false, Tn, h, F, 1, du_, F, param(W.up), h, 1, dm_, h);
    gemm<T>(true, false, F, h, Tn, 1, dg_, F, A.m, h, 1, grad(W.gate), h);
    gemm<T>(true, false, F, h, Tn, 1, du_, F, A.m, h, 1, grad(W.up), h);
    cpu::rmsnorm_backward(dm_, h, A.x_mid, h, param(W.post_norm), A.rstd_post, Tn, h, dx, h, true,
                          grad(W.post_norm));

    // Attention: x_mid = x_in + o_proj(attn).
    gemm<T>(false, false, Tn, H * dv, h, 1, dx, h, param(W.o), H * dv, 0, do_, H * dv);
    gemm<T>(true, false, h, H * dv, Tn, 1, dx, h, A.o, H * dv, 1, grad(W.o), H * dv);
    cpu::AttnShape s{Tn, H, dq, dv, H * dq, dq, H * dq, dq, H * (dn + dv), dn + dv};
    cpu::attention_backward(s, A.q, A.k, A.kv + dn, A.o, A.lse, do_, cu_, num_docs_,
                            1.0 / std::sqrt(double(dq)), dq_, dk_, dkv_ + dn);
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                T* dpe = dckv_ + t * (kr + dr) + kr;
                std::fill_n(dpe, dr, T(0));
                for (int64_t hh = 0; hh < H; ++hh) {
                    const T* dkd = dk_ + (t * H + hh) * dq;
                    std::copy_n(dkd, dn, dkv_ + (t * H + hh) * (dn + dv));
                    for (int64_t i = 0; i < dr; ++i) dpe[i] += dkd[dn + i];
                }
            }
        },
        16);
    cpu::rope(dq_ + dn, Tn, H, dr, H * dq, dq, positions_, c.rotary_base, c.rotary_interleaved,
              true);
    cpu::rope(dckv_ + kr, Tn, 1, dr, kr + dr, 0, positions_, c.rotary_base, c.rotary_interleaved,
              true);
    gemm<T>(false, false, Tn, kr, H * (dn + dv), 1, dkv_, H * (dn + dv), param(W.kv_b), kr, 0,
            dckv_n_, kr);
    gemm<T>(true, false, H * (dn + dv), kr, Tn, 1, dkv_, H * (dn + dv), A.ckv_n, kr, 1,
            grad(W.kv_b), kr);
    cpu::rmsnorm_backward(dckv_n_, kr, A.ckv, kr + dr, param(W.kv_a_norm), A.rstd_kv, Tn, kr, dckv_,
                          kr + dr, false, grad(W.kv_a_norm));
    gemm<T>(false, false, Tn, qr, H * dq, 1, dq_, H * dq, param(W.q_b), qr, 0, dcq_, qr);
    gemm<T>(true, false, H * dq, qr, Tn, 1, dq_, H * dq, A.cq, qr, 1, grad(W.q_b), qr);
    cpu::rmsnorm_backward(dcq_, qr, A.cq_raw, qr, param(W.q_a_norm), A.rstd_q, Tn, qr, dcq_raw_, qr,
                          false, grad(W.q_a_norm));
    gemm<T>(false, false, Tn, h, kr + dr, 1, dckv_, kr + dr, param(W.kv_a), h, 0, da_, h);
    gemm<T>(false, false, Tn, h, qr, 1, dcq_raw_, qr, param(W.q_a), h, 1, da_, h);
    gemm<T>(true, false, kr + dr, h, Tn, 1, dckv_, kr + dr, A.a, h, 1, grad(W.kv_a), h);
    gemm<T>(true, false, qr, h, Tn, 1, dcq_raw_, qr, A.a, h, 1, grad(W.q_a), h);
    cpu::rmsnorm_backward(da_, h, A.x_in, h, param(W.in_norm), A.rstd_in, Tn, h, dx, h, true,
                          grad(W.in_norm));
}

template <typename T>
LossSums Glm5Model<T>::forward_backward(double grad_scale, bool backward) {
    const auto& c = cfg_;
    const int64_t h = c.hidden_size, Tn = T_;
    ST_ASSERT(!acts_.empty() || c.num_layers == 0, "model not bound");
    T* x0 = c.num_layers > 0 ? acts_[0].x_in : x_final_;
    cpu::embedding_forward(tokens_, Tn, param(embed_), c.vocab_size, h, x0);
    for (int64_t l = 0; l < c.num_layers; ++l) forward_layer(l);
    cpu::rmsnorm_forward(x_final_, h, param(final_norm_), Tn, h, c.norm_epsilon, h_final_, h,
                         rstd_final_);
    LossSums out;
    cpu::head_cross_entropy(h_final_, Tn, h, param(head_), c.vocab_size, targets_,
                            std::min(chunk_rows_, Tn), logits_, grad_scale,
                            backward ? dh_ : nullptr, backward ? grad(head_) : nullptr,
                            &out.lm_loss_sum, &out.lm_targets);
    if (!backward) return out;
    cpu::rmsnorm_backward(dh_, h, x_final_, h, param(final_norm_), rstd_final_, Tn, h, dx_, h,
                          false, grad(final_norm_));
    for (int64_t l = c.num_layers - 1; l >= 0; --l) backward_layer(l, dx_);
    cpu::embedding_backward(tokens_, Tn, dx_, c.vocab_size, h, grad(embed_));
    return out;
}

template class Glm5Model<float>;
template class Glm5Model<double>;

}  // namespace sparsetron
