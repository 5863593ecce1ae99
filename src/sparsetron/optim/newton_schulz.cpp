#include "sparsetron/optim/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/error.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/optim/optim.h"
#include "sparsetron/optim/muon.h"

namespace sparsetron {

double round_ns(NsRounding r, double x) {
    switch (r) {
        case NsRounding::None:
            return x;
        case NsRounding::BF16:
            return bf16_to_float(float_to_bf16(float(x)));
        case NsRounding::FP16: {
            if (x == 0 || !std::isfinite(x)) return x;
            const double a = std::fabs(x);
            if (a >= 65520.0) return std::copysign(INFINITY, x);  // past the largest, 65504
            int e = 0;
            std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
            // 10 stored mantissa bits below the leading one; subnormals share 2^-24 steps.
            const double quantum = std::ldexp(1.0, std::max(e - 1, -14) - 10);
            return std::copysign(std::nearbyint(a / quantum) * quantum, x);
        }
    }
    return x;
}

namespace {

template <typename T>
void round_all(NsRounding r, T* x, int64_t n) {
    if (r == NsRounding::None) return;
    for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(round_ns(r, double(x[i])));
}

// x [m, n] -> X [r, c] in the wide orientation, normalized by its Frobenius norm and rounded.
template <typename T>
void load_wide(const T* x, int64_t m, int64_t n, T* X, NsRounding rounding) {
    const bool transpose = m > n;
    const int64_t c = transpose ? m : n;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) (transpose ? X[j * c + i] : X[i * c + j]) = x[i * n + j];
    const double norm = std::sqrt(cpu::sum_squares(X, m * n));
    cpu::scale_inplace(X, m * n, 1.0 / (norm + 1e-7));
    round_all(rounding, X, m * n);
}

// C = alpha op(A) op(B) + beta C, then rounded: one device GEMM with its output's rounding.
template <typename T>
void product(NsRounding r, bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
             const T* a, int64_t lda, const T* b, int64_t ldb, double beta, T* c, int64_t ldc) {
    cpu::gemm<T>(ta, tb, m, n, k, static_cast<T>(alpha), a, lda, b, ldb, static_cast<T>(beta), c,
                 ldc);
    round_all(r, c, m * ldc);
}

template <typename T>
void store_wide(const T* X, int64_t m, int64_t n, T* x) {
    const bool transpose = m > n;
    const int64_t c = transpose ? m : n;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) x[i * n + j] = transpose ? X[j * c + i] : X[i * c + j];
}

}  // namespace

double newton_schulz_cost(int64_t r, int64_t c, int64_t steps) {
    const double r2c = double(r) * double(r) * double(c), r3 = double(r) * double(r) * double(r);
    return double(steps) * (0.75 * r2c + 0.75 * r3 + r2c);  // X Xᵀ, A A, B X
}

double newton_schulz_gram_cost(int64_t r, int64_t c, int64_t steps,
                               const std::vector<int64_t>& restarts) {
    const double r2c = double(r) * double(r) * double(c), r3 = double(r) * double(r) * double(r);
    auto restart_at = [&](int64_t i) { return gram_ns_restarts_at(restarts, i); };
    // The first Gram matrix and the final Q X; per restart Q X and a new Gram matrix.
    double cost = 0.75 * r2c + r2c;
    for (int64_t i = 0; i < steps; ++i) {
        if (restart_at(i)) cost += r2c + 0.75 * r2c;
        cost += 0.75 * r3;                                               // Z = b R + c R R
        if (i > 0 && !restart_at(i)) cost += 0.75 * r3;                  // Q <- Q (a I + Z)
        if (i + 1 < steps && !restart_at(i + 1)) cost += 2 * 0.75 * r3;  // R <- Q_i R Q_i
    }
    return cost;
}

bool gram_ns_pays(int64_t r, int64_t c, int64_t steps) {
    return newton_schulz_gram_cost(r, c, steps, gram_ns_restarts()) <
           newton_schulz_cost(r, c, steps);
}

bool uses_gram_ns(const std::string& method, int64_t r, int64_t c, int64_t steps) {
    return method == "gram" && gram_ns_pays(r, c, steps);
}

double newton_schulz_cost(int64_t r, int64_t c, int64_t steps, bool gram) {
    return gram ? newton_schulz_gram_cost(r, c, steps, gram_ns_restarts())
                : newton_schulz_cost(r, c, steps);
}

template <typename T>
void newton_schulz_gram(T* x, int64_t m, int64_t n, int64_t steps, const std::string& type,
                        const std::vector<int64_t>& restarts, std::vector<T>& ws,
                        NsRounding rounding) {
    const int64_t r = std::min(m, n), c = std::max(m, n);
    ws.resize(static_cast<size_t>(2 * r * c + 5 * r * r));
    T* X = ws.data();
    T* Y = X + r * c;
    T* R = Y + r * c;
    T* Q = R + r * r;
    T* Z = Q + r * r;
    T* RZ = Z + r * r;
    T* S = RZ + r * r;  // scratch for out-of-place products
    load_wide(x, m, n, X, rounding);
    auto restart_at = [&](int64_t i) { return gram_ns_restarts_at(restarts, i); };
    auto gram = [&] { product(rounding, false, true, r, r, c, 1.0, X, c, X, c, 0.0, R, r); };
    auto apply_q = [&] {  // X <- Q X
        product(rounding, false, false, r, c, r, 1.0, Q, r, X, c, 0.0, Y, c);
        std::copy_n(Y, r * c, X);
    };
    gram();
    for (int64_t i = 0; i < steps; ++i) {
        const MuonCoefficients k = muon_ns_coefficients(type, i);
        const bool fresh = i == 0 || restart_at(i);
        if (restart_at(i)) {
            apply_q();
            gram();
        }
        // Z = b R + c R R: the polynomial of this iteration is Q_i = a I + Z.
        std::copy_n(R, r * r, Z);
        product(rounding, false, false, r, r, r, k.c, R, r, R, r, k.b, Z, r);
        if (fresh) {
            // Q = I (start or restart): Q Q_i = a I + Z.
            std::copy_n(Z, r * r, Q);
            for (int64_t d = 0; d < r; ++d)
                Q[d * r + d] = static_cast<T>(round_ns(rounding, double(Q[d * r + d]) + k.a));
        } else {
            // Q <- Q Q_i = a Q + Q Z (the Q's and R are polynomials in R_0: they commute).
            std::copy_n(Q, r * r, S);
            product(rounding, false, false, r, r, r, 1.0, S, r, Z, r, k.a, Q, r);
        }
        if (i + 1 < steps && !restart_at(i + 1)) {
            // R <- Q_i R Q_i: RZ = a R + R Z = R Q_i, then R = a RZ + Z RZ = Q_i R Q_i.
            std::copy_n(R, r * r, RZ);
            product(rounding, false, false, r, r, r, 1.0, R, r, Z, r, k.a, RZ, r);
            std::copy_n(RZ, r * r, R);
            product(rounding, false, false, r, r, r, 1.0, Z, r, RZ, r, k.a, R, r);
        }
    }
    apply_q();
    store_wide(X, m, n, x);
}

template <typename T>
void newton_schulz(T* x, int64_t m, int64_t n, int64_t steps, const std::string& type,
                   std::vector<T>& ws, NsRounding rounding) {
    const int64_t r = std::min(m, n), c = std::max(m, n);
    ws.resize(static_cast<size_t>(2 * r * c + 2 * r * r));
    T* X = ws.data();
    T* Y = X + r * c;
    T* A = Y + r * c;
    T* B = A + r * r;
    load_wide(x, m, n, X, rounding);
    for (int64_t s = 0; s < steps; ++s) {
        const MuonCoefficients k = muon_ns_coefficients(type, s);
        product(rounding, false, true, r, r, c, 1.0, X, c, X, c, 0.0, A, r);  // A = X Xᵀ
        std::copy_n(A, r * r, B);                                             // B = b A + c A A
        product(rounding, false, false, r, r, r, k.c, A, r, A, r, k.b, B, r);
        std::copy_n(X, r * c, Y);  // X = a X + B X
        product(rounding, false, false, r, c, r, 1.0, B, r, Y, c, k.a, X, c);
    }
    store_wide(X, m, n, x);
}

template void newton_schulz<float>(float*, int64_t, int64_t, int64_t, const std::string&,
                                   std::vector<float>&, NsRounding);
template void newton_schulz<double>(double*, int64_t, int64_t, int64_t, const std::string&,
                                    std::vector<double>&, NsRounding);
template void newton_schulz_gram<float>(float*, int64_t, int64_t, int64_t, const std::string&,
                                        const std::vector<int64_t>&, std::vector<float>&,
                                        NsRounding);
template void newton_schulz_gram<double>(double*, int64_t, int64_t, int64_t, const std::string&,
                                         const std::vector<int64_t>&, std::vector<double>&,
                                         NsRounding);

}  // namespace sparsetron
