#include "sparsetron/model/decoder_layer.h"

#include <algorithm>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/norm/norm.h"

namespace sparsetron {

template <typename T>
DecoderLayer<T>::DecoderLayer(const ModelConfig& c, const ParamStore& store, Buffers& buf,
                              int64_t layer0, int64_t tokens, int64_t key_tokens)
    : c_(c), layer_(layer0), T_(tokens), h_(c.hidden_size) {
    const std::string p = cat("model.layers.", layer0, ".");
    const bool is_mtp = layer0 >= c.num_layers;  // MTP layers (distinct ones follow the first)
    in_norm_ = store.index(p + "input_layernorm.weight");
    attn_ = std::make_unique<MlaAttention<T>>(c, store, buf, p + "self_attn.", tokens, c.uses_dsa(),
                                              key_tokens);
    if (c.uses_dsa()) {
        kslots_ = std::min(c.dsa_indexer_topk, key_tokens > 0 ? key_tokens : tokens);
        if (dsa_layer_is_full(c, layer0))
            indexer_ = std::make_unique<DsaIndexer<T>>(c, store, buf, p + "self_attn.indexer.",
                                                       tokens, key_tokens);
    }
    post_norm_ = store.index(p + "post_attention_layernorm.weight");
    // MTP layers take the kind of the last backbone layer (SPEC §8).
    const bool moe = c.is_moe_layer(is_mtp ? c.num_layers - 1 : layer0);
    if (moe) {
        moe_ = std::make_unique<MoeLayer<T>>(c, store, buf, p + "mlp.", tokens);
    } else {
        mlp_ = std::make_unique<SwiGluMlp<T>>(store, p + "mlp.", h_, c.ffn_hidden_size);
        s_dact_ = buf.scratch("grad.mlp.act", {tokens, c.ffn_hidden_size});
        s_dg_ = buf.scratch("grad.mlp.gate", {tokens, c.ffn_hidden_size});
        s_du_ = buf.scratch("grad.mlp.up", {tokens, c.ffn_hidden_size});
    }
    s_da_ = buf.scratch("grad.layer.attn_norm_out", {tokens, h_});
    s_dm_ = buf.scratch("grad.layer.mlp_norm_out", {tokens, h_});
}

template <typename T>
typename DecoderLayer<T>::Slots DecoderLayer<T>::declare_acts(Buffers& buf,
                                                              const std::string& p) const {
    Slots s{};
    s.a = buf.act(p + "attn_norm_out", {T_, h_});
    s.rstd_in = buf.act(p + "attn_norm_rstd", {T_});
    s.x_mid = buf.act(p + "x_mid", {T_, h_});
    s.m = buf.act(p + "mlp_norm_out", {T_, h_});
    s.rstd_post = buf.act(p + "mlp_norm_rstd", {T_});
    s.attn = attn_->declare_acts(buf, p);
    if (indexer_) s.idx = indexer_->declare_acts(buf, p);
    if (mlp_) {
        s.g = buf.act(p + "mlp_gate", {T_, mlp_->ffn()});
        s.u = buf.act(p + "mlp_up", {T_, mlp_->ffn()});
        s.act = buf.act(p + "mlp_act", {T_, mlp_->ffn()});
    }
    if (moe_) s.moe = moe_->declare_acts(buf, p + "moe.");
    return s;
}

template <typename T>
typename DecoderLayer<T>::Acts DecoderLayer<T>::resolve(const Buffers& buf, const Slots& s) const {
    Acts A{};
    A.a = buf.ptr<T>(s.a), A.rstd_in = buf.ptr<T>(s.rstd_in), A.x_mid = buf.ptr<T>(s.x_mid);
    A.m = buf.ptr<T>(s.m), A.rstd_post = buf.ptr<T>(s.rstd_post);
    A.attn = attn_->resolve(buf, s.attn);
    if (indexer_) {
        A.idx = indexer_->resolve(buf, s.idx);
        A.topk = A.idx.topk, A.topk_len = A.idx.len;
    }
    if (mlp_) A.g = buf.ptr<T>(s.g), A.u = buf.ptr<T>(s.u), A.act = buf.ptr<T>(s.act);
    if (moe_) A.moe = moe_->resolve(buf, s.moe);
    return A;
}

template <typename T>
void DecoderLayer<T>::bind(const Buffers& buf, const std::vector<T*>& params,
                           const std::vector<T*>& grads) {
    p_ = params, g_ = grads;
    attn_->bind(buf, params, grads);
    if (indexer_) indexer_->bind(buf, params, grads);
    if (mlp_) {
        mlp_->bind(params, grads);
        dact_ = buf.ptr<T>(s_dact_), dg_ = buf.ptr<T>(s_dg_), du_ = buf.ptr<T>(s_du_);
    }
    if (moe_) moe_->bind(buf, params, grads);
    da_ = buf.ptr<T>(s_da_), dm_ = buf.ptr<T>(s_dm_);
}

template <typename T>
LayerLosses DecoderLayer<T>::forward(Acts& A, const T* x, T* out, const StepInputs& in,
                                     double indexer_grad_scale, double aux_scale) {
    LayerLosses losses;
    const int64_t Tn = T_;
    cpu::rmsnorm_forward(x, h_, p_[in_norm_], Tn, h_, c_.norm_epsilon, A.a, h_, A.rstd_in);
    attn_->project(A.attn, A.a, in);
    const bool run_indexer = indexer_ && !A.skip_indexer;
    if (run_indexer) indexer_->forward(A.idx, A.a, A.attn.cq, in);
    ST_ASSERT(!c_.uses_dsa() || A.topk, "DSA layer ", layer_, " has no top-k source");
    std::copy_n(x, Tn * h_, A.x_mid);
    attn_->attend(A.attn, in, A.topk, A.topk_len, kslots_, A.x_mid);
    if (run_indexer) {
        typename DsaIndexer<T>::Teacher t{A.attn.qabs,         A.attn.kkeys,
                                          A.attn.lse,          c_.num_attention_heads,
                                          attn_->latent_dim(), attn_->scale()};
        losses.indexer = indexer_->loss(A.idx, A.a, A.attn.cq, in, t, indexer_grad_scale);
    }
    cpu::rmsnorm_forward(A.x_mid, h_, p_[post_norm_], Tn, h_, c_.norm_epsilon, A.m, h_,
                         A.rstd_post);
    std::copy_n(A.x_mid, Tn * h_, out);
    if (mlp_) mlp_->forward(A.m, Tn, {A.g, A.u, A.act}, out, true);
    if (moe_) losses.aux = moe_->forward(A.moe, A.m, in, out, aux_scale);
    return losses;
}

template <typename T>
void DecoderLayer<T>::backward(const Acts& A, const T* x, T* dx, const StepInputs& in,
                               double aux_scale, T* kv_grad_accum) {
    const int64_t Tn = T_;
    if (mlp_) mlp_->backward(A.m, dx, Tn, {A.g, A.u, A.act}, {dact_, dg_, du_}, dm_, false);
    if (moe_) moe_->backward(A.moe, A.m, dx, in, dm_, aux_scale);
    cpu::rmsnorm_backward(dm_, h_, A.x_mid, h_, p_[post_norm_], A.rstd_post, Tn, h_, dx, h_, true,
                          g_[post_norm_]);
    attn_->backward(A.attn, A.a, dx, in, A.topk, A.topk_len, kslots_, da_, kv_grad_accum);
    cpu::rmsnorm_backward(da_, h_, x, h_, p_[in_norm_], A.rstd_in, Tn, h_, dx, h_, true,
                          g_[in_norm_]);
}

template class DecoderLayer<float>;
template class DecoderLayer<double>;

}  // namespace sparsetron
