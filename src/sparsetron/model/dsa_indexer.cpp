#include "sparsetron/model/dsa_indexer.h"

#include <algorithm>
#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/model/cp_rows.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/indexer/indexer.h"
#include "sparsetron/ops/norm/norm.h"

namespace sparsetron {

using cpu::gemm;

namespace {
// q_I[t, j] . k_I[s] in double: the pre-ReLU score of one indexer head.
template <typename T>
double head_dot(const T* q, const T* k, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; ++i) d += double(q[i]) * k[i];
    return d;
}
}  // namespace

template <typename T>
DsaIndexer<T>::DsaIndexer(const ModelConfig& c, const ParamStore& store, Buffers& buf,
                          const std::string& p, int64_t tokens, int64_t key_tokens)
    : c_(c),
      T_(tokens),
      h_(c.hidden_size),
      HI_(c.dsa_indexer_n_heads),
      dI_(c.dsa_indexer_head_dim),
      dr_(c.qk_pos_emb_head_dim),
      qr_(c.q_lora_rank),
      K_(std::min(c.dsa_indexer_topk, key_tokens > 0 ? key_tokens : tokens)),
      cp_(key_tokens > 0),
      Tk_(key_tokens > 0 ? key_tokens : tokens),
      wscale_(1.0 / std::sqrt(double(c.dsa_indexer_n_heads) * double(c.dsa_indexer_head_dim))) {
    wq_ = store.index(p + "wq_b.weight");
    wk_ = store.index(p + "wk.weight");
    knw_ = store.index(p + "k_norm.weight");
    knb_ = store.index(p + "k_norm.bias");
    ww_ = store.index(p + "weights_proj.weight");
    s_scores_ = buf.scratch("dsa.scores", {tokens, Tk_});
    s_target_ = buf.scratch("dsa.loss_grad", {tokens, Tk_});
    if (cp_) s_dk_keys_ = buf.scratch("grad.dsa.k_all_rows", {Tk_, dI_});
    s_dq_ = buf.scratch("grad.dsa.q", {tokens, HI_ * dI_});
    s_dk_ = buf.scratch("grad.dsa.k", {tokens, dI_});
    s_dkraw_ = buf.scratch("grad.dsa.k_raw", {tokens, dI_});
    s_dw_ = buf.scratch("grad.dsa.weights", {tokens, HI_});
}

template <typename T>
typename DsaIndexer<T>::Slots DsaIndexer<T>::declare_acts(Buffers& buf,
                                                          const std::string& p) const {
    Slots s{};
    s.q = buf.act(p + "indexer_q", {T_, HI_ * dI_});
    s.k_raw = buf.act(p + "indexer_k_raw", {T_, dI_});
    s.k = buf.act(p + "indexer_k", {T_, dI_});
    s.mean = buf.act(p + "indexer_k_mean", {T_});
    s.rstd = buf.act(p + "indexer_k_rstd", {T_});
    s.w = buf.act(p + "indexer_weights", {T_, HI_});
    s.topk = buf.act_i32(p + "topk_indices", {T_, K_});
    s.len = buf.act_i32(p + "topk_length", {T_});
    if (cp_) s.kfull = buf.act(p + "indexer_k_all_rows", {Tk_, dI_});
    return s;
}

template <typename T>
typename DsaIndexer<T>::Acts DsaIndexer<T>::resolve(const Buffers& buf, const Slots& s) const {
    Acts A{buf.ptr<T>(s.q),          buf.ptr<T>(s.k_raw),    buf.ptr<T>(s.k),
           buf.ptr<T>(s.mean),       buf.ptr<T>(s.rstd),     buf.ptr<T>(s.w),
           buf.ptr<int32_t>(s.topk), buf.ptr<int32_t>(s.len)};
    A.kkeys = cp_ ? buf.ptr<T>(s.kfull) : A.k;
    return A;
}

template <typename T>
void DsaIndexer<T>::bind(const Buffers& buf, const std::vector<T*>& params,
                         const std::vector<T*>& grads) {
    p_ = params, g_ = grads;
    scores_ = buf.ptr<T>(s_scores_), target_ = buf.ptr<T>(s_target_), dq_ = buf.ptr<T>(s_dq_);
    dk_ = buf.ptr<T>(s_dk_), dkraw_ = buf.ptr<T>(s_dkraw_), dw_ = buf.ptr<T>(s_dw_);
    dk_keys_ = cp_ ? buf.ptr<T>(s_dk_keys_) : dk_;
}

template <typename T>
void DsaIndexer<T>::scores_row(const Acts& A, int64_t t, int64_t row, int64_t begin, T* out) const {
    // I[t, s] = Σ_j w[t, j] relu(q[t, j] · k[s]) for causal s in the document.
    cpu::indexer_scores_row(A.q + t * HI_ * dI_, A.w + t * HI_, A.kkeys, HI_, dI_, begin, row, out);
}

template <typename T>
void DsaIndexer<T>::forward(const Acts& A, const T* a, const T* cq, const StepInputs& in) const {
    const int64_t Tn = T_;
    gemm<T>(false, true, Tn, HI_ * dI_, qr_, 1, cq, qr_, p_[wq_], qr_, 0, A.q, HI_ * dI_);
    cpu::rope(A.q, Tn, HI_, dr_, HI_ * dI_, dI_, in.positions, c_.rotary_base,
              c_.dsa_indexer_rope_interleaved, false);
    gemm<T>(false, true, Tn, dI_, h_, 1, a, h_, p_[wk_], h_, 0, A.k_raw, dI_);
    cpu::layernorm_forward(A.k_raw, p_[knw_], p_[knb_], Tn, dI_, 1e-6, A.k, A.mean, A.rstd);
    cpu::rope(A.k, Tn, 1, dr_, dI_, 0, in.positions, c_.rotary_base,
              c_.dsa_indexer_rope_interleaved, false);
    gemm<T>(false, true, Tn, HI_, h_, wscale_, a, h_, p_[ww_], h_, 0, A.w, HI_);
    if (cp_) cp_gather_rows(in, A.k, dI_, A.kkeys);
    std::fill_n(A.topk, Tn * K_, -1);
    std::fill_n(A.len, Tn, 0);
    const int32_t* kcu = key_cu_seqlens(in);
    for (int64_t d = 0; d < in.num_docs; ++d) {
        // Local rows [begin, end) of document d; its keys start at micro-batch row kbegin.
        const int64_t begin = in.cu_seqlens[d], end = in.cu_seqlens[d + 1], kbegin = kcu[d];
        parallel_for(
            end - begin,
            [&](int64_t rb, int64_t re) {
                std::vector<int32_t> order;
                for (int64_t t = begin + rb; t < begin + re; ++t) {
                    T* row = scores_ + t * Tk_;
                    const int64_t g = key_row(in, t);
                    scores_row(A, t, g, kbegin, row);
                    A.len[t] = static_cast<int32_t>(
                        cpu::topk_row(row, kbegin, g, K_, A.topk + t * K_, order));
                }
            },
            4);
    }
}

template <typename T>
double DsaIndexer<T>::loss(const Acts& A, const T* a, const T* cq, const StepInputs& in,
                           const Teacher& tc, double grad_scale) const {
    const int64_t Tn = T_;
    const double coeff = c_.dsa_indexer_loss_coeff;
    if (coeff == 0) return 0;
    const bool sparse = c_.dsa_indexer_use_sparse_loss;
    // The KL's divisor: the rows with a selection over the whole micro-batch (every CP rank's
    // rows: its mean), or the global batch's tokens under per-token loss.
    double rows = 0;
    if (in.indexer_tokens > 0) {
        rows = double(in.indexer_tokens);
    } else {
        for (int64_t t = 0; t < Tn; ++t) rows += A.len[t] > 0;
        if (in.cp) in.cp->allreduce_sum(&rows, 1);
        if (rows == 0) return 0;
    }
    const int32_t* kcu = key_cu_seqlens(in);
    // Per row: teacher p and student q over the support; KL and its logit gradient (into target_).
    const cpu::IndexerTeacher<T> teacher{tc.q, tc.k, tc.lse, tc.heads, tc.dim, tc.scale, Tn};
    std::vector<double> kl(Tn, 0.0);
    for (int64_t d = 0; d < in.num_docs; ++d) {
        const int64_t begin = in.cu_seqlens[d], end = in.cu_seqlens[d + 1], kbegin = kcu[d];
        parallel_for(
            end - begin,
            [&](int64_t rb, int64_t re) {
                std::vector<int32_t> support;
                std::vector<double> p;
                for (int64_t t = begin + rb; t < begin + re; ++t) {
                    support.clear();
                    if (sparse) {
                        support.assign(A.topk + t * K_, A.topk + t * K_ + A.len[t]);
                    } else {
                        for (int64_t s = kbegin; s <= key_row(in, t); ++s)
                            support.push_back(static_cast<int32_t>(s));
                    }
                    kl[t] = cpu::indexer_kl_row(teacher, t, sparse, support.data(),
                                                int64_t(support.size()), scores_ + t * Tk_,
                                                target_ + t * Tk_, p);
                }
            },
            2);
    }
    double total = 0;
    for (double v : kl) total += v;
    const double loss = coeff * total / rows;
    if (grad_scale == 0) return loss;

    // dI = g (q - p) with g = grad_scale * coeff / rows, on the support only.
    const double gsc = grad_scale * coeff / rows;
    std::fill_n(dq_, Tn * HI_ * dI_, T(0));
    std::fill_n(dk_keys_, Tk_ * dI_, T(0));
    std::fill_n(dw_, Tn * HI_, T(0));
    auto in_support = [&](int64_t t, int64_t s) {
        if (!sparse) return true;
        const int32_t* sel = A.topk + t * K_;
        return std::binary_search(sel, sel + A.len[t], static_cast<int32_t>(s));
    };
    for (int64_t d = 0; d < in.num_docs; ++d) {
        const int64_t begin = in.cu_seqlens[d], end = in.cu_seqlens[d + 1];
        const int64_t kbegin = kcu[d], kend = kcu[d + 1];
        // Query side: dw[t, j] and dq[t, j] (one writer per row).
        parallel_for(
            end - begin,
            [&](int64_t rb, int64_t re) {
                for (int64_t t = begin + rb; t < begin + re; ++t)
                    for (int64_t s = kbegin; s <= key_row(in, t); ++s) {
                        if (!in_support(t, s)) continue;
                        const double dI = gsc * double(target_[t * Tk_ + s]);
                        const T* k = A.kkeys + s * dI_;
                        for (int64_t j = 0; j < HI_; ++j) {
                            const T* q = A.q + (t * HI_ + j) * dI_;
                            const double dd = head_dot(q, k, dI_);
                            if (dd <= 0) continue;  // ReLU
                            dw_[t * HI_ + j] += static_cast<T>(dI * dd);
                            const double da = dI * A.w[t * HI_ + j];
                            T* dq = dq_ + (t * HI_ + j) * dI_;
                            for (int64_t i = 0; i < dI_; ++i) dq[i] += static_cast<T>(da * k[i]);
                        }
                    }
            },
            2);
        // Key side: dk[s] over this rank's queries t at or after s (one writer per key).
        parallel_for(
            kend - kbegin,
            [&](int64_t rb, int64_t re) {
                for (int64_t s = kbegin + rb; s < kbegin + re; ++s)
                    for (int64_t t = begin; t < end; ++t) {
                        if (key_row(in, t) < s || !in_support(t, s)) continue;
                        const double dI = gsc * double(target_[t * Tk_ + s]);
                        const T* k = A.kkeys + s * dI_;
                        for (int64_t j = 0; j < HI_; ++j) {
                            const T* q = A.q + (t * HI_ + j) * dI_;
                            const double dd = head_dot(q, k, dI_);
                            if (dd <= 0) continue;  // ReLU
                            const double da = dI * A.w[t * HI_ + j];
                            for (int64_t i = 0; i < dI_; ++i)
                                dk_keys_[s * dI_ + i] += static_cast<T>(da * q[i]);
                        }
                    }
            },
            2);
    }
    // CP: every rank's queries reached every key row; sum and keep this rank's rows.
    if (cp_) cp_reduce_rows(in, dk_keys_, dI_, dk_);
    // Back through the weight scale, RoPE, LayerNorm and the three projections (weights only).
    gemm<T>(true, false, HI_, h_, Tn, wscale_, dw_, HI_, a, h_, 1, g_[ww_], h_);
    cpu::rope(dq_, Tn, HI_, dr_, HI_ * dI_, dI_, in.positions, c_.rotary_base,
              c_.dsa_indexer_rope_interleaved, true);
    gemm<T>(true, false, HI_ * dI_, qr_, Tn, 1, dq_, HI_ * dI_, cq, qr_, 1, g_[wq_], qr_);
    cpu::rope(dk_, Tn, 1, dr_, dI_, 0, in.positions, c_.rotary_base,
              c_.dsa_indexer_rope_interleaved, true);
    cpu::layernorm_backward(dk_, A.k_raw, p_[knw_], A.mean, A.rstd, Tn, dI_, dkraw_, g_[knw_],
                            g_[knb_]);
    gemm<T>(true, false, dI_, h_, Tn, 1, dkraw_, dI_, a, h_, 1, g_[wk_], h_);
    return loss;
}

template class DsaIndexer<float>;
template class DsaIndexer<double>;

}  // namespace sparsetron
