// Sparse MQA attention (absorbed MLA over top-k keys), forward and backward.
#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/common/vec.h"

namespace sparsetron::cpu {

template <typename T>
void sparse_mqa_forward(int64_t Tn, int64_t H, int64_t dqk, int64_t dv, const T* q, const T* kv,
                        const int32_t* idx, const int32_t* len, int64_t K, double scale, T* out,
                        T* lse) {
    parallel_for(
        Tn,
        [&](int64_t tb, int64_t te) {
            std::vector<double> p(K);
            for (int64_t t = tb; t < te; ++t) {
                const int32_t* sel = idx + t * K;
                const int64_t n = len[t];
                for (int64_t h = 0; h < H; ++h) {
                    T* o = out + (t * H + h) * dv;
                    std::fill_n(o, dv, T(0));
                    if (n == 0) {
                        lse[h * Tn + t] = 0;
                        continue;
                    }
                    const T* qh = q + (t * H + h) * dqk;
                    double mx = -INFINITY;
                    for (int64_t j = 0; j < n; ++j) {
                        p[j] = double(dot(qh, kv + int64_t(sel[j]) * dqk, dqk)) * scale;
                        mx = std::max(mx, p[j]);
                    }
                    double sum = 0;
                    for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
                    for (int64_t j = 0; j < n; ++j)
                        axpy(static_cast<T>(p[j] / sum), kv + int64_t(sel[j]) * dqk, o, dv);
                    lse[h * Tn + t] = static_cast<T>(mx + std::log(sum));
                }
            }
        },
        2);
}

template <typename T>
void sparse_mqa_backward(int64_t Tn, int64_t H, int64_t dqk, int64_t dv, const T* q, const T* kv,
                         const int32_t* idx, const int32_t* len, int64_t K, double scale,
                         const T* out, const T* lse, const T* dout, T* dq, T* dkv_heads, T* dkv,
                         int64_t keys) {
    const int64_t Tk = keys > 0 ? keys : Tn;
    parallel_for(H, [&](int64_t hb, int64_t he) {
        for (int64_t h = hb; h < he; ++h) {
            T* dkh = dkv_heads + h * Tk * dqk;
            std::fill_n(dkh, Tk * dqk, T(0));
            for (int64_t t = 0; t < Tn; ++t) {
                T* dqt = dq + (t * H + h) * dqk;
                std::fill_n(dqt, dqk, T(0));
                const int64_t n = len[t];
                if (n == 0) continue;  // empty row: no key, dq stays 0
                const int32_t* sel = idx + t * K;
                const T* qh = q + (t * H + h) * dqk;
                const T* doh = dout + (t * H + h) * dv;
                const double delta = dot(doh, out + (t * H + h) * dv, dv);
                const double l = lse[h * Tn + t];
                for (int64_t j = 0; j < n; ++j) {
                    const T* kj = kv + int64_t(sel[j]) * dqk;
                    double pj = std::exp(double(dot(qh, kj, dqk)) * scale - l);
                    T* dkj = dkh + int64_t(sel[j]) * dqk;
                    axpy(static_cast<T>(pj), doh, dkj, dv);  // dV (aliases the first dv of K)
                    T ds = static_cast<T>(pj * (double(dot(doh, kj, dv)) - delta) * scale);
                    axpy(ds, kj, dqt, dqk);
                    axpy(ds, qh, dkj, dqk);
                }
            }
        }
    });
    parallel_for(
        Tk,
        [&](int64_t tb, int64_t te) {
            for (int64_t t = tb; t < te; ++t) {
                T* d = dkv + t * dqk;
                std::fill_n(d, dqk, T(0));
                for (int64_t h = 0; h < H; ++h) axpy(T(1), dkv_heads + (h * Tk + t) * dqk, d, dqk);
            }
        },
        8);
}

template <typename T>
void sparse_mqa_prob_sums(int64_t tokens, int64_t heads, int64_t dqk, const T* q, const T* kv,
                          const int32_t* idx, const int32_t* len, int64_t kslots, double scale,
                          const T* lse, T* sums) {
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t j = 0; j < kslots; ++j) {
            double sum = 0;
            for (int64_t h = 0; j < len[t] && h < heads; ++h) {
                double d = 0;
                for (int64_t i = 0; i < dqk; ++i)
                    d += double(q[(t * heads + h) * dqk + i]) * kv[idx[t * kslots + j] * dqk + i];
                sum += std::exp(d * scale - lse[h * tokens + t]);
            }
            sums[t * kslots + j] = static_cast<T>(sum);
        }
}

#define INSTANTIATE(T)                                                                            \
    template void sparse_mqa_forward<T>(int64_t, int64_t, int64_t, int64_t, const T*, const T*,   \
                                        const int32_t*, const int32_t*, int64_t, double, T*, T*); \
    template void sparse_mqa_backward<T>(int64_t, int64_t, int64_t, int64_t, const T*, const T*,  \
                                         const int32_t*, const int32_t*, int64_t, double,         \
                                         const T*, const T*, const T*, T*, T*, T*, int64_t);      \
    template void sparse_mqa_prob_sums<T>(int64_t, int64_t, int64_t, const T*, const T*,          \
                                          const int32_t*, const int32_t*, int64_t, double,        \
                                          const T*, T*);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
