// The MoE sequence-level aux loss (DeepSeek-V3's balance loss per packed document, SPEC §4,
// `moe_aux_loss_coeff`). For document d of a micro-batch (rows [doc_rows[d], doc_rows[d + 1]) of
// this rank; n_d its rows in the whole micro-batch, every context-parallel rank's), with the
// router's sigmoid scores s and its top-k choices:
//   counts[d, e] = choices of expert e among the document's rows,
//   psum[d, e]   = Σ_t s_te / Σ_x s_tx,
//   f = counts * E / (k n_d)  (1 for every expert when balanced),   P = psum / n_d,
//   loss = Σ_d (α λ / D) Σ_e f_de P_de = Σ_d w_d Σ_e f_de psum_de,  w_d = α λ / (D n_d),
// α the coefficient, λ the micro-batch's aux weight, D its documents. Under context parallelism
// the counts are summed over the group before f is formed (psum stays each rank's: the ranks'
// losses add up to the document's). The gradient reaches the router's logits through P only
// (f counts choices): d loss / d s_ty = w_d (f_dy - Σ_x f_dx s_tx / z_t) / z_t, z_t = Σ_x s_tx.
// CPU reference: sequence_aux_cpu.cpp; CUDA: sequence_aux.cu. Tests: tests/ops/moe/.
#pragma once

#include <cstdint>

#include "sparsetron/core/exec_context.h"

namespace sparsetron::cpu {

// counts and psum [docs, experts], written.
template <typename T>
void sequence_balance(const T* probs, const int32_t* topk, const int32_t* doc_rows, int64_t docs,
                      int64_t experts, int64_t k, T* counts, T* psum);
// dlogits [rows, experts] += the loss's gradient with respect to the router logits (through the
// sigmoid: s (1 - s) times the scores' gradient), from f [docs, experts] and w [docs].
template <typename T>
void sequence_aux_backward(const T* probs, const int32_t* doc_rows, int64_t docs, int64_t experts,
                           const T* f, const T* w, T* dlogits);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// int64 scratch elements sequence_balance needs.
inline int64_t sequence_balance_work(int64_t docs, int64_t experts) {
    return 2 * docs * experts;
}
// counts and psum [docs, experts] (fp32, written) of `tokens` rows of scores and choices
// (padding rows outside every document are skipped). Deterministic: blocks of rows add their
// partial sums in 2^-40 fixed point (integer atomics), so psum does not depend on the order the
// blocks run in. doc_rows [docs + 1] on the device.
void sequence_balance(const ExecContext& ctx, const float* probs, const int32_t* topk,
                      const int32_t* doc_rows, int64_t tokens, int64_t docs, int64_t experts,
                      int64_t k, int64_t* work, float* counts, float* psum);
// f = counts * fscale[d] (written, [docs, experts]) and *loss += Σ_d w[d] Σ_e f psum (one block,
// fixed order; loss null: f only). fscale[d] = E / (k n_d), w[d] as above, both device.
void sequence_aux_loss(const ExecContext& ctx, const float* counts, const float* psum,
                       const float* fscale, const float* w, int64_t docs, int64_t experts, float* f,
                       double* loss);
// dlogits [tokens, experts] += the loss's gradient with respect to the logits, as the CPU form.
void sequence_aux_backward(const ExecContext& ctx, const float* probs, const int32_t* doc_rows,
                           int64_t tokens, int64_t docs, int64_t experts, const float* f,
                           const float* w, float* dlogits);

}  // namespace sparsetron::cuda
