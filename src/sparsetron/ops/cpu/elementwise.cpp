// SwiGLU, residual adds, scaling, squared norms and the AdamW update.
#include <cmath>
#include <vector>

#include "sparsetron/core/parallel.h"
#include "sparsetron/ops/cpu/kernels.h"

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

template <typename T>
double sum_squares(const T* x, int64_t n) {
    constexpr int64_t kBlock = 4096;
    int64_t blocks = (n + kBlock - 1) / kBlock;
    std::vector<double> partial(blocks, 0.0);
    parallel_for(blocks, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk) {
            double s = 0;
            int64_t end = std::min(n, (blk + 1) * kBlock);
            for (int64_t i = blk * kBlock; i < end; ++i) s += double(x[i]) * double(x[i]);
            partial[blk] = s;
        }
    });
    double total = 0;
    for (double p : partial) total += p;
    return total;
}

template <typename T>
void adamw_update(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int64_t step, double grad_scale) {
    const double bc1 = 1.0 - std::pow(beta1, double(step));
    const double bc2 = 1.0 - std::pow(beta2, double(step));
    parallel_for(
        n,
        [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) {
                double g = double(grad[i]) * grad_scale;
                double mi = beta1 * m[i] + (1.0 - beta1) * g;
                double vi = beta2 * v[i] + (1.0 - beta2) * g * g;
                m[i] = static_cast<T>(mi);
                v[i] = static_cast<T>(vi);
                double p = double(param[i]) * (1.0 - lr * weight_decay);
                p -= lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps);
                param[i] = static_cast<T>(p);
            }
        },
        4096);
}

#define INSTANTIATE(T)                                                                           \
    template void swiglu_forward<T>(const T*, const T*, int64_t, T*);                            \
    template void swiglu_backward<T>(const T*, const T*, const T*, int64_t, T*, T*);             \
    template void add_inplace<T>(T*, const T*, int64_t);                                         \
    template void scale_inplace<T>(T*, int64_t, double);                                         \
    template double sum_squares<T>(const T*, int64_t);                                           \
    template void adamw_update<T>(T*, const T*, T*, T*, int64_t, double, double, double, double, \
                                  double, int64_t, double);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
