// The element-wise family's CPU references (ops/elementwise/elementwise.h): RoPE, SwiGLU and
// the embedding against naive fp64, backwards by finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/fd_check.h"
#include "sparsetron/ops/elementwise/elementwise.h"
#include "test_util.h"

using namespace sparsetron;
using test::check_gradient;
using test::max_rel_error;
using test::random_vector;
using test::weighted_sum;

TEST(Elementwise, RopeBothPairingsRotateByPosition) {
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

TEST(Elementwise, RopeDotProductDependsOnlyOnRelativePosition) {
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

TEST(Elementwise, SwiGlu) {
    auto g = random_vector<double>(20, 7, 4.0), u = random_vector<double>(20, 8);
    std::vector<double> y(20);
    cpu::swiglu_forward(g.data(), u.data(), 20, y.data());
    for (int i = 0; i < 20; ++i) EXPECT_NEAR(y[i], g[i] / (1 + std::exp(-g[i])) * u[i], 1e-15);
}

TEST(Elementwise, GradientRopeBothPairings) {
    for (bool inter : {true, false}) {
        const int64_t T = 3, H = 2, D = 6;
        auto x = random_vector<double>(T * H * D, 4), dy = random_vector<double>(T * H * D, 5);
        std::vector<int32_t> pos = {0, 3, 9};
        auto loss = [&] {
            auto y = x;
            cpu::rope(y.data(), T, H, D, H * D, D, pos.data(), 100.0, inter, false);
            return weighted_sum(y, dy);
        };
        auto dx = dy;  // backward = inverse rotation of the incoming gradient
        cpu::rope(dx.data(), T, H, D, H * D, D, pos.data(), 100.0, inter, true);
        check_gradient(x, dx, loss, "rope");
    }
}

TEST(Elementwise, GradientSwiGlu) {
    const int64_t n = 12;
    auto g = random_vector<double>(n, 1, 3.0), u = random_vector<double>(n, 2),
         dy = random_vector<double>(n, 3);
    auto loss = [&] {
        std::vector<double> y(n);
        cpu::swiglu_forward(g.data(), u.data(), n, y.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> dg(n), du(n);
    cpu::swiglu_backward(g.data(), u.data(), dy.data(), n, dg.data(), du.data());
    check_gradient(g, dg, loss, "dg");
    check_gradient(u, du, loss, "du");
}

TEST(Elementwise, GradientEmbedding) {
    const int64_t V = 5, dim = 3, rows = 6;
    std::vector<int32_t> tok = {1, 4, 1, 0, 3, 1};
    auto table = random_vector<double>(V * dim, 4), dy = random_vector<double>(rows * dim, 5);
    auto loss = [&] {
        std::vector<double> y(rows * dim);
        cpu::embedding_forward(tok.data(), rows, table.data(), V, dim, y.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> dt(V * dim, 0.0);
    cpu::embedding_backward(tok.data(), rows, dy.data(), V, dim, dt.data());
    check_gradient(table, dt, loss, "dtable");
}
