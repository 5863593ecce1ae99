// The MTP end-to-end TV loss's CPU reference (loss.h, SPEC §5), as the model's CPU form runs it;
// the CUDA pieces (mtp_tv.cu) are checked against these.
#include <algorithm>
#include <cmath>
#include <vector>

#include "sparsetron/ops/loss/loss.h"

namespace sparsetron::cpu {

template <typename T>
void softmax_rows(T* z, int64_t rows, int64_t vocab) {
    for (int64_t r = 0; r < rows; ++r) {
        T* row = z + r * vocab;
        double mx = -INFINITY, sum = 0;
        for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, double(row[v]));
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - mx);
        for (int64_t v = 0; v < vocab; ++v)
            row[v] = static_cast<T>(std::exp(double(row[v]) - mx) / sum);
    }
}

template <typename T>
void tv_overlap(const T* p, const T* q, int64_t rows, int64_t vocab, T* alpha) {
    for (int64_t r = 0; r < rows; ++r) {
        double a = 0;
        for (int64_t v = 0; v < vocab; ++v)
            a += std::min(double(p[r * vocab + v]), double(q[r * vocab + v]));
        alpha[r] = static_cast<T>(a);
    }
}

template <typename T>
TvChainRow tv_chain_row(const T* alpha, int64_t stride, int64_t depths, double row_weight,
                        double* dalpha) {
    TvChainRow out;
    double prod = 1, loss = 0;
    std::vector<double> prefix(size_t(depths + 1), 1.0);
    for (int64_t k = 0; k < depths; ++k) {
        prod *= double(alpha[k * stride]);
        prefix[size_t(k + 1)] = prod;
        loss += 1.0 - prod;
        out.accept += prod;
    }
    out.loss = loss / double(depths);
    if (!dalpha) return out;
    // ∂L/∂α_d = -(1/D) Π_{i<d} α_i (1 + Σ_{j>d} Π_{d<i<=j} α_i), without dividing by α.
    for (int64_t d = 0; d < depths; ++d) {
        double tail = 1, run = 1;
        for (int64_t j = d + 1; j < depths; ++j) {
            run *= double(alpha[j * stride]);
            tail += run;
        }
        dalpha[d] = -prefix[size_t(d)] * tail / double(depths) * row_weight;
    }
    return out;
}

template <typename T>
void tv_logit_grad_row(const T* p, T* q, int64_t vocab, double dalpha) {
    // α = 1 - TV; ∂TV/∂z_v = q_v (s - 1 + 1[q_v > p_v]), s = Σ_{q<=p} q.
    double s = 0;
    for (int64_t v = 0; v < vocab; ++v)
        if (q[v] <= p[v]) s += q[v];
    for (int64_t v = 0; v < vocab; ++v) {
        const double dtv = double(q[v]) * (s - 1.0 + (q[v] > p[v] ? 1.0 : 0.0));
        q[v] = static_cast<T>(-dalpha * dtv);
    }
}

#define INSTANTIATE(T)                                                                \
    template void softmax_rows<T>(T*, int64_t, int64_t);                              \
    template void tv_overlap<T>(const T*, const T*, int64_t, int64_t, T*);            \
    template TvChainRow tv_chain_row<T>(const T*, int64_t, int64_t, double, double*); \
    template void tv_logit_grad_row<T>(const T*, T*, int64_t, double);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace sparsetron::cpu
