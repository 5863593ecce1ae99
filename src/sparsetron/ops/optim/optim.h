// Optimizer kernels on the device: the global gradient norm in fixed-order partial sums, the
// clipping scale and the skip flags as device scalars (the step never reads a norm on the host),
// and AdamW (Muon's momentum, batched Newton-Schulz and update are muon_batch.h). CPU references:
// optim_cpu.cpp (sum of squares, AdamW) and optim/ (Muon, Newton-Schulz). CUDA: clip_adamw.cu.
// Tests: tests/ops/optim/test_optim.cpp, tests/ops/optim/test_optim_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron::cpu {

// Σ x², summed in fixed 4096-element blocks in order (independent of the thread count).
template <typename T>
double sum_squares(const T* x, int64_t n);

// Decoupled-weight-decay Adam on flat arrays (grad is multiplied by grad_scale first).
template <typename T>
void adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int64_t step, double grad_scale);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

// Σ x² over `n` fp32 (or bf16: bf16 gradient buffers) values in fixed blocks, written to
// partials[sum_squares_blocks(n)].
int64_t sum_squares_blocks(int64_t n);
void sum_squares_partials(const ExecContext& ctx, const float* x, int64_t n, float* partials);
void sum_squares_partials(const ExecContext& ctx, const bf16* x, int64_t n, float* partials);
// norm = sqrt(Σ partials) (fp64, fixed order); scale = max_norm / (norm + 1e-6) if
// 0 < max_norm < norm else 1; a non-finite norm gives scale 0 and sets *skip = 1 (the step is
// skipped).
void clip_scale(const ExecContext& ctx, const float* partials, int64_t count, float max_norm,
                float* norm, float* scale, int32_t* skip);
// *out = Σ partials (the same fixed order as clip_scale): a stage's share of a norm that
// pipeline stages sum before clip_scale.
void sum_partials(const ExecContext& ctx, const float* partials, int64_t count, float* out);
// skip[0..n) = OR of them all (one non-finite clipping group skips the whole step).
void merge_skip(const ExecContext& ctx, int32_t* skip, int64_t n);
// skip[0..n) |= (*flag != 0): an outside reason to skip the step (the MoE stash overflowed).
void veto_skip(const ExecContext& ctx, int32_t* skip, int64_t n, const int32_t* flag);
// param -= lr * (m̂ / (sqrt(v̂) + eps) + wd * param) with grad * (*grad_scale); nothing when *skip.
// Writes the bf16 copy of the new parameter when param_bf16 is not null. With `schedule` (device
// [lr, 1 - beta1^t, 1 - beta2^t]: graph-safe), lr and step come from there instead.
struct AdamwHyper {
    float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
    int64_t step = 1;
    const float* schedule = nullptr;
};
void adamw_update(const ExecContext& ctx, const AdamwHyper& hp, float* param, const float* grad,
                  float* m, float* v, int64_t n, const float* grad_scale, const int32_t* skip,
                  bf16* param_bf16);
// The same from a bf16 gradient buffer.
void adamw_update(const ExecContext& ctx, const AdamwHyper& hp, float* param, const bf16* grad,
                  float* m, float* v, int64_t n, const float* grad_scale, const int32_t* skip,
                  bf16* param_bf16);

}  // namespace sparsetron::cuda
