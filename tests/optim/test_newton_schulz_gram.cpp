// The Gram form of Newton-Schulz (optim/newton_schulz.h): equal to the standard iteration in
// exact arithmetic, and its numerics with products rounded to bf16 / fp16 as a device would
// compute them, against the fp64 standard iteration, on ill-conditioned inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <vector>

#include "sparsetron/core/rng.h"
#include "sparsetron/optim/muon.h"
#include "sparsetron/optim/newton_schulz.h"

using namespace sparsetron;

namespace {

// [r, c] (or its transpose when `tall`) with singular values spread by exp(-decay i): rows of
// Gaussian noise scaled by exp(-decay i), then mixed by a random [r, r] matrix. Momentum
// matrices have such decaying spectra; decay 0 is plain Gaussian noise.
std::vector<double> spread_matrix(int64_t r, int64_t c, double decay, uint64_t seed, bool tall) {
    const CounterRng rng(seed, 0), mix(seed, 1);
    std::vector<double> x(size_t(r * c)), y(size_t(r * c), 0.0);
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j)
            x[size_t(i * c + j)] = rng.normal(uint64_t(i * c + j)) * std::exp(-decay * double(i));
    for (int64_t i = 0; i < r; ++i)
        for (int64_t k = 0; k < r; ++k) {
            const double w = mix.normal(uint64_t(i * r + k)) / std::sqrt(double(r));
            for (int64_t j = 0; j < c; ++j) y[size_t(i * c + j)] += w * x[size_t(k * c + j)];
        }
    if (!tall) return y;
    std::vector<double> t(y.size());
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) t[size_t(j * r + i)] = y[size_t(i * c + j)];
    return t;
}

double normalized_error(const std::vector<double>& got, const std::vector<double>& ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); ++i)
        num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
    return std::sqrt(num / den);
}

}  // namespace

TEST(NewtonSchulzGram, EqualsTheStandardIterationInExactArithmetic) {
    struct Case {
        int64_t m, n, steps;
        const char* coefficients;
        std::vector<int64_t> restarts;
    };
    const std::vector<Case> cases{
        {24, 80, 5, "quintic", {2}},   {24, 80, 5, "quintic", {}},     {90, 30, 5, "quintic", {2}},
        {40, 40, 5, "simple", {1, 3}}, {16, 64, 7, "quintic", {2, 5}},
    };
    std::vector<double> ws;
    for (const Case& k : cases) {
        SCOPED_TRACE(testing::Message() << k.m << " x " << k.n << " " << k.coefficients << ", "
                                        << k.restarts.size() << " restarts");
        const bool tall = k.m > k.n;
        const auto x = spread_matrix(std::min(k.m, k.n), std::max(k.m, k.n), 0.05, 11, tall);
        auto standard = x, gram = x;
        newton_schulz(standard.data(), k.m, k.n, k.steps, k.coefficients, ws);
        newton_schulz_gram(gram.data(), k.m, k.n, k.steps, k.coefficients, k.restarts, ws);
        EXPECT_LT(normalized_error(gram, standard), 1e-10);
        // Not a no-op: the result is far from the (normalized) input.
        EXPECT_GT(normalized_error(gram, x), 0.5);
    }
}

TEST(NewtonSchulzGram, RoundingEmulatesHalfPrecision) {
    EXPECT_EQ(round_ns(NsRounding::BF16, 1.0 + 1.0 / 256), 1.0);  // a tie, to even
    EXPECT_EQ(round_ns(NsRounding::BF16, 1.0 + 3.0 / 256), 1.0 + 1.0 / 64);
    EXPECT_EQ(round_ns(NsRounding::FP16, 1.0 + 1.0 / 2048), 1.0);  // a tie, to even
    EXPECT_EQ(round_ns(NsRounding::FP16, 1.0 + 3.0 / 2048), 1.0 + 1.0 / 512);
    EXPECT_EQ(round_ns(NsRounding::FP16, 3e-8), std::ldexp(1.0, -24));  // subnormal steps
    EXPECT_EQ(round_ns(NsRounding::FP16, 65504.0), 65504.0);
    EXPECT_TRUE(std::isinf(round_ns(NsRounding::FP16, 70000.0)));
    EXPECT_EQ(round_ns(NsRounding::None, 1.0 + 1e-12), 1.0 + 1e-12);
}

// The device runs the standard iteration with bf16 products (`muon_fp32_matmul_prec: medium`).
// With bf16 products the Gram form drifts without a restart (R carried by the polynomial alone)
// and stays within a small factor of the standard form's error with one; with fp16 products it
// is several times more accurate than the standard form in bf16. Measured values are printed;
// the bounds hold with margin on these fixed inputs.
TEST(NewtonSchulzGram, HalfPrecisionErrorsAgainstFp64) {
    struct Case {
        int64_t r, c;
        double decay;
    };
    std::vector<double> ws;
    for (const Case& k : std::vector<Case>{{64, 256, 0.05}, {96, 192, 0.1}, {64, 640, 0.03}}) {
        SCOPED_TRACE(testing::Message() << k.r << " x " << k.c << " decay " << k.decay);
        const auto x = spread_matrix(k.r, k.c, k.decay, 23, false);
        auto ref = x;
        newton_schulz(ref.data(), k.r, k.c, 5, "quintic", ws);
        auto run_standard = [&](NsRounding r) {
            auto y = x;
            newton_schulz(y.data(), k.r, k.c, 5, "quintic", ws, r);
            return normalized_error(y, ref);
        };
        auto run_gram = [&](NsRounding r, const std::vector<int64_t>& restarts) {
            auto y = x;
            newton_schulz_gram(y.data(), k.r, k.c, 5, "quintic", restarts, ws, r);
            return normalized_error(y, ref);
        };
        const double std_bf16 = run_standard(NsRounding::BF16);
        const double std_fp16 = run_standard(NsRounding::FP16);
        const double gram_bf16 = run_gram(NsRounding::BF16, gram_ns_restarts());
        const double gram_bf16_free = run_gram(NsRounding::BF16, {});
        const double gram_fp16 = run_gram(NsRounding::FP16, gram_ns_restarts());
        // The restart one iteration earlier costs the same (one restart either way).
        const double gram_fp16_at2 = run_gram(NsRounding::FP16, {2});
        std::cout << "[ns] " << k.r << "x" << k.c << " decay " << k.decay << ": standard bf16 "
                  << std_bf16 << ", fp16 " << std_fp16 << "; gram (restart at 3) bf16 " << gram_bf16
                  << ", fp16 " << gram_fp16 << "; gram bf16 without restart " << gram_bf16_free
                  << "; gram fp16 restarting at 2 " << gram_fp16_at2 << "\n";
        // The default restart (iteration 3) measured 1.6-2.0x below the one at 2 here
        // (docs/optimizer.md), 1.1-1.6x on the device (CudaMuon.GramNewtonSchulzMatchesCpu).
        EXPECT_LT(gram_fp16, gram_fp16_at2);
        EXPECT_GT(std_bf16, 1e-3);  // the rounding does act
        EXPECT_LT(std_fp16, std_bf16 / 4);
        EXPECT_LT(gram_bf16, 4 * std_bf16);  // measured 1.5-2.7x
        EXPECT_GT(gram_bf16_free, 3 * gram_bf16);
        EXPECT_LT(gram_fp16, std_bf16 / 2);
    }
}

// The FLOP model that picks the form per matrix (muon_ns_method: gram). By hand for 5 steps and
// one restart (at 3, the default; at 2 the same), in units of r^3 with c = 4 r: standard 5 (0.75 *
// 4 + 0.75 + 4) = 38.75; Gram 0.75
// * 4 + 4 (first X Xᵀ, final Q X) + 4 + 0.75 * 4 (the restart's Q X and X Xᵀ) + 0.75 (5 Z + 3 Q
// updates + 2 x 3 R updates) = 24.5. The Gram form pays from c ~ 1.3 r.
TEST(NewtonSchulzGram, CostModelPicksTheCheaperForm) {
    const int64_t r = 256;
    const double r3 = double(r) * r * r;
    EXPECT_NEAR(newton_schulz_cost(r, 4 * r, 5) / r3, 38.75, 1e-12);
    EXPECT_NEAR(newton_schulz_gram_cost(r, 4 * r, 5, gram_ns_restarts()) / r3, 24.5, 1e-12);
    EXPECT_NEAR(newton_schulz_gram_cost(r, 4 * r, 5, {2}) / r3, 24.5, 1e-12);
    // Without the restart: 0.75 * 4 + 4 + 0.75 (5 Z + 4 Q + 2 x 4 R) = 19.75.
    EXPECT_NEAR(newton_schulz_gram_cost(r, 4 * r, 5, {}) / r3, 19.75, 1e-12);
    EXPECT_FALSE(gram_ns_pays(r, r, 5));
    EXPECT_FALSE(gram_ns_pays(r, r * 5 / 4, 5));
    EXPECT_TRUE(gram_ns_pays(r, r * 4 / 3, 5));
    EXPECT_TRUE(gram_ns_pays(96, 768, 5));
}

// The per-step count `sparsetron plan` prints, by hand: a wide [64, 256] matrix (c = 4r: Gram
// pays), a tall [300, 100] one (c = 3r: pays) and a [100, 110] one (standard). In r^3 units
// (5 steps, one restart): standard 5 (1.75 x + 0.75) and Gram 3.5 x + 10.5 for c = x r.
TEST(NewtonSchulzGram, PerStepCountOverSlices) {
    std::vector<MuonSplit> splits(4);
    const std::vector<std::vector<int64_t>> shapes{{64, 256}, {300, 100}, {100, 110}, {7}};
    for (int i = 0; i < 3; ++i) splits[size_t(i)].slices.push_back({{{0, shapes[size_t(i)][0]}}});
    RunConfig r;
    r.muon_num_ns_steps = 5;
    auto standard = [](double rr, double x) { return 2 * rr * rr * rr * 5 * (1.75 * x + 0.75); };
    auto gram = [](double rr, double x) { return 2 * rr * rr * rr * (3.5 * x + 10.5); };
    const double all_standard = standard(64, 4) + standard(100, 3) + standard(100, 1.1);
    r.muon_ns_method = "standard";
    NewtonSchulzCount n = newton_schulz_count(splits, shapes, r);
    EXPECT_EQ(n.matrices, 3);
    EXPECT_EQ(n.gram_matrices, 0);
    EXPECT_NEAR(n.standard_flops, all_standard, 1e-6 * all_standard);
    EXPECT_NEAR(n.chosen_flops, all_standard, 1e-6 * all_standard);
    r.muon_ns_method = "gram";
    n = newton_schulz_count(splits, shapes, r);
    EXPECT_EQ(n.gram_matrices, 2);
    const double chosen = gram(64, 4) + gram(100, 3) + standard(100, 1.1);
    EXPECT_NEAR(n.chosen_flops, chosen, 1e-6 * chosen);
    EXPECT_NEAR(n.standard_flops, all_standard, 1e-6 * all_standard);
}
