// The optimizer kernels' CPU references (ops/optim/optim.h): the fixed-order sum of squares and
// AdamW against their formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "sparsetron/ops/optim/optim.h"
#include "test_util.h"

using namespace sparsetron;
using test::max_rel_error;
using test::random_vector;

TEST(Optim, SumSquaresInFixedBlocks) {
    auto x = random_vector<double>(10001, 6);
    double ss = 0;
    for (double e : x) ss += e * e;
    EXPECT_NEAR(cpu::sum_squares(x.data(), 10001), ss, 1e-10);
}

TEST(Optim, AdamWMatchesTheFormula) {
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
