// Output head fused with cross-entropy, one chunk of rows at a time, so [T, V] logits never exist.
#include <algorithm>
#include <cmath>

#include "sparsetron/core/error.h"
#include "sparsetron/core/thread_pool.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"

namespace sparsetron::cpu {

template <typename T>
void head_cross_entropy(const T* h, int64_t rows, int64_t dim, const T* w, int64_t vocab,
                        const int32_t* targets, int64_t chunk_rows, T* logits_ws, double grad_scale,
                        T* dh, T* dw, double* loss_sum, int64_t* count) {
    ST_ASSERT(chunk_rows > 0, "chunk rows");
    double total = 0;
    int64_t n_targets = 0;
    std::vector<double> row_loss(chunk_rows);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
        int64_t n = std::min(chunk_rows, rows - r0);
        gemm<T>(false, true, n, vocab, dim, T(1), h + r0 * dim, dim, w, dim, T(0), logits_ws,
                vocab);
        parallel_for(
            n,
            [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < e; ++r) {
                    T* z = logits_ws + r * vocab;
                    int32_t tgt = targets[r0 + r];
                    row_loss[r] = 0;
                    if (tgt < 0) {
                        if (dh || dw) std::fill(z, z + vocab, T(0));
                        continue;
                    }
                    ST_CHECK(tgt < vocab, "target id ", tgt, " is outside the vocabulary (", vocab,
                             ")");
                    double mx = -INFINITY;
                    for (int64_t c = 0; c < vocab; ++c) mx = std::max(mx, double(z[c]));
                    double sum = 0;
                    for (int64_t c = 0; c < vocab; ++c) sum += std::exp(double(z[c]) - mx);
                    double lse = mx + std::log(sum);
                    row_loss[r] = lse - double(z[tgt]);
                    if (dh || dw) {
                        for (int64_t c = 0; c < vocab; ++c)
                            z[c] = static_cast<T>(std::exp(double(z[c]) - lse) * grad_scale);
                        z[tgt] = static_cast<T>(z[tgt] - grad_scale);
                    }
                }
            },
            4);
        for (int64_t r = 0; r < n; ++r) {
            if (targets[r0 + r] >= 0) {
                total += row_loss[r];
                ++n_targets;
            }
        }
        if (dh)
            gemm<T>(false, false, n, dim, vocab, T(1), logits_ws, vocab, w, dim, T(0),
                    dh + r0 * dim, dim);
        if (dw)
            gemm<T>(true, false, vocab, dim, n, T(1), logits_ws, vocab, h + r0 * dim, dim, T(1), dw,
                    dim);
    }
    *loss_sum = total;
    *count = n_targets;
}

template void head_cross_entropy<float>(const float*, int64_t, int64_t, const float*, int64_t,
                                        const int32_t*, int64_t, float*, double, float*, float*,
                                        double*, int64_t*);
template void head_cross_entropy<double>(const double*, int64_t, int64_t, const double*, int64_t,
                                         const int32_t*, int64_t, double*, double, double*, double*,
                                         double*, int64_t*);

}  // namespace sparsetron::cpu
