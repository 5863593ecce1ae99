// Newton-Schulz (SPEC §7) on the CPU, in two forms. The standard one iterates on X directly. The
// Gram form (`muon_ns_method: gram`) is SPEC §7's iteration rewritten to
// iterate on the small symmetric Gram matrix R = X Xᵀ [r, r] and the accumulated polynomial Q,
// touching the wide X [r, c] only at the start, at each restart and at the end. Equal to the
// standard iteration in exact arithmetic (tested to 1e-12 in fp64); cheaper when c is several
// times r. Between restarts R is carried by the polynomial alone, R <- Q R Q, so rounding drifts
// it away from the true Gram matrix of Q X; a restart (X <- Q X, R <- X Xᵀ, Q <- I) resets that.
// With half-precision products it diverges without restarts on ill-conditioned inputs; one
// restart keeps it within a small factor of the standard form's error in bf16, and in fp16 it is
// several times more accurate than the standard form in bf16 (docs/optimizer.md). The restart
// sits at iteration 3 of 5: as cheap as anywhere, and more accurate than at 2 (docs/optimizer.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "sparsetron/ops/optim/muon_batch.h"

namespace sparsetron {

// Rounding applied to every product's output (and to the normalized input), to run the CPU
// iterations on the grid of a device's reduced-precision GEMMs: none, bf16 or fp16 (round to
// nearest even; fp16 with its subnormals, beyond +-65504 infinite).
enum class NsRounding { None, BF16, FP16 };
double round_ns(NsRounding r, double x);

// Multiply-adds of Newton-Schulz on one wide [r, c] matrix (r <= c) in each form, a product whose
// result is symmetric counted at 3/4 (the CUDA backend computes two diagonal half-blocks and one
// off-diagonal one): X Xᵀ and A A in the standard form; X Xᵀ and every [r, r] product in the
// Gram form (they are polynomials in the same R_0, so they commute and their products are
// symmetric).
double newton_schulz_cost(int64_t r, int64_t c, int64_t steps);
double newton_schulz_gram_cost(int64_t r, int64_t c, int64_t steps,
                               const std::vector<int64_t>& restarts);
// `muon_ns_method: gram` uses the Gram form for a matrix where it costs less (with 5 steps and
// one restart: c > ~1.3 r) and the standard iteration elsewhere (square-ish matrices).
bool gram_ns_pays(int64_t r, int64_t c, int64_t steps);
// The form a wide [r, c] matrix runs in under `method` (muon_ns_method), and its cost.
bool uses_gram_ns(const std::string& method, int64_t r, int64_t c, int64_t steps);
double newton_schulz_cost(int64_t r, int64_t c, int64_t steps, bool gram);

// X [m, n] <- NS_steps(X / ||X||_F) in place (transposed to the wide orientation internally), by
// SPEC §7's standard iteration; `rounding` emulates reduced-precision products.
template <typename T>
void newton_schulz(T* x, int64_t m, int64_t n, int64_t steps, const std::string& coefficients,
                   std::vector<T>& workspace, NsRounding rounding = NsRounding::None);

// The same by the Gram form with restarts at `restarts`; coefficients as muon_ns_coefficients.
template <typename T>
void newton_schulz_gram(T* x, int64_t m, int64_t n, int64_t steps, const std::string& coefficients,
                        const std::vector<int64_t>& restarts, std::vector<T>& workspace,
                        NsRounding rounding = NsRounding::None);

}  // namespace sparsetron
