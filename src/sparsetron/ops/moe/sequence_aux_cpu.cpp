// The MoE sequence aux loss's CPU reference (sequence_aux.h), as the CPU model's MoE layers run it.
#include <algorithm>
#include <vector>

#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/moe/sequence_aux.h"

namespace sparsetron::cpu {

template <typename T>
void sequence_balance(const T* probs, const int32_t* topk, const int32_t* doc_rows, int64_t docs,
                      int64_t experts, int64_t k, T* counts, T* psum) {
    const int64_t E = experts;
    parallel_for(
        docs,
        [&](int64_t b, int64_t e) {
            std::vector<double> c(static_cast<size_t>(E)), p(static_cast<size_t>(E));
            for (int64_t d = b; d < e; ++d) {
                std::fill(c.begin(), c.end(), 0.0);
                std::fill(p.begin(), p.end(), 0.0);
                for (int64_t t = doc_rows[d]; t < doc_rows[d + 1]; ++t) {
                    for (int64_t j = 0; j < k; ++j) c[size_t(topk[t * k + j])] += 1;
                    const T* s = probs + t * E;
                    double z = 0;
                    for (int64_t x = 0; x < E; ++x) z += double(s[x]);
                    for (int64_t x = 0; x < E; ++x) p[size_t(x)] += double(s[x]) / z;
                }
                for (int64_t x = 0; x < E; ++x)
                    counts[d * E + x] = T(c[size_t(x)]), psum[d * E + x] = T(p[size_t(x)]);
            }
        },
        1);
}

template <typename T>
void sequence_aux_backward(const T* probs, const int32_t* doc_rows, int64_t docs, int64_t experts,
                           const T* f, const T* w, T* dlogits) {
    const int64_t E = experts;
    for (int64_t d = 0; d < docs; ++d) {
        const T* fd = f + d * E;
        parallel_for(
            doc_rows[d + 1] - doc_rows[d],
            [&](int64_t b, int64_t e) {
                for (int64_t t = doc_rows[d] + b; t < doc_rows[d] + e; ++t) {
                    const T* s = probs + t * E;
                    double z = 0, fz = 0;
                    for (int64_t x = 0; x < E; ++x) z += double(s[x]), fz += double(fd[x]) * s[x];
                    // P uses s' = s / z: d s'_x / d s_y = (δ_xy - s'_x) / z.
                    for (int64_t y = 0; y < E; ++y) {
                        const double ds = double(w[d]) * (double(fd[y]) - fz / z) / z;
                        dlogits[t * E + y] += T(ds * double(s[y]) * (1.0 - double(s[y])));
                    }
                }
            },
            64);
    }
}

template void sequence_balance<float>(const float*, const int32_t*, const int32_t*, int64_t,
                                      int64_t, int64_t, float*, float*);
template void sequence_balance<double>(const double*, const int32_t*, const int32_t*, int64_t,
                                       int64_t, int64_t, double*, double*);
template void sequence_aux_backward<float>(const float*, const int32_t*, int64_t, int64_t,
                                           const float*, const float*, float*);
template void sequence_aux_backward<double>(const double*, const int32_t*, int64_t, int64_t,
                                            const double*, const double*, double*);

}  // namespace sparsetron::cpu
