// The norm family's CPU references (ops/norm/norm.h): against naive fp64, backwards by finite
// differences.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/fd_check.h"
#include "sparsetron/ops/norm/norm.h"
#include "test_util.h"

using namespace sparsetron;
using test::check_gradient;
using test::max_rel_error;
using test::random_vector;
using test::weighted_sum;

TEST(Norm, RmsNorm) {
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

TEST(Norm, GradientRmsNorm) {
    const int64_t rows = 4, dim = 9, ld = 11;  // strided rows
    auto x = random_vector<double>(rows * ld, 1, 2.0), w = random_vector<double>(dim, 2);
    auto dy = random_vector<double>(rows * dim, 3);
    auto loss = [&] {
        std::vector<double> y(rows * dim), r(rows);
        cpu::rmsnorm_forward(x.data(), ld, w.data(), rows, dim, 1e-5, y.data(), dim, r.data());
        return weighted_sum(y, dy);
    };
    std::vector<double> y(rows * dim), r(rows), dx(rows * ld, 0.0), dw(dim, 0.0);
    cpu::rmsnorm_forward(x.data(), ld, w.data(), rows, dim, 1e-5, y.data(), dim, r.data());
    cpu::rmsnorm_backward(dy.data(), dim, x.data(), ld, w.data(), r.data(), rows, dim, dx.data(),
                          ld, false, dw.data());
    for (int64_t rr = 0; rr < rows; ++rr)  // the gap columns are not inputs
        for (int64_t j = dim; j < ld; ++j) x[rr * ld + j] = 0, dx[rr * ld + j] = 0;
    check_gradient(x, dx, loss, "dx");
    check_gradient(w, dw, loss, "dw");
}
