// The optimizer's CPU kernels (optim.h): the fixed-order sum of squares and AdamW.
#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/optim/optim.h"

namespace sparsetron::cpu {

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
    template double sum_squares<T>(const T*, int64_t);                                           \
    template void adamw_update<T>(T*, const T*, T*, T*, int64_t, double, double, double, double, \
                                  double, int64_t, double);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
