// Small vector helpers for the CPU kernels' inner loops (vectorized with -fopenmp-simd).
#pragma once

#include <cstdint>

namespace sparsetron::cpu {

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

// y += alpha * x
template <typename T>
inline void axpy(T alpha, const T* __restrict x, T* __restrict y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace sparsetron::cpu
