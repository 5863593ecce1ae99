// Dense causal attention within packed documents (the reference for MLA and, later, for the
// sparse path when top-k covers every key). Heads are split across threads: each head's dq/dk/dv
// has one writer, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/common/vec.h"
#include "sparsetron/ops/elementwise/elementwise.h"

namespace sparsetron::cpu {

template <typename T>
void attention_forward(const AttnShape& s, const T* q, const T* k, const T* v,
                       const int32_t* cu_seqlens, int64_t num_docs, double scale, T* out, T* lse) {
    std::fill(out, out + s.tokens * s.heads * s.dv, T(0));
    std::fill(lse, lse + s.heads * s.tokens, T(0));
    parallel_for(s.heads, [&](int64_t hb, int64_t he) {
        std::vector<double> p;
        for (int64_t h = hb; h < he; ++h) {
            for (int64_t d = 0; d < num_docs; ++d) {
                int64_t begin = cu_seqlens[d], end = cu_seqlens[d + 1];
                for (int64_t i = begin; i < end; ++i) {
                    const T* qi = q + i * s.q_st + h * s.q_sh;
                    int64_t n = i - begin + 1;
                    p.resize(n);
                    double mx = -INFINITY;
                    for (int64_t j = 0; j < n; ++j) {
                        p[j] = dot(qi, k + (begin + j) * s.k_st + h * s.k_sh, s.dqk) * scale;
                        mx = std::max(mx, p[j]);
                    }
                    double sum = 0;
                    for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
                    T* oi = out + (i * s.heads + h) * s.dv;
                    for (int64_t j = 0; j < n; ++j)
                        axpy(static_cast<T>(p[j] / sum), v + (begin + j) * s.v_st + h * s.v_sh, oi,
                             s.dv);
                    lse[h * s.tokens + i] = static_cast<T>(mx + std::log(sum));
                }
            }
        }
    });
}

template <typename T>
void attention_backward(const AttnShape& s, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const T* dout, const int32_t* cu_seqlens, int64_t num_docs,
                        double scale, T* dq, T* dk, T* dv) {
    parallel_for(s.heads, [&](int64_t hb, int64_t he) {
        for (int64_t h = hb; h < he; ++h) {
            for (int64_t t = 0; t < s.tokens; ++t) {
                std::fill_n(dq + t * s.q_st + h * s.q_sh, s.dqk, T(0));
                std::fill_n(dk + t * s.k_st + h * s.k_sh, s.dqk, T(0));
                std::fill_n(dv + t * s.v_st + h * s.v_sh, s.dv, T(0));
            }
            for (int64_t d = 0; d < num_docs; ++d) {
                int64_t begin = cu_seqlens[d], end = cu_seqlens[d + 1];
                for (int64_t i = begin; i < end; ++i) {
                    const T* qi = q + i * s.q_st + h * s.q_sh;
                    const T* doi = dout + (i * s.heads + h) * s.dv;
                    const T* oi = out + (i * s.heads + h) * s.dv;
                    T* dqi = dq + i * s.q_st + h * s.q_sh;
                    double delta = dot(doi, oi, s.dv);
                    double l = lse[h * s.tokens + i];
                    for (int64_t j = begin; j <= i; ++j) {
                        const T* kj = k + j * s.k_st + h * s.k_sh;
                        const T* vj = v + j * s.v_st + h * s.v_sh;
                        double pij = std::exp(dot(qi, kj, s.dqk) * scale - l);
                        axpy(static_cast<T>(pij), doi, dv + j * s.v_st + h * s.v_sh, s.dv);
                        T ds = static_cast<T>(pij * (dot(doi, vj, s.dv) - delta) * scale);
                        axpy(ds, kj, dqi, s.dqk);
                        axpy(ds, qi, dk + j * s.k_st + h * s.k_sh, s.dqk);
                    }
                }
            }
        }
    });
}

template void attention_forward<float>(const AttnShape&, const float*, const float*, const float*,
                                       const int32_t*, int64_t, double, float*, float*);
template void attention_forward<double>(const AttnShape&, const double*, const double*,
                                        const double*, const int32_t*, int64_t, double, double*,
                                        double*);
template void attention_backward<float>(const AttnShape&, const float*, const float*, const float*,
                                        const float*, const float*, const float*, const int32_t*,
                                        int64_t, double, float*, float*, float*);
template void attention_backward<double>(const AttnShape&, const double*, const double*,
                                         const double*, const double*, const double*, const double*,
                                         const int32_t*, int64_t, double, double*, double*,
                                         double*);

}  // namespace sparsetron::cpu
