// SwiGLU, residual adds and scaling (elementwise.h).
#include <cmath>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/elementwise/elementwise.h"

namespace sparsetron::cpu {

template <typename T>
void swiglu_forward(const T* g, const T* u, int64_t n, T* out) {
    parallel_for(
        n,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                double x = g[i];
                out[i] = static_cast<T>(x / (1.0 + std::exp(-x)) * u[i]);
            }
        },
        4096);
}

template <typename T>
void swiglu_backward(const T* g, const T* u, const T* dout, int64_t n, T* dg, T* du) {
    parallel_for(
        n,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                double x = g[i], sig = 1.0 / (1.0 + std::exp(-x));
                double silu = x * sig;
                du[i] = static_cast<T>(dout[i] * silu);
                dg[i] = static_cast<T>(dout[i] * u[i] * sig * (1.0 + x * (1.0 - sig)));
            }
        },
        4096);
}

template <typename T>
void add_inplace(T* y, const T* x, int64_t n) {
    parallel_for(
        n,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) y[i] += x[i];
        },
        1 << 14);
}

template <typename T>
void scale_inplace(T* x, int64_t n, double s) {
    parallel_for(
        n,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) x[i] = static_cast<T>(x[i] * s);
        },
        1 << 14);
}

#define INSTANTIATE(T)                                                               \
    template void swiglu_forward<T>(const T*, const T*, int64_t, T*);                \
    template void swiglu_backward<T>(const T*, const T*, const T*, int64_t, T*, T*); \
    template void add_inplace<T>(T*, const T*, int64_t);                             \
    template void scale_inplace<T>(T*, int64_t, double);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
