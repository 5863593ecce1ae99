// RMSNorm and LayerNorm per row, forward and backward. CPU references: rmsnorm_cpu.cpp,
// layernorm_cpu.cpp; CUDA: norm.cu (bf16 in and out, fp32 statistics and weight gradients).
// Tests: tests/ops/test_norm.cpp, tests/gpu/ops/test_norm_cuda.cpp.
#pragma once

#include <cstdint>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/exec_context.h"

namespace sparsetron::cpu {

// y = w * x / sqrt(mean(x^2) + eps) per row; rstd[r] = 1/sqrt(mean + eps). Row strides allowed.
template <typename T>
void rmsnorm_forward(const T* x, int64_t ldx, const T* w, int64_t rows, int64_t dim, double eps,
                     T* y, int64_t ldy, T* rstd);
template <typename T>
void rmsnorm_backward(const T* dy, int64_t lddy, const T* x, int64_t ldx, const T* w, const T* rstd,
                      int64_t rows, int64_t dim, T* dx, int64_t lddx, bool accumulate, T* dw);

// LayerNorm with weight and bias per row: y = w * (x - mean) * rstd + b. mean/rstd: [rows].
template <typename T>
void layernorm_forward(const T* x, const T* w, const T* b, int64_t rows, int64_t dim, double eps,
                       T* y, T* mean, T* rstd);
// dx written; dw, db accumulate.
template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd,
                        int64_t rows, int64_t dim, T* dx, T* dw, T* db);

}  // namespace sparsetron::cpu

namespace sparsetron::cuda {

void rmsnorm_forward(const ExecContext& ctx, const bf16* x, int64_t ldx, const bf16* w,
                     int64_t rows, int64_t dim, float eps, bf16* y, int64_t ldy, float* rstd);
// dw += Σ_rows (fp32, fixed-order partial sums in `ws` of rmsnorm_ws_floats(rows, dim) floats).
void rmsnorm_backward(const ExecContext& ctx, const bf16* dy, int64_t lddy, const bf16* x,
                      int64_t ldx, const bf16* w, const float* rstd, int64_t rows, int64_t dim,
                      bf16* dx, int64_t lddx, bool accumulate, float* dw, float* ws);
int64_t rmsnorm_ws_floats(int64_t rows, int64_t dim);

void layernorm_forward(const ExecContext& ctx, const bf16* x, const bf16* w, const bf16* b,
                       int64_t rows, int64_t dim, float eps, bf16* y, float* mean, float* rstd);
// dx written; dw, db accumulate (fp32). ws: 2 * rmsnorm_ws_floats(rows, dim) floats.
void layernorm_backward(const ExecContext& ctx, const bf16* dy, const bf16* x, const bf16* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t dim, bf16* dx,
                        float* dw, float* db, float* ws);

}  // namespace sparsetron::cuda
