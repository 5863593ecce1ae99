// Muon on the device over a batch of equal-shape matrices (optim/muon_batches.h): the momentum
// rows of every problem gathered into one [count, rr, cc] stack in the wide orientation, each
// normalized by its own Frobenius norm, Newton-Schulz by strided batched cuBLASLt GEMMs, and the
// result applied to each problem's rows of the fp32 master weights.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron {

// The iterations at which the Gram form of Newton-Schulz (optim/newton_schulz.h) restarts on
// both backends (0-based; iteration 0 starts from X anyway).
inline const std::vector<int64_t>& gram_ns_restarts() {
    static const std::vector<int64_t> at{3};
    return at;
}
// Whether the Gram form restarts at iteration i (never at 0, which starts from X anyway).
inline bool gram_ns_restarts_at(const std::vector<int64_t>& restarts, int64_t i) {
    return i > 0 && std::find(restarts.begin(), restarts.end(), i) != restarts.end();
}

}  // namespace sparsetron

namespace sparsetron::cuda {

// One matrix of a batch, as the kernels read it from a device table. Row r of the problem is
// row row0 + (r / seg_rows) seg_stride + r % seg_rows of its [*, cols] parameter.
struct MuonDeviceProblem {
    const float* grad;  // fp32 gradient, or null with `grad16` (a bf16 gradient buffer)
    float* mom;
    float* master;
    bf16* weights;  // the bf16 copy the model reads, rewritten by the apply (may be null)
    int64_t row0, seg_rows, seg_stride;
    int32_t group;   // clipping group: reads scales[group] and skips[group]
    int32_t decays;  // 1: decoupled weight decay, master *= 1 - lr weight_decay before the update
    const bf16* grad16;
};

// x[p] = U of problem p's rows (nesterov ? (1 - beta) g scale + beta mom : mom) as [rows, cols],
// or its transpose [cols, rows] when `transpose` (the wide orientation of a tall matrix). With
// `update_skips`, the momentum update (muon_momentum) is done here first, unless
// update_skips[group]: one pass over the gradient and the momentum instead of two. With
// `norm_ws` (muon_gathered_norm_floats of workspace), the sums of squares the normalization needs
// are written too, per 32 x 32 tile: muon_normalize_gathered then skips its own read of x.
void muon_gather_batch(const ExecContext& ctx, const MuonDeviceProblem* problems, int64_t count,
                       int64_t rows, int64_t cols, bool transpose, float beta, bool nesterov,
                       const float* scales, float* x, const int32_t* update_skips = nullptr,
                       float* norm_ws = nullptr);

// w[p] = scale x[p] / (||x[p]||_F + eps) in `w_type` (F32, BF16 or F16) for the stack x that
// muon_gather_batch wrote (rows x cols as gathered), from the per-tile sums of squares it wrote
// into ws (muon_gathered_norm_floats of them); the norms summed in a fixed order.
int64_t muon_gathered_norm_floats(int64_t count, int64_t rows, int64_t cols);
void muon_normalize_gathered(const ExecContext& ctx, const float* x, int64_t count, int64_t rows,
                             int64_t cols, float eps, float* ws, DType w_type, void* w,
                             float scale = 1.f);

// Newton-Schulz iterations on w [count, rr, cc] (rr <= cc) in place: A = W W^T;
// B = b A + c A A; W = a W + B W, one (a, b, c) per iteration. `elem` F32 (tf32 allows TF32
// tensor cores) or BF16 (bf16 operands and outputs, fp32 accumulation: what PyTorch's Muon does
// at matmul precision "medium"). y: [count, rr, cc] (the iterate alternates between w and y;
// the result ends in w) and a, b: [count, rr, rr] of `elem`.
void newton_schulz_batch(const ExecContext& ctx, void* w, void* y, void* a, void* b, int64_t count,
                         int64_t rr, int64_t cc,
                         const std::vector<std::array<float, 3>>& coefficients, DType elem,
                         bool tf32);

// The Gram form of the same iterations (optim/newton_schulz.h): R = X X^T once, then per
// iteration Z = b R + c R R, Q <- Q (a I + Z) (Q = a I + Z at the start and at each restart),
// R <- Q_i R Q_i; X <- Q X at each restart (then R = X X^T anew) and at the end. Every [rr, rr]
// product is symmetric (polynomials in the same R commute) and computed as three half blocks.
// `elem` F32, BF16 or F16 (the optimizer's choice under bf16 matmul precision: the accumulated Q
// needs fp16's mantissa; docs/optimizer.md). w holds x_scale X on entry (normalized times a power
// of two, gram_ns_x_scale, so fp16 keeps X's entries out of its subnormals) and X on return.
// squares: kGramSquares [count, rr, rr] of `elem`.
constexpr int64_t kGramSquares = 5;  // R, Z, R Z, Q and the next Q
float gram_ns_x_scale(int64_t rr, int64_t cc);
void newton_schulz_gram_batch(const ExecContext& ctx, void* w, void* y, void* squares,
                              int64_t count, int64_t rr, int64_t cc,
                              const std::vector<std::array<float, 3>>& coefficients,
                              const std::vector<int64_t>& restarts, DType elem, bool tf32,
                              float x_scale);

// Unless skips[group]: master rows of problem p = master (1 - lr weight_decay [p decays])
// - lr step O[p], O[p]
// read from w in the layout muon_gather_batch wrote (transposed back when `transpose`), and the
// problem's bf16 weights (when set) = the new master rounded. lr: a device scalar (1 when null).
// Folding the decay and the bf16 copy in here saves two passes over every Muon parameter.
void muon_apply_batch(const ExecContext& ctx, const MuonDeviceProblem* problems, int64_t count,
                      int64_t rows, int64_t cols, bool transpose, const void* w, DType w_type,
                      float step, const int32_t* skips, const float* lr, float weight_decay = 0.f);

}  // namespace sparsetron::cuda
