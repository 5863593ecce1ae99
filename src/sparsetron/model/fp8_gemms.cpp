#include "sparsetron/model/fp8_gemms.h"

#include <type_traits>
#include <vector>

#include "sparsetron/core/error.h"
#include "sparsetron/ops/fp8/fp8.h"
#include "sparsetron/ops/gemm/gemm.h"

namespace sparsetron {
namespace {

int64_t blocks(int64_t n) {
    return (n + cpu::kFp8Block - 1) / cpu::kFp8Block;
}

// The values an operand [rows, k] (row stride ld) holds once quantized 1x128 along k: each e4m3
// code times its block's power-of-two scale, exact in fp32. A block-scaled GEMM's sum of the
// products scaled per block is then the plain GEMM of these values (up to the order of the fp32
// sums), which runs at the BLAS's speed.
std::vector<float> rows_1x128(const float* x, int64_t ld, int64_t rows, int64_t k) {
    std::vector<uint8_t> q(size_t(rows * k));
    std::vector<float> s(size_t(rows * blocks(k))), out(size_t(rows * k));
    cpu::quantize_1x128(x, rows, k, ld, cpu::kFp8Pow2Scales, q.data(), s.data());
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < k; ++c)
            out[size_t(r * k + c)] = cpu::e4m3_to_float(q[size_t(r * k + c)]) *
                                     s[size_t(r * blocks(k) + c / cpu::kFp8Block)];
    return out;
}

// The same for a weight [n, k] quantized 128x128.
std::vector<float> blocks_128x128(const float* w, int64_t n, int64_t k) {
    std::vector<uint8_t> q(size_t(n * k));
    std::vector<float> s(size_t(blocks(n) * blocks(k))), out(size_t(n * k));
    cpu::quantize_128x128(w, n, k, cpu::kFp8Pow2Scales, q.data(), s.data());
    for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < k; ++c)
            out[size_t(r * k + c)] =
                cpu::e4m3_to_float(q[size_t(r * k + c)]) *
                s[size_t((r / cpu::kFp8Block) * blocks(k) + c / cpu::kFp8Block)];
    return out;
}

// x [rows, cols] (row stride ld) transposed into [cols, rows].
std::vector<float> transposed(const float* x, int64_t ld, int64_t rows, int64_t cols) {
    std::vector<float> t(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) t[size_t(c * rows + r)] = x[r * ld + c];
    return t;
}

void fp8_forward(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t n,
                 float* y, int64_t ldy, bool add) {
    const std::vector<float> a = rows_1x128(x, ldx, rows, k), b = blocks_128x128(w, n, k);
    cpu::gemm<float>(false, true, rows, n, k, 1, a.data(), k, b.data(), k, add ? 1 : 0, y, ldy);
}

void fp8_dgrad(const float* dy, int64_t lddy, int64_t rows, int64_t n, const float* w, int64_t k,
               float* dx, int64_t lddx, bool add) {
    // W^T [k, n] quantized as a weight of its own (the CUDA engine's transposed copy).
    const std::vector<float> wt = transposed(w, k, n, k);
    const std::vector<float> a = rows_1x128(dy, lddy, rows, n), b = blocks_128x128(wt.data(), k, n);
    cpu::gemm<float>(false, true, rows, k, n, 1, a.data(), n, b.data(), n, add ? 1 : 0, dx, lddx);
}

void fp8_wgrad(const float* dy, int64_t lddy, int64_t rows, int64_t n, const float* x, int64_t ldx,
               int64_t k, float* dw) {
    // dy^T [n, rows] and x^T [k, rows], each quantized along the rows.
    const std::vector<float> dyt = transposed(dy, lddy, rows, n), xt = transposed(x, ldx, rows, k);
    const std::vector<float> a = rows_1x128(dyt.data(), rows, n, rows),
                             b = rows_1x128(xt.data(), rows, k, rows);
    cpu::gemm<float>(false, true, n, k, rows, 1, a.data(), rows, b.data(), rows, 1, dw, k);
}

template <typename T>
void require_float(bool fp8) {
    if constexpr (!std::is_same_v<T, float>)
        ST_CHECK(!fp8, "fp8_recipe: blockwise runs in float models only (not the fp64 checks)");
}

}  // namespace

template <typename T>
void linear_forward(bool fp8, const T* x, int64_t ldx, int64_t rows, int64_t k, const T* w,
                    int64_t n, T* y, int64_t ldy, bool add) {
    if (rows == 0) return;
    require_float<T>(fp8);
    if constexpr (std::is_same_v<T, float>)
        if (fp8) return fp8_forward(x, ldx, rows, k, w, n, y, ldy, add);
    cpu::gemm<T>(false, true, rows, n, k, 1, x, ldx, w, k, add ? 1 : 0, y, ldy);
}

template <typename T>
void linear_dgrad(bool fp8, const T* dy, int64_t lddy, int64_t rows, int64_t n, const T* w,
                  int64_t k, T* dx, int64_t lddx, bool add) {
    if (rows == 0) return;
    require_float<T>(fp8);
    if constexpr (std::is_same_v<T, float>)
        if (fp8) return fp8_dgrad(dy, lddy, rows, n, w, k, dx, lddx, add);
    cpu::gemm<T>(false, false, rows, k, n, 1, dy, lddy, w, k, add ? 1 : 0, dx, lddx);
}

template <typename T>
void linear_wgrad(bool fp8, const T* dy, int64_t lddy, int64_t rows, int64_t n, const T* x,
                  int64_t ldx, int64_t k, T* dw) {
    if (rows == 0) return;
    require_float<T>(fp8);
    if constexpr (std::is_same_v<T, float>)
        if (fp8) return fp8_wgrad(dy, lddy, rows, n, x, ldx, k, dw);
    cpu::gemm<T>(true, false, n, k, rows, 1, dy, lddy, x, ldx, 1, dw, k);
}

#define SPARSETRON_LINEAR(T)                                                                      \
    template void linear_forward<T>(bool, const T*, int64_t, int64_t, int64_t, const T*, int64_t, \
                                    T*, int64_t, bool);                                           \
    template void linear_dgrad<T>(bool, const T*, int64_t, int64_t, int64_t, const T*, int64_t,   \
                                  T*, int64_t, bool);                                             \
    template void linear_wgrad<T>(bool, const T*, int64_t, int64_t, int64_t, const T*, int64_t,   \
                                  int64_t, T*);
SPARSETRON_LINEAR(float)
SPARSETRON_LINEAR(double)
#undef SPARSETRON_LINEAR

}  // namespace sparsetron
