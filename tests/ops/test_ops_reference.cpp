// Each CPU kernel against a naive fp64 oracle written here.
#include <gtest/gtest.h>

#include <cmath>

#include "../test_util.h"
#include "sparsetron/ops/attention/attention.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "sparsetron/ops/gemm/gemm.h"
#include "sparsetron/ops/loss/loss.h"
#include "sparsetron/ops/norm/norm.h"
#include "sparsetron/ops/optim/optim.h"

using namespace sparsetron;
using test::max_rel_error;
using test::random_vector;

TEST(OpsReference, GemmAllTransposes) {
    const int64_t m = 7, n = 5, k = 9;
    for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
            auto a = random_vector<double>(m * k + 3 * 16, 1 + ta),
                 b = random_vector<double>(k * n + 3 * 16, 3 + tb);
            auto c = random_vector<double>(m * n, 5);
            auto expect = c;
            int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1;  // padded leading dimensions
            for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < n; ++j) {
                    double s = 0;
                    for (int64_t p = 0; p < k; ++p)
                        s += (ta ? a[p * lda + i] : a[i * lda + p]) *
                             (tb ? b[j * ldb + p] : b[p * ldb + j]);
                    expect[i * n + j] = 0.5 * s + 2.0 * c[i * n + j];
                }
            cpu::gemm<double>(ta, tb, m, n, k, 0.5, a.data(), lda, b.data(), ldb, 2.0, c.data(), n);
            EXPECT_LT(max_rel_error(c, expect), 1e-14) << ta << tb;
        }
}

TEST(OpsReference, RmsNorm) {
    const int64_t rows = 6, dim = 33;
    auto x = random_vector<double>(rows * dim, 2, 3.0), w = random_vector<double>(dim, 3);
    std::vector<double> y(rows * dim), rstd(rows), expect(rows * dim);
    cpu::rmsnorm_forward(x.data(), dim, w.data(), rows, dim, 1e-5, y.data(), dim, rstd.data());
    for (int64_t r = 0; r < rows; ++r) {
        double ms = 0;
        for (int64_t j = 0; j < dim; ++j) ms += x[r * dim + j] * x[r * dim + j] / dim;
        for (int64_t j = 0; j < dim; ++j)
            expect[r * dim + j] = w[j] * x[r * dim + j] / std::sqrt(ms + 1e-5);
    }
    EXPECT_LT(max_rel_error(y, expect), 1e-14);
}

TEST(OpsReference, RopeBothPairingsRotateByPosition) {
    const int64_t T = 5, H = 3, D = 8;
    for (bool inter : {true, false}) {
        auto x = random_vector<double>(T * H * D, 4);
        std::vector<int32_t> pos = {0, 1, 2, 7, 100};
        auto y = x;
        cpu::rope(y.data(), T, H, D, H * D, D, pos.data(), 10000.0, inter, false);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < D / 2; ++i) {
                    int64_t a = inter ? 2 * i : i, b = inter ? 2 * i + 1 : i + D / 2;
                    double ang = pos[t] * std::pow(10000.0, -2.0 * i / D);
                    const double* xi = &x[(t * H + h) * D];
                    const double* yi = &y[(t * H + h) * D];
                    EXPECT_NEAR(yi[a], xi[a] * std::cos(ang) - xi[b] * std::sin(ang), 1e-12);
                    EXPECT_NEAR(yi[b], xi[a] * std::sin(ang) + xi[b] * std::cos(ang), 1e-12);
                }
        cpu::rope(y.data(), T, H, D, H * D, D, pos.data(), 10000.0, inter, true);
        EXPECT_LT(max_rel_error(y, x), 1e-13);  // the inverse undoes the rotation
    }
}

TEST(OpsReference, RopeDotProductDependsOnlyOnRelativePosition) {
    const int64_t D = 16;
    auto q = random_vector<double>(D, 8), k = random_vector<double>(D, 9);
    auto rotated_dot = [&](int32_t pq, int32_t pk) {
        auto a = q, b = k;
        cpu::rope(a.data(), 1, 1, D, D, D, &pq, 500.0, false, false);
        cpu::rope(b.data(), 1, 1, D, D, D, &pk, 500.0, false, false);
        double s = 0;
        for (int64_t i = 0; i < D; ++i) s += a[i] * b[i];
        return s;
    };
    EXPECT_NEAR(rotated_dot(10, 3), rotated_dot(107, 100), 1e-10);
    EXPECT_GT(std::fabs(rotated_dot(10, 3) - rotated_dot(10, 4)), 1e-6);
}

namespace {
// Naive attention: per document, causal softmax in fp64.
std::vector<double> naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, const std::vector<int32_t>& cu,
                                    int64_t T, int64_t H, int64_t D, int64_t Dv, double scale) {
    std::vector<double> out(T * H * Dv, 0.0);
    for (size_t d = 0; d + 1 < cu.size(); ++d)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = cu[d]; i < cu[d + 1]; ++i) {
                std::vector<double> s;
                double mx = -1e300, sum = 0;
                for (int64_t j = cu[d]; j <= i; ++j) {
                    double dot = 0;
                    for (int64_t c = 0; c < D; ++c)
                        dot += q[(i * H + h) * D + c] * k[(j * H + h) * D + c];
                    s.push_back(dot * scale);
                    mx = std::max(mx, dot * scale);
                }
                for (double& x : s) sum += (x = std::exp(x - mx));
                for (int64_t j = cu[d]; j <= i; ++j)
                    for (int64_t c = 0; c < Dv; ++c)
                        out[(i * H + h) * Dv + c] += s[j - cu[d]] / sum * v[(j * H + h) * Dv + c];
            }
    return out;
}
}  // namespace

TEST(OpsReference, AttentionMasksCausallyWithinDocuments) {
    const int64_t T = 13, H = 2, D = 6, Dv = 5;
    std::vector<int32_t> cu = {0, 4, 5, 11};  // three documents, two padding rows at the end
    auto q = random_vector<double>(T * H * D, 1, 2.0), k = random_vector<double>(T * H * D, 2, 2.0);
    auto v = random_vector<double>(T * H * Dv, 3);
    std::vector<double> out(T * H * Dv), lse(H * T);
    cpu::AttnShape s{T, H, D, Dv, H * D, D, H * D, D, H * Dv, Dv};
    cpu::attention_forward(s, q.data(), k.data(), v.data(), cu.data(), 3, 0.3, out.data(),
                           lse.data());
    EXPECT_LT(max_rel_error(out, naive_attention(q, k, v, cu, T, H, D, Dv, 0.3)), 1e-13);
    // Changing a key of document 2 leaves documents 0 and 1 untouched.
    k[(6 * H + 1) * D + 2] += 5.0;
    std::vector<double> out2(T * H * Dv);
    cpu::attention_forward(s, q.data(), k.data(), v.data(), cu.data(), 3, 0.3, out2.data(),
                           lse.data());
    for (int64_t i = 0; i < 5 * H * Dv; ++i) EXPECT_EQ(out[i], out2[i]);
    for (int64_t i = 11 * H * Dv; i < T * H * Dv; ++i) EXPECT_EQ(out2[i], 0.0);  // padding
}

TEST(OpsReference, HeadCrossEntropyMatchesNaiveForAnyChunking) {
    const int64_t rows = 9, dim = 7, vocab = 11;
    auto h = random_vector<double>(rows * dim, 4, 2.0), w = random_vector<double>(vocab * dim, 5);
    std::vector<int32_t> tgt = {3, -1, 0, 10, 5, 5, -1, 2, 1};
    double expect = 0;
    for (int64_t r = 0; r < rows; ++r) {
        if (tgt[r] < 0) continue;
        std::vector<double> z(vocab);
        double mx = -1e300, sum = 0;
        for (int64_t c = 0; c < vocab; ++c) {
            for (int64_t j = 0; j < dim; ++j) z[c] += h[r * dim + j] * w[c * dim + j];
            mx = std::max(mx, z[c]);
        }
        for (double x : z) sum += std::exp(x - mx);
        expect += mx + std::log(sum) - z[tgt[r]];
    }
    for (int64_t chunk : {1, 4, 9}) {
        std::vector<double> ws(chunk * vocab);
        double loss = 0;
        int64_t count = 0;
        cpu::head_cross_entropy(h.data(), rows, dim, w.data(), vocab, tgt.data(), chunk, ws.data(),
                                0.0, (double*)nullptr, (double*)nullptr, &loss, &count);
        EXPECT_NEAR(loss, expect, 1e-12);
        EXPECT_EQ(count, 7);
    }
}

TEST(OpsReference, AdamWMatchesTheFormula) {
    const int64_t n = 50;
    auto p = random_vector<double>(n, 1), g1 = random_vector<double>(n, 2),
         g2 = random_vector<double>(n, 3);
    std::vector<double> m(n, 0), v(n, 0), ref = p;
    double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, gs = 0.5;
    cpu::adamw_update(p.data(), g1.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, 1, gs);
    cpu::adamw_update(p.data(), g2.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, 2, gs);
    for (int64_t i = 0; i < n; ++i) {
        double mi = 0, vi = 0, x = ref[i];
        for (int step = 1; step <= 2; ++step) {
            double g = (step == 1 ? g1[i] : g2[i]) * gs;
            mi = b1 * mi + (1 - b1) * g;
            vi = b2 * vi + (1 - b2) * g * g;
            x = x * (1 - lr * wd) - lr * (mi / (1 - std::pow(b1, step))) /
                                        (std::sqrt(vi / (1 - std::pow(b2, step))) + eps);
        }
        EXPECT_NEAR(p[i], x, 1e-15);
    }
}

TEST(OpsReference, SumSquaresAndSwiGlu) {
    auto x = random_vector<double>(10001, 6);
    double ss = 0;
    for (double e : x) ss += e * e;
    EXPECT_NEAR(cpu::sum_squares(x.data(), 10001), ss, 1e-10);
    auto g = random_vector<double>(20, 7, 4.0), u = random_vector<double>(20, 8);
    std::vector<double> y(20);
    cpu::swiglu_forward(g.data(), u.data(), 20, y.data());
    for (int i = 0; i < 20; ++i) EXPECT_NEAR(y[i], g[i] / (1 + std::exp(-g[i])) * u[i], 1e-15);
}
