// A linear layer's three GEMMs (y = x W^T, W [n, k]) for the CPU model, in fp32/fp64 or in the
// FP8 blockwise recipe (`fp8_recipe: blockwise`, SPEC §6) as the CUDA engine runs them
// (model/cuda/fp8_linear.h): the forward with x 1x128 along k and W 128x128, the input gradient
// with dy 1x128 along n and W^T 128x128, the weight gradient with dy^T and x^T 1x128 along the
// rows; the same quantizers (ops/fp8, bit for bit the CUDA ones), the quantized values (exact in
// fp32: power-of-two scales) multiplied by the BLAS in fp32. FP8 runs in float models only. Row
// strides: ldx, ldy, lddy, lddx.
#pragma once

#include <cstdint>

namespace sparsetron {

// y [rows, n] (+)= x [rows, k] W^T.
template <typename T>
void linear_forward(bool fp8, const T* x, int64_t ldx, int64_t rows, int64_t k, const T* w,
                    int64_t n, T* y, int64_t ldy, bool add);
// dx [rows, k] (+)= dy [rows, n] W.
template <typename T>
void linear_dgrad(bool fp8, const T* dy, int64_t lddy, int64_t rows, int64_t n, const T* w,
                  int64_t k, T* dx, int64_t lddx, bool add);
// dW [n, k] += dy^T x.
template <typename T>
void linear_wgrad(bool fp8, const T* dy, int64_t lddy, int64_t rows, int64_t n, const T* x,
                  int64_t ldx, int64_t k, T* dw);

}  // namespace sparsetron
