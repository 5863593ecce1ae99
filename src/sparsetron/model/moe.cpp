#include "sparsetron/model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/moe/moe.h"
#include "sparsetron/ops/moe/sequence_aux.h"

namespace sparsetron {

using cpu::gemm;

template <typename T>
MoeLayer<T>::MoeLayer(const ModelConfig& c, const ParamStore& store, Buffers& buf,
                      const std::string& p, int64_t tokens)
    : c_(c),
      T_(tokens),
      h_(c.hidden_size),
      E_(c.num_experts),
      k_(c.moe_router_topk),
      F_(c.moe_ffn_hidden_size),
      Fs_(c.moe_shared_expert_intermediate_size) {
    capacity_ = c.moe_expert_capacity(tokens);
    router_ = store.index(p + "gate.weight");
    bias_ = store.index(p + "gate.e_score_correction_bias");
    W_ = c.expert_parallel_ranks;
    ST_CHECK(W_ >= 1 && E_ % W_ == 0, "num_experts (", E_,
             ") must be divisible by expert_model_parallel_size (", W_, ")");
    El_ = E_ / W_;
    ST_CHECK(c.expert_parallel_rank >= 0 && c.expert_parallel_rank < W_, "expert-parallel rank ",
             c.expert_parallel_rank, " of ", W_);
    // This rank's experts (all of them without expert parallelism), by their global index.
    for (int64_t e = c.first_local_expert(); e < c.first_local_expert() + c.local_experts(); ++e)
        experts_.emplace_back(store, cat(p, "experts.", e, "."), h_, F_);
    if (Fs_ > 0) shared_ = std::make_unique<SwiGluMlp<T>>(store, p + "shared_experts.", h_, Fs_);
    const int64_t R = tokens * k_;
    s_dxperm_ = buf.scratch("grad.moe.x_permuted", {R, h_});
    s_doutperm_ = buf.scratch("grad.moe.out_permuted", {R, h_});
    s_dact_ = buf.scratch("grad.moe.act", {R, F_});
    s_dg_ = buf.scratch("grad.moe.gate", {R, F_});
    s_du_ = buf.scratch("grad.moe.up", {R, F_});
    s_dlogits_ = buf.scratch("grad.moe.router_logits", {tokens, E_});
    s_sdact_ = s_sdg_ = s_sdu_ = -1;
    if (Fs_ > 0) {
        s_sdact_ = buf.scratch("grad.moe.shared_act", {tokens, Fs_});
        s_sdg_ = buf.scratch("grad.moe.shared_gate", {tokens, Fs_});
        s_sdu_ = buf.scratch("grad.moe.shared_up", {tokens, Fs_});
    }
    stats_.load.assign(E_, 0);
    if (W_ > 1) {
        // What can arrive from the W sources: the dropless bound (the CPU exchange has no
        // receive budget; moe_expert_rank_capacity_factor sizes the CUDA buffers).
        received_rows_ = c.moe_ep_dropless_rows(tokens);
        const int64_t Rr = received_rows_;
        s_outr_ = buf.scratch("grad.moe.ep_out_received", {Rr, h_});
        s_doutr_ = buf.scratch("grad.moe.ep_dout_received", {Rr, h_});
        s_dxr_ = buf.scratch("grad.moe.ep_dx_received", {Rr, h_});
        s_dactr_ = buf.scratch("grad.moe.ep_act_received", {Rr, F_});
        s_dgr_ = buf.scratch("grad.moe.ep_gate_received", {Rr, F_});
        s_dur_ = buf.scratch("grad.moe.ep_up_received", {Rr, F_});
    }
}

template <typename T>
typename MoeLayer<T>::Slots MoeLayer<T>::declare_acts(Buffers& buf, const std::string& p) const {
    const int64_t Tn = T_, R = T_ * k_;
    Slots s{};
    s.probs = buf.act(p + "router_probs", {Tn, E_});
    s.topk = buf.act_i32(p + "router_topk", {Tn, k_});
    s.gates = buf.act(p + "router_gates", {Tn, k_});
    s.slot_row = buf.act_i32(p + "slot_row", {R});
    s.perm_token = buf.act_i32(p + "perm_token", {R});
    s.xperm = buf.act(p + "x_permuted", {R, h_});
    s.g = buf.act(p + "expert_gate", {R, F_});
    s.u = buf.act(p + "expert_up", {R, F_});
    s.act = buf.act(p + "expert_act", {R, F_});
    s.out_perm = buf.act(p + "expert_out", {R, h_});
    if (W_ > 1) {
        const int64_t Rr = received_rows_;
        s.xr = buf.act(p + "ep_x_received", {Rr, h_});
        s.gr = buf.act(p + "ep_gate_received", {Rr, F_});
        s.ur = buf.act(p + "ep_up_received", {Rr, F_});
        s.actr = buf.act(p + "ep_act_received", {Rr, F_});
    }
    s.sg = s.su = s.sact = -1;
    if (Fs_ > 0) {
        s.sg = buf.act(p + "shared_gate", {Tn, Fs_});
        s.su = buf.act(p + "shared_up", {Tn, Fs_});
        s.sact = buf.act(p + "shared_act", {Tn, Fs_});
    }
    return s;
}

template <typename T>
typename MoeLayer<T>::Acts MoeLayer<T>::resolve(const Buffers& buf, const Slots& s) const {
    auto P = [&](MemoryPlan::Slot x) { return x < 0 ? nullptr : buf.ptr<T>(x); };
    auto I = [&](MemoryPlan::Slot x) { return buf.ptr<int32_t>(x); };
    Acts a{P(s.probs), I(s.topk), P(s.gates), I(s.slot_row), I(s.perm_token), P(s.xperm),
           P(s.g),     P(s.u),    P(s.act),   P(s.out_perm), P(s.sg),         P(s.su),
           P(s.sact),  {},        nullptr,    nullptr,       nullptr,         nullptr,
           {}};
    a.xr = P(s.xr), a.gr = P(s.gr), a.ur = P(s.ur), a.actr = P(s.actr);
    return a;
}

template <typename T>
void MoeLayer<T>::bind(const Buffers& buf, const std::vector<T*>& params,
                       const std::vector<T*>& grads) {
    p_ = params, g_ = grads;
    for (auto& e : experts_) e.bind(params, grads);
    if (shared_) shared_->bind(params, grads);
    auto P = [&](MemoryPlan::Slot x) { return x < 0 ? nullptr : buf.ptr<T>(x); };
    dxperm_ = P(s_dxperm_), doutperm_ = P(s_doutperm_), dact_ = P(s_dact_), dg_ = P(s_dg_);
    du_ = P(s_du_), dlogits_ = P(s_dlogits_), sdact_ = P(s_sdact_), sdg_ = P(s_sdg_);
    sdu_ = P(s_sdu_);
    outr_ = P(s_outr_), doutr_ = P(s_doutr_), dxr_ = P(s_dxr_), dactr_ = P(s_dactr_);
    dgr_ = P(s_dgr_), dur_ = P(s_dur_);
}

template <typename T>
void MoeLayer<T>::set_expert_parallel(Comm* ep) {
    const int ranks = ep ? ep->size() : 1;
    ST_CHECK(ranks == W_, "the MoE layers were planned for ", W_,
             " expert-parallel ranks, the group has ", ranks);
    ST_CHECK(!ep || ep->rank() == c_.expert_parallel_rank, "the MoE layers hold the experts of ",
             "expert-parallel rank ", c_.expert_parallel_rank, ", this process is rank ",
             ep ? ep->rank() : 0, " of its EP group");
    ep_ = ranks > 1 ? ep : nullptr;
}

template <typename T>
std::vector<int64_t> MoeLayer<T>::ep_send_bytes(const Acts& A, int64_t width) const {
    std::vector<int64_t> b(static_cast<size_t>(W_));
    for (int64_t d = 0; d < W_; ++d)
        b[size_t(d)] = (A.offsets[(d + 1) * El_] - A.offsets[d * El_]) * width * int64_t(sizeof(T));
    return b;
}

template <typename T>
std::vector<int64_t> MoeLayer<T>::ep_recv_bytes(const Acts& A, int64_t width) const {
    std::vector<int64_t> b(size_t(W_), 0);
    for (int64_t s = 0; s < W_; ++s)
        for (int64_t l = 0; l < El_; ++l)
            b[size_t(s)] += A.ep_recv[size_t(s * El_ + l)] * width * int64_t(sizeof(T));
    return b;
}

template <typename T>
void MoeLayer<T>::ep_forward(Acts& A) {
    // Rows per (destination, its expert), then the rows themselves.
    std::vector<int64_t> send(static_cast<size_t>(E_));
    for (int64_t e = 0; e < E_; ++e) send[size_t(e)] = A.offsets[e + 1] - A.offsets[e];
    A.ep_recv.assign(size_t(W_ * El_), 0);
    const std::vector<int64_t> counts(size_t(W_), El_ * int64_t(sizeof(int64_t)));
    ep_->alltoallv(send.data(), counts, A.ep_recv.data(), counts);
    const int64_t received = std::accumulate(A.ep_recv.begin(), A.ep_recv.end(), int64_t(0));
    ST_ASSERT(received <= received_rows_, "MoE expert parallelism: ", received,
              " rows received, the plan holds ", received_rows_);
    const std::vector<int64_t> sb = ep_send_bytes(A, h_), rb = ep_recv_bytes(A, h_);
    ep_->alltoallv(A.xperm, sb, A.xr, rb);
    int64_t r = 0;
    for (int64_t s = 0; s < W_; ++s)
        for (int64_t l = 0; l < El_; ++l) {
            const int64_t n = A.ep_recv[size_t(s * El_ + l)];
            experts_[size_t(l)].forward(A.xr + r * h_, n,
                                        {A.gr + r * F_, A.ur + r * F_, A.actr + r * F_},
                                        outr_ + r * h_, false);
            r += n;
        }
    // The outputs land where the rows came from: the permuted layout of the one-rank code.
    ep_->alltoallv(outr_, rb, A.out_perm, sb);
}

template <typename T>
void MoeLayer<T>::ep_backward(const Acts& A) const {
    const std::vector<int64_t> sb = ep_send_bytes(A, h_), rb = ep_recv_bytes(A, h_);
    ep_->alltoallv(doutperm_, sb, doutr_, rb);
    int64_t r = 0;
    for (int64_t s = 0; s < W_; ++s)
        for (int64_t l = 0; l < El_; ++l) {
            const int64_t n = A.ep_recv[size_t(s * El_ + l)];
            experts_[size_t(l)].backward(
                A.xr + r * h_, doutr_ + r * h_, n, {A.gr + r * F_, A.ur + r * F_, A.actr + r * F_},
                {dactr_ + r * F_, dgr_ + r * F_, dur_ + r * F_}, dxr_ + r * h_, false);
            r += n;
        }
    ep_->alltoallv(dxr_, rb, dxperm_, sb);
}

template <typename T>
void MoeLayer<T>::route(Acts& A, const StepInputs& in, const T* logits) {
    const int64_t real = in.cu_seqlens[in.num_docs];  // padding rows are not routed
    cpu::router_topk(logits, p_[bias_], T_, real, E_, k_, c_.moe_router_force_load_balancing,
                     c_.moe_router_topk_scaling_factor, A.probs, A.topk, A.gates);
    std::vector<int64_t> count(E_);
    A.offsets.assign(E_ + 1, 0);
    cpu::moe_permute(A.topk, real, T_, E_, k_, capacity_, count.data(), A.offsets.data(),
                     A.slot_row, A.perm_token);
    for (int64_t e = 0; e < E_; ++e) {
        stats_.load[e] += count[e];
        stats_.dropped += std::max<int64_t>(0, count[e] - capacity_);
    }
}

template <typename T>
double MoeLayer<T>::forward(Acts& A, const T* m, const StepInputs& in, T* y, double aux_scale) {
    const int64_t Tn = T_;
    // Router in the master precision (fp32 on CPU), sigmoid scores (in place of the logits).
    gemm<T>(false, true, Tn, E_, h_, 1, m, h_, p_[router_], h_, 0, A.probs, E_);
    route(A, in, A.probs);
    const int64_t R = A.offsets[E_];
    parallel_for(
        R,
        [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r)
                std::copy_n(m + A.perm_token[r] * h_, h_, A.xperm + r * h_);
        },
        16);
    ST_CHECK(ep() || W_ == 1, "the MoE layers hold ", El_, " of ", E_,
             " experts (expert parallelism) but no expert-parallel group was set");
    if (ep()) {
        ep_forward(A);
    } else {
        for (int64_t e = 0; e < E_; ++e) {
            int64_t r0 = A.offsets[e], n = A.offsets[e + 1] - r0;
            experts_[e].forward(A.xperm + r0 * h_, n,
                                {A.g + r0 * F_, A.u + r0 * F_, A.act + r0 * F_},
                                A.out_perm + r0 * h_, false);
        }
    }
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t)
                for (int64_t j = 0; j < k_; ++j) {
                    int32_t r = A.slot_row[t * k_ + j];
                    if (r < 0) continue;
                    T gate = A.gates[t * k_ + j];
                    const T* o = A.out_perm + int64_t(r) * h_;
                    for (int64_t c = 0; c < h_; ++c) y[t * h_ + c] += gate * o[c];
                }
        },
        16);
    if (shared_) shared_->forward(m, Tn, {A.sg, A.su, A.sact}, y, true);
    if (aux_scale > 0 && c_.moe_aux_loss_coeff > 0) {
        // DeepSeek-V3 sequence aux loss, per packed document (ops/moe/sequence_aux.h).
        const Balance bal = document_balance(A, in, aux_scale);
        double total = 0;
        for (size_t i = 0; i < bal.f.size(); ++i)
            total += double(bal.w[i / size_t(E_)]) * double(bal.f[i]) * double(bal.psum[i]);
        return total;
    }
    return 0.0;
}

template <typename T>
void MoeLayer<T>::backward(const Acts& A, const T* m, const T* dy, const StepInputs& in, T* dm,
                           double aux_scale) const {
    const int64_t Tn = T_, R = A.offsets[E_];
    std::fill_n(dm, Tn * h_, T(0));
    if (shared_)
        shared_->backward(m, dy, Tn, {A.sg, A.su, A.sact}, {sdact_, sdg_, sdu_}, dm, false);
    // Gate gradients and the scaled output gradient of each routed row.
    std::vector<double> dgate(Tn * k_, 0.0);
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t)
                for (int64_t j = 0; j < k_; ++j) {
                    int32_t r = A.slot_row[t * k_ + j];
                    if (r < 0) continue;
                    const T* o = A.out_perm + int64_t(r) * h_;
                    double s = 0;
                    T gate = A.gates[t * k_ + j];
                    for (int64_t c = 0; c < h_; ++c) {
                        s += double(dy[t * h_ + c]) * o[c];
                        doutperm_[int64_t(r) * h_ + c] = gate * dy[t * h_ + c];
                    }
                    dgate[t * k_ + j] = s;
                }
        },
        16);
    if (ep()) {
        ep_backward(A);
    } else {
        for (int64_t e = 0; e < E_; ++e) {
            int64_t r0 = A.offsets[e], n = A.offsets[e + 1] - r0;
            experts_[e].backward(A.xperm + r0 * h_, doutperm_ + r0 * h_, n,
                                 {A.g + r0 * F_, A.u + r0 * F_, A.act + r0 * F_},
                                 {dact_ + r0 * F_, dg_ + r0 * F_, du_ + r0 * F_}, dxperm_ + r0 * h_,
                                 false);
        }
    }
    (void)R;
    // Router: g_j = c * s_j / S over the chosen set; dS flows into every chosen s.
    const double c = c_.moe_router_topk_scaling_factor;
    std::fill_n(dlogits_, Tn * E_, T(0));
    const int64_t real = in.cu_seqlens[in.num_docs];
    parallel_for(
        real,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                const int32_t* chosen = A.topk + t * k_;
                const T* s = A.probs + t * E_;
                double S = 1e-20, dot = 0;
                for (int64_t j = 0; j < k_; ++j) S += double(s[chosen[j]]);
                for (int64_t j = 0; j < k_; ++j) dot += dgate[t * k_ + j] * double(s[chosen[j]]);
                for (int64_t j = 0; j < k_; ++j) {
                    double ds = c * (dgate[t * k_ + j] / S - dot / (S * S));
                    dlogits_[t * E_ + chosen[j]] += static_cast<T>(ds);
                }
            }
        },
        8);
    parallel_for(
        Tn * E_,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) dlogits_[i] *= A.probs[i] * (T(1) - A.probs[i]);
        },
        4096);
    if (aux_scale > 0 && c_.moe_aux_loss_coeff > 0) {
        const Balance bal = document_balance(A, in, aux_scale);
        cpu::sequence_aux_backward(A.probs, in.cu_seqlens, in.num_docs, E_, bal.f.data(),
                                   bal.w.data(), dlogits_);
    }
    gemm<T>(true, false, E_, h_, Tn, 1, dlogits_, E_, m, h_, 1, g_[router_], h_);
    gemm<T>(false, false, Tn, h_, E_, 1, dlogits_, E_, p_[router_], h_, 1, dm, h_);
    // Scatter the routed rows' input gradients back to their tokens (one writer per token).
    parallel_for(
        Tn,
        [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t)
                for (int64_t j = 0; j < k_; ++j) {
                    int32_t r = A.slot_row[t * k_ + j];
                    if (r < 0) continue;
                    const T* d = dxperm_ + int64_t(r) * h_;
                    for (int64_t cc = 0; cc < h_; ++cc) dm[t * h_ + cc] += d[cc];
                }
        },
        16);
}

template <typename T>
typename MoeLayer<T>::Balance MoeLayer<T>::document_balance(const Acts& A, const StepInputs& in,
                                                            double aux_scale) const {
    const int64_t D = in.num_docs;
    const int32_t* kcu = key_cu_seqlens(in);
    Balance bal{std::vector<T>(size_t(D * E_)), std::vector<T>(size_t(D * E_)),
                std::vector<T>(size_t(D))};
    cpu::sequence_balance(A.probs, A.topk, in.cu_seqlens, D, E_, k_, bal.f.data(), bal.psum.data());
    std::vector<double> counts(bal.f.begin(), bal.f.end());
    if (in.cp) in.cp->allreduce_sum(counts.data(), D * E_);  // counts: exact in double
    for (int64_t d = 0; d < D; ++d) {
        const double n = double(std::max<int32_t>(1, kcu[d + 1] - kcu[d]));
        bal.w[size_t(d)] = T(aux_scale * c_.moe_aux_loss_coeff / double(D) / n);
        for (int64_t x = 0; x < E_; ++x)
            bal.f[size_t(d * E_ + x)] =
                T(counts[size_t(d * E_ + x)] * double(E_) / (double(k_) * n));
    }
    return bal;
}

template <typename T>
void MoeLayer<T>::update_bias(double rate) {
    if (rate == 0) return;
    double mean = 0;
    for (int64_t l : stats_.load) mean += double(l) / double(E_);
    T* b = p_[bias_];
    for (int64_t e = 0; e < E_; ++e) {
        double diff = mean - double(stats_.load[e]);
        b[e] += static_cast<T>(rate * (diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0));
    }
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace sparsetron
