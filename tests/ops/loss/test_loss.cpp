// The loss family's CPU references (ops/loss/loss.h): the fused head + cross-entropy against a
// naive form for any chunking, its backward by finite differences, and the MTP TV loss's pieces.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/fd_check.h"
#include "sparsetron/ops/loss/loss.h"
#include "test_util.h"

using namespace sparsetron;
using test::check_gradient;
using test::max_rel_error;
using test::random_vector;
using test::weighted_sum;

TEST(Loss, HeadCrossEntropyMatchesNaiveForAnyChunking) {
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

TEST(Loss, GradientFusedHeadCrossEntropy) {
    const int64_t rows = 7, dim = 5, vocab = 9;
    auto h = random_vector<double>(rows * dim, 6, 2.0), w = random_vector<double>(vocab * dim, 7);
    std::vector<int32_t> tgt = {2, -1, 8, 0, 3, 3, -1};
    const double scale = 0.37;
    auto loss = [&] {
        std::vector<double> ws(3 * vocab);
        double l = 0;
        int64_t c = 0;
        cpu::head_cross_entropy(h.data(), rows, dim, w.data(), vocab, tgt.data(), 3, ws.data(), 0.0,
                                (double*)nullptr, (double*)nullptr, &l, &c);
        return scale * l;
    };
    std::vector<double> ws(3 * vocab), dh(rows * dim), dw(vocab * dim, 0.0);
    double l = 0;
    int64_t c = 0;
    cpu::head_cross_entropy(h.data(), rows, dim, w.data(), vocab, tgt.data(), 3, ws.data(), scale,
                            dh.data(), dw.data(), &l, &c);
    check_gradient(h, dh, loss, "dh");
    check_gradient(w, dw, loss, "dw");
}

// softmax_rows in place: every row sums to 1 and follows exp(z - max) / Σ.
TEST(MtpTv, SoftmaxRowsMatchTheFormula) {
    const int64_t rows = 3, V = 11;
    auto z = random_vector<double>(rows * V, 41, 3.0);
    std::vector<double> p = z;
    cpu::softmax_rows(p.data(), rows, V);
    for (int64_t r = 0; r < rows; ++r) {
        double sum = 0, norm = 0;
        for (int64_t v = 0; v < V; ++v) sum += p[r * V + v], norm += std::exp(z[r * V + v]);
        EXPECT_NEAR(sum, 1.0, 1e-14);
        for (int64_t v = 0; v < V; ++v)
            EXPECT_NEAR(p[r * V + v], std::exp(z[r * V + v]) / norm, 1e-14);
    }
}

// One chain row of D = 4 depths (SPEC §5): the loss and acceptance from their definitions, and
// ∂loss/∂α_k against finite differences of the loss (times the row weight).
TEST(MtpTv, ChainRowLossAcceptanceAndGradient) {
    const int64_t D = 4, stride = 3;  // depth k's α of this row at alpha[k * stride]
    std::vector<double> alpha(D * stride, -1.0);
    const double a[D] = {0.9, 0.7, 0.55, 0.8};
    for (int64_t k = 0; k < D; ++k) alpha[k * stride] = a[k];
    auto loss_of = [&] {
        double prod = 1, loss = 0;
        for (int64_t k = 0; k < D; ++k) prod *= alpha[k * stride], loss += 1 - prod;
        return loss / double(D);
    };
    const double w = 0.3;
    std::vector<double> dalpha(D);
    const cpu::TvChainRow row = cpu::tv_chain_row(alpha.data(), stride, D, w, dalpha.data());
    EXPECT_NEAR(row.loss, loss_of(), 1e-15);
    EXPECT_NEAR(row.accept, 0.9 + 0.9 * 0.7 + 0.9 * 0.7 * 0.55 + 0.9 * 0.7 * 0.55 * 0.8, 1e-15);
    std::vector<double> x(D), analytic(D);
    for (int64_t k = 0; k < D; ++k) x[k] = alpha[k * stride], analytic[k] = dalpha[k];
    check_gradient(
        x, analytic,
        [&] {
            for (int64_t k = 0; k < D; ++k) alpha[k * stride] = x[k];
            return w * loss_of();
        },
        "dloss/dalpha");
    // Without dalpha only the loss and acceptance.
    EXPECT_NEAR(cpu::tv_chain_row(alpha.data(), stride, D, w, nullptr).loss, loss_of(), 1e-15);
}

// The draft logits' gradient: with q = softmax(z) and α = Σ_v min(p_v, q_v), tv_logit_grad_row
// gives dalpha ∂α/∂z; against finite differences, with some q_v above and some below p_v.
TEST(MtpTv, LogitGradientMatchesFiniteDifferences) {
    const int64_t V = 9;
    auto z = random_vector<double>(V, 43, 2.0);
    std::vector<double> p = random_vector<double>(V, 44, 2.0);
    cpu::softmax_rows(p.data(), 1, V);
    const double dalpha = -0.7;
    auto overlap = [&] {
        std::vector<double> q = z;
        cpu::softmax_rows(q.data(), 1, V);
        double a = 0;
        cpu::tv_overlap(p.data(), q.data(), 1, V, &a);
        int above = 0;
        for (int64_t v = 0; v < V; ++v) above += q[v] > p[v];
        EXPECT_GT(above, 0);
        EXPECT_LT(above, V);
        return dalpha * a;
    };
    std::vector<double> g = z;
    cpu::softmax_rows(g.data(), 1, V);
    cpu::tv_logit_grad_row(p.data(), g.data(), V, dalpha);
    check_gradient(z, g, overlap, "dalpha * dalpha/dz");
}
