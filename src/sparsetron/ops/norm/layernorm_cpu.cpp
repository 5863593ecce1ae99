// LayerNorm with bias (the DSA indexer's key norm, SPEC §3).
#include <cmath>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/norm/norm.h"

namespace sparsetron::cpu {

template <typename T>
void layernorm_forward(const T* x, const T* w, const T* b, int64_t rows, int64_t dim, double eps,
                       T* y, T* mean, T* rstd) {
    parallel_for(
        rows,
        [&](int64_t rb, int64_t re) {
            for (int64_t r = rb; r < re; ++r) {
                const T* xr = x + r * dim;
                double mu = 0, var = 0;
                for (int64_t j = 0; j < dim; ++j) mu += xr[j];
                mu /= double(dim);
                for (int64_t j = 0; j < dim; ++j) var += (xr[j] - mu) * (xr[j] - mu);
                double rs = 1.0 / std::sqrt(var / double(dim) + eps);
                mean[r] = static_cast<T>(mu);
                rstd[r] = static_cast<T>(rs);
                for (int64_t j = 0; j < dim; ++j)
                    y[r * dim + j] = static_cast<T>(w[j] * ((xr[j] - mu) * rs) + b[j]);
            }
        },
        8);
}

template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd,
                        int64_t rows, int64_t dim, T* dx, T* dw, T* db) {
    // xhat = (x - mean) * rstd;  g = w * dy;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    parallel_for(
        rows,
        [&](int64_t rb, int64_t re) {
            for (int64_t r = rb; r < re; ++r) {
                const T* xr = x + r * dim;
                const T* dyr = dy + r * dim;
                double mu = mean[r], rs = rstd[r], mg = 0, mgx = 0;
                for (int64_t j = 0; j < dim; ++j) {
                    double g = double(w[j]) * dyr[j], xh = (xr[j] - mu) * rs;
                    mg += g, mgx += g * xh;
                }
                mg /= double(dim), mgx /= double(dim);
                for (int64_t j = 0; j < dim; ++j) {
                    double g = double(w[j]) * dyr[j], xh = (xr[j] - mu) * rs;
                    dx[r * dim + j] = static_cast<T>(rs * (g - mg - xh * mgx));
                }
            }
        },
        8);
    parallel_for(
        dim,
        [&](int64_t jb, int64_t je) {
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = jb; j < je; ++j) {
                    double xh = (x[r * dim + j] - double(mean[r])) * double(rstd[r]);
                    dw[j] += static_cast<T>(dy[r * dim + j] * xh);
                    db[j] += dy[r * dim + j];
                }
        },
        8);
}

template void layernorm_forward<float>(const float*, const float*, const float*, int64_t, int64_t,
                                       double, float*, float*, float*);
template void layernorm_forward<double>(const double*, const double*, const double*, int64_t,
                                        int64_t, double, double*, double*, double*);
template void layernorm_backward<float>(const float*, const float*, const float*, const float*,
                                        const float*, int64_t, int64_t, float*, float*, float*);
template void layernorm_backward<double>(const double*, const double*, const double*, const double*,
                                         const double*, int64_t, int64_t, double*, double*,
                                         double*);

}  // namespace sparsetron::cpu
