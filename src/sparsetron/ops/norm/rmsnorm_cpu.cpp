// Embedding and RMSNorm.
#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/norm/norm.h"

namespace sparsetron::cpu {

template <typename T>
void embedding_forward(const int32_t* tokens, int64_t rows, const T* table, int64_t vocab,
                       int64_t dim, T* out) {
    for (int64_t r = 0; r < rows; ++r)
        ST_CHECK(tokens[r] >= 0 && tokens[r] < vocab, "token id ", tokens[r],
                 " is outside the vocabulary (vocab_size ", vocab, ")");
    parallel_for(
        rows,
        [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const T* src = table + static_cast<int64_t>(tokens[r]) * dim;
                for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = src[j];
            }
        },
        16);
}

template <typename T>
void embedding_backward(const int32_t* tokens, int64_t rows, const T* dout, int64_t, int64_t dim,
                        T* dtable) {
    // Columns are split across threads so each element of dtable has one writer, and rows are
    // added in order: deterministic for any thread count.
    parallel_for(
        dim,
        [&](int64_t b, int64_t e) {
            for (int64_t r = 0; r < rows; ++r) {
                T* dst = dtable + static_cast<int64_t>(tokens[r]) * dim;
                for (int64_t j = b; j < e; ++j) dst[j] += dout[r * dim + j];
            }
        },
        16);
}

template <typename T>
void rmsnorm_forward(const T* x, int64_t ldx, const T* w, int64_t rows, int64_t dim, double eps,
                     T* y, int64_t ldy, T* rstd) {
    parallel_for(
        rows,
        [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const T* xr = x + r * ldx;
                double ss = 0;
                for (int64_t j = 0; j < dim; ++j) ss += double(xr[j]) * double(xr[j]);
                double rs = 1.0 / std::sqrt(ss / double(dim) + eps);
                rstd[r] = static_cast<T>(rs);
                for (int64_t j = 0; j < dim; ++j)
                    y[r * ldy + j] = static_cast<T>(w[j] * (xr[j] * rs));
            }
        },
        4);
}

template <typename T>
void rmsnorm_backward(const T* dy, int64_t lddy, const T* x, int64_t ldx, const T* w, const T* rstd,
                      int64_t rows, int64_t dim, T* dx, int64_t lddx, bool accumulate, T* dw) {
    // dx = rstd * (w*dy - xhat * mean(w*dy*xhat)),  xhat = x * rstd;  dw += Σ_rows dy * xhat.
    parallel_for(
        rows,
        [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const T* xr = x + r * ldx;
                const T* dyr = dy + r * lddy;
                double rs = rstd[r];
                double dot = 0;
                for (int64_t j = 0; j < dim; ++j) dot += double(w[j]) * dyr[j] * xr[j] * rs;
                double mean = dot / double(dim);
                for (int64_t j = 0; j < dim; ++j) {
                    double g = rs * (double(w[j]) * dyr[j] - xr[j] * rs * mean);
                    T* d = dx + r * lddx + j;
                    *d = static_cast<T>(accumulate ? *d + g : g);
                }
            }
        },
        4);
    if (dw) {
        parallel_for(
            dim,
            [&](int64_t b, int64_t e) {
                for (int64_t r = 0; r < rows; ++r) {
                    const T* xr = x + r * ldx;
                    const T* dyr = dy + r * lddy;
                    T rs = rstd[r];
                    for (int64_t j = b; j < e; ++j) dw[j] += dyr[j] * (xr[j] * rs);
                }
            },
            16);
    }
}

#define INSTANTIATE(T)                                                                            \
    template void embedding_forward<T>(const int32_t*, int64_t, const T*, int64_t, int64_t, T*);  \
    template void embedding_backward<T>(const int32_t*, int64_t, const T*, int64_t, int64_t, T*); \
    template void rmsnorm_forward<T>(const T*, int64_t, const T*, int64_t, int64_t, double, T*,   \
                                     int64_t, T*);                                                \
    template void rmsnorm_backward<T>(const T*, int64_t, const T*, int64_t, const T*, const T*,   \
                                      int64_t, int64_t, T*, int64_t, bool, T*);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
