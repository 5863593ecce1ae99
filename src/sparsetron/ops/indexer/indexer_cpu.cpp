// The indexer's CPU reference (indexer.h): scores, the top-k rule and the KL loss of one row, in
// the order the model applies them; the CUDA kernels and the model's CPU layers are checked
// against these.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "sparsetron/ops/indexer/indexer.h"

namespace sparsetron::cpu {

template <typename T>
void indexer_scores_row(const T* q, const T* w, const T* k, int64_t heads, int64_t dim,
                        int64_t begin, int64_t last, T* out) {
    for (int64_t s = begin; s <= last; ++s) {
        double acc = 0;
        for (int64_t j = 0; j < heads; ++j) {
            const T* qj = q + j * dim;
            const T* ks = k + s * dim;
            T d = 0;
            for (int64_t i = 0; i < dim; ++i) d += qj[i] * ks[i];
            if (d > 0) acc += double(w[j]) * d;
        }
        out[s] = static_cast<T>(acc);
    }
}

template <typename T>
int64_t topk_row(const T* row, int64_t begin, int64_t last, int64_t k, int32_t* idx,
                 std::vector<int32_t>& order) {
    const int64_t n = last - begin + 1, kk = std::min(k, n);
    order.resize(size_t(n));
    std::iota(order.begin(), order.end(), static_cast<int32_t>(begin));
    std::partial_sort(order.begin(), order.begin() + kk, order.end(), [&](int32_t x, int32_t y) {
        return row[x] > row[y] || (row[x] == row[y] && x < y);
    });
    std::sort(order.begin(), order.begin() + kk);
    std::copy_n(order.begin(), kk, idx);
    return kk;
}

template <typename T>
double indexer_kl_row(const IndexerTeacher<T>& tc, int64_t t, bool sparse, const int32_t* support,
                      int64_t n, const T* scores, T* target, std::vector<double>& p) {
    p.assign(size_t(n), 0.0);
    for (int64_t hh = 0; hh < tc.heads; ++hh) {
        const T* qh = tc.q + (t * tc.heads + hh) * tc.dim;
        std::vector<double> z(static_cast<size_t>(n));
        double mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
            const T* ks = tc.k + int64_t(support[j]) * tc.dim;
            double dd = 0;
            for (int64_t i = 0; i < tc.dim; ++i) dd += double(qh[i]) * ks[i];
            z[size_t(j)] = dd * tc.scale;
            mx = std::max(mx, z[size_t(j)]);
        }
        // Sparse: the attention's own LSE over the top-k set; dense: recomputed.
        double lse = 0;
        if (sparse) {
            lse = tc.lse[hh * tc.tokens + t];
        } else {
            double sum = 0;
            for (double v : z) sum += std::exp(v - mx);
            lse = mx + std::log(sum);
        }
        for (int64_t j = 0; j < n; ++j) p[size_t(j)] += std::exp(z[size_t(j)] - lse);
    }
    double psum = 0;
    for (double v : p) psum += v;
    psum = std::max(psum, 1e-10);
    for (double& v : p) v /= psum;
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, double(scores[support[j]]));
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(double(scores[support[j]]) - mx);
    const double lse_i = mx + std::log(sum);
    double kl = 0;
    for (int64_t j = 0; j < n; ++j) {
        const double logq = double(scores[support[j]]) - lse_i;
        if (p[size_t(j)] > 0) kl += p[size_t(j)] * (std::log(p[size_t(j)]) - logq);
        target[support[j]] = static_cast<T>(std::exp(logq) - p[size_t(j)]);  // q - p
    }
    return kl;
}

#define INSTANTIATE(T)                                                                           \
    template void indexer_scores_row<T>(const T*, const T*, const T*, int64_t, int64_t, int64_t, \
                                        int64_t, T*);                                            \
    template int64_t topk_row<T>(const T*, int64_t, int64_t, int64_t, int32_t*,                  \
                                 std::vector<int32_t>&);                                         \
    template double indexer_kl_row<T>(const IndexerTeacher<T>&, int64_t, bool, const int32_t*,   \
                                      int64_t, const T*, T*, std::vector<double>&);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
