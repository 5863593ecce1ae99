#include "sparsetron/model/mla_attention.h"

#include <algorithm>
#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/model/cp_rows.h"
#include "sparsetron/model/fp8_gemms.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/norm/norm.h"

namespace sparsetron {

using cpu::gemm;

template <typename T>
MlaAttention<T>::MlaAttention(const ModelConfig& c, const ParamStore& store, Buffers& buf,
                              const std::string& p, int64_t tokens, bool absorbed,
                              int64_t key_tokens)
    : c_(c),
      T_(tokens),
      h_(c.hidden_size),
      H_(c.num_attention_heads),
      dq_(c.q_head_dim()),
      dn_(c.qk_head_dim),
      dr_(c.qk_pos_emb_head_dim),
      dv_(c.v_head_dim),
      qr_(c.q_lora_rank),
      kr_(c.kv_lora_rank),
      absorbed_(absorbed),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens) {
    ST_CHECK(!cp_ || absorbed, "context parallelism needs the absorbed (DSA) attention");
    q_a_ = store.index(p + "q_a_proj.weight");
    q_a_norm_ = store.index(p + "q_a_layernorm.weight");
    q_b_ = store.index(p + "q_b_proj.weight");
    kv_a_ = store.index(p + "kv_a_proj_with_mqa.weight");
    kv_a_norm_ = store.index(p + "kv_a_layernorm.weight");
    kv_b_ = store.index(p + "kv_b_proj.weight");
    o_ = store.index(p + "o_proj.weight");
    const int64_t Tn = tokens, L = kr_ + dr_;
    s_do_ = buf.scratch("grad.attn.o", {Tn, H_ * dv_});
    s_dq_ = buf.scratch("grad.attn.q", {Tn, H_ * dq_});
    s_dcq_ = buf.scratch("grad.attn.q_a_norm_out", {Tn, qr_});
    s_dcq_raw_ = buf.scratch("grad.attn.q_a", {Tn, qr_});
    s_dckv_ = buf.scratch("grad.attn.kv_a", {Tn, L});
    s_dckv_n_ = buf.scratch("grad.attn.kv_a_norm_out", {Tn, kr_});
    if (absorbed) {
        s_dqabs_ = buf.scratch("grad.attn.q_absorbed", {Tn, H_ * L});
        s_dkabs_ = buf.scratch("grad.attn.k_latent", {Tn, L});
        s_dkabs_heads_ = buf.scratch("grad.attn.k_latent_per_head", {H_, Tk_, L});
        if (cp_) s_dkabs_keys_ = buf.scratch("grad.attn.k_latent_all_rows", {Tk_, L});
        s_doabs_ = buf.scratch("grad.attn.o_latent", {Tn, H_ * kr_});
    } else {
        s_dk_ = buf.scratch("grad.attn.k", {Tn, H_ * dq_});
        s_dkv_ = buf.scratch("grad.attn.kv", {Tn, H_ * (dn_ + dv_)});
    }
}

template <typename T>
typename MlaAttention<T>::Slots MlaAttention<T>::declare_acts(Buffers& buf,
                                                              const std::string& p) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    Slots s{};
    s.cq_raw = buf.act(p + "q_a", {Tn, qr_});
    s.cq = buf.act(p + "q_a_norm_out", {Tn, qr_});
    s.rstd_q = buf.act(p + "q_a_norm_rstd", {Tn});
    s.q = buf.act(p + "q", {Tn, H_ * dq_});
    s.ckv = buf.act(p + "kv_a", {Tn, L});
    s.ckv_n = buf.act(p + "kv_a_norm_out", {Tn, kr_});
    s.rstd_kv = buf.act(p + "kv_a_norm_rstd", {Tn});
    s.kv = s.k = s.qabs = s.kabs = s.oabs = s.kfull = -1;
    if (absorbed_) {
        s.qabs = buf.act(p + "q_absorbed", {Tn, H_ * L});
        s.kabs = buf.act(p + "k_latent", {Tn, L});
        s.oabs = buf.act(p + "o_latent", {Tn, H_ * kr_});
        if (cp_) s.kfull = buf.act(p + "k_latent_all_rows", {Tk_, L});
    } else {
        s.kv = buf.act(p + "kv", {Tn, H_ * (dn_ + dv_)});
        s.k = buf.act(p + "k", {Tn, H_ * dq_});
    }
    s.o = buf.act(p + "attn_out", {Tn, H_ * dv_});
    s.lse = buf.act(p + "attn_lse", {H_, Tn});
    return s;
}

template <typename T>
typename MlaAttention<T>::Acts MlaAttention<T>::resolve(const Buffers& buf, const Slots& s) const {
    auto P = [&](MemoryPlan::Slot x) { return x < 0 ? nullptr : buf.ptr<T>(x); };
    Acts A{P(s.cq_raw), P(s.cq), P(s.rstd_q), P(s.q),    P(s.ckv),  P(s.ckv_n), P(s.rstd_kv),
           P(s.kv),     P(s.k),  P(s.qabs),   P(s.kabs), P(s.oabs), P(s.o),     P(s.lse)};
    A.kkeys = cp_ ? P(s.kfull) : A.kabs;
    return A;
}

template <typename T>
void MlaAttention<T>::bind(const Buffers& buf, const std::vector<T*>& params,
                           const std::vector<T*>& grads) {
    p_ = params, g_ = grads;
    auto P = [&](MemoryPlan::Slot x) { return x < 0 ? nullptr : buf.ptr<T>(x); };
    do_ = P(s_do_), dq_b_ = P(s_dq_), dcq_ = P(s_dcq_), dcq_raw_ = P(s_dcq_raw_);
    dckv_ = P(s_dckv_), dckv_n_ = P(s_dckv_n_);
    if (absorbed_) {
        dqabs_ = P(s_dqabs_), dkabs_ = P(s_dkabs_), dkabs_heads_ = P(s_dkabs_heads_);
        doabs_ = P(s_doabs_);
        dkabs_keys_ = cp_ ? P(s_dkabs_keys_) : dkabs_;
    } else {
        dk_ = P(s_dk_), dkv_ = P(s_dkv_);
    }
}

template <typename T>
double MlaAttention<T>::scale() const {
    return 1.0 / std::sqrt(double(dq_));
}

template <typename T>
void MlaAttention<T>::project(const Acts& A, const T* a, const StepInputs& in) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    linear_forward(fp8_, a, h_, Tn, h_, p_[q_a_], qr_, A.cq_raw, qr_, false);
    cpu::rmsnorm_forward(A.cq_raw, qr_, p_[q_a_norm_], Tn, qr_, c_.latent_norm_epsilon, A.cq, qr_,
                         A.rstd_q);
    linear_forward(fp8_, A.cq, qr_, Tn, qr_, p_[q_b_], H_ * dq_, A.q, H_ * dq_, false);
    cpu::rope(A.q + dn_, Tn, H_, dr_, H_ * dq_, dq_, in.positions, c_.rotary_base,
              c_.rotary_interleaved, false);
    if (!A.kabs_shared) {
        linear_forward(fp8_, a, h_, Tn, h_, p_[kv_a_], L, A.ckv, L, false);
        cpu::rmsnorm_forward(A.ckv, L, p_[kv_a_norm_], Tn, kr_, c_.latent_norm_epsilon, A.ckv_n,
                             kr_, A.rstd_kv);
        cpu::rope(A.ckv + kr_, Tn, 1, dr_, L, 0, in.positions, c_.rotary_base,
                  c_.rotary_interleaved, false);
    }
    if (!absorbed_) return;
    // Q'_h = [q_nope_h W_UK^h ; q_pe_h];  K' = [c_kv ; k_pe].  W_UK^h: rows h*(dn+dv) .. +dn.
    const T* wkvb = p_[kv_b_];
    for (int64_t hh = 0; hh < H_; ++hh)
        gemm<T>(false, false, Tn, kr_, dn_, 1, A.q + hh * dq_, H_ * dq_,
                wkvb + hh * (dn_ + dv_) * kr_, kr_, 0, A.qabs + hh * L, H_ * L);
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                for (int64_t hh = 0; hh < H_; ++hh)
                    std::copy_n(A.q + t * H_ * dq_ + hh * dq_ + dn_, dr_,
                                A.qabs + (t * H_ + hh) * L + kr_);
                std::copy_n(A.ckv_n + t * kr_, kr_, A.kabs + t * L);
                std::copy_n(A.ckv + t * L + kr_, dr_, A.kabs + t * L + kr_);
            }
        },
        16);
    if (cp_ && !A.kabs_shared) cp_gather_rows(in, A.kabs, L, A.kkeys);
}

template <typename T>
void MlaAttention<T>::attend(const Acts& A, const StepInputs& in, const int32_t* idx,
                             const int32_t* len, int64_t kslots, T* x_accum) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    if (absorbed_) {
        const T* K = A.kabs_shared ? A.kabs_shared : A.kkeys;
        cpu::sparse_mqa_forward(Tn, H_, L, kr_, A.qabs, K, idx, len, kslots, scale(), A.oabs,
                                A.lse);
        // o_h = o'_h W_UV^h^T, W_UV^h: rows h*(dn+dv)+dn .. +dv of kv_b_proj.
        for (int64_t hh = 0; hh < H_; ++hh)
            gemm<T>(false, true, Tn, dv_, kr_, 1, A.oabs + hh * kr_, H_ * kr_,
                    p_[kv_b_] + (hh * (dn_ + dv_) + dn_) * kr_, kr_, 0, A.o + hh * dv_, H_ * dv_);
    } else {
        gemm<T>(false, true, Tn, H_ * (dn_ + dv_), kr_, 1, A.ckv_n, kr_, p_[kv_b_], kr_, 0, A.kv,
                H_ * (dn_ + dv_));
        parallel_for(
            Tn,
            [&](int64_t b, int64_t e) {
                for (int64_t t = b; t < e; ++t)
                    for (int64_t hh = 0; hh < H_; ++hh) {
                        T* kd = A.k + (t * H_ + hh) * dq_;
                        std::copy_n(A.kv + (t * H_ + hh) * (dn_ + dv_), dn_, kd);
                        std::copy_n(A.ckv + t * L + kr_, dr_, kd + dn_);
                    }
            },
            16);
        cpu::AttnShape s{Tn,       H_, dq_, dv_, H_ * dq_, dq_, H_ * dq_, dq_, H_ * (dn_ + dv_),
                         dn_ + dv_};
        cpu::attention_forward(s, A.q, A.k, A.kv + dn_, in.cu_seqlens, in.num_docs, scale(), A.o,
                               A.lse);
    }
    linear_forward(fp8_, A.o, H_ * dv_, Tn, H_ * dv_, p_[o_], h_, x_accum, h_, true);
}

template <typename T>
void MlaAttention<T>::backward(const Acts& A, const T* a, const T* dy, const StepInputs& in,
                               const int32_t* idx, const int32_t* len, int64_t kslots, T* da,
                               T* kv_grad_accum) const {
    const int64_t Tn = T_, L = kr_ + dr_;
    T* gkvb = g_[kv_b_];
    linear_dgrad(fp8_, dy, h_, Tn, h_, p_[o_], H_ * dv_, do_, H_ * dv_, false);
    linear_wgrad(fp8_, dy, h_, Tn, h_, A.o, H_ * dv_, H_ * dv_, g_[o_]);
    if (absorbed_) {
        for (int64_t hh = 0; hh < H_; ++hh) {
            const int64_t uv = (hh * (dn_ + dv_) + dn_) * kr_;
            gemm<T>(false, false, Tn, kr_, dv_, 1, do_ + hh * dv_, H_ * dv_, p_[kv_b_] + uv, kr_, 0,
                    doabs_ + hh * kr_, H_ * kr_);
            gemm<T>(true, false, dv_, kr_, Tn, 1, do_ + hh * dv_, H_ * dv_, A.oabs + hh * kr_,
                    H_ * kr_, 1, gkvb + uv, kr_);
        }
        const T* K = A.kabs_shared ? A.kabs_shared : A.kkeys;
        cpu::sparse_mqa_backward(Tn, H_, L, kr_, A.qabs, K, idx, len, kslots, scale(), A.oabs,
                                 A.lse, doabs_, dqabs_, dkabs_heads_, dkabs_keys_, Tk_);
        // CP: every rank's queries reached every key row; sum and keep this rank's rows.
        if (cp_) cp_reduce_rows(in, dkabs_keys_, L, dkabs_);
        // Shared K': hand dK' to its owner. Owner: add what the sharers accumulated.
        if (kv_grad_accum)
            cpu::add_inplace(A.kabs_shared ? kv_grad_accum : dkabs_,
                             A.kabs_shared ? dkabs_ : kv_grad_accum, Tn * L);
        for (int64_t hh = 0; hh < H_; ++hh) {
            const int64_t uk = hh * (dn_ + dv_) * kr_;
            gemm<T>(false, true, Tn, dn_, kr_, 1, dqabs_ + hh * L, H_ * L, p_[kv_b_] + uk, kr_, 0,
                    dq_b_ + hh * dq_, H_ * dq_);
            gemm<T>(true, false, dn_, kr_, Tn, 1, A.q + hh * dq_, H_ * dq_, dqabs_ + hh * L, H_ * L,
                    1, gkvb + uk, kr_);
        }
        parallel_for(
            Tn,
            [&](int64_t b, int64_t e) {
                for (int64_t t = b; t < e; ++t) {
                    for (int64_t hh = 0; hh < H_; ++hh)
                        std::copy_n(dqabs_ + (t * H_ + hh) * L + kr_, dr_,
                                    dq_b_ + t * H_ * dq_ + hh * dq_ + dn_);
                    std::copy_n(dkabs_ + t * L, kr_, dckv_n_ + t * kr_);
                    std::copy_n(dkabs_ + t * L + kr_, dr_, dckv_ + t * L + kr_);
                }
            },
            16);
    } else {
        cpu::AttnShape s{Tn,       H_, dq_, dv_, H_ * dq_, dq_, H_ * dq_, dq_, H_ * (dn_ + dv_),
                         dn_ + dv_};
        cpu::attention_backward(s, A.q, A.k, A.kv + dn_, A.o, A.lse, do_, in.cu_seqlens,
                                in.num_docs, scale(), dq_b_, dk_, dkv_ + dn_);
        parallel_for(
            Tn,
            [&](int64_t b, int64_t e) {
                for (int64_t t = b; t < e; ++t) {
                    T* dpe = dckv_ + t * L + kr_;
                    std::fill_n(dpe, dr_, T(0));
                    for (int64_t hh = 0; hh < H_; ++hh) {
                        const T* dkd = dk_ + (t * H_ + hh) * dq_;
                        std::copy_n(dkd, dn_, dkv_ + (t * H_ + hh) * (dn_ + dv_));
                        for (int64_t i = 0; i < dr_; ++i) dpe[i] += dkd[dn_ + i];
                    }
                }
            },
            16);
        gemm<T>(false, false, Tn, kr_, H_ * (dn_ + dv_), 1, dkv_, H_ * (dn_ + dv_), p_[kv_b_], kr_,
                0, dckv_n_, kr_);
        gemm<T>(true, false, H_ * (dn_ + dv_), kr_, Tn, 1, dkv_, H_ * (dn_ + dv_), A.ckv_n, kr_, 1,
                gkvb, kr_);
    }
    (void)idx, (void)len, (void)kslots;
    const bool kv_path = !A.kabs_shared;
    cpu::rope(dq_b_ + dn_, Tn, H_, dr_, H_ * dq_, dq_, in.positions, c_.rotary_base,
              c_.rotary_interleaved, true);
    if (kv_path) {
        cpu::rope(dckv_ + kr_, Tn, 1, dr_, L, 0, in.positions, c_.rotary_base,
                  c_.rotary_interleaved, true);
        cpu::rmsnorm_backward(dckv_n_, kr_, A.ckv, L, p_[kv_a_norm_], A.rstd_kv, Tn, kr_, dckv_, L,
                              false, g_[kv_a_norm_]);
    }
    linear_dgrad(fp8_, dq_b_, H_ * dq_, Tn, H_ * dq_, p_[q_b_], qr_, dcq_, qr_, false);
    linear_wgrad(fp8_, dq_b_, H_ * dq_, Tn, H_ * dq_, A.cq, qr_, qr_, g_[q_b_]);
    cpu::rmsnorm_backward(dcq_, qr_, A.cq_raw, qr_, p_[q_a_norm_], A.rstd_q, Tn, qr_, dcq_raw_, qr_,
                          false, g_[q_a_norm_]);
    linear_dgrad(fp8_, dcq_raw_, qr_, Tn, qr_, p_[q_a_], h_, da, h_, false);
    linear_wgrad(fp8_, dcq_raw_, qr_, Tn, qr_, a, h_, h_, g_[q_a_]);
    if (kv_path) {
        linear_dgrad(fp8_, dckv_, L, Tn, L, p_[kv_a_], h_, da, h_, true);
        linear_wgrad(fp8_, dckv_, L, Tn, L, a, h_, h_, g_[kv_a_]);
    }
}

template class MlaAttention<float>;
template class MlaAttention<double>;

}  // namespace sparsetron
